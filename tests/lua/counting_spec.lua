-- kvtune.counting: the fallback estimate of a prompt's tokens, measured in characters as Python's
-- len() measures them.
local counting = require "kvtune.counting"

describe("kvtune.counting", function()
    it("counts characters, not bytes, in UTF-8 text", function()
        assert.are.equal(5, counting.text_chars("hello"))
        assert.are.equal(5, counting.text_chars("h\195\169llo"))          -- é: 2 bytes, 1 character
        assert.are.equal(2, counting.text_chars("\240\159\152\128!"))     -- an emoji: 4 bytes, 1 character
        assert.are.equal(0, counting.text_chars(""))
    end)

    it("measures a value as its compact JSON, a / as one character as Python writes it", function()
        assert.are.equal(#'{"a":"x/y"}', counting.json_chars({ a = "x/y" }))
        assert.are.equal(#'["\195\169"]' - 1, counting.json_chars({ "\195\169" }))
        assert.are.equal(#"[1,2,3]", counting.json_chars({ 1, 2, 3 }))
    end)

    it("estimates ceil(characters / chars_per_token) + the margin", function()
        assert.are.equal(64 + 3, counting.estimate(10, 4, 64))
        assert.are.equal(64 + 2, counting.estimate(8, 4, 64))
        assert.are.equal(1, counting.estimate(1, 3.5, 0))
        assert.are.equal(64, counting.estimate(0, 4, 64))
    end)
end)
