"""The door to `kvtune profile`: logs read into per-route histograms (kvtune.profile), and a
profile saved by `kvtune profile --save` read back strictly."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from kvtune.domain.log_reading import LogReading
from kvtune.ingest import options_for
from kvtune.profile.build import is_saved_profile, save_profile
from kvtune.profile.build import load_profile as load_saved_profile
from kvtune.profile.logs import load_profile_or_logs
from kvtune.profile.logs import profile_logs as read_logs
from kvtune.profile.routes import Profile, fold_routes
from kvtune.profile.routes import merge_profiles as merge


def profile_logs(
    paths: Sequence[str | os.PathLike[str]],
    reading: LogReading | None = None,
    *,
    progress: Callable | None = None,
    workers: int | None = 1,
    ray_address: str | None = None,
    trace_max_is_cap: bool = False,
) -> Profile:
    """Per-route exact histograms of output and prompt tokens from log files, directories or
    globs (or one saved profile, which is loaded), read as `reading` says (kvtune.LogReading:
    format, field mapping, what names a route, bad rows, routes folded past `max_routes`, files
    excluded). `workers` processes read the logs (None: one per 2 cores for a big input; call
    it under `if __name__ == "__main__":`, as multiprocessing needs), or Ray tasks at
    `ray_address` ("" a local cluster): the same profile either way. Files matching an `exclude`
    glob (relative path or base name) and files kvtune wrote are not read
    (`Profile.skipped_files`, `Profile.notes`); logs without one usable row raise InputError.
    `trace_max_is_cap`: the largest output in the logs is taken as their cap (they are read twice;
    kvtune.profile.logs.profile_logs).

    >>> profile = kvtune.profile_logs(["sample_logs/"], kvtune.LogReading(route_by="model"))
    >>> [(r.route, r.output.quantile(0.99).value_tokens) for r in profile.routes][:1]  # doctest: +SKIP
    [('meta-llama/Llama-3.1-8B-Instruct', 2474)]
    """
    r = reading or LogReading()
    files = [os.fspath(p) for p in paths]
    if trace_max_is_cap:  # logs only: a saved profile holds no rows to read again
        return read_logs(files, options_for(r), progress=progress, trace_max_is_cap=True, max_routes=r.max_routes,
                         workers=workers, ray_address=ray_address)
    return load_profile_or_logs(files, options_for(r), progress=progress, max_routes=r.max_routes,
                                workers=workers, ray_address=ray_address)


def load_profile(path: str | os.PathLike[str], *, max_routes: int | None = None) -> Profile:
    """A profile saved by `kvtune profile --save` (strict: a damaged file names its field), its
    routes beyond `max_routes` (the least busy) folded into `*` (None: as saved).

    >>> profile = kvtune.load_profile("profile.json")          # doctest: +SKIP
    >>> profile.requests                                        # doctest: +SKIP
    12000
    """
    return fold_routes(load_saved_profile(path), max_routes)


def merge_profiles(profiles: Sequence[Profile], *, max_routes: int | None = None) -> Profile:
    """Profiles (of logs, or saved ones) merged exactly, as if their logs had been read together,
    the routes beyond `max_routes` (the least busy) folded into `*` (None: every route kept):
    what `kvtune profile --merge` prints.

    >>> week = kvtune.merge_profiles([kvtune.load_profile(p) for p in ("mon.json", "tue.json")])  # doctest: +SKIP
    """
    return fold_routes(merge(profiles), max_routes)


__all__ = ["profile_logs", "load_profile", "is_saved_profile", "merge_profiles", "save_profile"]
