"""RefusalLog (kvtune.gateway.refusals): refusals counted per reason and route, one line each per
window, whatever the rate; every refusal in exactly one line."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.gateway.refusals import Reason, RefusalLog, Rejection

LINE = re.compile(r"^refused (\d+) in (\d+\.\d) s: (\S+) route=(\S+) status=(\d+) (.*)$")
FULL = Rejection(429, Reason.KV_BUDGET_EXHAUSTED, "KV budget full", retry_after_s=1, blocks=(34, 12))
SLOW = Rejection(408, Reason.BODY_TIMEOUT, "the body did not arrive within 30 s")


def test_a_burst_is_one_line_per_reason_and_route_per_second():
    log = RefusalLog()
    lines = []
    for i in range(1000):  # 1,000 refusals over 2.5 s
        t = i * 0.0025
        lines += log.record("/v1/chat/completions", FULL, t)
        if i % 100 == 0:
            lines += log.record("", SLOW, t)
    lines += log.flush(2.5)
    assert lines == [
        "refused 400 in 1.0 s: kv_budget_exhausted route=/v1/chat/completions status=429 needed 34 blocks, 12 free "
        "(last)",
        "refused 4 in 1.0 s: body_timeout route=- status=408 last: the body did not arrive within 30 s",
        "refused 400 in 1.0 s: kv_budget_exhausted route=/v1/chat/completions status=429 needed 34 blocks, 12 free "
        "(last)",
        "refused 4 in 1.0 s: body_timeout route=- status=408 last: the body did not arrive within 30 s",
        "refused 200 in 0.5 s: kv_budget_exhausted route=/v1/chat/completions status=429 needed 34 blocks, 12 free "
        "(last)",
        "refused 2 in 0.5 s: body_timeout route=- status=408 last: the body did not arrive within 30 s",
    ]
    assert log.flush(3.0) == [] and not log.due(10.0)


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0, 2.5), max_size=300), routes=st.lists(st.sampled_from(["a", "b", ""]), min_size=1))
def test_every_refusal_is_counted_once_and_lines_stay_few(gaps, routes):
    log, lines, now = RefusalLog(), [], 0.0
    for i, gap in enumerate(gaps):
        now += gap
        if log.due(now) and i % 3 == 0:  # the timer, sometimes before the next refusal
            lines += log.flush(now)
        lines += log.record(routes[i % len(routes)], FULL, now)
    lines += log.flush(now + 1)
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed) and sum(int(m.group(1)) for m in parsed if m) == len(gaps)
    assert len(lines) <= 3 * (now + 2)  # at most one line per route per window of one second
