-- kvtune.flow: the flow-control queue (docs/guides/flow-control.md) on a ledger of plain blocks.
local flow = require "kvtune.flow"

-- A ledger of `limit` blocks: try_reserve admits what fits leaving w.keep free beside it (at
-- most limit - blocks, as the ledgers clamp it), release gives it back.
local function ledger(limit)
    local L = { limit = limit, reserved = 0, running = {} }
    function L.try_reserve(w)
        local keep = math.min(w.keep or 0, math.max(0, L.limit - w.blocks))
        if L.reserved + w.blocks + keep > L.limit then return nil end
        L.reserved = L.reserved + w.blocks
        local held = { blocks = w.blocks, cap = w.cap, law = w.law, admitted_at = w.now or 0, seq = #L.running + 1 }
        L.running[#L.running + 1] = held
        return held
    end
    function L.release(held)
        L.reserved = L.reserved - held.blocks
        for i, r in ipairs(L.running) do
            if r == held then table.remove(L.running, i) break end
        end
    end
    function L.free() return math.max(0, L.limit - L.reserved), L.limit end
    function L.list() return L.running end
    return L
end

local function config(extra)
    local cfg = { token_time_s = 0.1, bands = { { name = "interactive", deadline_s = 1000 }, { name = "batch", deadline_s = 1000 } },
                  default_band = "interactive", default_weight = 1, weights = {}, max_waiting = 100,
                  max_waiting_per_flow = 50, max_flows = 100, metrics_flows = 10 }
    for k, v in pairs(extra or {}) do cfg[k] = v end
    return cfg
end

describe("kvtune.flow's forecast", function()
    it("expects the tokens left under the law past what was generated, at least one", function()
        local law = { lengths = { 10, 20, 100 }, counts = { 1, 1, 2 } }
        -- cap 50: the bins end at 10, 20, 50; after 15 tokens: (1 x 5 + 2 x 35) / 3
        assert.are.equal((1 * 5 + 2 * 35) / 3, flow.tokens_left(law, 50, 15))
        assert.are.equal(1, flow.tokens_left(law, 50, 50))            -- no bin left: 1
        assert.are.equal(34, flow.tokens_left(nil, 50, 16))           -- no law: the cap less g
        assert.are.equal(1, flow.tokens_left(nil, 50, 50))
        assert.are.equal(1, flow.tokens_left(nil, nil, 0))             -- pooling: 1
    end)

    it("walks the admitted by their ends, whole turns of everything first", function()
        local running = {
            { blocks = 10, cap = 100, admitted_at = 0, seq = 1 },     -- ends in 100 x 0.1 = 10 s
            { blocks = 5, cap = 20, admitted_at = 0, seq = 2 },       -- 2 s
        }
        assert.are.equal(0, flow.forecast_s(running, 0, 0, 0.1))
        assert.are.near(2, flow.forecast_s(running, 5, 0, 0.1), 1e-12)
        assert.are.near(10, flow.forecast_s(running, 6, 0, 0.1), 1e-12)
        -- 20 blocks: one whole turn of 15 (10 s), then 5 more (2 s)
        assert.are.near(12, flow.forecast_s(running, 20, 0, 0.1), 1e-12)
        -- time passes: 1 s is 10 tokens generated
        assert.are.near(1, flow.forecast_s(running, 5, 1, 0.1), 1e-12)
        running[2].streamed = 15
        assert.are.near(0.5, flow.forecast_s(running, 5, 0, 0.1), 1e-12)
        assert.are.equal(0, flow.forecast_s({}, 5, 0, 0.1))  -- nothing admitted: 0
    end)
end)

describe("kvtune.flow's queue", function()
    it("admits at once while nobody waits in its band or before it", function()
        local L = ledger(10)
        local Q = flow.new(config())
        local a = { blocks = 8, band = 2, flow = "x" }
        assert.are.equal("admitted", Q.offer(a, 0, L.try_reserve, L.free, L.list))
        local b = { blocks = 5, band = 2, flow = "x" }
        assert.are.equal("queued", Q.offer(b, 0, L.try_reserve, L.free, L.list))
        -- a smaller request of the batch band waits behind b (nobody overtakes) ...
        assert.are.equal("queued", Q.offer({ blocks = 1, band = 2, flow = "y" }, 0, L.try_reserve, L.free, L.list))
        -- ... but the interactive band is not held back by batch's waiters
        assert.are.equal("admitted", Q.offer({ blocks = 1, band = 1, flow = "y" }, 0, L.try_reserve, L.free, L.list))
        assert.are.equal(2, Q.waiting)
    end)

    it("serves the higher band first, and within a flow the earliest deadline", function()
        local L = ledger(4)
        local Q = flow.new(config({ bands = { { name = "hi", deadline_s = 50 }, { name = "lo", deadline_s = 100 } } }))
        local first = { blocks = 4, band = 2, flow = "x" }
        Q.offer(first, 0, L.try_reserve, L.free, L.list)
        local order = {}
        local waiters = {
            { blocks = 1, band = 2, flow = "x", name = "lo-1" }, { blocks = 1, band = 1, flow = "x", name = "hi-1" },
            { blocks = 1, band = 2, flow = "x", name = "lo-2" }, { blocks = 1, band = 1, flow = "x", name = "hi-2" },
        }
        for i, w in ipairs(waiters) do assert.are.equal("queued", Q.offer(w, i, L.try_reserve, L.free, L.list)) end
        L.release(first.reservation)
        for _, w in ipairs(Q.wake(L.try_reserve, 10)) do order[#order + 1] = w.name end
        assert.are.same({ "hi-1", "hi-2", "lo-1", "lo-2" }, order)
    end)

    it("does not let the chosen waiter be overtaken by a smaller one", function()
        local L = ledger(10)
        local Q = flow.new(config())
        local first = { blocks = 10, band = 1, flow = "x" }
        Q.offer(first, 0, L.try_reserve, L.free, L.list)
        local big, small = { blocks = 8, band = 1, flow = "x" }, { blocks = 1, band = 1, flow = "x" }
        Q.offer(big, 0, L.try_reserve, L.free, L.list)
        Q.offer(small, 0, L.try_reserve, L.free, L.list)
        L.reserved = 5  -- room for the small one only
        assert.are.same({}, Q.wake(L.try_reserve, 1))
        L.reserved = 0
        assert.are.equal(2, #Q.wake(L.try_reserve, 1))
    end)

    it("shares a band fairly: one flooding flow does not take the whole budget", function()
        local L = ledger(2)
        local Q = flow.new(config())
        local hold = { blocks = 2, band = 1, flow = "flood" }
        Q.offer(hold, 0, L.try_reserve, L.free, L.list)
        for i = 1, 10 do Q.offer({ blocks = 1, band = 1, flow = "flood", name = "flood" }, i, L.try_reserve, L.free, L.list) end
        Q.offer({ blocks = 1, band = 1, flow = "quiet", name = "quiet-1" }, 11, L.try_reserve, L.free, L.list)
        Q.offer({ blocks = 1, band = 1, flow = "quiet", name = "quiet-2" }, 12, L.try_reserve, L.free, L.list)
        local order = {}
        L.release(hold.reservation)
        for _ = 1, 6 do  -- one block at a time
            L.limit = L.reserved + 1
            for _, w in ipairs(Q.wake(L.try_reserve, 20)) do order[#order + 1] = w.name end
        end
        assert.are.same({ "flood", "quiet-1", "flood", "quiet-2", "flood", "flood" }, order)
    end)

    it("shares by weight", function()
        local L = ledger(1)
        local Q = flow.new(config({ weights = { { "heavy", 3 } } }))
        local hold = { blocks = 1, band = 1, flow = "x" }
        Q.offer(hold, 0, L.try_reserve, L.free, L.list)
        for i = 1, 6 do
            Q.offer({ blocks = 1, band = 1, flow = "heavy", name = "H" }, i, L.try_reserve, L.free, L.list)
            Q.offer({ blocks = 1, band = 1, flow = "light", name = "L" }, i, L.try_reserve, L.free, L.list)
        end
        L.release(hold.reservation)
        local order = {}
        for _ = 1, 8 do
            L.limit = L.reserved + 1
            for _, w in ipairs(Q.wake(L.try_reserve, 20)) do order[#order + 1] = w.name end
        end
        assert.are.equal("HLHHLHHH", table.concat(order))
    end)

    it("sheds at arrival a request whose forecast is past its band's deadline, with that forecast", function()
        local L = ledger(10)
        local Q = flow.new(config({ bands = { { name = "interactive", deadline_s = 2 } } }))
        -- admitted: 10 blocks, 64 tokens of cap at 0.1 s: ends in 6.4 s
        Q.offer({ blocks = 10, band = 1, flow = "x", cap = 64 }, 0, L.try_reserve, L.free, L.list)
        local verdict, reason, wait_s = Q.offer({ blocks = 1, band = 1, flow = "x" }, 0, L.try_reserve, L.free, L.list)
        assert.are.equal("shed", verdict)
        assert.are.equal("deadline_unreachable", reason)
        assert.are.near(6.4, wait_s, 1e-9)
        assert.are.equal(0, Q.waiting)
        -- 5 s later 14 tokens are left: 1.4 s, within the deadline: it waits
        assert.are.equal("queued", Q.offer({ blocks = 1, band = 1, flow = "x" }, 5, L.try_reserve, L.free, L.list))
        local snap = Q.snapshot()
        assert.are.equal(1, snap.bands[1].shed)
        assert.are.equal(1, snap.bands[1].waiting)
    end)

    it("counts the blocks ahead as the spec does: earlier bands, its flow, the others' fair share", function()
        local L = ledger(0)
        local Q = flow.new(config({ weights = { { "b", 2 } } }))
        Q.offer({ blocks = 7, band = 1, flow = "hi" }, 0, L.try_reserve, L.free, L.list)
        Q.offer({ blocks = 3, band = 2, flow = "a" }, 0, L.try_reserve, L.free, L.list)
        Q.offer({ blocks = 20, band = 2, flow = "b" }, 0, L.try_reserve, L.free, L.list)
        -- a request of 2 blocks of flow a in band 2: 7 + 3 + min(20, ceil((3 + 2) x 2 / 1))
        assert.are.equal(7 + 3 + 10, Q.ahead(2, "a", 2))
        -- of a new flow c: 7 + 0 + ceil(2 x 1 / 1) + ceil(2 x 2 / 1)
        assert.are.equal(7 + 2 + 4, Q.ahead(2, "c", 2))
    end)

    it("bounds the queue: all bands, per flow, and the flow states", function()
        local L = ledger(0)
        local Q = flow.new(config({ max_waiting = 3, max_waiting_per_flow = 2, max_flows = 2 }))
        local function offer(f) return Q.offer({ blocks = 1, band = 1, flow = f }, 0, L.try_reserve, L.free, L.list) end
        assert.are.equal("queued", offer("a"))
        assert.are.equal("queued", offer("a"))
        assert.are.same({ "shed", "queue_full", 0 }, { offer("a") })  -- nothing admitted: a wait of 0 s
        assert.are.equal("queued", offer("b"))
        assert.are.same({ "shed", "queue_full", 0 }, { offer("b") })   -- 3 wait in all
        -- a third flow: two states exist and neither is idle
        Q = flow.new(config({ max_flows = 2 }))
        offer("a"); offer("b")
        assert.are.same({ "shed", "queue_full", 0 }, { offer("c") })
        assert.are.equal(2, Q.states)
    end)

    it("evicts the least recently used idle flow, its counts going to other", function()
        local L = ledger(100)
        local Q = flow.new(config({ max_flows = 2, metrics_flows = 5 }))
        local function offer(f) return Q.offer({ blocks = 1, band = 1, flow = f }, 0, L.try_reserve, L.free, L.list) end
        offer("a"); offer("b"); offer("a"); offer("c")  -- b, least recently used, goes
        local band = Q.snapshot().bands[1]
        local names = {}
        for _, f in ipairs(band.flows) do names[#names + 1] = f.flow .. "=" .. f.admitted end
        assert.are.same({ "a=2", "c=1" }, names)
        assert.are.equal(1, band.other.admitted)
        assert.are.equal(4, band.admitted)
    end)

    it("labels the flows with the most traffic and sums the rest as other", function()
        local L = ledger(100)
        local Q = flow.new(config({ metrics_flows = 1 }))
        for _, f in ipairs({ "b", "a", "b" }) do Q.offer({ blocks = 1, band = 1, flow = f }, 0, L.try_reserve, L.free, L.list) end
        local series = Q.series()
        assert.are.equal("b", series[1].flow)
        assert.are.equal(2, series[1].c.admitted)
        assert.are.equal("other", series[2].flow)
        assert.are.equal(1, series[2].c.admitted)
        assert.are.equal(3, series[1].c.wait_buckets[1] + series[2].c.wait_buckets[1])  -- waited 0 s
    end)

    it("lets a waiter leave without touching any tag, counting a timeout", function()
        local L = ledger(1)
        local Q = flow.new(config())
        local hold = { blocks = 1, band = 1, flow = "x" }
        Q.offer(hold, 0, L.try_reserve, L.free, L.list)
        local late = { blocks = 1, band = 1, flow = "y" }
        local gone = { blocks = 1, band = 1, flow = "z" }
        Q.offer(late, 0, L.try_reserve, L.free, L.list)
        Q.offer(gone, 0, L.try_reserve, L.free, L.list)
        Q.leave(late, "timeout")
        Q.leave(gone, "gone")
        Q.leave(gone, "gone")  -- twice: nothing more
        assert.are.equal(0, Q.waiting)
        local band = Q.snapshot().bands[1]
        assert.are.equal(1, band.timed_out)
        assert.are.equal(0, band.shed)
        L.release(hold.reservation)
        assert.are.same({}, Q.wake(L.try_reserve, 1))
    end)
end)

describe("kvtune.flow's reserve (trunk reservation)", function()
    local function reserved_config()
        return config({ bands = { { name = "interactive", deadline_s = 1000, reserve_blocks = 3 },
                                  { name = "batch", deadline_s = 1000 } } })
    end

    it("keeps the bands above's reserves free from a lower band: K_b", function()
        local Q = flow.new(config({ bands = { { name = "a", deadline_s = 1, reserve_blocks = 2 },
                                              { name = "b", deadline_s = 1, reserve_blocks = 5 },
                                              { name = "c", deadline_s = 1 } } }))
        assert.are.same({ 0, 2, 7 }, { Q.kept(1), Q.kept(2), Q.kept(3) })
        local snap = Q.snapshot()
        assert.are.same({ 2, 5, 0 }, { snap.bands[1].reserve_blocks, snap.bands[2].reserve_blocks,
                                       snap.bands[3].reserve_blocks })
        assert.are.same({ 0, 2, 7 }, { snap.bands[1].kept_blocks, snap.bands[2].kept_blocks,
                                       snap.bands[3].kept_blocks })
    end)

    it("refuses a batch request the reserve while an interactive one is admitted into it", function()
        local L = ledger(10)
        local Q = flow.new(reserved_config())
        assert.are.equal("admitted", Q.offer({ blocks = 5, band = 2, flow = "x" }, 0, L.try_reserve, L.free, L.list))
        -- 5 held: a batch request of 3 would leave 2 free, under the reserve of 3: it waits
        local batch = { blocks = 3, band = 2, flow = "x" }
        assert.are.equal("queued", Q.offer(batch, 0, L.try_reserve, L.free, L.list))
        -- the top band takes the reserve, to the last block
        local top = { blocks = 5, band = 1, flow = "y" }
        assert.are.equal("admitted", Q.offer(top, 0, L.try_reserve, L.free, L.list))
        assert.are.equal(10, L.reserved)
        L.release(top.reservation)
        -- 5 held, 5 free: the batch waiter still leaves only 2: served only once 6 are free
        assert.are.equal(0, #Q.wake(L.try_reserve, 1))
        L.release(L.running[1])
        local granted = Q.wake(L.try_reserve, 2)
        assert.are.equal(1, #granted)
        assert.are.equal(batch, granted[1])
        assert.are.equal(3, L.reserved)
    end)

    it("lets a request too large for the reserve into an empty ledger", function()
        local L = ledger(10)
        local Q = flow.new(reserved_config())
        -- 9 blocks beside a reserve of 3 never fit: it keeps min(3, 10 - 9) = 1
        local big = { blocks = 9, band = 2, flow = "x" }
        assert.are.equal("admitted", Q.offer(big, 0, L.try_reserve, L.free, L.list))
        L.release(big.reservation)
        assert.are.equal("admitted", Q.offer({ blocks = 1, band = 1, flow = "y" }, 0, L.try_reserve, L.free, L.list))
        assert.are.equal("queued", Q.offer({ blocks = 9, band = 2, flow = "x" }, 0, L.try_reserve, L.free, L.list))
    end)

    it("forecasts the blocks a lower band must leave free", function()
        local L = ledger(10)
        local Q = flow.new(reserved_config())
        Q.offer({ blocks = 8, band = 1, flow = "x", cap = 20 }, 0, L.try_reserve, L.free, L.list)  -- ends in 2 s
        -- interactive, 2 blocks: 2 free, it would not wait
        assert.are.equal(0, Q.wait_s(1, "y", 2, 0, L.free, L.list))
        -- batch, 2 blocks: 2 + 3 kept - 2 free = 3 to free: the holder's end
        assert.are.near(2, Q.wait_s(2, "y", 2, 0, L.free, L.list), 1e-12)
    end)
end)
