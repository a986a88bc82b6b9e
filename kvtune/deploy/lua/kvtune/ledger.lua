-- kvtune.ledger: the release rate the shared ledger keeps for Retry-After (admission.py's
-- retry_after): blocks released per second, exponentially weighted over rate_window_s. Concurrent
-- updates from several workers may lose a sample: it is an estimate for Retry-After only.
--
-- ledger.new(dict, window_s, min_s, max_s): dict is an ngx.shared.DICT (get/set), so the rate
-- is one for all workers; times are passed in (ngx.now()), so the module reads no clock.
local ceil, exp, max, min = math.ceil, math.exp, math.max, math.min

local _M = {}

function _M.new(dict, window_s, min_s, max_s)
    local rates = {}

    -- Blocks per second at `now`, or nil before the first release.
    function rates.release_rate(now)
        local at = dict:get("released_at")
        if not at then return nil end
        local sum = dict:get("released_sum") or 0
        return sum * exp(-max(0, now - at) / window_s) / window_s
    end

    function rates.note_release(blocks, now)
        now = now or ngx.now()
        local at = dict:get("released_at") or now
        local sum = dict:get("released_sum") or 0
        dict:set("released_sum", sum * exp(-max(0, now - at) / window_s) + blocks)
        dict:set("released_at", now)
    end

    -- Seconds until need_blocks are likely released, within [min_s, max_s]: min_s before any
    -- release, max_s when nothing is being released.
    function rates.retry_after(need_blocks, now)
        local rate = rates.release_rate(now)
        local secs = min_s
        if rate ~= nil then
            if rate > 0 then secs = ceil(need_blocks / rate) else secs = max_s end
        end
        return max(min_s, min(max_s, secs))
    end

    return rates
end

return _M
