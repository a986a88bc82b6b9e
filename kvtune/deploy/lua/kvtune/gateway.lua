-- kvtune.gateway: the rendered nginx.conf's admission gateway (the Python gateway's twin).
-- nginx.conf's init_by_lua_block holds the data (CONFIG, the deployment's limits and routes;
-- POLICY, the endpoint and field rules rendered from kvtune.render.lua_policy) and calls
-- gateway.new(CONFIG, POLICY); the phases call the handlers it returns.
local cjson = require "cjson.safe"
local counting = require "kvtune.counting"
local events = require "kvtune.events"
local flow_queue = require "kvtune.flow"
local ledger_rates = require "kvtune.ledger"
local refusal_log = require "kvtune.refusals"
local reservation_math = require "kvtune.reservation"
local statistical = require "kvtune.statistical"

local _M = {}

function _M.new(CONFIG, POLICY)
    local ffi = require "ffi"
    local ledger = ngx.shared.kvtune_ledger
    local M = { config = CONFIG }
    local STAT  -- the statistical ledger (below), when the policy is statistical
    local find, sub, byte, format, concat = string.find, string.sub, string.byte, string.format, table.concat
    local floor, ceil, huge = math.floor, math.ceil, math.huge

    cjson.decode_invalid_numbers(false)       -- NaN, Infinity and hex are not JSON
    cjson.decode_max_depth(POLICY.max_depth)
    cjson.encode_max_depth(POLICY.max_depth + 8)
    cjson.encode_invalid_numbers(true)        -- 1e400 reads as inf; estimates may encode it

    local NULL = cjson.null
    -- cjson decodes [] and {} alike, to an empty table: an empty array is decoded from a
    -- stand-in object (EMPTY_KEY) and then given this metatable.
    local ARRAY = {}
    local EMPTY_KEY = "\255"
    local EMPTY_STANDIN = '{"\255":0}'
    -- A lone UTF-16 surrogate escape (cjson refuses them as invalid JSON; Python reads them
    -- and refuses the text) is decoded as this byte, which valid UTF-8 never holds.
    local LONE = "\254"

    local PASSTHROUGH = {}
    for _, p in ipairs(CONFIG.passthrough) do PASSTHROUGH[p] = true end
    -- Literal route paths that are no vLLM endpoint: each makes its path governed (the first
    -- route naming it reads it).
    local ROUTE_PATHS = {}
    for _, r in ipairs(CONFIG.routes) do
        if r.path ~= nil and POLICY.generate[r.path] == nil and ROUTE_PATHS[r.path] == nil then
            ROUTE_PATHS[r.path] = r
        end
    end
    local ADMIN_TOKEN
    if CONFIG.token_env then
        local token = os.getenv(CONFIG.token_env)
        if not token or token == "" then
            error("the environment variable " .. CONFIG.token_env .. " holds no token (admin.token_env)")
        end
        ADMIN_TOKEN = "Bearer " .. token
    end

    -- ------------------------------------------------------------ answers

    -- A refusal raised by the readers (error(refusal)) or returned by the admission steps.
    local REFUSAL = {}
    local function refusal(status, code, message, extra)
        local r = setmetatable({ status = status, code = code, message = message }, REFUSAL)
        if extra then for k, v in pairs(extra) do r[k] = v end end
        return r
    end
    local function refuse(code, message) error(refusal(400, code, message), 0) end
    local function invalid(message) refuse("invalid_request", message) end
    local function uncountable(what)
        refuse("uncountable_request", "the gateway cannot count " .. what .. ", so it cannot admit it")
    end

    local function error_body(status, code, message)
        local kind = "invalid_request_error"
        if status == 429 then kind = "rate_limit_error" elseif status >= 500 then kind = "server_error" end
        return cjson.encode({ error = { message = message, type = kind, param = NULL, code = code } })
    end

    -- The refusal log (kvtune.refusals): a line per reason and route each second, never one per
    -- request.
    local REFUSAL_LOG = refusal_log.new(1, function(line) ngx.log(ngx.WARN, line) end)
    local function count_refusal(r) REFUSAL_LOG.count(r, ngx.ctx.kvtune_route or "-", ngx.now()) end

    -- init_worker_by_lua: every worker flushes its own window once it has lasted its second,
    -- and what is left when it exits (the timer runs premature then).
    function M.watch_refusals()
        local ok, err = ngx.timer.every(REFUSAL_LOG.window_s / 4, function(premature)
            ngx.update_time()
            local now = ngx.now()
            if premature or REFUSAL_LOG.due(now) then REFUSAL_LOG.flush(now) end
        end)
        if not ok then ngx.log(ngx.ERR, "kvtune: cannot start the refusal log: ", err) end
    end

    -- Constant time in the token's bytes.
    local function same_secret(given, wanted)
        if #given ~= #wanted then return false end
        local diff = 0
        for i = 1, #wanted do diff = bit.bor(diff, bit.bxor(byte(given, i), byte(wanted, i))) end
        return diff == 0
    end

    -- admin.shows_detail: whether refusals and admissions may tell this client the ledger's
    -- figures (admin.refusal_detail: ledger, to a client admin.ledger lets read the ledger).
    local function shows_detail()
        if CONFIG.refusal_detail ~= "ledger" then return false end
        if CONFIG.ledger_access == "token" then
            return same_secret(ngx.var.http_authorization or "", ADMIN_TOKEN or "\0")
        end
        local remote = ngx.var.remote_addr
        return remote == "127.0.0.1" or remote == "::1" or remote == "::ffff:127.0.0.1"
    end

    local function send(r)
        ledger:incr("rejected", 1, 0)
        count_refusal(r)
        if r.public and not shows_detail() then r.message = r.public end
        if r.close then
            -- nginx closes the connection after answering from a location whose
            -- keepalive_timeout is 0 (a body left unread, an upgrade, a broken encoding)
            return ngx.exec("/_kvtune/refuse", { status = r.status, code = r.code, message = r.message,
                                                  allow = r.allow, retry = r.retry_after })
        end
        ngx.status = r.status
        ngx.header["Content-Type"] = "application/json; charset=utf-8"
        if r.retry_after then ngx.header["Retry-After"] = format("%d", r.retry_after) end
        if r.allow then ngx.header["Allow"] = r.allow end
        ngx.print(error_body(r.status, r.code, r.message))
        return ngx.exit(ngx.HTTP_OK)
    end

    function M.refused()
        local args = ngx.req.get_uri_args()
        local status = tonumber(args.status) or 400
        ngx.status = status
        ngx.header["Content-Type"] = "application/json; charset=utf-8"
        if args.retry then ngx.header["Retry-After"] = args.retry end
        if args.allow then ngx.header["Allow"] = args.allow end
        ngx.print(error_body(status, args.code or "refused", args.message or ""))
    end

    -- ------------------------------------------------------------ JSON values

    local function val(t, k)  -- t[k], JSON null as nil (Python's dict.get)
        local v = t[k]
        if v == NULL then return nil end
        return v
    end
    local function is_list(v) return type(v) == "table" and (v[1] ~= nil or getmetatable(v) == ARRAY) end
    local function is_dict(v) return type(v) == "table" and v[1] == nil and getmetatable(v) ~= ARRAY end
    -- An integer as the Python gateway's parser (orjson) reads one: integral and within
    -- [-2^63, 2^64) (larger literals it reads as floats). Callers that must tell 1 from 1.0
    -- look at the literal too.
    local function is_int(v) return type(v) == "number" and v == floor(v) and v >= -2^63 and v < 2^64 end
    local function is_str(v) return type(v) == "string" end
    local function truthy(v)  -- Python's bool() of a JSON value
        if v == nil or v == NULL or v == false then return false end
        if type(v) == "number" then return v ~= 0 end
        if type(v) == "string" then return #v > 0 end
        if type(v) == "table" then return next(v) ~= nil end
        return true
    end
    local function size(t)  -- len() of a JSON object
        local n = 0
        for _ in pairs(t) do n = n + 1 end
        return n
    end
    local function all_ints(list)
        for _, t in ipairs(list) do if not is_int(t) then return false end end
        return true
    end
    local function all_dicts(list)
        for _, m in ipairs(list) do if not is_dict(m) then return false end end
        return true
    end
    local function type_name(v)  -- what Python would call a JSON value's type
        if v == nil or v == NULL then return "NoneType" end
        if type(v) == "boolean" then return "bool" end
        if type(v) == "number" then return is_int(v) and "int" or "float" end
        if type(v) == "string" then return "str" end
        return is_list(v) and "list" or "dict"
    end
    local function quoted(v)  -- Python's repr of str(v)[:40], near enough for a message
        local text = is_str(v) and v or (v == nil or v == NULL) and "None" or type_name(v)
        return "'" .. sub(text, 1, 40) .. "'"
    end
    -- Characters of text and of a value as compact JSON (kvtune.counting).
    local text_chars, json_chars = counting.text_chars, counting.json_chars

    -- ------------------------------------------------------------ the raw body

    -- A scanner over JSON that cjson has already accepted: the byte spans of an object's
    -- members and an array's elements, so members are rewritten and forwarded without
    -- re-encoding (cjson would turn [] into {} and round long numbers). Long scans go
    -- through plain finds and PCRE (JIT), which are many times faster than Lua patterns.
    local RE_CTX = {}
    local function re_at(s, regex, from)  -- the first match of `regex` at or after `from`
        RE_CTX.pos = from
        return (ngx.re.find(s, regex, "jo", RE_CTX))
    end
    local function skip_ws(s, i) return (find(s, "[^ \t\r\n]", i)) end
    -- The closing quote of the string whose opening quote is at i: the next quote after an
    -- even run of backslashes.
    local function string_end(s, i)
        local j = i + 1
        while true do
            local q = find(s, '"', j, true)
            if not q then return nil end
            local k = q - 1
            while k > i and byte(s, k) == 92 do k = k - 1 end
            if (q - 1 - k) % 2 == 0 then return q end
            j = q + 1
        end
    end
    local function value_end(s, i)
        local c = byte(s, i)
        if c == 34 then return string_end(s, i) end
        if c == 123 or c == 91 then
            local depth, j = 0, i
            while true do
                local k = re_at(s, [=[[\[\]{}"]]=], j)
                if not k then return nil end
                local b = byte(s, k)
                if b == 34 then
                    k = string_end(s, k)
                    if not k then return nil end
                elseif b == 123 or b == 91 then
                    depth = depth + 1
                else
                    depth = depth - 1
                    if depth == 0 then return k end
                end
                j = k + 1
            end
        end
        local k = find(s, "[,}%] \t\r\n]", i)
        if not k then return #s end
        return k - 1
    end
    local function key_text(s, a, b)
        local inner = sub(s, a + 1, b - 1)
        if not find(inner, "\\", 1, true) then return inner end
        return cjson.decode(sub(s, a, b)) or inner
    end
    -- The members { key, kstart, kend, vstart, vend } of the object whose "{" is at `open`.
    local function members(s, open)
        local out = {}
        local i = skip_ws(s, open + 1)
        if i and byte(s, i) == 125 then return out end
        while i do
            local kend = string_end(s, i)
            local colon = skip_ws(s, kend + 1)
            local vstart = skip_ws(s, colon + 1)
            local vend = value_end(s, vstart)
            out[#out + 1] = { key = key_text(s, i, kend), kstart = i, kend = kend, vstart = vstart, vend = vend }
            local nxt = skip_ws(s, vend + 1)
            if byte(s, nxt) ~= 44 then return out end
            i = skip_ws(s, nxt + 1)
        end
        return out
    end
    -- The elements { vstart, vend } of the array whose "[" is at `open`.
    local function elements(s, open)
        local out = {}
        local i = skip_ws(s, open + 1)
        if i and byte(s, i) == 93 then return out end
        while i do
            local vend = value_end(s, i)
            out[#out + 1] = { vstart = i, vend = vend }
            local nxt = skip_ws(s, vend + 1)
            if byte(s, nxt) ~= 44 then return out end
            i = skip_ws(s, nxt + 1)
        end
        return out
    end
    local function last_member(list, key)
        for i = #list, 1, -1 do if list[i].key == key then return list[i] end end
        return nil
    end

    -- Where cjson is more lenient than JSON (and Python): numbers such as "1." or "-.5",
    -- control characters inside strings; and what it reads differently: lone surrogate
    -- escapes (an error to cjson), empty arrays (an empty table, like {}). Cheap to rule out
    -- for most bodies; for the rest one pass over the raw text finds them all.
    local SUSPECT = [=[[\x00-\x1f]|[0-9]\.(?![0-9])|-\.|\\u[dD][89a-fA-F]|\[[ \t\r\n]*\]]=]
    local function number_ok(s, a, b)
        local i = a
        if byte(s, i) == 45 then i = i + 1 end
        local c = byte(s, i)
        if c == 48 then
            i = i + 1
        elseif c and c >= 49 and c <= 57 then
            i = select(2, find(s, "^%d+", i)) + 1
        else
            return false
        end
        if i <= b and byte(s, i) == 46 then
            local _, e = find(s, "^%d+", i + 1)
            if not e or e > b then return false end
            i = e + 1
        end
        c = i <= b and byte(s, i)
        if c == 101 or c == 69 then
            i = i + 1
            c = byte(s, i)
            if c == 43 or c == 45 then i = i + 1 end
            local _, e = find(s, "^%d+", i)
            if not e or e > b then return false end
            i = e + 1
        end
        return i == b + 1
    end
    -- `find(s, pattern, from)` answered from the last search when it still holds, so a scan
    -- that asks from every segment stays linear in the body.
    local function finder(s, regex)
        local from, found = huge, false  -- nothing searched yet
        return function(j)
            if j < from or (found and j > found) then
                from, found = j, re_at(s, regex, j) or false
            end
            return found or nil
        end
    end
    local function hex4(s, i)
        local h = sub(s, i, i + 3)
        if #h ~= 4 or find(h, "[^0-9a-fA-F]") then return nil end
        return tonumber(h, 16)
    end
    -- The text cjson should decode, whether it held stand-ins, or nil and the refusal.
    local function normalize(s)
        local n = #s
        local pieces, last = {}, 1
        local marked = false
        local next_token = finder(s, [=[[-0-9\[]]=])
        local next_control = finder(s, [=[[\x00-\x1f]]=])
        local i = 1
        while i <= n do
            local q = find(s, '"', i, true)
            local seg_end = q and q - 1 or n
            -- between strings: numbers and empty arrays
            local j = i
            while true do
                local a = next_token(j)
                if not a or a > seg_end then break end
                if byte(s, a) == 91 then
                    local _, e = find(s, "^[ \t\r\n]*%]", a + 1)
                    if e then
                        pieces[#pieces + 1] = sub(s, last, a - 1)
                        pieces[#pieces + 1] = EMPTY_STANDIN
                        last, marked = e + 1, true
                        j = e + 1
                    else
                        j = a + 1
                    end
                else
                    local _, e = find(s, "^[-+.eE0-9]*", a)
                    if not number_ok(s, a, e) then return nil end
                    j = e + 1
                end
            end
            if not q then break end
            -- a string: its escapes, and no raw control character inside
            local k = q + 1
            local close
            while true do
                local p = re_at(s, [=[["\\]]=], k)
                if not p then return nil end
                if byte(s, p) == 34 then close = p break end
                if byte(s, p + 1) == 117 then
                    local cp = hex4(s, p + 2)
                    local width = 6
                    if cp and cp >= 0xD800 and cp <= 0xDFFF then
                        local low = cp <= 0xDBFF and byte(s, p + 6) == 92 and byte(s, p + 7) == 117
                            and hex4(s, p + 8)
                        if low and low >= 0xDC00 and low <= 0xDFFF then
                            width = 12
                        else
                            pieces[#pieces + 1] = sub(s, last, p - 1)
                            pieces[#pieces + 1] = LONE
                            last, marked = p + 6, true
                        end
                    end
                    k = p + width
                else
                    k = p + 2
                end
            end
            local ctl = next_control(q)
            if ctl and ctl < close then return nil end
            i = close + 1
        end
        if not marked then return s, false end
        pieces[#pieces + 1] = sub(s, last)
        return concat(pieces), true
    end
    -- Give decoded stand-ins their meaning: empty arrays become ARRAY tables; true when a
    -- lone surrogate survived into the document (keys included), which is not text.
    local function restore(doc)
        local stack = { doc }
        while #stack > 0 do
            local t = stack[#stack]
            stack[#stack] = nil
            for k, v in pairs(t) do
                if type(k) == "string" and find(k, LONE, 1, true) then return true end
                if type(v) == "table" then
                    if v[EMPTY_KEY] ~= nil then t[k] = setmetatable({}, ARRAY) else stack[#stack + 1] = v end
                elseif type(v) == "string" and find(v, LONE, 1, true) then
                    return true
                end
            end
        end
        return false
    end

    -- A governed request's body as kvtune.gateway.body reads it: one JSON object in UTF-8
    -- (no BOM, NaN or Infinity, nested at most max_depth deep), no lone surrogates in its
    -- text, no key given twice at the top level. Raises the 400.
    local function parse_body(raw)
        -- PCRE checks that the whole subject is UTF-8; cjson would stop at a NUL byte
        if find(raw, "\0", 1, true) or not ngx.re.find(raw, "", "uo") then
            refuse("invalid_json", "request body must be a JSON object in UTF-8")
        end
        local text, marked = raw, false
        if ngx.re.find(raw, SUSPECT, "jo") then
            text, marked = normalize(raw)
            if not text then refuse("invalid_json", "request body must be a JSON object in UTF-8") end
        end
        local doc, err = cjson.decode(text)
        if doc == nil then
            if err and find(err, "too many nested", 1, true) then
                refuse("invalid_json", "request body nests deeper than the gateway reads")
            end
            refuse("invalid_json", "request body must be a JSON object in UTF-8")
        end
        local open = skip_ws(raw, 1)
        if type(doc) ~= "table" or byte(raw, open) ~= 123 then
            refuse("invalid_json", "request body must be a JSON object")
        end
        if marked and restore(doc) then
            refuse("invalid_unicode", "request text holds a lone UTF-16 surrogate, which is not text")
        end
        local top = members(raw, open)
        local by_key = {}
        for _, m in ipairs(top) do
            if by_key[m.key] then
                local key = m.key
                if #key > 40 then key = sub(key, 1, 40) .. "…" end
                refuse("duplicate_key", "the request gives " .. cjson.encode(key) .. " twice")
            end
            by_key[m.key] = m
        end
        return { raw = raw, doc = doc, open = open, top = top, by_key = by_key }
    end
    local function raw_of(body, key)
        local m = body.by_key[key]
        return sub(body.raw, m.vstart, m.vend)
    end

    -- ------------------------------------------------------------ the readers (apis.py)

    -- A prompt: { text = s } | { tokens = n } | { messages = lua, messages_json = s,
    -- args = lua, args_json = { key = s }, body = body } | { anthropic = lua, json = s }.
    -- A reading: { prompts, sequences = { { parts, extra } }, generates, caps, add_cap,
    -- requested_cap, copies, min_tokens }.
    local function count_field(key, v)
        if type(v) ~= "number" or v ~= v or v == huge or v == -huge or v ~= floor(v)
                or v < 1 or v >= POLICY.max_count then
            local code = "invalid_max_tokens"
            if key == "n" or key == "best_of" then code = "invalid_" .. key end
            refuse(code, key .. " must be a positive integer")
        end
        return v
    end
    local function holder_of(doc, f)
        if f.parent == nil then return doc end
        return val(doc, f.parent)
    end
    local function requested(doc, fields)
        local least
        for _, f in ipairs(fields) do
            local holder = holder_of(doc, f)
            if is_dict(holder) then
                local v = val(holder, f.key)
                if v ~= nil then
                    local n = count_field(f.key, v)
                    if least == nil or n < least then least = n end
                end
            end
        end
        return least
    end
    local function copies(doc, keys, holder)
        holder = holder or doc
        local c = 1
        for _, key in ipairs(keys) do
            local v = val(holder, key)
            if v ~= nil then
                local n = count_field(key, v)
                if n > c then c = n end
            end
        end
        return c
    end
    local function refuse_present(doc, fields)
        for _, f in ipairs(fields) do
            if val(doc, f[1]) ~= nil then uncountable(f[2]) end
        end
    end
    local function template_args(body)
        local doc = body.doc
        local args, json = {}, {}
        for _, list in ipairs({ POLICY.template_fields, POLICY.estimate_fields }) do
            for _, k in ipairs(list) do
                if val(doc, k) ~= nil then args[k] = doc[k]; json[k] = raw_of(body, k) end
            end
        end
        local kwargs = args.chat_template_kwargs
        if kwargs ~= nil and not is_dict(kwargs) then invalid("chat_template_kwargs must be an object") end
        if kwargs and kwargs.messages ~= nil then invalid("chat_template_kwargs cannot replace the messages") end
        return args, json
    end
    local function check_messages(value, where)
        if not is_list(value) or not all_dicts(value) then invalid(where .. " must be a list of message objects") end
        return value
    end
    local function chat_prompt(body, messages, messages_json, args, json)
        return { messages = messages, messages_json = messages_json, args = args, args_json = json, body = body }
    end
    local function seq(parts, extra) return { parts = parts, extra = extra or 0 } end
    -- apis.forcing: the tokens a reading forces at least (min_tokens) and the field, if any,
    -- that may hold it to its cap (ignore_eos, logit_bias, bad_words, allowed_token_ids).
    local function with_forcing(holder, reading, fields, no_min_tokens)
        local forced, field = 0, nil
        local least = nil
        if not no_min_tokens then least = val(holder, "min_tokens") end
        if least ~= nil then
            if type(least) ~= "number" or least ~= least or least == huge or least == -huge then
                field = "min_tokens"
            else
                forced = math.max(0, math.min(math.ceil(least), POLICY.max_count))
            end
        end
        if field == nil then
            for _, key in ipairs(fields or POLICY.forcing_fields) do
                local v = val(holder, key)
                if v ~= nil and v ~= false and v ~= 0 and not (type(v) == "table" and next(v) == nil) then
                    field = key
                    break
                end
            end
        end
        if field == "min_tokens" then forced = 0 end
        reading.forced_tokens, reading.forces_cap = forced, field
        return reading
    end
    local CAPS = POLICY.caps
    -- A chat request's add_special_tokens (vLLM's default false): true puts the tokenizer's
    -- start token(s) before the rendered chat, so /tokenize is asked with it too.
    local function chat_special_tokens(doc)
        local v = val(doc, "add_special_tokens")
        if v ~= nil and type(v) ~= "boolean" then invalid("add_special_tokens must be true or false") end
        return v == true
    end
    -- The messages array whose "[" is at `open` with each message's reasoning_content renamed
    -- to reasoning (unless that is set) as vLLM's chat request renames it and /tokenize does
    -- not (vllm_messages.py rename_reasoning); the raw text itself when no message has one.
    local function renamed_reasoning_json(raw, open, close, messages)
        local any = false
        for _, m in ipairs(messages) do
            if m.reasoning_content ~= nil then any = true; break end
        end
        if not any then return sub(raw, open, close) end
        local out = {}
        for i, e in ipairs(elements(raw, open)) do
            local m = messages[i]
            if m.reasoning_content == nil then
                out[i] = sub(raw, e.vstart, e.vend)
            else
                local keep, reasoning = {}, nil
                for _, member in ipairs(members(raw, e.vstart)) do
                    local text = sub(raw, member.kstart, member.kend) .. ":" .. sub(raw, member.vstart, member.vend)
                    if member.key == "reasoning_content" then
                        if m.reasoning_content ~= NULL and val(m, "reasoning") == nil then
                            reasoning = '"reasoning":' .. sub(raw, member.vstart, member.vend)
                        end
                    elseif not (member.key == "reasoning" and m.reasoning == NULL) then
                        keep[#keep + 1] = text
                    end
                end
                keep[#keep + 1] = reasoning
                out[i] = "{" .. concat(keep, ",") .. "}"
            end
        end
        return "[" .. concat(out, ",") .. "]"
    end

    local R = {}
    function R.chat(body)
        local doc = body.doc
        refuse_present(doc, POLICY.refused.chat)
        local messages = check_messages(val(doc, "messages"), "messages")
        local args, json = template_args(body)
        local span = body.by_key.messages
        local prompt = chat_prompt(body, messages, renamed_reasoning_json(body.raw, span.vstart, span.vend, messages),
                                   args, json)
        prompt.add_special_tokens = chat_special_tokens(doc)
        return with_forcing(doc, { prompts = { prompt }, sequences = { seq({ 1 }) }, generates = true, caps = CAPS.chat,
                 add_cap = { key = "max_tokens" }, requested_cap = requested(doc, CAPS.chat),
                 copies = copies(doc, { "n" }), min_tokens = { key = "min_tokens" } })
    end
    R["chat-batch"] = function(body)
        local doc = body.doc
        refuse_present(doc, POLICY.refused.chat)
        local conversations = val(doc, "messages")
        if not is_list(conversations) or #conversations == 0 then
            invalid("messages must be a non-empty list of conversations")
        end
        local args, json = template_args(body)
        local spans = elements(body.raw, body.by_key.messages.vstart)
        local special = chat_special_tokens(doc)
        local prompts, sequences = {}, {}
        for i, c in ipairs(conversations) do
            check_messages(c, "messages[i]")
            prompts[i] = chat_prompt(body, c, renamed_reasoning_json(body.raw, spans[i].vstart, spans[i].vend, c),
                                     args, json)
            prompts[i].add_special_tokens = special
            sequences[i] = seq({ i })
        end
        return with_forcing(doc, { prompts = prompts, sequences = sequences, generates = true, caps = CAPS.chat,
                 add_cap = { key = "max_tokens" }, requested_cap = requested(doc, CAPS.chat),
                 copies = copies(doc, { "n" }), min_tokens = { key = "min_tokens" } })
    end
    -- Token ids are integers: cjson reads 1.0 and 1e0 as 1, so the literals are checked too
    -- (a list of numbers holds no ".", "e" or "E" unless one of them is a float).
    local function token_ids(list, raw, span)
        if not all_ints(list) then return false end
        local float = re_at(raw, "[.eE]", span.vstart)
        return not float or float > span.vend
    end
    -- vLLM's four prompt shapes: text, a list of texts, token ids, a list of token-id lists.
    -- `key` names the top-level member that holds them.
    local function completion_prompts(body, key, where)
        local value, raw, span = body.doc[key], body.raw, body.by_key[key]
        where = where or "prompt"
        if is_str(value) then return { { text = value } } end
        local bad = where .. " must be text, token ids, or a non-empty list of either"
        if not is_list(value) or #value == 0 then invalid(bad) end
        if token_ids(value, raw, span) then return { { tokens = #value } } end
        local out, spans = {}, nil
        for i, item in ipairs(value) do
            if is_str(item) then
                out[#out + 1] = { text = item }
            elseif is_list(item) and #item > 0 and all_ints(item) then
                spans = spans or elements(raw, span.vstart)
                if not token_ids(item, raw, spans[i]) then invalid(bad) end
                out[#out + 1] = { tokens = #item }
            else
                invalid(bad)
            end
        end
        return out
    end
    function R.completions(body)
        local doc = body.doc
        refuse_present(doc, POLICY.refused.completions)
        if val(doc, "prompt") == nil then invalid("prompt is required") end
        local prompts = completion_prompts(body, "prompt")
        local sequences = {}
        for i = 1, #prompts do sequences[i] = seq({ i }) end
        local suffix = val(doc, "suffix")
        if suffix ~= nil then
            if not is_str(suffix) then invalid("suffix must be text") end
            prompts[#prompts + 1] = { text = suffix }
            for _, s in ipairs(sequences) do s.parts[#s.parts + 1] = #prompts end
        end
        return with_forcing(doc, { prompts = prompts, sequences = sequences, generates = true, caps = CAPS.completions,
                 add_cap = { key = "max_tokens" }, requested_cap = requested(doc, CAPS.completions),
                 copies = copies(doc, { "n", "best_of" }), min_tokens = { key = "min_tokens" } })
    end
    -- Responses input items of text, read as vLLM's construct_input_messages reads them.
    local function response_item(item, i)
        local kind = is_dict(item) and item.type
        if kind == nil then kind = "message" end
        if not is_dict(item) or kind ~= "message" or item.role == nil then
            local what = type_name(item)
            if is_dict(item) then what = val(item, "type") end
            uncountable(format("input[%d] of type %s (only message items are counted)", i - 1, quoted(what)))
        end
        local content = val(item, "content")
        if is_str(content) then return { role = item.role, content = content } end
        if is_list(content) then
            local parts = setmetatable({}, ARRAY)
            for _, part in ipairs(content) do
                if not is_dict(part) or not POLICY.text_parts[part.type] or not is_str(part.text) then
                    local what = is_dict(part) and val(part, "type") or type_name(part)
                    uncountable(format("input[%d] content of type %s", i - 1, quoted(what)))
                end
                parts[#parts + 1] = { type = "text", text = part.text }
            end
            return { role = item.role, content = parts }
        end
        invalid(format("input[%d].content must be text or a list of parts", i - 1))
    end
    local function encode_message(m)
        local content = m.content
        local text
        if is_str(content) then
            text = cjson.encode(content)
        else
            local parts = {}
            for i, p in ipairs(content) do parts[i] = '{"type":"text","text":' .. cjson.encode(p.text) .. "}" end
            text = "[" .. concat(parts, ",") .. "]"
        end
        return '{"role":' .. (cjson.encode(m.role) or "null") .. ',"content":' .. text .. "}"
    end
    -- Responses function tools in the chat shape vLLM converts them to, from the raw bytes.
    local function response_tools(body, tools)
        if not is_list(tools) then invalid("tools must be a list") end
        local raw = body.raw
        local spans = elements(raw, body.by_key.tools.vstart)
        local out, json = {}, {}
        for i, tool in ipairs(tools) do
            if not is_dict(tool) or tool.type ~= "function" then
                local what = is_dict(tool) and val(tool, "type") or type_name(tool)
                uncountable("a tool of type " .. quoted(what))
            end
            local fields = members(raw, spans[i].vstart)
            local fn, fn_json = {}, {}
            for _, k in ipairs({ "name", "description", "parameters", "strict" }) do
                local m = last_member(fields, k)
                if m then
                    fn[k] = tool[k]
                    fn_json[#fn_json + 1] = sub(raw, m.kstart, m.kend) .. ":" .. sub(raw, m.vstart, m.vend)
                end
            end
            out[i] = { type = "function", ["function"] = fn }
            json[i] = '{"type":"function","function":{' .. concat(fn_json, ",") .. "}}"
        end
        return out, "[" .. concat(json, ",") .. "]"
    end
    function R.responses(body)
        local doc = body.doc
        refuse_present(doc, POLICY.refused.responses)
        local messages = {}
        local instructions = val(doc, "instructions")
        if instructions ~= nil then
            if not is_str(instructions) then invalid("instructions must be text") end
            if #instructions > 0 then messages[#messages + 1] = { role = "system", content = instructions } end
        end
        local input = val(doc, "input")
        if is_str(input) then
            messages[#messages + 1] = { role = "user", content = input }
        elseif is_list(input) then
            for i, item in ipairs(input) do messages[#messages + 1] = response_item(item, i) end
        else
            invalid("input must be text or a list of input items")
        end
        local args, json = template_args(body)
        args.tools, json.tools = nil, nil
        local tools = val(doc, "tools")
        if truthy(tools) then args.tools, json.tools = response_tools(body, tools) end
        local encoded = {}
        for i, m in ipairs(messages) do encoded[i] = encode_message(m) end
        if #messages == 0 then messages = setmetatable({}, ARRAY) end
        local prompt = chat_prompt(body, messages, "[" .. concat(encoded, ",") .. "]", args, json)
        -- vLLM tokenizes a Responses prompt with special tokens added (a second BOS where the tokenizer adds one)
        prompt.add_special_tokens = true
        return with_forcing(doc, { prompts = { prompt }, sequences = { seq({ 1 }) }, generates = true,
                 caps = CAPS.responses, add_cap = { key = "max_output_tokens" },
                 requested_cap = requested(doc, CAPS.responses), copies = 1 },
                 POLICY.responses_forcing_fields, true)
    end
    function R.messages(body)
        local doc = body.doc
        refuse_present(doc, { { "mm_payload", "a multimodal payload" } })
        check_messages(val(doc, "messages"), "messages")
        local fields, json = {}, {}
        for _, k in ipairs(POLICY.anthropic_fields) do
            if val(doc, k) ~= nil then
                fields[k] = doc[k]
                json[#json + 1] = cjson.encode(k) .. ":" .. raw_of(body, k)
            end
        end
        local prompt = { anthropic = fields, json = "{" .. concat(json, ",") .. "}" }
        return { prompts = { prompt }, sequences = { seq({ 1 }) }, generates = true, caps = CAPS.messages,
                 add_cap = { key = "max_tokens" }, requested_cap = requested(doc, CAPS.messages), copies = 1 }
    end
    function R.tokens(body)
        local doc = body.doc
        refuse_present(doc, { { "features", "multimodal features" }, { "content_parts", "multimodal content parts" } })
        local ids = val(doc, "token_ids")
        if not is_list(ids) or #ids == 0 or not token_ids(ids, body.raw, body.by_key.token_ids) then
            invalid("token_ids must be a non-empty list of token ids")
        end
        local params = val(doc, "sampling_params")
        if not is_dict(params) then invalid("sampling_params must be an object") end
        return with_forcing(params, { prompts = { { tokens = #ids } }, sequences = { seq({ 1 }) }, generates = true,
                 caps = CAPS.tokens, add_cap = CAPS.tokens[1], requested_cap = requested(doc, CAPS.tokens),
                 copies = copies(doc, { "n", "best_of" }, params),
                 min_tokens = { key = "min_tokens", parent = "sampling_params" } })
    end
    -- A route whose upstream API kvtune cannot know: every prompt field the body carries is
    -- charged, all in one sequence, and every cap alias is clamped.
    function R.any(body)
        local doc = body.doc
        local prompts = {}
        local function take(list) for _, p in ipairs(list) do prompts[#prompts + 1] = p end end
        if val(doc, "messages") ~= nil then take(R.chat(body).prompts) end
        if val(doc, "prompt") ~= nil then take(completion_prompts(body, "prompt")) end
        if val(doc, "input") ~= nil or val(doc, "instructions") ~= nil then
            if val(doc, "input") == nil then invalid("instructions come with an input") end
            take(R.responses(body).prompts)
        end
        if #prompts == 0 then invalid("the request carries no prompt (messages, prompt or input)") end
        local parts = {}
        for i = 1, #prompts do parts[i] = i end
        return with_forcing(doc, { prompts = prompts, sequences = { seq(parts) }, generates = true, caps = CAPS.any,
                 add_cap = { key = "max_tokens" }, requested_cap = requested(doc, CAPS.any),
                 copies = copies(doc, { "n", "best_of" }), min_tokens = { key = "min_tokens" } })
    end
    -- pooling: no output
    local EMBED_REFUSED = {}
    for i, f in ipairs(POLICY.refused.chat) do EMBED_REFUSED[i] = f end
    EMBED_REFUSED[#EMBED_REFUSED + 1] = { "data", "a plugin's input data" }
    function R.embed(body)
        local doc = body.doc
        refuse_present(doc, EMBED_REFUSED)
        local key = val(doc, "messages") ~= nil and "messages" or "input"
        local source = val(doc, key)
        if source == nil then invalid("input is required") end
        local args, json = template_args(body)
        local prompts = {}
        local function conversations()
            for _, c in ipairs(source) do
                if not (is_list(c) and #c > 0 and all_dicts(c)) then return false end
            end
            return true
        end
        if is_list(source) and #source > 0 and all_dicts(source) then
            prompts[1] = chat_prompt(body, source, raw_of(body, key), args, json)
        elseif is_list(source) and #source > 0 and conversations() then
            local spans = elements(body.raw, body.by_key[key].vstart)
            for i, c in ipairs(source) do
                prompts[i] = chat_prompt(body, c, sub(body.raw, spans[i].vstart, spans[i].vend), args, json)
            end
        else
            prompts = completion_prompts(body, key, "input")
        end
        local sequences = {}
        for i = 1, #prompts do sequences[i] = seq({ i }) end
        return { prompts = prompts, sequences = sequences, generates = false, copies = 1 }
    end
    -- One side of a score pair: text or a list of texts (multimodal parts are not counted).
    local function texts(value, where, out)
        out = out or {}
        if is_str(value) then
            out[#out + 1] = value
        elseif is_dict(value) and is_str(value.text) and size(value) <= 2 then
            out[#out + 1] = value.text
        elseif is_list(value) and #value > 0 then
            for _, item in ipairs(value) do
                if is_list(item) then uncountable(where .. " unless it is text or a list of texts") end
                texts(item, where, out)
            end
        else
            uncountable(where .. " unless it is text or a list of texts")
        end
        return out
    end
    local function instruction(doc)
        local v = val(doc, "instruction")
        if v == nil then return {} end
        if not is_str(v) then invalid("instruction must be text") end
        return { v }
    end
    -- vLLM pairs one left text with every right one, or left and right one by one.
    local function pairs_reading(left, right, extra)
        if #left ~= 1 and #left ~= #right then invalid("give one query or as many as there are documents") end
        local prompts = {}
        for _, list in ipairs({ left, right, extra }) do
            for _, t in ipairs(list) do prompts[#prompts + 1] = { text = t } end
        end
        local sequences = {}
        for j = 1, #right do
            local parts = { #left == 1 and 1 or j, #left + j }
            for t = #left + #right + 1, #prompts do parts[#parts + 1] = t end
            sequences[j] = seq(parts, CONFIG.pair_tokens)
        end
        return { prompts = prompts, sequences = sequences, generates = false, copies = 1 }
    end
    function R.score(body)
        local doc = body.doc
        for _, side in ipairs(POLICY.score_sides) do
            local a, b = side[1], side[2]
            if val(doc, a) ~= nil and val(doc, b) ~= nil then
                local left = texts(doc[a], a)
                local right = texts(doc[b], b)
                return pairs_reading(left, right, instruction(doc))
            end
        end
        invalid("a score request needs data_1/data_2, text_1/text_2 or queries/documents")
    end
    function R.rerank(body)
        local doc = body.doc
        if val(doc, "query") == nil or val(doc, "documents") == nil then
            invalid("a rerank request needs query and documents")
        end
        local left = texts(doc.query, "query")
        local right = texts(doc.documents, "documents")
        return pairs_reading(left, right, instruction(doc))
    end
    R["cohere-embed"] = function(body)
        local doc = body.doc
        if val(doc, "images") ~= nil then uncountable("images") end
        local out = {}
        if val(doc, "texts") ~= nil then texts(doc.texts, "texts", out) end
        local inputs = val(doc, "inputs")
        if truthy(inputs) then
            if not is_list(inputs) then uncountable("inputs[0] unless all its content is text") end
            for i, item in ipairs(inputs) do
                local parts = is_dict(item) and val(item, "content") or nil
                local ok = is_list(parts)
                if ok then
                    for _, p in ipairs(parts) do
                        if not (is_dict(p) and p.type == "text" and is_str(p.text)) then ok = false end
                    end
                end
                if not ok then uncountable(format("inputs[%d] unless all its content is text", i - 1)) end
                local text = {}
                for k, p in ipairs(parts) do text[k] = p.text end
                out[#out + 1] = concat(text)
            end
        end
        if #out == 0 then invalid("texts or inputs are required") end
        local prompts, sequences = {}, {}
        for i, t in ipairs(out) do prompts[i] = { text = t }; sequences[i] = seq({ i }) end
        return { prompts = prompts, sequences = sequences, generates = false, copies = 1 }
    end
    -- SageMaker: vLLM tries chat, then completions, then pooling; the largest is reserved.
    local function invocations(body)
        local doc = body.doc
        local readings = {}
        if is_list(val(doc, "messages")) then readings[#readings + 1] = R.chat(body) end
        if val(doc, "prompt") ~= nil then readings[#readings + 1] = R.completions(body) end
        if #readings == 0 then
            if val(doc, "input") == nil and val(doc, "messages") == nil then
                invalid("the request has neither messages, prompt nor input")
            end
            readings[1] = R.embed(body)
        end
        return readings
    end
    -- Every reading of a body, and one prompt list for all of them (parts shifted).
    local function read_request(api, body)
        local readings
        if api == "invocations" then readings = invocations(body) else readings = { R[api](body) } end
        local prompts = {}
        for _, r in ipairs(readings) do
            local offset = #prompts
            for _, p in ipairs(r.prompts) do prompts[#prompts + 1] = p end
            for _, s in ipairs(r.sequences) do
                for k, part in ipairs(s.parts) do s.parts[k] = part + offset end
            end
        end
        local generates = false
        for _, r in ipairs(readings) do generates = generates or r.generates end
        return { readings = readings, prompts = prompts, generates = generates }
    end

    -- ------------------------------------------------------------ counting (counting.py)

    -- chat_template_kwargs as vLLM's chat request builds them: the client's, overridden by
    -- documents and reasoning_effort when set (None and "auto" leave a kwarg alone), and
    -- enable_thinking from reasoning_effort.
    local function template_kwargs_json(p)
        local args, json, raw = p.args, p.args_json, p.body.raw
        local kwargs = args.chat_template_kwargs
        local effort = args.reasoning_effort
        local extra = {}
        if args.documents ~= nil and args.documents ~= "auto" then extra[#extra + 1] = { "documents", json.documents } end
        if effort ~= nil and effort ~= "auto" then extra[#extra + 1] = { "reasoning_effort", json.reasoning_effort } end
        if effort ~= nil and (kwargs == nil or kwargs.enable_thinking == nil) then
            extra[#extra + 1] = { "enable_thinking", effort ~= "none" and "true" or "false" }
        end
        local set, out = {}, {}
        for _, e in ipairs(extra) do set[e[1]] = true end
        if kwargs ~= nil then
            for _, m in ipairs(members(raw, p.body.by_key.chat_template_kwargs.vstart)) do
                if not set[m.key] then out[#out + 1] = sub(raw, m.kstart, m.kend) .. ":" .. sub(raw, m.vstart, m.vend) end
            end
        end
        for _, e in ipairs(extra) do out[#out + 1] = '"' .. e[1] .. '":' .. e[2] end
        if #out == 0 then return nil end
        return "{" .. concat(out, ",") .. "}"
    end
    -- The engine call that counts a prompt exactly: (location, body).
    local function tokenize_payload(model_json, p)
        if p.anthropic then return "/_kvtune/count_tokens", p.json end
        if p.text then return "/_kvtune/tokenize", '{"model":' .. model_json .. ',"prompt":' .. cjson.encode(p.text) .. "}" end
        local out = { '{"model":', model_json, ',"messages":', p.messages_json }
        for _, key in ipairs({ "tools", "add_generation_prompt", "continue_final_message" }) do
            if p.args[key] ~= nil then out[#out + 1] = ',"' .. key .. '":' .. p.args_json[key] end
        end
        local kwargs = template_kwargs_json(p)
        if kwargs then out[#out + 1] = ',"chat_template_kwargs":' .. kwargs end
        if p.add_special_tokens then out[#out + 1] = ',"add_special_tokens":true' end
        out[#out + 1] = "}"
        return "/_kvtune/tokenize", concat(out)
    end
    -- ceil(characters / chars_per_token) + margin, every part of the prompt measured.
    local function estimate(p)
        local chars
        if p.text then
            chars = text_chars(p.text)
        elseif p.anthropic then
            chars = json_chars(p.anthropic)
        else
            chars = 3 + json_chars(p.messages) + json_chars(next(p.args) and p.args or setmetatable({}, {}))
        end
        return counting.estimate(chars, CONFIG.estimate_chars_per_token, CONFIG.estimate_margin_tokens)
    end
    local function short(data)
        data = data or ""
        local text = sub(data, 1, 80)
        if #data > 80 then text = text .. "…" end
        return "'" .. text .. "'"
    end
    local function error_message(parsed)
        if type(parsed) ~= "table" or not is_dict(parsed) then return nil end
        local err = parsed.error
        if err == nil then err = parsed end
        if is_dict(err) and is_str(err.message) then return sub(err.message, 1, 500) end
        if is_str(parsed.message) then return sub(parsed.message, 1, 500) end
        return nil
    end
    -- { n, exact } for one prompt, or { refusal }.
    local function count_one(p, model_json)
        local location, payload = tokenize_payload(model_json, p)
        local path = p.anthropic and "/v1/messages/count_tokens" or "/tokenize"
        local res = ngx.location.capture(location, { method = ngx.HTTP_POST, body = payload })
        local parsed = res.body and cjson.decode(res.body)
        if res.status == 200 and not res.truncated then
            local key = p.anthropic and "input_tokens" or "count"
            local n = is_dict(parsed) and parsed[key]
            if is_int(n) and n >= 0 then
                -- an integer literal: Python reads 5.0 or 1e20 as a float, which is no count
                local m = last_member(members(res.body, skip_ws(res.body, 1)), key)
                if m and find(sub(res.body, m.vstart, m.vend), "^%-?%d+$") then return { n = n, exact = true } end
            end
            return { refusal = refusal(502, "prompt_count_invalid", "the gateway could not count the prompt: the upstream "
                                       .. path .. " answered no count: " .. short(res.body)) }
        end
        if res.status == 400 then
            local message = error_message(parsed) or "the upstream tokenizer refused the prompt"
            local code = find(message, "context length", 1, true) and "context_length_exceeded" or "invalid_prompt"
            return { refusal = refusal(400, code, message) }
        end
        if CONFIG.estimate_chars_per_token then return { n = estimate(p), exact = false } end
        return { refusal = refusal(503, "prompt_count_unavailable", format(
            "the gateway could not count the prompt: the upstream %s answered %d", path, res.status),
            { retry_after = CONFIG.retry_after_min_s }) }
    end
    -- Tokens per prompt (token ids counted here), at most tokenize_concurrency calls at once.
    local function count(asked, model_json)
        local prompts = asked.prompts
        local tokens, jobs, results = {}, {}, {}
        for i, p in ipairs(prompts) do
            if p.tokens then tokens[i] = p.tokens else jobs[#jobs + 1] = i end
        end
        local next_job, failed = 1, false
        local function worker()
            while not failed and next_job <= #jobs do
                local i = jobs[next_job]
                next_job = next_job + 1
                local r = count_one(prompts[i], model_json)
                results[i] = r
                if r.refusal then failed = true end
            end
        end
        if #jobs == 1 then
            worker()
        elseif #jobs > 1 then
            local threads = {}
            for w = 1, math.min(POLICY.tokenize_concurrency, #jobs) do threads[w] = ngx.thread.spawn(worker) end
            for _, t in ipairs(threads) do
                local ok, err = ngx.thread.wait(t)
                if not ok then error(err, 0) end
            end
        end
        local exact = true
        for _, i in ipairs(jobs) do
            local r = results[i]
            if r and r.refusal then return nil, nil, r.refusal end
        end
        for _, i in ipairs(jobs) do
            tokens[i] = results[i].n
            exact = exact and results[i].exact
        end
        return tokens, exact
    end

    -- ------------------------------------------------------------ reservation (admission.py)

    local function int_text(n)  -- an integer of any size (%d wraps past 2^63)
        if n > -2^53 and n < 2^53 then return format("%d", n) end
        return format("%.0f", n)
    end
    local function blocks_of(prompt, grow) return reservation_math.blocks_of(prompt, grow, CONFIG.block_size) end
    -- What a 413 was measured against (admission.py's _limit_text).
    local function limit_text()
        if CONFIG.admit_limit == CONFIG.block_budget then
            return format("the whole budget is %d", CONFIG.block_budget)
        end
        return format("the overcommit limit is %d (%g x the budget %d)", CONFIG.admit_limit, CONFIG.factor,
                      CONFIG.block_budget)
    end
    -- 413 before any count when even the cheapest reading exceeds the budget (a batch of
    -- thousands of prompts is refused without a thousand /tokenize calls).
    local function never_fits(asked, cap)
        local smallest
        for _, r in ipairs(asked.readings) do
            local grow = r.generates and cap or 0
            local total = 0
            for _, s in ipairs(r.sequences) do
                local prompt = s.extra
                for _, i in ipairs(s.parts) do prompt = prompt + (asked.prompts[i].tokens or 0) end
                total = total + blocks_of(prompt, grow)
            end
            total = total * r.copies
            if smallest == nil or total < smallest then smallest = total end
        end
        if smallest and smallest > CONFIG.admit_limit then
            return refusal(413, "kv_reservation_exceeds_budget", format(
                "this request needs at least %d KV blocks but %s: it can never be admitted",
                smallest, limit_text()), { public = CONFIG.never_fits })
        end
    end
    local forced_law = reservation_math.forced_law
    -- The largest reading: copies x the sum over its sequences of ceil((prompt + cap) / block_size);
    -- and what its sequences may reach (the statistical ledger's demand: their prompts, the cap,
    -- the route's output law; none for a reading that generates nothing).
    local function reservation(asked, cap, tokens, exact, route)
        local largest, demand, chosen, law, single, grown = 0, nil, false, nil, false, nil
        for _, r in ipairs(asked.readings) do
            local grow = r.generates and cap or 0
            local total, prompts = 0, {}
            for _, s in ipairs(r.sequences) do
                local prompt = s.extra
                for _, i in ipairs(s.parts) do prompt = prompt + tokens[i] end
                if exact and prompt + (r.generates and 1 or 0) > CONFIG.max_model_len then
                    return nil, refusal(400, "context_length_exceeded", format(
                        "the prompt has %s tokens; this deployment's context is %d tokens", int_text(prompt),
                        CONFIG.max_model_len))
                end
                prompts[#prompts + 1] = math.min(prompt, CONFIG.max_model_len)
                total = total + blocks_of(prompts[#prompts], grow)
            end
            total = r.copies * total
            if total > largest or not chosen then
                largest, chosen, demand = total, true, nil
                -- what the forecast reads (kvtune.flow): its law, and whether one stream is one sequence
                law = grow ~= 0 and forced_law(route and route.law, r, grow) or nil
                single, grown = #prompts == 1 and r.copies == 1, grow ~= 0 and grow or nil
                if grow ~= 0 and STAT then
                    local all = {}
                    for _ = 1, r.copies do
                        for _, p in ipairs(prompts) do all[#all + 1] = p end
                    end
                    demand = { prompts = all, cap = grow, law = forced_law(route and route.law, r, grow) }
                end
            end
        end
        local never
        if STAT then never = STAT.never_fits(largest, demand) else never = largest > CONFIG.admit_limit end
        if never then
            return nil, refusal(413, "kv_reservation_exceeds_budget", format(
                "this request needs %d KV blocks but %s: it can never be admitted",
                largest, limit_text()), { public = CONFIG.never_fits })
        end
        return math.max(largest, 1), nil, demand, { law = law, single = single, cap = grown }
    end

    -- The body with every cap field the readings read set to `cap` (the first one added
    -- where none is present) and a min_tokens above the cap lowered to it; nothing else.
    local function field_id(f) return f.key .. "\0" .. (f.parent or "") end
    local function rewrite(body, asked, cap)
        local doc, raw = body.doc, body.raw
        local fields, adds, floors = {}, {}, {}
        local seen = {}
        local function put(list, f)
            local id = field_id(f)
            if not seen[list] then seen[list] = {} end
            if not seen[list][id] then seen[list][id] = true; list[#list + 1] = f end
        end
        for _, r in ipairs(asked.readings) do
            if r.generates then
                local present = 0
                for _, f in ipairs(r.caps) do
                    local holder = holder_of(doc, f)
                    if is_dict(holder) and holder[f.key] ~= nil then put(fields, f); present = present + 1 end
                end
                if present == 0 and r.add_cap then put(adds, r.add_cap) end
                if r.min_tokens then put(floors, r.min_tokens) end
            end
        end
        local value = format("%d", cap)
        local spans = { [""] = { open = body.open, list = body.top } }
        local function span(f)
            local id = f.parent or ""
            if not spans[id] then
                local parent = body.by_key[f.parent]
                spans[id] = { open = parent.vstart, list = members(raw, parent.vstart) }
            end
            return spans[id]
        end
        local edits = {}
        for _, f in ipairs(fields) do
            local m = last_member(span(f).list, f.key)
            edits[#edits + 1] = { m.vstart, m.vend, value }
        end
        for _, f in ipairs(floors) do
            local holder = holder_of(doc, f)
            local floor_value = is_dict(holder) and val(holder, f.key)
            if type(floor_value) == "number" and floor_value > cap then
                local m = last_member(span(f).list, f.key)
                edits[#edits + 1] = { m.vstart, m.vend, value }
            end
        end
        local field_set = {}
        for _, f in ipairs(fields) do field_set[field_id(f)] = true end
        local inserts = {}
        for _, f in ipairs(adds) do
            if not field_set[field_id(f)] then
                local s = span(f)
                local at = s.open + 1
                inserts[at] = inserts[at] or { count = #s.list, items = {} }
                local items = inserts[at].items
                items[#items + 1] = '"' .. f.key .. '":' .. value
            end
        end
        for at, ins in pairs(inserts) do
            local sep = ins.count > 0 and "," or ""
            edits[#edits + 1] = { at, at - 1, concat(ins.items, ",") .. sep }
        end
        if #edits == 0 then return raw end
        table.sort(edits, function(a, b) return a[1] < b[1] end)
        local out, last = {}, 1
        for _, e in ipairs(edits) do
            out[#out + 1] = sub(raw, last, e[1] - 1)
            out[#out + 1] = e[3]
            last = e[2] + 1
        end
        out[#out + 1] = sub(raw, last)
        return concat(out)
    end

    -- ------------------------------------------------------------ request bodies

    -- zlib through LuaJIT's FFI: gzip and deflate request bodies are decoded (nginx does
    -- not), bounded, and forwarded decoded, as aiohttp decodes them for the Python gateway.
    pcall(ffi.cdef, [[
        typedef struct {
            const unsigned char *next_in; unsigned int avail_in; unsigned long total_in;
            unsigned char *next_out; unsigned int avail_out; unsigned long total_out;
            const char *msg; void *state; void *zalloc; void *zfree; void *opaque;
            int data_type; unsigned long adler; unsigned long reserved;
        } kvtune_z_stream;
        const char *zlibVersion(void);
        int inflateInit2_(kvtune_z_stream *strm, int windowBits, const char *version, int stream_size);
        int inflate(kvtune_z_stream *strm, int flush);
        int inflateReset(kvtune_z_stream *strm);
        int inflateEnd(kvtune_z_stream *strm);
    ]])
    local ok_z, zlib = pcall(ffi.load, "z")
    if not ok_z then zlib = ffi.load("libz.so.1") end
    local Z_OK, Z_STREAM_END, Z_BUF_ERROR, CHUNK = 0, 1, -5, 65536
    -- gzip: windowBits 15 + 16 (gzip members, one after another); deflate: the zlib wrapper,
    -- or raw deflate (-15) when the first byte is no zlib header. A stream that stops early or
    -- has bytes after its end is corrupt, as in the Python gateway (intake._Decoder).
    -- Returns the text, or nil and "too_large" / "corrupt".
    local function inflate(data, encoding, limit)
        local wbits = 31
        if encoding == "deflate" then
            wbits = (byte(data, 1) % 16 == 8) and 15 or -15
        end
        local strm = ffi.new("kvtune_z_stream")
        if zlib.inflateInit2_(strm, wbits, zlib.zlibVersion(), ffi.sizeof(strm)) ~= Z_OK then
            return nil, "corrupt"
        end
        local buf = ffi.new("unsigned char[?]", CHUNK)
        local input = ffi.cast("const unsigned char *", data)
        strm.next_in, strm.avail_in = input, #data
        local parts, total, result = {}, 0, nil
        while true do
            strm.next_out, strm.avail_out = buf, CHUNK
            local rc = zlib.inflate(strm, 0)
            local got = CHUNK - strm.avail_out
            total = total + got
            if total > limit then result = "too_large" break end
            if got > 0 then parts[#parts + 1] = ffi.string(buf, got) end
            if rc == Z_STREAM_END then
                if strm.avail_in == 0 then break end
                if encoding ~= "gzip" then result = "corrupt" break end  -- bytes after the stream
                zlib.inflateReset(strm)  -- the next gzip member
            elseif rc == Z_BUF_ERROR or (rc == Z_OK and strm.avail_in == 0 and got < CHUNK) then
                result = "corrupt"  -- the stream stops early
                break
            elseif rc ~= Z_OK then
                result = "corrupt"
                break
            end
        end
        zlib.inflateEnd(strm)
        if result then return nil, result end
        return concat(parts)
    end

    local function content_encoding()
        local value = ngx.var.http_content_encoding or ""
        return (value:lower():gsub("^%s+", ""):gsub("%s+$", ""))
    end
    local DECODED = { [""] = true, identity = true, gzip = true, deflate = true }

    -- The whole body, decoded. nginx itself answers 413 past client_max_body_size (chunked
    -- bodies too) and 408 when the body stops coming for client_body_timeout; a watchdog
    -- light thread answers 408 when the whole body has not come within body_deadline_s
    -- (client_body_timeout bounds one read only: a byte every few seconds held the connection
    -- for as long as the body was long), as the Python gateway's limits.body_deadline_s does.
    local function body_deadline()
        ngx.sleep(CONFIG.body_deadline_s)
        local r = refusal(408, "body_timeout", format("the request body did not arrive within %g s",
                                                      CONFIG.body_deadline_s))
        ledger:incr("rejected", 1, 0)
        count_refusal(r)
        ngx.status = 408
        ngx.header["Content-Type"] = "application/json; charset=utf-8"
        ngx.print(error_body(408, r.code, r.message))
        return ngx.exit(ngx.HTTP_OK)
    end
    local function read_body()
        local watchdog = ngx.thread.spawn(body_deadline)
        ngx.req.read_body()
        ngx.thread.kill(watchdog)
        local body = ngx.req.get_body_data()
        if body == nil then
            local name = ngx.req.get_body_file()
            if name then
                local f = io.open(name, "rb")
                if not f then return nil, refusal(500, "body_unreadable", "the gateway could not read the request body") end
                body = f:read("*a")
                f:close()
            else
                body = ""
            end
        end
        local encoding = content_encoding()
        if (encoding == "gzip" or encoding == "deflate") and #body > 0 then
            local decoded, err = inflate(body, encoding, CONFIG.max_body_bytes)
            if err == "too_large" then
                return nil, refusal(413, "body_too_large", format("request bodies are limited to %d bytes",
                                                                  CONFIG.max_body_bytes), { close = true })
            elseif err then
                return nil, refusal(400, "invalid_body", "the request body could not be read (ContentEncodingError)",
                                    { close = true })
            end
            return decoded, nil, true
        end
        return body, nil, encoding == "gzip" or encoding == "deflate"
    end
    local function forward_body(text, decoded, changed)
        if decoded then ngx.req.clear_header("Content-Encoding") end
        if decoded or changed then ngx.req.set_body_data(text) end
    end

    -- ------------------------------------------------------------ Retry-After

    local rates = ledger_rates.new(ledger, POLICY.rate_window_s, CONFIG.retry_after_min_s, CONFIG.retry_after_max_s)
    local release_rate, note_release = rates.release_rate, rates.note_release
    local function retry_after(need_blocks) return rates.retry_after(need_blocks, ngx.now()) end

    -- ------------------------------------------------------------ statistical admission (kvtune.statistical)
    STAT = statistical.new(CONFIG)
    -- the flow-control queue (kvtune.flow), when gateway.yaml has a flow: section
    local FLOW = CONFIG.flow and flow_queue.new(CONFIG.flow)

    -- ------------------------------------------------------------ admission

    local function canonical_path(target)
        local path = target
        local q = find(target, "?", 1, true)
        if q then path = sub(target, 1, q - 1) end
        if not ngx.re.find(path, POLICY.canonical, "jo") or ngx.re.find(path, POLICY.dot_segment, "jo") then
            return nil
        end
        return path
    end
    local function classify(path)
        local api = POLICY.generate[path]
        if api then return "generate", api end
        api = POLICY.pool[path]
        if api then return "pool", api end
        local reason = POLICY.uncountable[path]
        if reason then return "uncountable", nil, reason end
        if POLICY.operator[path] then return "operator" end
        for _, prefix in ipairs(POLICY.operator_prefixes) do
            if sub(path, 1, #prefix) == prefix then return "operator" end
        end
        if PASSTHROUGH[path] then return "passthrough" end
        return "unknown"
    end
    -- match.header routes: the request's one value of the header, compared exactly (groups:
    -- its route headers by lower-case name, absent or empty ones left out)
    local function header_ok(r, groups)
        return r.header == nil or groups[r.header] == r.value
    end
    local function route_for(path, model, groups)
        for _, r in ipairs(CONFIG.routes) do
            local ok = (r.path == nil or r.path == path)
                and (r.path_prefix == nil or sub(path, 1, #r.path_prefix) == r.path_prefix)
                and (r.model == nil or r.model == model)
                and header_ok(r, groups)
            if ok then return r end
        end
        return nil
    end
    -- A literal route path that is no vLLM endpoint: the first route naming it whose header
    -- the request carries (kvtune.gateway.config.GatewayConfig.path_route).
    local function path_route(path, groups)
        for _, r in ipairs(CONFIG.routes) do
            if r.path == path and header_ok(r, groups) then return r end
        end
        return nil
    end
    -- The headers routes match on, each sent at most once (intake.Intake._groups).
    local ROUTE_HEADERS = {}
    for _, r in ipairs(CONFIG.routes) do
        if r.header ~= nil then r.header = string.lower(r.header) end
        if r.header ~= nil and ROUTE_HEADERS[r.header] == nil then
            ROUTE_HEADERS[r.header] = true
            ROUTE_HEADERS[#ROUTE_HEADERS + 1] = r.header
        end
    end
    local function route_groups()
        local groups = {}
        if #ROUTE_HEADERS == 0 then return groups end
        local headers = ngx.req.get_headers(0, true)  -- every header, names as sent
        local seen = {}
        for name, value in pairs(headers) do
            local lower = string.lower(name)
            if ROUTE_HEADERS[lower] then
                local n = type(value) == "table" and #value or 1
                seen[lower] = (seen[lower] or 0) + n
                if seen[lower] > 1 then
                    return nil, refusal(400, "duplicate_route_header", "the " .. lower .. " header is sent "
                                        .. seen[lower] .. " times: routes match on its one value")
                end
                if value ~= "" then groups[lower] = value end
            end
        end
        return groups
    end

    -- The request's path and class, or a refusal for what is refused before any body.
    local function classify_request()
        local method = ngx.req.get_method()
        if method == "CONNECT" or method == "TRACE" then
            return nil, refusal(405, "method_not_allowed", method .. " is not served", { close = true })
        end
        if ngx.var.http_upgrade ~= nil then
            return nil, refusal(400, "upgrade_refused", "the gateway does not switch protocols", { close = true })
        end
        -- the request target as the client sent it (nginx's $uri is already normalised)
        local target = ngx.var.request:match("^%S+%s+(%S+)") or ""
        local path = canonical_path(target)
        if not path then
            return nil, refusal(400, "invalid_path", "the request path must be plain (no percent-escapes, "
                                .. "'//', '.' or '..' segments)")
        end
        local first = ROUTE_PATHS[path]
        local kind, api, reason
        if first then kind, api = "generate", first.api or "any" else kind, api, reason = classify(path) end
        if kind == "generate" or kind == "pool" then
            if method ~= "POST" then
                return nil, refusal(405, "method_not_allowed", path .. " takes POST", { allow = "POST" })
            end
            if not DECODED[content_encoding()] then
                return nil, refusal(415, "unsupported_encoding", "request bodies may be gzip or deflate encoded",
                                    { close = true })
            end
        elseif kind == "uncountable" then
            return nil, refusal(501, "uncountable_endpoint", path .. " is not served through this gateway: " .. reason)
        elseif kind ~= "passthrough" then
            return nil, refusal(404, "not_found", path .. " is not served through this gateway")
        end
        local groups = {}
        if kind == "generate" then
            local err
            groups, err = route_groups()
            if err then return nil, err end
        end
        local route = first and path_route(path, groups) or nil
        return { path = path, kind = kind, api = api, route = route, groups = groups }
    end

    local function cap_of(route, asked)
        local cap = route.max_new_tokens
        for _, r in ipairs(asked.readings) do
            if r.requested_cap ~= nil and r.requested_cap < cap then cap = r.requested_cap end
        end
        return cap
    end

    -- ------------------------------------------------------------ health (several upstreams)
    -- pool.py's health: a replica is out while the ledger holds "down:i" (why it was taken
    -- out), in by default; "ejections:i" counts the times it was taken out.
    -- Passive health (pool.py's record/readmit): "fails:i" counts a replica's answers in a row
    -- that were 5xx (or failed connections); at health.consecutive_failures it is ejected:
    -- "ejected:i" holds why, for a while the shared dict's expiry ends (health.ejection_s,
    -- doubled by "in_a_row:i" up to max_ejection_s); "passive:i" counts its ejections,
    -- "ejection_s:i" is how long the last one lasts.
    local HEALTH = CONFIG.health
    local function probed_up(i) return ledger:get("down:" .. i) == nil end
    local function is_up(i) return probed_up(i) and ledger:get("ejected:" .. i) == nil end

    local function mark_down(i, why)
        if ledger:add("down:" .. i, why) then  -- add: only the first to see it counts it
            ledger:incr("ejections:" .. i, 1, 0)
            ngx.log(ngx.WARN, "kvtune: upstream ", CONFIG.upstreams[i].url, " taken out: ", sub(why, 1, 200))
        end
    end

    local function mark_up(i)
        if ledger:get("down:" .. i) ~= nil then
            ledger:delete("down:" .. i)
            ngx.log(ngx.WARN, "kvtune: upstream ", CONFIG.upstreams[i].url, " is back")
        end
    end

    -- One answer's outcome on replica i (failed: 5xx, or no connection), as pool.py's record.
    local function record_outcome(i, failed, status)
        if not failed then
            ledger:set("fails:" .. i, 0)
            if ledger:get("ejected:" .. i) == nil then ledger:set("in_a_row:" .. i, 0) end
            return
        end
        if ledger:get("ejected:" .. i) ~= nil then return end  -- a straggler sent before the ejection
        local fails = ledger:incr("fails:" .. i, 1, 0)
        local limit = HEALTH.consecutive_failures
        if limit == 0 or not fails or fails < limit then return end
        -- Counting the others and ejecting is one decision across workers: two workers ejecting
        -- two replicas at once could each see the other still in. The lock is held without a
        -- yield (shared-dict calls only); a worker that does not get it leaves the ejection to
        -- the next failure.
        if not ledger:add("eject-lock", true, 0.1) then return end
        local n, ejected, others = #CONFIG.upstreams, 0, false
        for j in ipairs(CONFIG.upstreams) do
            if ledger:get("ejected:" .. j) ~= nil then ejected = ejected + 1 end
            if j ~= i and is_up(j) then others = true end
        end
        local allowed = math.max(1, floor(HEALTH.max_ejected_share * n + 1e-9))
        if not others or ejected + 1 > allowed or ejected + 1 >= n then  -- it stays
            ledger:delete("eject-lock")
            return
        end
        local row = ledger:get("in_a_row:" .. i) or 0
        local secs = math.min(HEALTH.max_ejection_s, HEALTH.ejection_s * 2 ^ math.min(row, 32))
        if ledger:add("ejected:" .. i, format("%d consecutive failures (the last answered %d)", fails, status), secs) then
            ledger:set("fails:" .. i, 0)
            ledger:incr("in_a_row:" .. i, 1, 0)
            ledger:incr("passive:" .. i, 1, 0)
            ledger:set("ejection_s:" .. i, secs)
            ngx.log(ngx.WARN, "kvtune: upstream ", CONFIG.upstreams[i].url, " ejected for ", secs, " s: ",
                    fails, " consecutive failures (the last answered ", status, ")")
        end
        ledger:delete("eject-lock")
    end

    -- With every replica out: 503 with Retry-After (the next probe may bring one back).
    local function none_up()
        for i in ipairs(CONFIG.upstreams) do if is_up(i) then return nil end end
        local secs = math.max(CONFIG.retry_after_min_s, math.min(CONFIG.retry_after_max_s, ceil(HEALTH.interval_s)))
        return refusal(503, "no_healthy_upstream", format(
            "every upstream is taken out (GET %s failed, or a connection to it failed): nothing is "
            .. "admitted until one answers %s with 200 again; retry later", HEALTH.path, HEALTH.path),
            { retry_after = secs })
    end

    if HEALTH then
        -- A replica named by host name is resolved once here, as nginx resolves the servers
        -- of its upstream groups at start (a cosocket would need a `resolver` directive).
        pcall(ffi.cdef, [[
            struct kvtune_addrinfo { int ai_flags; int ai_family; int ai_socktype; int ai_protocol;
                unsigned int ai_addrlen; void *ai_addr; char *ai_canonname; struct kvtune_addrinfo *ai_next; };
            int getaddrinfo(const char *node, const char *service, const struct kvtune_addrinfo *hints,
                            struct kvtune_addrinfo **res);
            void freeaddrinfo(struct kvtune_addrinfo *res);
            const char *inet_ntop(int af, const void *src, char *dst, unsigned int size);
        ]])
        -- Every address of the name, each tried in turn (as nginx makes each one a server).
        local function resolve(host)
            if find(host, ":", 1, true) then return { "[" .. host .. "]" } end  -- IPv6 literal
            if find(host, "^[%d.]+$") then return { host } end
            local hints = ffi.new("struct kvtune_addrinfo")
            hints.ai_socktype = 1  -- SOCK_STREAM
            local res = ffi.new("struct kvtune_addrinfo *[1]")
            if ffi.C.getaddrinfo(host, nil, hints, res) ~= 0 or res[0] == nil then
                error("kvtune: cannot resolve upstream host " .. host)
            end
            local out, buf, ai = {}, ffi.new("char[64]"), res[0]
            while ai ~= nil do
                local family, addr = ai.ai_family, ffi.cast("const uint8_t *", ai.ai_addr)
                if family == 2 or family == 10 then  -- AF_INET, AF_INET6
                    -- sockaddr_in keeps the address at byte 4, sockaddr_in6 at byte 8
                    local text = ffi.C.inet_ntop(family, addr + (family == 2 and 4 or 8), buf, 64)
                    if text ~= nil then
                        out[#out + 1] = family == 2 and ffi.string(text) or "[" .. ffi.string(text) .. "]"
                    end
                end
                ai = ai.ai_next
            end
            ffi.C.freeaddrinfo(res[0])
            if #out == 0 then error("kvtune: cannot resolve upstream host " .. host) end
            return out
        end
        for _, u in ipairs(CONFIG.upstreams) do u.addrs = resolve(u.host) end
    end

    -- One probe (proxy.py's _probe): nil when GET health.path answered 200 in time, else why not.
    local function probe(u)
        local sock = ngx.socket.tcp()
        ngx.update_time()
        local deadline = ngx.now() + HEALTH.timeout_s
        local function in_time()  -- one deadline over connect, send and the whole answer
            ngx.update_time()
            sock:settimeout(math.max(1, floor((deadline - ngx.now()) * 1000)))
        end
        local function failed(err)
            sock:close()
            if err == "timeout" then
                return format("GET %s gave no answer within %g s", HEALTH.path, HEALTH.timeout_s)
            end
            return format("GET %s failed: %s", HEALTH.path, err)
        end
        local ok, err
        for _, addr in ipairs(u.addrs) do
            in_time()
            ok, err = sock:connect(addr, u.port)
            if ok or err == "timeout" then break end
            sock = ngx.socket.tcp()  -- a failed connect closes the cosocket: a fresh one for the next
        end
        if not ok then return failed(err == "timeout" and err or "cannot connect to the upstream: " .. tostring(err)) end
        if HEALTH.https then
            in_time()
            ok, err = sock:sslhandshake(nil, u.host, false)  -- as proxy_pass: proxy_ssl_verify off
            if not ok then return failed(err) end
        end
        in_time()
        ok, err = sock:send("GET " .. HEALTH.path .. " HTTP/1.1\r\nHost: " .. u.netloc
                            .. "\r\nConnection: close\r\nUser-Agent: kvtune-nginx-health\r\n\r\n")
        if not ok then return failed(err) end
        in_time()
        local line
        line, err = sock:receive("*l")
        if not line then
            return failed(err == "closed" and "the upstream closed the connection without answering" or err)
        end
        local status = tonumber(line:match("^HTTP/1%.[01] (%d%d%d)"))
        if not status then
            return failed("not an HTTP/1.x answer from the upstream: " .. sub(line, 1, 80))
        end
        -- the rest of the answer, up to the upstream's close (Connection: close), in time
        local total = 0
        while total < 65536 do
            in_time()
            local data
            data, err = sock:receiveany(65536)
            if not data then
                if err == "closed" then break end
                return failed(err)
            end
            total = total + #data
        end
        sock:close()
        if status ~= 200 then return format("GET %s answered %d", HEALTH.path, status) end
        return nil
    end

    -- Every replica at once, each taken out or brought back by its own answer.
    local function probe_all()
        local threads = {}
        for i, u in ipairs(CONFIG.upstreams) do threads[i] = ngx.thread.spawn(probe, u) end
        for i, t in ipairs(threads) do
            local ok, why = ngx.thread.wait(t)
            if not ok then why = "the probe failed: " .. tostring(why) end
            if why then mark_down(i, why) else mark_up(i) end
        end
    end

    -- init_worker_by_lua: worker 0 alone probes (nginx respawns a crashed worker with its id),
    -- every health.interval_s; a round still running when the next is due is not doubled.
    function M.watch_health()
        if not HEALTH or ngx.worker.id() ~= 0 then return end
        local busy = false
        local ok, err = ngx.timer.every(HEALTH.interval_s, function(premature)
            if premature or busy then return end
            busy = true
            local done, failure = pcall(probe_all)
            busy = false
            if not done then ngx.log(ngx.ERR, "kvtune: the health probe failed: ", tostring(failure)) end
        end)
        if not ok then ngx.log(ngx.ERR, "kvtune: cannot start the health probe: ", err) end
    end

    -- Several engine replicas (pool.py's try_reserve): among those in (health above), try
    -- the one with the most free blocks first (ties: fewest in flight, then order), each
    -- reservation added, checked against that upstream's limit and rolled back when over;
    -- fits nowhere: 429 with the Retry-After of the upstream nearest to room; none in: 503.
    -- Returns nil, nil, the upstream's index.
    local function reserve_on_one(blocks, keep)
        local order = {}
        for i, u in ipairs(CONFIG.upstreams) do
            if is_up(i) then
                order[#order + 1] = { i = i, free = u.admit_limit - (ledger:get("held:" .. i) or 0),
                                      inflight = ledger:get("inflight:" .. i) or 0 }
            end
        end
        if #order == 0 then return none_up() end
        table.sort(order, function(a, b)
            if a.free ~= b.free then return a.free > b.free end
            if a.inflight ~= b.inflight then return a.inflight < b.inflight end
            return a.i < b.i
        end)
        local need, held_text, limit_text_of
        for _, o in ipairs(order) do
            local i, u = o.i, CONFIG.upstreams[o.i]
            local reserved, err = ledger:incr("reserved:" .. i, blocks, 0)
            if not reserved then
                return refusal(503, "ledger_unavailable", "the gateway ledger failed: " .. tostring(err))
            end
            if reserved + math.min(keep, math.max(0, u.admit_limit - blocks)) <= u.admit_limit then
                ledger:incr("held:" .. i, blocks, 0)
                ledger:incr("inflight:" .. i, 1, 0)
                ledger:incr("held", blocks, 0)
                ledger:incr("inflight", 1, 0)
                return nil, nil, i
            end
            ledger:incr("reserved:" .. i, -blocks, 0)
            if blocks <= u.admit_limit then
                local held = ledger:get("held:" .. i) or 0
                local n = math.max(1, held + blocks - u.admit_limit)
                if need == nil or n < need then need, held_text, limit_text_of = n, held, u.admit_limit end
            end
        end
        return refusal(429, "kv_budget_exhausted", format(
            "KV budget full on every upstream: %d blocks needed, %d of %d reserved on the nearest; retry later",
            blocks, held_text or 0, limit_text_of or CONFIG.admit_limit), { retry_after = retry_after(need or blocks),
            public = CONFIG.budget_full, needed = blocks, free = math.max((limit_text_of or CONFIG.admit_limit) - (held_text or 0), 0) })
    end

    -- Reserve atomically: add first, check, roll back when over. "held" counts only admitted
    -- reservations, so it never exceeds admit_limit even while a rollback is in flight. `keep`:
    -- flow control's reserve for higher bands, the blocks left free beside it (at most the limit
    -- less its own, docs/guides/flow-control.md, The reserve).
    local function reserve(blocks, demand, keep)
        keep = keep or 0
        if STAT then  -- one worker: the check and the add cannot interleave with another request
            local entry = STAT.try_reserve(blocks, demand, ledger:get("held") or 0, keep)
            if not entry then
                local held = ledger:get("held") or 0
                -- at most its own blocks: "held" counts every worst case and passes the budget
                -- by design (StatisticalLedger._retry_need)
                local need = math.min(blocks, math.max(1, held + blocks - CONFIG.admit_limit))
                return refusal(429, "kv_budget_exhausted", format(
                    "KV budget full: %d blocks needed, %d of %d reserved; retry later", blocks, held, CONFIG.admit_limit),
                    { retry_after = retry_after(need), public = CONFIG.budget_full, needed = blocks, free = math.max(CONFIG.admit_limit - held, 0) })
            end
            ledger:incr("reserved", blocks, 0)
            ledger:incr("held", blocks, 0)
            ledger:incr("inflight", 1, 0)
            return nil, entry
        end
        if CONFIG.upstreams then return reserve_on_one(blocks, keep) end
        local reserved, err = ledger:incr("reserved", blocks, 0)
        if not reserved then
            return refusal(503, "ledger_unavailable", "the gateway ledger failed: " .. tostring(err))
        end
        if reserved + math.min(keep, math.max(0, CONFIG.admit_limit - blocks)) > CONFIG.admit_limit then
            ledger:incr("reserved", -blocks, 0)
            local held = ledger:get("held") or 0
            local need = math.max(1, held + blocks - CONFIG.admit_limit)
            return refusal(429, "kv_budget_exhausted", format(
                "KV budget full: %d blocks needed, %d of %d reserved; retry later", blocks, held, CONFIG.admit_limit),
                { retry_after = retry_after(need), public = CONFIG.budget_full, needed = blocks, free = math.max(CONFIG.admit_limit - held, 0) })
        end
        ledger:incr("held", blocks, 0)
        ledger:incr("inflight", 1, 0)
        return nil
    end

    -- ------------------------------------------------------------ flow control (kvtune.flow)
    -- gateway.yaml's flow: section (docs/guides/flow-control.md). The queue lives in this
    -- worker's memory: a config with flow control runs one nginx worker (nginx.conf's header),
    -- so every request meets the same order and the order needs no lock. A waiter sleeps on its
    -- own ngx.semaphore in the access phase; whoever may have made room (a release in the log
    -- phase, a waiter leaving, the wake timer for an upstream coming back) serves the waiters
    -- that now fit, reserving for them, and posts their semaphores.
    local FLOW_CONFIG = CONFIG.flow
    local semaphore = require "ngx.semaphore"
    -- The admitted requests, each as the forecast reads it (kvtune.flow.forecast_s): its
    -- blocks, cap, law, admission time and streamed tokens; the log phase's ctx.kvtune.
    local ADMITTED, admitted_seq = {}, 0

    -- The ledger's try_reserve for a request of the queue: its held record, or nil.
    local function try_reserve_for(w)
        local full, entry, where = reserve(w.blocks, w.demand, w.keep)
        if full then return nil end
        admitted_seq = admitted_seq + 1
        local held = { blocks = w.blocks, entry = entry, upstream = where, cap = w.ends.cap, law = w.ends.law,
                       single = w.ends.single, admitted_at = ngx.now(), seq = admitted_seq }
        ADMITTED[held] = true
        return held
    end
    local function post(granted)
        for _, w in ipairs(granted) do w.sema:post(1) end
    end
    -- The ledger's limit less its reserved blocks, and the limit, as /kvtune/ledger shows them.
    local function free_blocks()
        if CONFIG.upstreams then
            local limit = 0
            for i, u in ipairs(CONFIG.upstreams) do
                if is_up(i) then limit = limit + u.admit_limit end
            end
            return math.max(0, limit - (ledger:get("held") or 0)), limit
        end
        return math.max(0, CONFIG.admit_limit - (ledger:get("held") or 0)), CONFIG.admit_limit
    end
    local function running()
        local out = {}
        for ctx in pairs(ADMITTED) do out[#out + 1] = ctx end
        return out
    end
    local function retry_of(wait_s)
        return math.max(CONFIG.retry_after_min_s, math.min(CONFIG.retry_after_max_s, ceil(wait_s)))
    end
    local function wake_now()
        if FLOW and FLOW.waiting > 0 then post(FLOW.wake(try_reserve_for, ngx.now())) end
    end

    -- init_worker_by_lua: room may appear without a release here (an upstream back, an old
    -- worker's reservations given back after a reload): the waiters are served a few times a
    -- second as well.
    function M.watch_flow()
        local ok, err = ngx.timer.every(0.1, function(premature)
            if not premature then wake_now() end
        end)
        if not ok then ngx.log(ngx.ERR, "kvtune: cannot start the flow-control timer: ", err) end
    end

    -- A header's first value among `headers` (ngx.req.get_headers), spaces and tabs at either
    -- end stripped.
    local function first_header(headers, name)
        local value = headers[name]
        if type(value) == "table" then value = value[1] end
        if type(value) ~= "string" then return nil end
        return (value:gsub("^[ \t]+", ""):gsub("[ \t]+$", ""))
    end
    -- The band: the band header's value when it names a band exactly, else the route's band,
    -- else the default band.
    local function band_of(headers, route)
        local named = first_header(headers, FLOW_CONFIG.band_header)
        if named and FLOW.band_of(named) then return FLOW.band_of(named) end
        return FLOW.band_of(route and route.band or FLOW_CONFIG.default_band)
    end
    -- The flow: the flow header's value (1 to 128 printable ASCII characters), else key- and the
    -- first 16 hex digits of SHA-1 of the bearer token, else anonymous.
    local function flow_of(headers)
        local named = first_header(headers, FLOW_CONFIG.flow_header)
        if named and #named >= 1 and #named <= 128 and not find(named, "[^\32-\126]") then return named end
        local auth = first_header(headers, "authorization")
        local space = auth and find(auth, " ", 1, true)
        if space and sub(auth, 1, space - 1):lower() == "bearer" then
            local token = sub(auth, space + 1):gsub("^[ \t]+", ""):gsub("[ \t]+$", "")
            if token ~= "" then
                local digest = sub(ngx.sha1_bin(token), 1, 8)
                return "key-" .. (digest:gsub(".", function(c) return format("%02x", byte(c)) end))
            end
        end
        return "anonymous"
    end

    local function turned(code, blocks, wait_s)
        local held = ledger:get("held") or 0
        return refusal(429, code, format("KV budget full: %d blocks needed, %d of %d reserved; retry later",
                                         blocks, held, CONFIG.admit_limit),
                       { retry_after = retry_of(wait_s), public = CONFIG.budget_full, needed = blocks,
                         free = math.max(CONFIG.admit_limit - held, 0) })
    end

    local function gone() return ngx.exit(499) end  -- the log phase takes it out of the queue

    -- Reserve now, wait for its turn, or 429 at once: (held) or (nil, refusal).
    local function admit_in_turn(blocks, demand, route, ends)
        local now = ngx.now()
        local headers = ngx.req.get_headers(0)
        local w = { blocks = blocks, demand = demand, ends = ends, band = band_of(headers, route), flow = flow_of(headers) }
        local verdict, reason, wait_s = FLOW.offer(w, now, try_reserve_for, free_blocks, running)
        if verdict == "admitted" then return w.reservation end
        if verdict == "shed" then return nil, turned(reason, blocks, wait_s) end
        -- it waits: granted by whoever makes room, or out at its deadline or when its client
        -- leaves (the log phase: out of the queue, or its grant given back, once)
        ngx.ctx.kvtune_waiter = w
        w.sema = semaphore.new()
        ngx.on_abort(gone)  -- lua_check_client_abort: a client that leaves does not wait on
        w.sema:wait(math.max(0.001, w.deadline - now))
        w.taken = true
        if w.reservation then return w.reservation end
        FLOW.leave(w, "timeout")
        wake_now()
        local left = ngx.now()
        return nil, turned("queue_timeout", blocks, FLOW.wait_s(w.band, w.flow, blocks, left, free_blocks, running))
    end

    local function governed(req)
        local raw, err, decoded = read_body()
        if err then return err end
        local ok, body = pcall(parse_body, raw)
        if not ok then
            if getmetatable(body) == REFUSAL then return body end
            error(body, 0)
        end
        local doc = body.doc
        local model = val(doc, "model")
        if not is_str(model) then model = nil end
        local route = req.route
        if req.kind == "generate" and route == nil then
            route = route_for(req.path, model, req.groups)
            if route == nil then
                return refusal(404, "no_route", "no route of this gateway serves " .. req.path .. " for this model")
            end
        end
        if route ~= nil then ngx.ctx.kvtune_route = route.name end  -- the refusal log's route
        local asked
        ok, asked = pcall(read_request, req.api, body)
        if not ok then
            if getmetatable(asked) == REFUSAL then return asked end
            error(asked, 0)
        end
        local cap = asked.generates and cap_of(route, asked) or nil
        local too_big = never_fits(asked, cap)
        if too_big then return too_big end
        if HEALTH then  -- no replica to count it on or send it to: said before any count
            local down = none_up()
            if down then return down end
        end
        local tokens, exact, failed = count(asked, model and cjson.encode(model) or "null")
        if failed then return failed end
        local blocks, over, demand, ends = reservation(asked, cap, tokens, exact, route)
        if over then return over end
        local forwarded = raw
        if cap ~= nil then forwarded = rewrite(body, asked, cap) end
        if FLOW then
            local held, full = admit_in_turn(blocks, demand, route, ends)
            if full then return full end
            if held.upstream then ngx.var.kvtune_upstream = CONFIG.upstreams[held.upstream].name end
            -- Admitted: from here the log phase gives the blocks back, once.
            held.cap_header = cap
            ngx.ctx.kvtune = held
        else
            local full, entry, where = reserve(blocks, demand)
            if full then return full end
            if where then ngx.var.kvtune_upstream = CONFIG.upstreams[where].name end
            -- Admitted: from here the log phase gives the blocks back, once.
            ngx.ctx.kvtune = { blocks = blocks, cap_header = cap, entry = entry, upstream = where }
        end
        forward_body(forwarded, decoded, forwarded ~= raw)
        return nil
    end

    function M.access()
        ngx.ctx.kvtune_client_http = ngx.req.http_version()  -- see broken_status_line
        local req, refused = classify_request()
        if refused then return send(refused) end
        if req.kind == "passthrough" then
            -- forwarded untouched, but for a gzip or deflate body, which goes up decoded
            local encoding = content_encoding()
            if encoding == "gzip" or encoding == "deflate" then
                local raw, err, decoded = read_body()
                if err then return send(err) end
                forward_body(raw, decoded, false)
            end
            return
        end
        refused = governed(req)
        if refused then return send(refused) end
    end

    -- An upstream answer without a valid status line ("upstream sent no valid HTTP/1.0
    -- header"): nginx relays it as HTTP/0.9, the engine's raw bytes with no status and no
    -- headers of its own, so a client read them as an answer (a "Content-Length: 100" in them
    -- held it waiting). The Python gateway answers 502 upstream_broken; so does this, written
    -- in place of those bytes (body_filter) since nginx sends no status line of its own.
    local BROKEN_STATUS_LINE = error_body(502, "upstream_broken", "the upstream's answer is not HTTP")
    BROKEN_STATUS_LINE = "HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\nContent-Length: "
        .. #BROKEN_STATUS_LINE .. "\r\nConnection: close\r\n\r\n" .. BROKEN_STATUS_LINE

    local function broken_status_line()
        return ngx.req.http_version() == 0.9 and ngx.ctx.kvtune_client_http ~= 0.9
    end

    function M.headers()
        if broken_status_line() then
            ngx.ctx.kvtune_broken = true
            ngx.status = 502  -- for the log phase: passive health counts it as the failure it is
            return
        end
        local ctx = ngx.ctx.kvtune
        if ctx then
            if shows_detail() then ngx.header["X-Kvtune-Reserved-Blocks"] = format("%d", ctx.blocks) end
            if ctx.cap_header then ngx.header["X-Kvtune-Max-Tokens"] = format("%d", ctx.cap_header) end
            -- statistical: a single-sequence request answered with an event stream reports
            -- the tokens it streams (relay.py's progress)
            -- (flow control: the forecast reads them too)
            local entry = ctx.entry
            local content_type = ngx.header["Content-Type"]
            if ((entry and entry.next_mark) or (FLOW and ctx.single)) and type(content_type) == "string"
                    and find(content_type, "text/event-stream", 1, true) == 1 then
                ctx.events, ctx.newline = 0, false
            end
        end
    end

    local count_events = events.count_events

    function M.body()
        if ngx.ctx.kvtune_broken then  -- broken_status_line: the 502 instead of the raw bytes
            ngx.arg[1] = not ngx.ctx.kvtune_broken_sent and BROKEN_STATUS_LINE or ""
            ngx.ctx.kvtune_broken_sent = true
            ngx.arg[2] = true
            return
        end
        local ctx = ngx.ctx.kvtune
        if not ctx or not ctx.events then return end
        local chunk = ngx.arg[1]
        if chunk == nil or #chunk == 0 then return end
        ctx.events = ctx.events + count_events(ctx, chunk)
        local streamed = math.max(0, ctx.events - (CONFIG.statistical or CONFIG.flow).events_without_tokens)
        ctx.streamed = streamed
        if ctx.entry then STAT.progress(ctx.entry, streamed) end
    end

    -- The blocks of one admitted request back to the ledger (on the upstream they were reserved
    -- on), then whoever waits and now fits is served.
    local function give_back(held)
        ADMITTED[held] = nil
        local i = held.upstream
        if i then
            ledger:incr("held:" .. i, -held.blocks, 0)
            ledger:incr("reserved:" .. i, -held.blocks, 0)
            ledger:incr("inflight:" .. i, -1, 0)
        else
            ledger:incr("reserved", -held.blocks, 0)
        end
        ledger:incr("held", -held.blocks, 0)
        ledger:incr("inflight", -1, 0)
        note_release(held.blocks)
        if held.entry then STAT.release(held.entry) end
        wake_now()
    end

    -- Runs in the log phase, which nginx enters once per request, also after a client abort.
    function M.release()
        local waiter = ngx.ctx.kvtune_waiter
        if waiter and not waiter.taken then
            -- the client went away while it waited: out of the queue, or the reservation granted
            -- to it meanwhile given back, once
            waiter.taken = true
            if waiter.queued then
                FLOW.leave(waiter, "gone")
                wake_now()
            end
            if waiter.reservation then give_back(waiter.reservation) end
        end
        local ctx = ngx.ctx.kvtune
        if not ctx or ctx.released then return end
        ctx.released = true
        local i = ctx.upstream
        if i then
            -- passive health: nginx could not connect to it (502/504, no connect time); out
            -- first, so the blocks given back are not offered to it again (proxy.py)
            local status = ngx.var.upstream_status
            if (status == "502" or status == "504") and ngx.var.upstream_connect_time == "-" then
                mark_down(i, "cannot connect to the upstream (nginx answered " .. status .. ")")
            end
            local answered = tonumber(ngx.status) or 0
            if HEALTH and answered ~= 499 then  -- 499: the client left, nothing learnt
                record_outcome(i, answered >= 500, answered)
            end
        end
        give_back(ctx)
    end

    -- A client asking for one of the internal locations: the 404 of any path not served.
    function M.not_found()
        local path = ngx.var.uri
        ngx.status = 404
        ngx.header["Content-Type"] = "application/json; charset=utf-8"
        ngx.print(error_body(404, "not_found", path .. " is not served through this gateway"))
    end

    -- /healthz and /kvtune/ledger answer GET and HEAD; other methods are any unknown path's.
    local function read_only()
        local method = ngx.req.get_method()
        if method == "GET" or method == "HEAD" then return true end
        send(refusal(404, "not_found", ngx.var.uri .. " is not served through this gateway"))
        return false
    end

    function M.healthz()
        if not read_only() then return end
        ngx.header["Content-Type"] = "application/json; charset=utf-8"
        ngx.print('{"status": "ok"}')
    end

    -- cjson writes an empty table as {}: a list that may be empty is this marker until encoded.
    local EMPTY_ARRAY = "\1kvtune-empty-array\1"
    local function with_empty_arrays(text)
        return (text:gsub('"\\u0001kvtune%-empty%-array\\u0001"', "[]"))
    end
    -- /kvtune/ledger's "flow" member (docs/guides/flow-control.md), absent without flow control.
    local function flow_json()
        if not FLOW then return nil end
        local out = FLOW.snapshot()
        for _, b in ipairs(out.bands) do
            if #b.flows == 0 then b.flows = EMPTY_ARRAY end
        end
        return out
    end

    -- /metrics (flow control): the queue per band and flow, as Prometheus text.
    local function label(v) return (v:gsub("\\", "\\\\"):gsub('"', '\\"'):gsub("\n", "\\n")) end
    local function le(bound)
        if bound == floor(bound) then return format("%d.0", bound) end
        return format("%g", bound)
    end
    function M.metrics()
        if not read_only() then return end
        if CONFIG.metrics_access == "token" and not same_secret(ngx.var.http_authorization or "", ADMIN_TOKEN or "\0") then
            return ngx.exit(ngx.HTTP_FORBIDDEN)
        end
        local series = FLOW.series()
        local out = {}
        local function family(name, kind, help, each)  -- a counter's family is named without _total
            out[#out + 1] = "# HELP " .. name .. " " .. help
            out[#out + 1] = "# TYPE " .. name .. " " .. kind
            for _, x in ipairs(series) do each(x, format('band="%s",flow="%s"', label(x.band), label(x.flow))) end
        end
        family("kvtune_gateway_flow_waiting", "gauge", "Requests waiting in the flow-control queue.", function(x, l)
            out[#out + 1] = format("kvtune_gateway_flow_waiting{%s} %d", l, x.waiting)
        end)
        family("kvtune_gateway_flow_admitted", "counter", "Requests admitted, at once or after a wait.",
               function(x, l) out[#out + 1] = format("kvtune_gateway_flow_admitted_total{%s} %d", l, x.c.admitted) end)
        family("kvtune_gateway_flow_shed", "counter", "Requests answered 429 at arrival.", function(x, l)
            for _, reason in ipairs({ "deadline_unreachable", "queue_full" }) do
                out[#out + 1] = format('kvtune_gateway_flow_shed_total{%s,reason="%s"} %d', l, reason, x.c.shed[reason])
            end
        end)
        family("kvtune_gateway_flow_timed_out", "counter", "Waiters that reached their deadline.",
               function(x, l) out[#out + 1] = format("kvtune_gateway_flow_timed_out_total{%s} %d", l, x.c.timed_out) end)
        family("kvtune_gateway_flow_wait_seconds", "histogram", "Time admitted requests waited (0 when at once).",
               function(x, l)
            for i, bound in ipairs(flow_queue.WAIT_BUCKETS_S) do
                out[#out + 1] = format('kvtune_gateway_flow_wait_seconds_bucket{%s,le="%s"} %d', l, le(bound),
                                       x.c.wait_buckets[i])
            end
            out[#out + 1] = format('kvtune_gateway_flow_wait_seconds_bucket{%s,le="+Inf"} %d', l, x.c.wait_count)
            out[#out + 1] = format("kvtune_gateway_flow_wait_seconds_count{%s} %d", l, x.c.wait_count)
            out[#out + 1] = format("kvtune_gateway_flow_wait_seconds_sum{%s} %.17g", l, x.c.wait_sum)
        end)
        out[#out + 1] = "# HELP kvtune_gateway_flow_kept_blocks Blocks a band's requests leave free for the bands above it (its reserve)."
        out[#out + 1] = "# TYPE kvtune_gateway_flow_kept_blocks gauge"
        for i, b in ipairs(FLOW_CONFIG.bands) do
            out[#out + 1] = format('kvtune_gateway_flow_kept_blocks{band="%s"} %d', label(b.name), FLOW.kept(i))
        end
        ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
        ngx.print(concat(out, "\n"), "\n")
    end

    function M.ledger()
        if not read_only() then return end
        if CONFIG.ledger_access == "token" and not same_secret(ngx.var.http_authorization or "", ADMIN_TOKEN or "\0") then
            return ngx.exit(ngx.HTTP_FORBIDDEN)
        end
        local names = {}
        for i, r in ipairs(CONFIG.routes) do names[i] = r.name end
        ngx.header["Content-Type"] = "application/json; charset=utf-8"
        if CONFIG.upstreams then
            -- the totals count the budgets of the replicas in, and what is held on all of them
            local ups, budget, limit, any_up = {}, 0, 0, false
            for i, u in ipairs(CONFIG.upstreams) do
                local up = is_up(i)
                any_up = any_up or up
                ups[i] = { url = u.url, budget = u.block_budget, limit = u.admit_limit,
                           reserved = ledger:get("held:" .. i) or 0, inflight = ledger:get("inflight:" .. i) or 0,
                           healthy = probed_up(i), ejections = ledger:get("ejections:" .. i) or 0,
                           why = ledger:get("down:" .. i) or NULL,
                           ejected = ledger:get("ejected:" .. i) ~= nil,
                           passive_ejections = ledger:get("passive:" .. i) or 0,
                           ejection_s = ledger:get("ejection_s:" .. i) or 0 }
                if up then budget, limit = budget + u.block_budget, limit + u.admit_limit end
            end
            ngx.print(with_empty_arrays(cjson.encode({
                reserved = ledger:get("held") or 0, budget = budget, inflight = ledger:get("inflight") or 0,
                -- admin.py's EVERY_UPSTREAM_DOWN
                budget_note = not any_up and "every upstream is down (health check failed or connection refused): "
                    .. "no budget is usable until one answers its health check with 200" or NULL,
                rejected = ledger:get("rejected") or 0, waiting = FLOW and FLOW.waiting or 0,
                release_rate_blocks_per_s = release_rate(ngx.now()) or 0, routes = names,
                policy = CONFIG.policy, factor = CONFIG.policy == "overcommit" and CONFIG.factor or NULL,
                epsilon = NULL, limit = limit, overflow_probability = NULL, upstreams = ups,
                flow = flow_json(),
            })))
            return
        end
        ngx.print(with_empty_arrays(cjson.encode({
            reserved = ledger:get("held") or 0,
            budget = CONFIG.block_budget,
            budget_note = NULL,
            inflight = ledger:get("inflight") or 0,
            rejected = ledger:get("rejected") or 0,
            waiting = FLOW and FLOW.waiting or 0,
            flow = flow_json(),
            release_rate_blocks_per_s = release_rate(ngx.now()) or 0,
            routes = names,
            -- admin.py's ledger_policy
            policy = CONFIG.policy,
            factor = CONFIG.policy == "overcommit" and CONFIG.factor or NULL,
            epsilon = STAT and STAT.epsilon or NULL,
            limit = STAT and NULL or CONFIG.admit_limit,
            overflow_probability = STAT and STAT.overflow_probability(ledger:get("held") or 0) or NULL,
        })))
    end

    return M
end

return _M
