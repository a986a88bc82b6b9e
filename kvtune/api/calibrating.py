"""The door to `kvtune calibrate`: the KV capacity (and step time) a running engine really has."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtune.capacity.engine_logs import calibrate_engine
from kvtune.capacity.measured import MeasuredCapacity
from kvtune.capacity.measured import calibrate as calibrate_vllm
from kvtune.errors import OptionError

if TYPE_CHECKING:
    from kvtune.bench.timing import TimingProgress


async def calibrate(
    url: str | None,
    engine: str = "vllm",
    *,
    engine_log: str | None = None,
    timeout_s: float = 10.0,
    timing: bool = False,
    timing_budget_s: float | None = None,
    max_num_batched_tokens: int | None = None,
    progress: TimingProgress | None = None,
) -> MeasuredCapacity:
    """The KV capacity a running engine really has (vLLM's /v1/models and /metrics, SGLang's
    /server_info, or a startup log `engine_log`, cross-checked against the server when both are
    given): what `kvtune calibrate` saves for `--capacity FILE`. With `timing` (vLLM only) it
    also sends bounded sweeps of requests for `timing_budget_s` (default 300) and fits the step
    time simulate uses; `progress` hears each sweep.

    >>> measured = asyncio.run(kvtune.calibrate("http://127.0.0.1:8000"))   # doctest: +SKIP
    >>> measured.num_blocks, measured.block_size                            # doctest: +SKIP
    (27153, 16)
    """
    if engine != "vllm":
        if timing:
            raise OptionError("measures vLLM only; leave --engine at vllm", field="timing")
        _refuse_timing_options(timing_budget_s, max_num_batched_tokens)
        return await calibrate_engine(engine, url, engine_log=engine_log, timeout_s=timeout_s)
    if timing:
        if url is None:
            raise OptionError("needs the server's URL: it sends requests to measure step times", field="timing")
        from kvtune.bench.timing import calibrate_timing  # orjson, logging: only for the sweeps

        budget = {} if timing_budget_s is None else {"budget_s": timing_budget_s}
        return await calibrate_timing(url, vllm_log=engine_log, timeout_s=timeout_s, **budget,
                                      max_num_batched_tokens=max_num_batched_tokens, progress=progress)
    _refuse_timing_options(timing_budget_s, max_num_batched_tokens)
    return await calibrate_vllm(url, vllm_log=engine_log, timeout_s=timeout_s)


def _refuse_timing_options(timing_budget_s: float | None, max_num_batched_tokens: int | None) -> None:
    for name, value in (("timing_budget_s", timing_budget_s), ("max_num_batched_tokens", max_num_batched_tokens)):
        if value is not None:
            raise OptionError("only applies with --timing", field=name)
