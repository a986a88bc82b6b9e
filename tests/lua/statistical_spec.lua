-- kvtune.statistical: the statistical admission ledger, its exact overflow probability and the
-- Chernoff bound it falls back to when convolving would cost too much.
local statistical = require "kvtune.statistical"

-- overflow.THETAS (2^-12 .. 2^2 in half powers of two) and interval_edges(max_model_len).
local function thetas()
    local out = {}
    for k = 0, 28 do out[#out + 1] = 2 ^ (-12 + k / 2) end
    return out
end
local function edges(max_model_len)
    local out, a, b = { { 0, 1 } }, 1, 2
    while a < max_model_len do
        out[#out + 1] = { a, b }
        a, b = b, b * 2
    end
    return out
end

-- exact_work: how much convolving the ledger may do; 0 leaves it the Chernoff bound only.
local function ledger(budget, epsilon, exact_work)
    return statistical.new({
        block_budget = budget, block_size = 16,
        statistical = { epsilon = epsilon, thetas = thetas(), edges = edges(1024), exact_work = exact_work,
                        first_mark = 16, resum_every = 1024, events_without_tokens = 3 },
    })
end

-- A chat of `prompt` tokens capped at 512 whose output is mostly short.
local LAW = { lengths = { 16, 64, 512 }, counts = { 70, 20, 10 } }
local function demand(prompt) return { prompts = { prompt }, cap = 512, law = LAW } end
local function blocks(prompt) return math.ceil((prompt + 512) / 16) end

describe("kvtune.statistical", function()
    it("is no ledger under another policy", function()
        assert.is_nil(statistical.new({ block_budget = 10, block_size = 16 }))
    end)

    it("sees no risk while the worst case fits the budget", function()
        local stat = ledger(100, 0.01, 2000000)
        assert.is_truthy(stat.try_reserve(blocks(100), demand(100), 0))  -- 39 blocks
        assert.is_truthy(stat.try_reserve(blocks(100), demand(100), 0))  -- 78
        assert.are.equal(0, stat.overflow_probability(0))
    end)

    it("admits past the worst case while the overflow probability stays within epsilon", function()
        local stat, admitted = ledger(100, 0.01, 2000000), 0
        while stat.try_reserve(blocks(100), demand(100), 0) do admitted = admitted + 1 end
        assert.is_true(admitted * blocks(100) > 100)              -- more than guaranteed admits
        assert.is_true(stat.overflow_probability(0) <= 0.01)
        assert.is_true(stat.last_admitted_probability <= 0.01)
    end)

    it("is the guaranteed policy at epsilon 0", function()
        local stat, admitted = ledger(100, 0, 2000000), 0
        while stat.try_reserve(blocks(100), demand(100), 0) do admitted = admitted + 1 end
        assert.are.equal(2, admitted)                            -- floor(100 / 39)
        assert.is_true(stat.never_fits(101, demand(100)))
        assert.is_false(stat.never_fits(100, demand(100)))
    end)

    it("bounds the exact probability from above with the Chernoff bound", function()
        for _, budget in ipairs({ 60, 100, 200, 400 }) do
            local exact, bound = ledger(budget, 1, 2000000), ledger(budget, 1, 0)
            for n = 1, 12 do
                local prompt = 50 * n
                assert.is_truthy(exact.try_reserve(blocks(prompt), demand(prompt), 0))
                assert.is_truthy(bound.try_reserve(blocks(prompt), demand(prompt), 0))
                local p, b = exact.overflow_probability(0), bound.overflow_probability(0)
                assert.is_true(p >= 0 and p <= 1, "exact " .. p)
                assert.is_true(b >= p - 1e-12 and b <= 1, ("bound %.17g under exact %.17g"):format(b, p))
            end
            assert.is_true(exact.overflow_probability(0) > 0)
        end
    end)

    it("refuses by the bound what overflows for certain, and forgets what is released", function()
        local stat = ledger(100, 0.01, 0)
        local entries = {}
        while true do
            local e = stat.try_reserve(blocks(100), demand(100), 0)
            if not e then break end
            entries[#entries + 1] = e
        end
        assert.is_true(#entries >= 2)
        assert.is_true(stat.overflow_probability(0) <= 0.01)
        for _, e in ipairs(entries) do stat.release(e) end
        stat.release(entries[1])                                  -- twice: once
        assert.are.equal(0, stat.overflow_probability(0))
        assert.is_truthy(stat.try_reserve(blocks(100), demand(100), 0))
    end)

    it("keeps flow control's reserve as a budget that much smaller", function()
        -- P(peak KV + k > budget) = P(peak KV > budget - k): 30 kept of 100 admit what 70 admit
        for _, epsilon in ipairs({ 0, 0.01, 0.2 }) do
            local kept, smaller, n = ledger(100, epsilon, 2000000), ledger(70, epsilon, 2000000), 0
            while kept.try_reserve(blocks(100), demand(100), 0, 30) do
                assert.is_truthy(smaller.try_reserve(blocks(100), demand(100), 0))
                n = n + 1
            end
            assert.is_nil(smaller.try_reserve(blocks(100), demand(100), 0))
            assert.is_true(n >= 1)
            assert.is_truthy(kept.try_reserve(blocks(100), demand(100), 0))  -- nothing kept: the top band
        end
    end)

    it("counts other workers' blocks at their worst case", function()
        local stat = ledger(100, 0.01, 2000000)
        assert.is_nil(stat.try_reserve(blocks(100), demand(100), 100))  -- 100 held elsewhere
        assert.are.equal(0, stat.overflow_probability(0))
    end)
end)
