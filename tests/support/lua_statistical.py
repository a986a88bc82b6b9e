"""The rendered nginx.conf's statistical ledger (its Lua module, kvtune/statistical.lua) run by LuaJIT
in this process through ctypes, without nginx: test_lua_statistical.py drives it and the Python
StatisticalLedger through the same scripted operations and compares every decision.

    LuaLedger(budget, block_size, max_model_len, epsilon).run(ops) -> list of results
ops: ("admit", blocks, demand | None) (also "admit_quiet": no result), ("progress", i, tokens), ("release", i), ("never", blocks,
demand), ("probability",); i is the index of an earlier admit. A demand is (prompts, cap,
(lengths, counts) | None). Results: admit -> [admitted, probability after], never -> [bool],
probability -> [p].
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from kvtune.deploy.filters import lua_string
from kvtune.deploy.render import LUA_DIR

# package.path that finds the gateway's modules (require "kvtune.statistical"), as nginx.conf's
# lua_package_path finds them under its prefix.
PACKAGE_PATH = f"package.path = {str(LUA_DIR / '?.lua')!r} .. ';' .. package.path"


def luajit() -> ctypes.CDLL | None:
    for name in ("libluajit-5.1.so.2", ctypes.util.find_library("luajit-5.1")):
        if name:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            lib.luaL_newstate.restype = ctypes.c_void_p
            lib.luaL_openlibs.argtypes = [ctypes.c_void_p]
            lib.luaL_loadstring.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.lua_pcall.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.lua_tolstring.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            lib.lua_tolstring.restype = ctypes.c_char_p
            lib.lua_close.argtypes = [ctypes.c_void_p]
            return lib
    return None


def _demand(demand: Any) -> str:
    if demand is None:
        return "nil"
    prompts, cap, law = demand
    law_text = "nil" if law is None else f"{{ lengths = {lua_string(list(law[0]))}, counts = {lua_string(list(law[1]))} }}"
    return f"{{ prompts = {lua_string(list(prompts))}, cap = {cap}, law = {law_text} }}"


class LuaLedger:
    def __init__(self, budget: int, block_size: int, max_model_len: int, epsilon: float) -> None:
        from kvtune.gateway import overflow, relay, statistical

        self.config = (
            f"{{ block_budget = {budget}, block_size = {block_size}, statistical = {{ epsilon = {epsilon!r}, "
            f"thetas = {lua_string(list(overflow.THETAS))}, "
            f"edges = {lua_string([list(e) for e in overflow.interval_edges(max_model_len)])}, "
            f"exact_work = {overflow.EXACT_WORK}, first_mark = {overflow.FIRST_MARK}, "
            f"resum_every = {statistical.RESUM_EVERY}, events_without_tokens = {relay.EVENTS_WITHOUT_TOKENS} }} }}")

    def run(self, ops: list[tuple]) -> list[list[Any]]:
        lines = []
        for op in ops:
            kind = op[0]
            if kind == "admit":
                lines.append(f"admit({op[1]}, {_demand(op[2])})")
            elif kind == "admit_quiet":  # the decision only, as nginx makes it (for timing)
                lines.append(f"entries[#entries + 1] = STAT.try_reserve({op[1]}, {_demand(op[2])}, 0) or false")
            elif kind == "never":
                lines.append(f"out[#out + 1] = STAT.never_fits({op[1]}, {_demand(op[2])}) and '1' or '0'")
            elif kind == "progress":
                lines.append(f"if entries[{op[1] + 1}] then STAT.progress(entries[{op[1] + 1}], {op[2]}) end")
            elif kind == "release":
                lines.append(f"if entries[{op[1] + 1}] then STAT.release(entries[{op[1] + 1}]) end")
            elif kind == "probability":
                lines.append("out[#out + 1] = string.format('%.17g', STAT.overflow_probability(0))")
        chunk = "\n".join([
            PACKAGE_PATH,
            f"local CONFIG = {self.config}",
            "local STAT = require('kvtune.statistical').new(CONFIG)",
            "local out, entries = {}, {}",
            "local function admit(blocks, demand)",
            "  local e = STAT.try_reserve(blocks, demand, 0)",
            "  entries[#entries + 1] = e or false",
            "  out[#out + 1] = (e and '1' or '0') .. ' ' .. string.format('%.17g', STAT.overflow_probability(0))",
            "end",
            *lines,
            "return table.concat(out, '\\n')",
        ])
        lib = luajit()
        assert lib is not None
        state = lib.luaL_newstate()
        try:
            lib.luaL_openlibs(state)
            if lib.luaL_loadstring(state, chunk.encode()) != 0 or lib.lua_pcall(state, 0, 1, 0) != 0:
                raise RuntimeError(lib.lua_tolstring(state, -1, None).decode())
            text = lib.lua_tolstring(state, -1, None).decode()
        finally:
            lib.lua_close(state)
        results: list[list[Any]] = []
        it = iter(text.split("\n") if text else [])
        for op in ops:
            if op[0] == "admit":
                admitted, p = next(it).split()
                results.append([admitted == "1", float(p)])
            elif op[0] == "never":
                results.append([next(it) == "1"])
            elif op[0] == "probability":
                results.append([float(next(it))])
        return results


BC_PATH = "/usr/share/luajit-2.1.0-beta3/?.lua"


def globals_used(source: str) -> tuple[set[str], set[str]]:
    """The global names a Lua chunk (and every function in it) reads and writes, from LuaJIT's
    own bytecode listing (jit.bc): a misspelt or not-yet-declared local shows up here."""
    lib = luajit()
    assert lib is not None
    lib.lua_pushlstring.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.lua_setfield.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
    state = lib.luaL_newstate()
    driver = (f"package.path = {BC_PATH!r} .. ';' .. package.path\n"
              "local bc = require 'jit.bc'\n"
              "local f = assert(loadstring(SRC, 'nginx.conf'))\n"
              "local out = {}\n"
              "bc.dump(f, { write = function(_, s) out[#out + 1] = s end, close = function() end, flush = function() end }, true)\n"
              "return table.concat(out)\n")
    try:
        lib.luaL_openlibs(state)
        data = source.encode()
        lib.lua_pushlstring(state, data, len(data))
        lib.lua_setfield(state, -10002, b"SRC")  # LUA_GLOBALSINDEX
        if lib.luaL_loadstring(state, driver.encode()) != 0 or lib.lua_pcall(state, 0, 1, 0) != 0:
            raise RuntimeError(lib.lua_tolstring(state, -1, None).decode())
        listing = lib.lua_tolstring(state, -1, None).decode("latin-1")
    finally:
        lib.lua_close(state)
    import re

    reads = set(re.findall(r'\bGGET\b.*; "([^"]*)"', listing))
    writes = set(re.findall(r'\bGSET\b.*; "([^"]*)"', listing))
    return reads, writes
