-- luacheck for kvtune's nginx gateway (kvtune/deploy/lua): LuaJIT under lua-nginx-module, whose
-- ngx global (ngx.status, ngx.header, ngx.ctx, ngx.var, ngx.arg are written per request) is the
-- only one the modules use; the busted specs also see busted's names.
std = "ngx_lua"
max_line_length = 150
files["tests/lua"] = { std = "+busted" }
