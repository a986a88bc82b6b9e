-- kvtune.reservation: blocks per sequence and the output law a request leaves to its route.
local reservation = require "kvtune.reservation"

describe("kvtune.reservation.blocks_of", function()
    it("rounds a sequence's tokens up to whole blocks", function()
        assert.are.equal(1, reservation.blocks_of(1, 0, 16))
        assert.are.equal(1, reservation.blocks_of(10, 6, 16))
        assert.are.equal(2, reservation.blocks_of(10, 7, 16))
        assert.are.equal(39, reservation.blocks_of(100, 512, 16))
        assert.are.equal(0, reservation.blocks_of(0, 0, 16))
    end)
end)

describe("kvtune.reservation.forced_law", function()
    local LAW = { lengths = { 16, 64, 512 }, counts = { 70, 0, 10 } }

    it("leaves the route's law to a request that forces nothing", function()
        assert.are.equal(LAW, reservation.forced_law(LAW, {}, 512))
        assert.are.equal(LAW, reservation.forced_law(LAW, { forced_tokens = 0 }, 512))
    end)

    it("is no law (the cap) without one or when a field may hold the length at the cap", function()
        assert.is_nil(reservation.forced_law(nil, {}, 512))
        assert.is_nil(reservation.forced_law(LAW, { forces_cap = "ignore_eos" }, 512))
    end)

    it("conditions the law on length >= min_tokens, dropping lengths never seen", function()
        assert.are.same({ lengths = { 512 }, counts = { 10 } }, reservation.forced_law(LAW, { forced_tokens = 17 }, 512))
        assert.are.same({ lengths = { 16, 512 }, counts = { 70, 10 } },
                        reservation.forced_law(LAW, { forced_tokens = 16 }, 512))
    end)

    it("holds min_tokens to the cap, and is the cap where no length reaches it", function()
        assert.are.same({ lengths = { 512 }, counts = { 10 } }, reservation.forced_law(LAW, { forced_tokens = 9999 }, 300))
        assert.is_nil(reservation.forced_law({ lengths = { 16 }, counts = { 5 } }, { forced_tokens = 17 }, 512))
    end)
end)
