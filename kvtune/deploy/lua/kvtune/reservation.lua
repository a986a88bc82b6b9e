-- kvtune.reservation: the arithmetic of a reservation (admission.py), apart from the request it
-- is read from: blocks for a sequence, and the output law a request leaves to its route.
local ceil, min = math.ceil, math.min

local _M = {}

-- KV blocks a sequence of `prompt` tokens holds once it has grown by `grow` tokens.
function _M.blocks_of(prompt, grow, block_size) return ceil((prompt + grow) / block_size) end

-- admission.forced_law: the route's law as far as the reading `r` leaves its length to it:
-- none (its cap) when a field may hold it there, conditioned on length >= min_tokens.
function _M.forced_law(law, r, cap)
    if law == nil or r.forces_cap ~= nil then return nil end
    local least = min(r.forced_tokens or 0, cap)
    if least <= 0 then return law end
    local lengths, counts = {}, {}
    for i = 1, #law.lengths do
        if law.lengths[i] >= least and law.counts[i] > 0 then
            lengths[#lengths + 1], counts[#counts + 1] = law.lengths[i], law.counts[i]
        end
    end
    if #lengths == 0 then return nil end
    return { lengths = lengths, counts = counts }
end

return _M
