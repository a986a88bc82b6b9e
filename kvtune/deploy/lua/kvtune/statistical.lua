-- kvtune.statistical: the statistical admission ledger of the rendered nginx.conf.
-- kvtune.gateway.overflow and StatisticalLedger (ledger.py), decision for decision, with
-- their constants rendered from Python (CONFIG.statistical): admit while a bound on
-- P(peak KV of the held sequences over the coming steps > budget) stays <= epsilon. The
-- held sequences live in this worker's memory (the config runs one worker for this
-- policy), so each check-and-add is atomic and the state incremental, as in Python.
--
-- statistical.new(CONFIG) -> STAT, or nil when CONFIG.statistical is absent (another policy).
-- Pure Lua (LuaJIT's ffi for the arrays): no ngx, so it runs and is unit-tested outside nginx.
local ffi = require "ffi"
local ceil, huge = math.ceil, math.huge

local _M = {}

function _M.new(CONFIG)
    if not CONFIG.statistical then return nil end
    local STAT
    local S = CONFIG.statistical
    local THETAS, NT = S.thetas, #S.thetas
    local EDGES = S.edges
    local ROWS = #EDGES + 1
    local CAP = CONFIG.block_budget
    local SIZE = CAP + 2
    local TOP = CAP + 1  -- the slot sums above the budget are lumped into
    local BS = CONFIG.block_size
    local EPS = S.epsilon
    local exp, log, min, max = math.exp, math.log, math.min, math.max
    local doubles = ffi.typeof("double[?]")

    local function next_mark(tokens)
        local mark = S.first_mark
        while mark <= tokens do mark = mark * 2 end
        return mark
    end
    local function last_mark(tokens)
        if tokens < S.first_mark then return 0 end
        local mark = S.first_mark
        while mark * 2 <= tokens do mark = mark * 2 end
        return mark
    end
    local function exact_is_cheap(units) return SIZE * ROWS * units <= S.exact_work end

    -- OutputLaw.conditioned: the lengths (each at most cap) and their probabilities
    -- given `streamed` tokens seen; none left: the cap.
    local function conditioned(law, cap, streamed)
        local lengths, weights = {}, {}
        for i = 1, #law.lengths do
            local length, weight = min(law.lengths[i], cap), law.counts[i]
            if length >= streamed and weight > 0 then
                local n = #lengths
                if n > 0 and lengths[n] == length then
                    weights[n] = weights[n] + weight
                else
                    lengths[n + 1], weights[n + 1] = length, weight
                end
            end
        end
        if #lengths == 0 then return { cap }, { 1.0 } end
        local total = 0
        for i = 1, #weights do total = total + weights[i] end
        local probs = {}
        for i = 1, #weights do probs[i] = weights[i] / total end
        return lengths, probs
    end

    -- One row's log-moments on THETAS (into lmgf at row r) and its pmf clipped at TOP,
    -- as sorted parallel lists (np.bincount of min(values, TOP)).
    local function fill_row(seq, r, values, logp)
        local lmgf, n = seq.lmgf, #values
        for t = 1, NT do
            local theta, top = THETAS[t], -huge
            for j = 1, n do
                local e = theta * values[j] + logp[j]
                if e > top then top = e end
            end
            local s = 0
            for j = 1, n do s = s + exp(theta * values[j] + logp[j] - top) end
            lmgf[(r - 1) * NT + t - 1] = top + log(s)
        end
        local vs, ps = {}, {}
        for j = 1, n do
            local v, m = min(values[j], TOP), #vs
            if m > 0 and vs[m] == v then ps[m] = ps[m] + seq.probs[j] else vs[m + 1], ps[m + 1] = v, seq.probs[j] end
        end
        seq.pmf[r] = { v = vs, p = ps, n = #vs }
    end

    -- overflow.sequence_rows: one sequence of `prompt` tokens capped at `cap`, `streamed` in.
    local function sequence_rows(prompt, cap, law, streamed)
        local lengths, probs = conditioned(law, cap, streamed)
        local seq = { probs = probs, pmf = {}, lmgf = doubles(ROWS * NT), worst = ceil((prompt + cap) / BS) }
        seq.units = min(seq.worst, TOP) + 1
        local logp = {}
        for j = 1, #probs do logp[j] = log(probs[j]) end
        for r = 1, ROWS - 1 do
            local a, b = EDGES[r][1], EDGES[r][2]
            local values = {}
            for j = 1, #lengths do
                local length = lengths[j]
                values[j] = (length - streamed > a) and ceil((prompt + min(streamed + b, length)) / BS) or 0
            end
            fill_row(seq, r, values, logp)
        end
        local final = {}
        for j = 1, #lengths do final[j] = ceil((prompt + lengths[j]) / BS) end
        fill_row(seq, ROWS, final, logp)
        return seq
    end

    -- ledger._fixed_rows: blocks held for as long as anything runs (nothing known).
    local function fixed_rows(blocks)
        local seq = { probs = { 1.0 }, pmf = {}, lmgf = doubles(ROWS * NT), worst = blocks }
        seq.units = min(blocks, TOP) + 1
        local values, logp = { blocks }, { 0.0 }
        for r = 1, ROWS do fill_row(seq, r, values, logp) end
        return seq
    end

    -- StatisticalLedger._rows_of
    local function rows_of(blocks, demand, streamed)
        if demand == nil then return { fixed_rows(blocks) } end
        local law = demand.law or { lengths = { max(demand.cap, 1) }, counts = { 1 } }
        local out = {}
        for i, p in ipairs(demand.prompts) do out[i] = sequence_rows(p, demand.cap, law, streamed or 0) end
        return out
    end

    -- overflow.convolve_clipped: dst (at doff) = src (at soff) convolved with one row's
    -- pmf, sums above the budget lumped at TOP. `hi` is the highest index src may hold
    -- mass at (above it src is unread); returns dst's.
    local function convolve(src, soff, hi, pmf, dst, doff)
        local vs, ps, n = pmf.v, pmf.p, pmf.n
        local dhi = min(TOP, hi + vs[n])
        for i = 0, dhi do dst[doff + i] = 0 end
        for k = 1, n do
            local v, p = vs[k], ps[k]
            local split = min(hi, TOP - v)  -- src[i] with i > split lands above the budget
            for i = 0, split do
                local x = src[soff + i]
                if x ~= 0 then dst[doff + i + v] = dst[doff + i + v] + x * p end
            end
            if split < hi then
                local over = 0
                for i = max(split + 1, 0), hi do over = over + src[soff + i] * p end
                dst[doff + TOP] = dst[doff + TOP] + over
            end
        end
        return dhi
    end

    -- The ledger: held entries in admission order (a doubly linked list), the sums.
    local first, last = nil, nil
    local held_count, reserved, worst_sum, units_sum, removals = 0, 0, 0, 0, 0
    local lmgf_sum = doubles(ROWS * NT)
    local exact = doubles(ROWS * SIZE)  -- each row's exact distribution, while exact_valid
    local exact_hi = {}  -- per row, the highest index it holds mass at
    local exact_valid = true
    for r = 1, ROWS do exact[(r - 1) * SIZE], exact_hi[r] = 1.0, 0 end
    local scratch_a, scratch_b = doubles(SIZE), doubles(SIZE)

    local function convolve_row(r, pmf)  -- exact row r convolved with pmf, in place
        local off = (r - 1) * SIZE
        local hi = convolve(exact, off, exact_hi[r], pmf, scratch_a, 0)
        ffi.copy(exact + off, scratch_a, (hi + 1) * 8)
        exact_hi[r] = hi
    end
    local function add_seq(s)
        worst_sum = worst_sum + s.worst
        units_sum = units_sum + s.units
        for i = 0, ROWS * NT - 1 do lmgf_sum[i] = lmgf_sum[i] + s.lmgf[i] end
        if exact_valid then
            if exact_is_cheap(units_sum) then
                for r = 1, ROWS do convolve_row(r, s.pmf[r]) end
            else
                exact_valid = false
            end
        end
    end
    local function hold(entry)
        entry.prev, entry.next = last, nil
        if last then last.next = entry else first = entry end
        last = entry
        entry.held = true
        held_count = held_count + 1
        for _, s in ipairs(entry.seqs) do add_seq(s) end
    end
    local function unhold(entry)
        if entry.prev then entry.prev.next = entry.next else first = entry.next end
        if entry.next then entry.next.prev = entry.prev else last = entry.prev end
        entry.prev, entry.next, entry.held = nil, nil, false
        held_count = held_count - 1
        for _, s in ipairs(entry.seqs) do
            worst_sum = worst_sum - s.worst
            units_sum = units_sum - s.units
            for i = 0, ROWS * NT - 1 do lmgf_sum[i] = lmgf_sum[i] - s.lmgf[i] end
        end
        exact_valid = false
        removals = removals + 1
        if removals % S.resum_every == 0 or held_count == 0 then  -- float drift
            for i = 0, ROWS * NT - 1 do lmgf_sum[i] = 0 end
            local e = first
            while e do
                for _, s in ipairs(e.seqs) do
                    for i = 0, ROWS * NT - 1 do lmgf_sum[i] = lmgf_sum[i] + s.lmgf[i] end
                end
                e = e.next
            end
        end
    end
    local function exact_rows()
        if not exact_valid then
            for r = 1, ROWS do
                exact[(r - 1) * SIZE], exact_hi[r] = 1.0, 0
                local e = first
                while e do
                    for _, s in ipairs(e.seqs) do convolve_row(r, s.pmf[r]) end
                    e = e.next
                end
            end
            exact_valid = true
        end
    end

    -- overflow.combine
    local function combine(tails)
        local s = 0
        for r = 1, ROWS - 1 do s = s + tails[r] end
        return min(1.0, tails[ROWS], s)
    end
    -- overflow.chernoff_tail per row over what is held (or nothing, `alone`) plus `extra`.
    local function chernoff(extra, alone)
        local tails = {}
        for r = 1, ROWS do
            local e = huge
            for t = 1, NT do
                local i = (r - 1) * NT + t - 1
                local total = alone and 0 or lmgf_sum[i]
                for _, s in ipairs(extra) do total = total + s.lmgf[i] end
                local x = total - THETAS[t] * (CAP + 1)
                if x < e then e = x end
            end
            tails[r] = min(1.0, exp(min(e, 0)))
        end
        return combine(tails)
    end
    -- P(peak KV of what is held (or nothing, `alone`), plus `extra`, outgrows the budget),
    -- StatisticalLedger.overflow_probability. `within`: only whether it is at most that;
    -- the Chernoff bound, never below the exact value, answers yes cheaply when it can
    -- (same decision, without convolving every held sequence again after a release).
    local function overflow_probability(extra, alone, within)
        local w, u = alone and 0 or worst_sum, alone and 0 or units_sum
        for _, s in ipairs(extra) do w, u = w + s.worst, u + s.units end
        if w <= CAP then return 0.0 end
        if not exact_is_cheap(u) then return chernoff(extra, alone) end
        if within and not alone and not exact_valid then
            local bound = chernoff(extra, false)
            if bound <= within then return bound end
        end
        if not alone then exact_rows() end
        local tails = {}
        for r = 1, ROWS do
            local src, soff, hi = exact, (r - 1) * SIZE, exact_hi[r]
            if alone then scratch_b[0], src, soff, hi = 1.0, scratch_b, 0, 0 end
            for _, s in ipairs(extra) do
                hi = convolve(src, soff, hi, s.pmf[r], scratch_a, 0)
                ffi.copy(scratch_b, scratch_a, (hi + 1) * 8)
                src, soff = scratch_b, 0
            end
            tails[r] = hi == TOP and min(1.0, max(0.0, src[soff + TOP])) or 0.0
        end
        return combine(tails)
    end

    -- Blocks other workers hold: after a reload, the old worker's reservations while it
    -- drains (the shared dict outlives it). They are counted at their worst case for as
    -- long as anything runs, as a reservation without a demand; 0 in steady state.
    local foreign_rows = {}
    local function foreign(shared_held)
        local blocks = shared_held - reserved
        if blocks <= 0 then return {} end
        if not foreign_rows[blocks] then foreign_rows = { [blocks] = { fixed_rows(blocks) } } end
        return foreign_rows[blocks]
    end

    STAT = { epsilon = EPS, last_admitted_probability = 0.0 }
    function STAT.overflow_probability(shared_held) return overflow_probability(foreign(shared_held)) end
    -- StatisticalLedger.never_fits: its own probability alone exceeds epsilon.
    function STAT.never_fits(blocks, demand)
        if EPS == 0 or blocks <= CAP then return blocks > CAP end
        local alone = rows_of(blocks, demand)
        local w = 0
        for _, s in ipairs(alone) do w = w + s.worst end
        if w <= CAP then return false end
        return overflow_probability(alone, true) > EPS
    end
    -- The blocks flow control's reserve keeps free beside a request (StatisticalLedger.try_reserve's
    -- keep_blocks): a reservation of that many blocks without a demand, never held.
    local kept_rows = {}
    local function kept(blocks)
        if not kept_rows[blocks] then kept_rows = { [blocks] = fixed_rows(blocks) } end
        return kept_rows[blocks]
    end
    -- StatisticalLedger.try_reserve: the held entry, or nil (nothing is held). keep: the blocks
    -- to leave free beside it (flow control's reserve), at most the budget less its own.
    function STAT.try_reserve(blocks, demand, shared_held, keep)
        local seqs = rows_of(blocks, demand)
        local probability = 0.0
        local k = min(keep or 0, max(0, CAP - blocks))
        if EPS == 0 then
            if max(reserved, shared_held) + blocks + k > CAP then return nil end
        else
            local extra = seqs
            local other = foreign(shared_held)
            if #other > 0 or k > 0 then
                extra = {}
                if #other > 0 then extra[1] = other[1] end
                for _, s in ipairs(seqs) do extra[#extra + 1] = s end
                if k > 0 then extra[#extra + 1] = kept(k) end
            end
            probability = overflow_probability(extra, false, EPS)
            if probability > EPS then return nil end
        end
        reserved = reserved + blocks
        local entry = { blocks = blocks, demand = demand, seqs = seqs }
        if demand ~= nil and #demand.prompts == 1 then entry.next_mark = next_mark(0) end
        hold(entry)
        STAT.last_admitted_probability = probability
        return entry
    end
    -- Reservation.progress / StatisticalLedger._progress: conditioned again at the marks.
    function STAT.progress(entry, streamed)
        local mark = entry.next_mark
        if mark == nil or streamed < mark or entry.released then return end
        if not entry.held then entry.next_mark = nil return end
        unhold(entry)
        local demand = entry.demand
        entry.seqs = rows_of(entry.blocks, demand, min(last_mark(streamed), demand.cap))
        hold(entry)
        entry.next_mark = next_mark(streamed)
    end
    function STAT.release(entry)
        if entry.released then return end
        entry.released = true
        reserved = reserved - entry.blocks
        if entry.held then unhold(entry) end
    end
    return STAT
end

return _M
