-- kvtune.events: the body filter's count of complete server-sent events.
local find, byte = string.find, string.byte

local _M = {}

-- Complete events (b"\n\n") in one chunk of the stream, counted over the stream as a
-- whole (relay.py's EventCounter): a blank line split across two chunks still counts once.
function _M.count_events(ctx, chunk)
    local n, i = 0, 1
    if ctx.newline and byte(chunk, 1) == 10 then n, i = 1, 2 end
    while true do
        local j = find(chunk, "\n\n", i, true)
        if not j then break end
        n, i = n + 1, j + 2
    end
    ctx.newline = #chunk >= i and byte(chunk, #chunk) == 10
    return n
end

return _M
