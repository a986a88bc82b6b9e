"""The rendered nginx.conf's statistical ledger, decision for decision against the Python one.

The Lua module kvtune/statistical.lua (tests/support/lua_statistical.py runs it in LuaJIT through ctypes, no
nginx needed) and kvtune.gateway.statistical.StatisticalLedger go through the same random scripts of
admissions, progress reports, releases and 413 checks, over budgets, block sizes, contexts, laws
and epsilons that reach both the exact convolution and the Chernoff bound: every decision must be
the same and every overflow probability equal to 1e-9 relative. The enforcers themselves, on a
real nginx, are compared in test_enforcer_parity.py."""

from __future__ import annotations

import math
import random

import pytest
from lua_statistical import LuaLedger, luajit

from kvtune.domain.demand import Demand
from kvtune.domain.output_law import OutputLaw
from kvtune.gateway.overflow import EXACT_WORK, exact_is_cheap, interval_edges
from kvtune.gateway.statistical import StatisticalLedger
from kvtune.policy.recommendation import read_recommendation


@pytest.fixture(scope="module", autouse=True)
def _needs_luajit():
    if luajit() is None:
        pytest.fail("LuaJIT (libluajit-5.1.so.2, installed with nginx's Lua module) is required: "
                    "apt-get install -y libnginx-mod-http-lua")


def _blocks(prompts, cap, block_size) -> int:
    return sum(-(-(p + cap) // block_size) for p in prompts)


def _python(budget, block_size, max_model_len, epsilon, ops):
    ledger = StatisticalLedger(budget, epsilon=epsilon, block_size=block_size, max_model_len=max_model_len)

    def demand(d):
        if d is None:
            return None
        prompts, cap, law = d
        return Demand(tuple(prompts), cap, None if law is None else OutputLaw(tuple(law[0]), tuple(law[1])))

    out, entries = [], []
    for op in ops:
        if op[0] == "admit":
            r = ledger.try_reserve(op[1], demand(op[2]))
            entries.append(r)
            out.append([r is not None, ledger.overflow_probability()])
            if r is not None:
                assert ledger.last_admitted_probability <= epsilon
        elif op[0] == "never":
            out.append([ledger.never_fits(op[1], demand(op[2]))])
        elif op[0] == "progress" and entries[op[1]] is not None:
            entries[op[1]].progress(op[2])
        elif op[0] == "release" and entries[op[1]] is not None:
            entries[op[1]].release()
        elif op[0] == "probability":
            out.append([ledger.overflow_probability()])
    return out


def _law(rng: random.Random, max_model_len: int):
    if rng.random() < 0.15:
        return None
    bins = rng.randint(1, 12)
    lengths = sorted(rng.sample(range(1, max_model_len + 1), min(bins, max_model_len)))
    counts = [rng.choice([0, 1, 3, 10, 50, 200]) for _ in lengths]
    if sum(counts) == 0:
        counts[-1] = 1
    return lengths, counts


def _script(seed: int):
    rng = random.Random(seed)
    budget = rng.choice([8, 40, 100, 400, 3000])
    block_size = rng.choice([1, 4, 16])
    max_model_len = rng.choice([64, 300, 2048, 8192])
    epsilon = rng.choice([0.0, 1e-6, 1e-3, 0.02, 0.3])
    laws = [_law(rng, max_model_len) for _ in range(3)]
    ops: list[tuple] = []
    admits: list[int] = []
    streamed: dict[int, int] = {}
    for _ in range(rng.randint(20, 80)):
        roll = rng.random()
        if roll < 0.6 or not admits:
            if rng.random() < 0.1:
                d, blocks = None, rng.randint(1, max(1, budget // 2))
            else:
                room = max(2, min(max_model_len, budget * block_size // rng.choice([1, 2, 4, 8])))  # tokens
                cap = rng.randint(1, room // 2)
                prompts = [rng.randint(0, room - cap) for _ in range(rng.choice([1, 1, 1, 2]))]
                prompts *= rng.choice([1, 1, 2])
                d = (prompts, cap, rng.choice(laws))
                blocks = max(1, _blocks(prompts, cap, block_size))
            ops.append(("never" if rng.random() < 0.1 else "admit", blocks, d))
            if ops[-1][0] == "admit":
                admits.append(len(admits))
        elif roll < 0.8:
            i = rng.choice(admits)
            streamed[i] = streamed.get(i, 0) + rng.choice([1, 5, 16, 40, 200])
            ops.append(("progress", i, streamed[i]))
        elif roll < 0.95:
            ops.append(("release", rng.choice(admits)))
        else:
            ops.append(("probability",))
    return (budget, block_size, max_model_len, epsilon), ops


def _close(a: float, b: float) -> bool:
    # Python convolves by FFT (exact up to ~1e-15 of rounding), the Lua directly: 1e-9 relative,
    # or 1e-12 absolute for probabilities next to 0
    return abs(a - b) <= max(1e-9 * max(abs(a), abs(b)), 1e-12)


@pytest.mark.parametrize("seed", range(100))
def test_lua_ledger_decides_as_the_python_ledger(seed):
    params, ops = _script(seed)
    expected = _python(*params, ops)
    got = LuaLedger(*params).run(ops)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if isinstance(e[0], float):  # a probability
            assert _close(g[0], e[0]), (i, params, g, e)
            continue
        assert g[0] == e[0], (i, params, g, e)  # admitted, or never fits
        if len(e) > 1:
            assert _close(g[1], e[1]), (i, params, g, e)


def test_the_scripts_reach_both_the_exact_and_the_chernoff_bound():
    """The seeds above are not all of one kind: some evaluations convolve, some bound."""
    kinds = set()
    for seed in range(100):
        (budget, block_size, max_model_len, _), ops = _script(seed)
        rows = len(interval_edges(max_model_len)) + 1
        units = sum(min(_blocks(d[0], d[1], block_size), budget + 1) + 1 for op in ops
                    if op[0] == "admit" and (d := op[2]) is not None)
        kinds.add(exact_is_cheap(units, budget, rows))
    assert kinds == {True, False}, EXACT_WORK


def test_many_held_sequences_stay_equal_over_a_long_run():
    """1,500 admissions and releases on a 3,000-block budget (the Chernoff bound, with its running
    sums resummed every 1,024 removals): the Lua and Python probabilities never drift apart."""
    rng = random.Random(7)
    law = ([16, 64, 256, 1024], [50, 30, 15, 5])
    ops: list[tuple] = []
    live: list[int] = []
    n = 0
    for _ in range(1500):
        if live and (len(live) > 60 or rng.random() < 0.45):
            ops.append(("release", live.pop(rng.randrange(len(live)))))
        else:
            prompt = rng.randint(10, 900)
            ops.append(("admit", math.ceil((prompt + 1024) / 16), ([prompt], 1024, law)))
            live.append(n)
            n += 1
            if rng.random() < 0.3:
                ops.append(("progress", n - 1, rng.choice([16, 40, 100])))
    params = (3000, 16, 4096, 1e-3)
    expected = _python(*params, ops)
    got = LuaLedger(*params).run(ops)
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(_close(g[1], e[1]) for g, e in zip(got, expected, strict=True))
    assert sum(e[0] for e in expected) > 500


LUA_GLOBALS = {"ngx", "require", "ipairs", "pairs", "next", "type", "tostring", "tonumber", "error", "pcall",
               "select", "setmetatable", "getmetatable", "string", "table", "math", "os", "io", "bit", "unpack",
               "package"}


@pytest.mark.parametrize("admission", [{"policy": "guaranteed"}, {"policy": "statistical", "epsilon": 0.01}])
def test_the_rendered_lua_reads_no_stray_globals(admission):
    """Every name the Lua reads is a local or one of Lua's and nginx's own: a local used before
    its declaration (a nil global at run time) fails here, not in production. nginx.conf's own
    Lua (the data and the wiring) and each module it loads."""
    import json
    from pathlib import Path

    from lua_statistical import globals_used

    from kvtune.deploy.render import lua_modules, render_files

    doc = json.loads((Path(__file__).parents[1] / "data" / "recommendation.json").read_text(encoding="utf-8"))
    doc["admission"] = admission
    conf = render_files(read_recommendation(doc), targets=["nginx.conf"])["nginx.conf"]
    start = conf.index("init_by_lua_block {") + len("init_by_lua_block {")
    end = conf.index('.new(CONFIG, POLICY)') + len('.new(CONFIG, POLICY)')
    chunks = {"nginx.conf": conf[start:end], **lua_modules()}
    assert set(chunks) > {"nginx.conf", "lua/kvtune/gateway.lua", "lua/kvtune/statistical.lua"}
    for name, chunk in chunks.items():
        reads, writes = globals_used(chunk)
        assert reads <= LUA_GLOBALS, (name, reads - LUA_GLOBALS)
        assert writes == set(), name


def test_streamed_events_are_counted_over_the_whole_stream_however_it_is_chunked():
    """relay.EventCounter (and the body filter's count, its Lua twin) count b"\\n\\n" as the whole
    stream holds them, also when a chunk ends between the two newlines."""
    from kvtune.gateway.relay import EventCounter

    rng = random.Random(3)
    for _ in range(2000):
        stream = bytes(rng.choice(b"ab\n") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(0, 6))))
        counter, start, seen = EventCounter(), 0, 0
        for cut in [*cuts, len(stream)]:
            seen = counter.add(stream[start:cut])
            start = cut
        assert seen == stream.count(b"\n\n"), (stream, cuts)
    assert EventCounter().add(b"data: x\n") == 0
    counter = EventCounter()
    assert (counter.add(b"data: x\n"), counter.add(b"\ndata: y\n\n")) == (0, 2)


def test_the_body_filter_counts_events_as_the_relay_does():
    """The body filter's count_events (kvtune/events.lua), run by LuaJIT, against
    relay.EventCounter over random streams and chunkings."""
    from lua_statistical import PACKAGE_PATH

    from kvtune.gateway.relay import EventCounter

    rng = random.Random(5)
    cases, expected = [], []
    for _ in range(300):
        stream = bytes(rng.choice(b"ab\n") for _ in range(rng.randint(1, 30)))
        cuts = sorted(set(rng.sample(range(1, len(stream) + 1), min(len(stream), rng.randint(1, 5)))) | {len(stream)})
        chunks, start = [], 0
        for cut in cuts:
            chunks.append(stream[start:cut])
            start = cut
        counter = EventCounter()
        expected.append([counter.add(c) for c in chunks])
        cases.append("{" + ", ".join('"' + "".join(f"\\{b}" for b in c) + '"' for c in chunks) + "}")
    chunk = "\n".join([
        PACKAGE_PATH,
        "local count_events = require('kvtune.events').count_events",
        "local out = {}",
        f"for _, chunks in ipairs({{ {', '.join(cases)} }}) do",
        "  local ctx, n, seen = { newline = false }, 0, {}",
        "  for _, c in ipairs(chunks) do n = n + count_events(ctx, c); seen[#seen + 1] = n end",
        "  out[#out + 1] = table.concat(seen, ',')",
        "end",
        "return table.concat(out, ';')",
    ])
    lib = luajit()
    state = lib.luaL_newstate()
    try:
        lib.luaL_openlibs(state)
        assert lib.luaL_loadstring(state, chunk.encode()) == 0 and lib.lua_pcall(state, 0, 1, 0) == 0, \
            lib.lua_tolstring(state, -1, None)
        got = lib.lua_tolstring(state, -1, None).decode()
    finally:
        lib.lua_close(state)
    assert got == ";".join(",".join(map(str, e)) for e in expected)
