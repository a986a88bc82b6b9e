"""The profile's map step as Ray tasks: the tasks local workers run (`kvtune.profile.parallel`),
on a Ray cluster.

`ray` is an optional extra (`pip install 'kvtune[ray]'`), imported only here and only when asked
for. Each task reads its own part where it runs, so on a cluster of several machines the inputs
are object-store URLs (a local path is read from the worker's own disk). A task whose worker dies
(a killed process, a lost node) is run again by Ray, up to TASK_RETRIES times; a task that fails
on its input is not, and its error (file, line, field) is raised here as a single process raises
it: the first failure in input order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtune.errors import EndpointError, KvtuneError, OptionError
from kvtune.profile.parallel import Task, in_process, merge_parts, parallel_safe, profile_part, split
from kvtune.profile.routes import Profile

if TYPE_CHECKING:  # pragma: no cover
    from kvtune.ingest import IngestOptions
    from kvtune.ingest.plan import FilePlan

__all__ = ["TASK_RETRIES", "check_address", "profile_on_ray", "run_on_ray"]

#: Times Ray runs a task again when its worker process or node dies (not when its input is bad).
TASK_RETRIES = 3

#: Seconds to wait for a Ray head's port to accept a connection before saying it is not there.
CONNECT_TIMEOUT_S = 5.0

#: What `ray.init(address=…)` takes: auto, local, host:port, ray://host:port.
_ADDRESS = re.compile(r"^(?:auto|local|(?:ray://)?(?P<host>[\w.\-\[\]:]+):(?P<port>\d{1,5}))$")


def check_address(address: str) -> str:
    """A --ray value as Ray takes it ("" for a new local cluster); anything else, such as a log
    path swallowed as the option's value (`--ray logs/`), is an OptionError saying so."""
    if address == "" or _ADDRESS.match(address):
        return address
    if os.path.exists(address):
        raise OptionError(f"{address!r} was read as the Ray address: put the log paths before --ray, or write "
                          "--ray=ADDRESS", field="--ray")
    raise OptionError(f"not a Ray address: {address!r} (auto, local, HOST:PORT or ray://HOST:PORT)", field="--ray")


def profile_on_ray(paths: Sequence[str], options: IngestOptions, *, address: str,
                   progress: Callable[[int, int], None] | None = None, max_routes: int | None) -> Profile:
    """Profile logs with the map step as Ray tasks on the cluster at `address` ("" starts a local
    one); the same bytes as one process."""
    from kvtune.ingest.readers import plan_logs  # pyarrow, only when logs are read

    plans, pruned, skipped = plan_logs(paths, options)
    if not plans:  # every file excluded or kvtune's own: nothing for the cluster to read
        return in_process(plans, pruned, skipped, options, progress, max_routes)
    if not parallel_safe(plans):
        raise OptionError("an input holds Batch API input files or memory:// files, which are read in one "
                          "process: drop --ray", field="--ray")
    tasks, parts = run_on_ray(plans, options, address, progress)
    return merge_parts(tasks, parts, len(pruned), skipped, options, max_routes)


def run_on_ray(plans: Sequence[FilePlan], options: IngestOptions, address: str,
               progress: Callable[[int, int], None] | None) -> tuple[list[Task], list[Profile]]:
    """(the tasks, their parts in task order): the plans cut into tasks for the cluster's CPUs and
    run there. Joins the cluster at `address` ("" starts a local one, stopped afterwards)."""
    ray = _import_ray()
    # Ray's driver prints what the cluster reports (a worker died, a task is retried) to stdout,
    # which is where `--json` goes: while Ray runs here, stdout is stderr.
    with contextlib.redirect_stdout(sys.stderr):
        return _run(ray, plans, options, address, progress)


def _run(ray: Any, plans: Sequence[FilePlan], options: IngestOptions, address: str,
         progress: Callable[[int, int], None] | None) -> tuple[list[Task], list[Profile]]:
    started = not ray.is_initialized()
    if started:
        _reachable(address)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        try:
            ray.init(address=address or None, logging_level=logging.WARNING, log_to_driver=False,
                     include_dashboard=False, configure_logging=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise EndpointError(f"cannot join the Ray cluster at {address or 'a new local cluster'}: {exc}",
                                field="--ray") from exc
    try:
        cpus = max(int(ray.cluster_resources().get("CPU", 1)), 1)
        tasks = split(plans, cpus)
        remote = ray.remote(profile_part).options(num_cpus=1, max_retries=TASK_RETRIES, retry_exceptions=False)
        shared_options = ray.put(options)
        refs = [remote.remote(task, shared_options) for task in tasks]
        return tasks, _gather(ray, refs, tasks, progress)
    finally:
        if started:
            ray.shutdown()


def _gather(ray: Any, refs: list[Any], tasks: Sequence[Task],
            progress: Callable[[int, int], None] | None) -> list[Profile]:
    """The results in task order as they finish; the first failure in task order raises (its
    KvtuneError as such: the bad file and line), and the tasks still running are cancelled."""
    total = sum(t.weight for t in tasks) or 1
    weight = {ref: task.weight for ref, task in zip(refs, tasks, strict=True)}
    ready: set[Any] = set()
    pending = list(refs)
    parts: list[Profile] = []
    done = 0
    while len(parts) < len(refs):
        if pending:
            finished, pending = ray.wait(pending, num_returns=1)
            ready.update(finished)
            done += sum(weight[r] for r in finished)
            if progress is not None:
                progress(min(done, total), total)
        while len(parts) < len(refs) and refs[len(parts)] in ready:
            try:
                parts.append(ray.get(refs[len(parts)]))
            except ray.exceptions.RayTaskError as exc:
                for ref in pending:
                    ray.cancel(ref, force=True)
                cause = getattr(exc, "cause", None)
                if isinstance(cause, KvtuneError):
                    raise cause from None
                raise
            except ray.exceptions.RayError as exc:  # the task's worker or node died TASK_RETRIES + 1 times
                for ref in pending:
                    ray.cancel(ref, force=True)
                task = tasks[len(parts)]
                raise EndpointError(f"Ray could not run the task reading {task.plan.path} ({type(exc).__name__}, "
                                    f"after {TASK_RETRIES} retries)", field="--ray") from exc
    return parts


def _reachable(address: str) -> None:
    """Fail at once on a HOST:PORT nothing listens on: Ray itself retries a missing head node for
    about a minute before it gives up."""
    import socket

    match = _ADDRESS.match(address)
    if match is None or match["host"] is None:  # "", auto, local: Ray's own discovery
        return
    host, port = match["host"].strip("[]"), int(match["port"])
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise EndpointError(f"cannot join the Ray cluster at {address}: {exc.strerror or exc}", field="--ray") from None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise OptionError("--ray needs Ray: pip install 'kvtune[ray]'", field="--ray") from None
    return ray
