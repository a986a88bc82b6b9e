-- An in-memory stand-in for ngx.shared.DICT (get/set/incr), for unit tests outside nginx; the
-- real shared dict is exercised end to end by the nginx tests (tests/integration/test_enforcer_parity.py).
local FakeDict = {}
FakeDict.__index = FakeDict

function FakeDict.new() return setmetatable({ data = {} }, FakeDict) end
function FakeDict:get(key) return self.data[key] end
function FakeDict:set(key, value) self.data[key] = value; return true end
function FakeDict:incr(key, by, init)
    local value = self.data[key]
    if value == nil then
        if init == nil then return nil, "not found" end
        value = init
    end
    self.data[key] = value + by
    return self.data[key]
end

return FakeDict
