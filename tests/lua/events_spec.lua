-- kvtune.events: complete server-sent events counted over the stream, however it is chunked.
local events = require "kvtune.events"

local function count(chunks)
    local ctx, n = { newline = false }, 0
    for _, c in ipairs(chunks) do n = n + events.count_events(ctx, c) end
    return n
end

describe("kvtune.events.count_events", function()
    it("counts each blank line that ends an event", function()
        assert.are.equal(2, count({ "data: a\n\ndata: b\n\n" }))
        assert.are.equal(0, count({ "data: a\n" }))
        assert.are.equal(0, count({ "" }))
    end)

    it("counts a blank line split across two chunks once (the body filter skips empty chunks)", function()
        assert.are.equal(1, count({ "data: a\n", "\ndata: b" }))
        assert.are.equal(2, count({ "data: a\n", "\ndata: b\n", "\n" }))
    end)

    it("counts as Python's bytes.count(b'\\n\\n') over the whole stream", function()
        assert.are.equal(1, count({ "\n\n\n" }))
        assert.are.equal(1, count({ "\n", "\n", "\n" }))
        assert.are.equal(2, count({ "\n", "\n", "\n", "\n" }))
    end)
end)
