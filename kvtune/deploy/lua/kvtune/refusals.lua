-- kvtune.refusals: the refusal log (refusals.py's RefusalLog). Each worker counts its refusals
-- per reason and route over window_s and logs one line each, with the count and the last one's
-- blocks needed and free (or its message), on the next refusal after the window, from its
-- timer (watch) and when the worker exits; never a line per request.
--
-- refusals.new(window_s, log) -> log: `log(line)` writes a line (ngx.log at WARN in nginx); the
-- times are passed in, so the tally runs outside nginx too.
local format, sub, max = string.format, string.sub, math.max

local _M = {}

function _M.new(window_s, write)
    local tallies, since = {}, nil
    local log = { window_s = window_s }

    function log.flush(now)
        if since == nil then return end
        local elapsed = max(now - since, 0)
        for _, t in pairs(tallies) do
            local what
            if t.needed then
                what = format("needed %d blocks, %d free (last)", t.needed, t.free)
            else
                what = "last: " .. sub(t.message or "", 1, 200)
            end
            write(format("kvtune: refused %d in %.1f s: %s route=%s status=%d %s",
                         t.count, elapsed, t.code, t.route, t.status, what))
        end
        tallies, since = {}, nil
    end

    -- Whether the open window has lasted window_s at `now` (the timer flushes it then).
    function log.due(now) return since ~= nil and now - since >= window_s end

    -- One refusal `r` ({ code, status, message, needed, free }) on `route` at `now`.
    function log.count(r, route, now)
        if log.due(now) then log.flush(now) end
        if since == nil then since = now end
        local key = r.code .. "\0" .. route
        local t = tallies[key]
        if t == nil then
            t = { count = 0, code = r.code, route = route }
            tallies[key] = t
        end
        t.count, t.status, t.message, t.needed, t.free = t.count + 1, r.status, r.message, r.needed, r.free
    end

    return log
end

return _M
