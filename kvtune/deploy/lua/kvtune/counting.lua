-- kvtune.counting: the estimate a prompt falls back to when the engine cannot count it
-- (counting.py's estimate: characters of its compact JSON / chars_per_token + a margin).
-- Characters, not bytes: what Python's len() of the text is.
local cjson = require "cjson.safe"
local ceil, gsub, select = math.ceil, string.gsub, select

local _M = {}

-- Characters in UTF-8 text: its bytes less the continuation bytes (0x80-0xbf).
function _M.text_chars(s) return #s - select(2, gsub(s, "[\128-\191]", "")) end

-- Characters of a value as compact JSON (what the Python estimate measures): cjson writes
-- "/" as "\/", Python does not.
function _M.json_chars(v)
    local text = cjson.encode(v) or ""
    return _M.text_chars(text) - select(2, gsub(text, "/", ""))
end

-- ceil(characters / chars_per_token) + margin.
function _M.estimate(chars, chars_per_token, margin_tokens) return ceil(chars / chars_per_token) + margin_tokens end

return _M
