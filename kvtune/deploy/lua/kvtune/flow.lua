-- kvtune.flow: the flow-control queue of the rendered nginx.conf (gateway.yaml's `flow:`), rule
-- for rule the specification in docs/guides/flow-control.md that the Python gateway implements
-- too: priority bands (strict), weighted fair sharing between the flows of a band (start and
-- finish tags on reserved blocks), earliest deadline first within a flow, nobody overtaking the
-- request chosen; at arrival a forecast of when its blocks will be free, and a 429 at once
-- (deadline_unreachable) when that is past its band's deadline. Trunk reservation: a request of
-- band b leaves K_b blocks free (the reserves of the bands before it; w.keep, which the caller's
-- try_reserve honours), so a higher band's arrival finds room at once.
--
-- flow.new(cfg) -> Q. Pure Lua, no ngx: the caller passes the clock (now), the ledger's
-- try_reserve, its free blocks and the admitted requests, so busted runs it outside nginx. One Q
-- per nginx worker; a config with flow control runs one worker (nginx.conf.j2), so every request
-- meets the same order.
local ceil, floor, max, min = math.ceil, math.floor, math.max, math.min

local _M = {}

-- Upper bounds (seconds) of kvtune_gateway_flow_wait_seconds' buckets.
_M.WAIT_BUCKETS_S = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60 }
_M.OTHER = "other"
local SHED_REASONS = { "deadline_unreachable", "queue_full" }

local function counters()
    local c = { admitted = 0, timed_out = 0, shed = { deadline_unreachable = 0, queue_full = 0 },
                wait_count = 0, wait_sum = 0, wait_buckets = {} }
    for i = 1, #_M.WAIT_BUCKETS_S do c.wait_buckets[i] = 0 end
    return c
end
local function add_counters(into, c)
    into.admitted, into.timed_out = into.admitted + c.admitted, into.timed_out + c.timed_out
    for _, reason in ipairs(SHED_REASONS) do into.shed[reason] = into.shed[reason] + c.shed[reason] end
    into.wait_count, into.wait_sum = into.wait_count + c.wait_count, into.wait_sum + c.wait_sum
    for i = 1, #_M.WAIT_BUCKETS_S do into.wait_buckets[i] = into.wait_buckets[i] + c.wait_buckets[i] end
end
local function observe_wait(c, seconds)
    c.wait_count, c.wait_sum = c.wait_count + 1, c.wait_sum + seconds
    for i, bound in ipairs(_M.WAIT_BUCKETS_S) do
        if seconds <= bound then c.wait_buckets[i] = c.wait_buckets[i] + 1 end
    end
end
local function traffic(c) return c.admitted + c.shed.deadline_unreachable + c.shed.queue_full + c.timed_out end

-- A waiter's order within its flow: the earliest deadline, then the earliest arrival.
local function earlier(a, b)
    if a.deadline ~= b.deadline then return a.deadline < b.deadline end
    return a.seq < b.seq
end

-- Expected output tokens an admitted request has left (the spec's R_i): its route's law (bins
-- of upper edge lengths[j], counts[j]) past the g tokens generated, each bin at most the cap;
-- without a law the cap less g; 1 at least, and 1 for a request that generates nothing.
function _M.tokens_left(law, cap, g)
    if cap == nil then return 1 end
    local left
    if law ~= nil then
        local num, den = 0, 0
        for j = 1, #law.lengths do
            local m = min(law.lengths[j], cap)
            if m > g then num, den = num + law.counts[j] * (m - g), den + law.counts[j] end
        end
        left = den > 0 and num / den or 1
    else
        left = cap - g
    end
    return max(left, 1)
end

-- Seconds until `need` more blocks are free (the spec's walk): running is the admitted
-- requests { blocks, cap, law, admitted_at, streamed, seq }, tau seconds a token.
function _M.forecast_s(running, need, now, tau)
    if need <= 0 then return 0 end
    local ends, total = {}, 0
    for i, r in ipairs(running) do
        local cap = r.cap
        local g = 0
        if cap ~= nil then g = min(cap, max(r.streamed or 0, floor((now - r.admitted_at) / tau))) end
        ends[i] = { t = _M.tokens_left(r.law, cap, g) * tau, blocks = r.blocks, seq = r.seq or 0 }
        total = total + r.blocks
    end
    if total == 0 then return 0 end
    table.sort(ends, function(a, b)  -- by end, then by admission
        if a.t ~= b.t then return a.t < b.t end
        return a.seq < b.seq
    end)
    local q = floor((need - 1) / total)
    local r = need - q * total
    local sum, t_k = 0, ends[#ends].t
    for _, e in ipairs(ends) do
        sum = sum + e.blocks
        if sum >= r then t_k = e.t break end
    end
    return q * ends[#ends].t + t_k
end

function _M.new(cfg)
    local Q = { waiting = 0, states = 0 }
    local bands, band_index = {}, {}
    local kept = 0  -- K_b: the reserves of the bands before b
    for i, b in ipairs(cfg.bands) do
        bands[i] = { name = b.name, deadline_s = b.deadline_s, V = 0, flows = {}, active = {}, waiting = 0,
                     other = counters(), reserve_blocks = b.reserve_blocks or 0, kept = kept }
        band_index[b.name] = i
        kept = kept + (b.reserve_blocks or 0)
    end
    local weights = {}  -- cfg.weights: { flow id, weight } pairs
    for _, pair in ipairs(cfg.weights or {}) do weights[pair[1]] = pair[2] end
    local seq, touch = 0, 0

    function Q.band_of(name) return band_index[name] end
    -- K_b of band bi: the blocks its requests leave free for the bands above it.
    function Q.kept(bi) return bands[bi].kept end
    function Q.weight_of(id) return weights[id] or cfg.default_weight end

    -- ------------------------------------------------------------ flow states (bounded, LRU)

    -- The least recently used idle flow state leaves (its counters go to its band's other).
    local function evict_idle()
        local oldest, home
        for _, b in ipairs(bands) do
            for _, f in pairs(b.flows) do
                if #f.waiters == 0 and (oldest == nil or f.used < oldest.used) then oldest, home = f, b end
            end
        end
        if oldest == nil then return false end
        add_counters(home.other, oldest.c)
        home.flows[oldest.id] = nil
        Q.states = Q.states - 1
        return true
    end
    -- Band b's state of flow `id`, made (evicting an idle one past max_flows) when `make`; nil
    -- when there is none and no room for one.
    local function state(b, id, make)
        local f = b.flows[id]
        if f == nil and make then
            if Q.states >= cfg.max_flows and not evict_idle() then return nil end
            f = { id = id, weight = Q.weight_of(id), F = 0, S = nil, W = 0, waiters = {}, c = counters(), used = 0 }
            b.flows[id] = f
            Q.states = Q.states + 1
        end
        if f then touch = touch + 1; f.used = touch end
        return f
    end
    -- Counters of band b's flow `id`: its state's, else the band's other.
    local function counts_of(b, id)
        local f = state(b, id, true)
        return f and f.c or b.other
    end

    -- ------------------------------------------------------------ the order

    local function waits_before(bi)  -- a waiter in band bi or any band before it
        for i = 1, bi do if bands[i].waiting > 0 then return true end end
        return false
    end
    -- The request served next: (waiter, band, flow), or nil when nobody waits.
    local function head()
        for _, b in ipairs(bands) do
            if b.waiting > 0 then
                local best
                for _, f in ipairs(b.active) do
                    if best == nil or f.S < best.S or (f.S == best.S and f.waiters[1].seq < best.waiters[1].seq) then
                        best = f
                    end
                end
                return best.waiters[1], b, best
            end
        end
        return nil
    end
    function Q.head() return (head()) end

    local function remove(w)
        local b = bands[w.band]
        local f = b.flows[w.flow]
        for i, x in ipairs(f.waiters) do
            if x == w then table.remove(f.waiters, i) break end
        end
        f.W = f.W - w.blocks
        if #f.waiters == 0 then
            f.S = nil
            for i, x in ipairs(b.active) do
                if x == f then table.remove(b.active, i) break end
            end
        end
        b.waiting, Q.waiting = b.waiting - 1, Q.waiting - 1
        w.queued = false
        return b, f
    end

    -- Serve waiters one by one while the chosen one fits (try_reserve(w) -> a reservation or
    -- nil): the waiters granted, each with .reservation and .waited_s.
    function Q.wake(try_reserve, now)
        local granted = {}
        while true do
            local w, b, f = head()
            if w == nil then break end
            local reservation = try_reserve(w)
            if reservation == nil then break end
            local S = f.S
            remove(w)
            b.V = S
            f.F = S + w.blocks / f.weight
            if #f.waiters > 0 then f.S = f.F end
            w.reservation, w.waited_s = reservation, max(0, now - w.arrived)
            f.c.admitted = f.c.admitted + 1
            observe_wait(f.c, w.waited_s)
            granted[#granted + 1] = w
        end
        return granted
    end

    -- The blocks served before a request of `blocks` of flow `id` in band bi (the spec's
    -- "ahead"): every waiter of the bands before, its own flow's, and what fair sharing serves
    -- each other flow of its band before its turn.
    function Q.ahead(bi, id, blocks)
        local total = 0
        for i = 1, bi - 1 do
            for _, f in ipairs(bands[i].active) do total = total + f.W end
        end
        local b = bands[bi]
        local own = b.flows[id]
        local W_f = own and own.W or 0
        local w_f = own and own.weight or Q.weight_of(id)
        total = total + W_f
        for _, g in ipairs(b.active) do
            if g ~= own then total = total + min(g.W, ceil((W_f + blocks) * g.weight / w_f)) end
        end
        return total
    end

    -- The forecast wait of a request of `blocks` in band bi, flow `id`, were it to wait now:
    -- free(), the ledger's free blocks and its limit; running(), the admitted requests. It must
    -- leave k = min(K_b, max(0, limit - blocks)) blocks free beside it.
    function Q.wait_s(bi, id, blocks, now, free, running)
        local f, limit = free()
        local k = min(bands[bi].kept, max(0, limit - blocks))
        return _M.forecast_s(running(), Q.ahead(bi, id, blocks) + blocks + k - f, now, cfg.token_time_s)
    end

    -- A request that arrives: w = { blocks, band (its index), flow (its id) }; try_reserve(w)
    -- must leave w.keep blocks free beside it (clamped as the ledger clamps). Returns
    --   "admitted"                  reserved at once (w.reservation)
    --   "queued"                    it waits (w.deadline); wake grants it, or leave takes it out
    --   "shed", reason, wait_s      429 at once: "queue_full" or "deadline_unreachable"
    function Q.offer(w, now, try_reserve, free, running)
        local b = bands[w.band]
        w.keep = b.kept  -- what try_reserve(w) leaves free beside it
        if not waits_before(w.band) then
            local reservation = try_reserve(w)
            if reservation ~= nil then
                w.reservation, w.waited_s = reservation, 0
                local c = counts_of(b, w.flow)
                c.admitted = c.admitted + 1
                observe_wait(c, 0)
                return "admitted"
            end
        end
        local f = state(b, w.flow, true)
        if f == nil or Q.waiting >= cfg.max_waiting or #f.waiters >= cfg.max_waiting_per_flow then
            local c = f and f.c or b.other
            c.shed.queue_full = c.shed.queue_full + 1
            return "shed", "queue_full", Q.wait_s(w.band, w.flow, w.blocks, now, free, running)
        end
        local wait_s = Q.wait_s(w.band, w.flow, w.blocks, now, free, running)
        if wait_s > b.deadline_s then
            f.c.shed.deadline_unreachable = f.c.shed.deadline_unreachable + 1
            return "shed", "deadline_unreachable", wait_s
        end
        seq = seq + 1
        w.seq, w.arrived, w.deadline = seq, now, now + b.deadline_s
        if #f.waiters == 0 then
            f.S = max(b.V, f.F)
            b.active[#b.active + 1] = f
        end
        local list = f.waiters
        local at = #list + 1
        while at > 1 and earlier(w, list[at - 1]) do at = at - 1 end
        table.insert(list, at, w)
        f.W = f.W + w.blocks
        b.waiting, Q.waiting = b.waiting + 1, Q.waiting + 1
        w.queued = true
        return "queued"
    end

    -- A waiter leaves unserved: its deadline came ("timeout", counted) or its client went
    -- away ("gone"). No tag changes. The caller serves whoever that lets in (wake).
    function Q.leave(w, why)
        if not w.queued then return end
        local _, f = remove(w)
        if why == "timeout" then f.c.timed_out = f.c.timed_out + 1 end
    end

    -- ------------------------------------------------------------ what is shown

    -- Band b's flows by traffic (then id), the first `n` of them, and the rest summed as other.
    local function split(b, n)
        local list = {}
        for _, f in pairs(b.flows) do list[#list + 1] = f end
        table.sort(list, function(x, y)
            local tx, ty = traffic(x.c), traffic(y.c)
            if tx ~= ty then return tx > ty end
            return x.id < y.id
        end)
        local top, other = {}, counters()
        add_counters(other, b.other)
        local other_waiting = 0
        for i, f in ipairs(list) do
            if i <= n then top[#top + 1] = f else add_counters(other, f.c); other_waiting = other_waiting + #f.waiters end
        end
        return top, other, other_waiting
    end

    local function row(c, waiting)
        return { waiting = waiting, admitted = c.admitted, timed_out = c.timed_out,
                 shed = c.shed.deadline_unreachable + c.shed.queue_full }
    end

    -- /kvtune/ledger's "flow" member.
    function Q.snapshot()
        local out = { token_time_s = cfg.token_time_s, waiting = Q.waiting, flows = Q.states, bands = {} }
        for i, b in ipairs(bands) do
            local top, other, other_waiting = split(b, cfg.metrics_flows)
            local all = counters()
            add_counters(all, b.other)
            for _, f in pairs(b.flows) do add_counters(all, f.c) end
            local entry = row(all, b.waiting)
            entry.name, entry.deadline_s, entry.flows = b.name, b.deadline_s, {}
            entry.reserve_blocks, entry.kept_blocks = b.reserve_blocks, b.kept
            for k, f in ipairs(top) do
                local r = row(f.c, #f.waiters)
                r.flow = f.id
                entry.flows[k] = r
            end
            entry.other = row(other, other_waiting)
            out.bands[i] = entry
        end
        return out
    end

    -- The series of /metrics: { band, flow, waiting, c (counters) } per band, its top flows
    -- then other.
    function Q.series()
        local out = {}
        for _, b in ipairs(bands) do
            local top, other, other_waiting = split(b, cfg.metrics_flows)
            for _, f in ipairs(top) do
                out[#out + 1] = { band = b.name, flow = f.id, waiting = #f.waiters, c = f.c }
            end
            out[#out + 1] = { band = b.name, flow = _M.OTHER, waiting = other_waiting, c = other }
        end
        return out
    end

    return Q
end

return _M
