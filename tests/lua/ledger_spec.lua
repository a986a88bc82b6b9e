-- kvtune.ledger: the release rate behind Retry-After, on a fake shared dict.
local FakeDict = require "fake_dict"
local ledger = require "kvtune.ledger"

local WINDOW, MIN_S, MAX_S = 10, 1, 60

describe("kvtune.ledger", function()
    local dict, rates
    before_each(function()
        dict = FakeDict.new()
        rates = ledger.new(dict, WINDOW, MIN_S, MAX_S)
    end)

    it("knows no rate before the first release, and answers the shortest Retry-After", function()
        assert.is_nil(rates.release_rate(100))
        assert.are.equal(MIN_S, rates.retry_after(1000, 100))
    end)

    it("is the blocks released over the window, decaying exponentially after", function()
        rates.note_release(20, 100)
        assert.are.near(2.0, rates.release_rate(100), 1e-12)
        assert.are.near(2.0 * math.exp(-1), rates.release_rate(110), 1e-12)
        assert.are.near(2.0, rates.release_rate(90), 1e-12)  -- a clock behind the last release: no growth
    end)

    it("adds a release to what is left of the earlier ones", function()
        rates.note_release(20, 100)
        rates.note_release(10, 110)
        assert.are.near((20 * math.exp(-1) + 10) / WINDOW, rates.release_rate(110), 1e-12)
    end)

    it("is one rate for every worker reading the same dict", function()
        local other = ledger.new(dict, WINDOW, MIN_S, MAX_S)
        rates.note_release(30, 5)
        other.note_release(10, 5)
        assert.are.near(4.0, rates.release_rate(5), 1e-12)
        assert.are.near(4.0, other.release_rate(5), 1e-12)
    end)

    it("asks a refused request to wait until the blocks it needs are likely released", function()
        rates.note_release(20, 100)                            -- 2 blocks/s
        assert.are.equal(5, rates.retry_after(9, 100))         -- ceil(9 / 2)
        assert.are.equal(MIN_S, rates.retry_after(1, 100))     -- never under the shortest
        assert.are.equal(MAX_S, rates.retry_after(10000, 100)) -- never over the longest
    end)

    it("answers the longest Retry-After while nothing is being released", function()
        rates.note_release(0, 100)
        assert.are.equal(0, rates.release_rate(100))
        assert.are.equal(MAX_S, rates.retry_after(1, 100))
    end)
end)
