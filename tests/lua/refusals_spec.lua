-- kvtune.refusals: one log line per reason and route per window, never one per request.
local refusals = require "kvtune.refusals"

local FULL = { code = "kv_budget_exhausted", status = 429, message = "full", needed = 40, free = 3 }
local BIG = { code = "kv_reservation_exceeds_budget", status = 413, message = "never fits" }

describe("kvtune.refusals", function()
    local lines, log
    before_each(function()
        lines = {}
        log = refusals.new(1, function(line) lines[#lines + 1] = line end)
    end)

    it("logs nothing while the window is open", function()
        log.count(FULL, "chat", 10.0)
        log.count(FULL, "chat", 10.5)
        assert.are.same({}, lines)
        assert.is_false(log.due(10.9))
        assert.is_true(log.due(11.0))
    end)

    it("logs one line per reason and route once the window has lasted, with the last one's figures", function()
        log.count(FULL, "chat", 10.0)
        log.count({ code = FULL.code, status = 429, needed = 50, free = 1 }, "chat", 10.2)
        log.count(BIG, "code", 10.4)
        log.count(FULL, "chat", 11.2)  -- the next refusal after the window flushes it, then opens a new one
        table.sort(lines)
        assert.are.same({
            "kvtune: refused 1 in 1.2 s: kv_reservation_exceeds_budget route=code status=413 last: never fits",
            "kvtune: refused 2 in 1.2 s: kv_budget_exhausted route=chat status=429 needed 50 blocks, 1 free (last)",
        }, lines)
        lines = {}
        log.flush(11.5)  -- the worker exits: what is left
        assert.are.same({ "kvtune: refused 1 in 0.3 s: kv_budget_exhausted route=chat status=429 needed 40 blocks, 3 free (last)" },
                        lines)
        log.flush(12)
        assert.are.equal(1, #lines)
    end)

    it("cuts a long message at 200 bytes", function()
        log.count({ code = "invalid_request", status = 400, message = string.rep("x", 300) }, "-", 0)
        log.flush(0)
        assert.are.equal("kvtune: refused 1 in 0.0 s: invalid_request route=- status=400 last: " .. string.rep("x", 200),
                         lines[1])
    end)
end)
