"""Logs → a profile: in this process, in local worker processes (`parallel`) or as Ray tasks
(`on_ray`), all three giving the same bytes; or a saved profile loaded instead of logs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtune.errors import InputError
from kvtune.ingest import IngestOptions, read_logs
from kvtune.profile.build import (
    MAX_ROUTES,
    PREFETCH_BATCHES,
    ProgressCallback,
    is_saved_profile,
    load_profile,
    profile_read,
)
from kvtune.profile.logged_model import one_logged_model
from kvtune.profile.parallel import profile_parallel
from kvtune.profile.routes import Profile, fold_routes

if TYPE_CHECKING:  # pragma: no cover
    from kvtune.ingest import IngestOptions

__all__ = ["profile_logs", "load_profile_or_logs", "require_rows"]

#: Inputs and skip reasons named in the one-line error for logs without a usable row.
_SHOWN = 3


def profile_logs(
    paths: Sequence[str],
    options: IngestOptions,
    *,
    progress: ProgressCallback | None = None,
    trace_max_is_cap: bool = False,
    max_routes: int | None = MAX_ROUTES,
    workers: int | None = 1,
    ray_address: str | None = None,
) -> Profile:
    """Read logs through `kvtune.ingest` and profile them; skipped rows are kept in the profile.

    trace_max_is_cap: for traces without finish reasons whose largest output is a generation
    cap (Mooncake conversation: 30 rows at exactly 2000), read twice: once to find the largest
    output, then with outputs at that value treated as cut (ingest's assume_cap).
    max_routes: the busiest routes kept; the others fold into `*` (None keeps every route).
    workers: processes for the map step (None: every core when the input pays for it);
    ray_address: run it as Ray tasks instead ("" starts a local cluster). Either way the profile
    is the one a single process builds (`kvtune.profile.parallel`). Logs without one usable row
    are an InputError (`require_rows`): CI must not pass on an empty profile.
    """

    def once(opts: IngestOptions) -> Profile:
        if ray_address is not None:
            from kvtune.profile.on_ray import profile_on_ray  # logging (Ray's), only on a cluster

            return profile_on_ray(paths, opts, address=ray_address, progress=progress, max_routes=max_routes)
        if workers == 1:
            return _profile_once(paths, opts, progress, max_routes)

        return profile_parallel(paths, opts, workers=workers, progress=progress, max_routes=max_routes)

    profile = require_rows(once(options), paths)
    if trace_max_is_cap and profile.routes:
        import dataclasses

        top = max(r.output.observed.max or 0 for r in profile.routes)
        if top > 0:
            profile = once(dataclasses.replace(options, assume_cap=top))
    return profile


def require_rows(profile: Profile, paths: Sequence[str]) -> Profile:
    """The profile, if its logs gave at least one usable row; otherwise one InputError naming the
    inputs and why each row went (skip reasons with counts and the first place, the window, the
    files not read)."""
    if profile.requests:
        return profile
    if profile.log_model is not None:  # a --log-model that no row names says so, listing the models
        one_logged_model(profile.models, profile.log_model)
    why = []
    if profile.skipped_rows:
        reasons = sorted(profile.skipped.items(), key=lambda kv: (-kv[1], kv[0]))
        why.append(f"{profile.skipped_rows:,} rows skipped (" + "; ".join(
            f"{count:,} {reason}" for reason, count in reasons[:_SHOWN]) + (", …" if len(reasons) > _SHOWN else "")
            + (f"; first at {profile.skip_examples[reasons[0][0]]}" if reasons[0][0] in profile.skip_examples else "")
            + ")")
    if profile.window is not None and (profile.window.outside_rows or profile.window.pruned_files):
        w = profile.window
        why.append(f"{w.outside_rows:,} rows outside --since/--until and {w.pruned_files:,} files pruned by it")
    if profile.skipped_files:
        files = len(profile.skipped_files)
        why.append(f"{files:,} file{'s' if files != 1 else ''} not read (" + "; ".join(profile.notes) + ")")
    if not why:
        why.append("the files hold no rows" if profile.inputs else "no file was read")
    hint = " (see --tokenizer, --field, --format, --on-error)" if profile.skipped_rows else ""
    shown = ", ".join(paths[:_SHOWN]) + (f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else "")
    raise InputError("no usable row: " + "; ".join(why) + hint, path=shown)


def _profile_once(paths: Sequence[str], options: IngestOptions, progress: ProgressCallback | None,
                  max_routes: int | None) -> Profile:
    batches, stats = read_logs(list(paths), options, progress=progress, prefetch=PREFETCH_BATCHES)
    return profile_read(batches, stats, options, max_routes)


def load_profile_or_logs(
    paths: Sequence[str], options: IngestOptions | None = None, *, progress: ProgressCallback | None = None,
    max_routes: int | None = MAX_ROUTES, workers: int | None = 1, ray_address: str | None = None,
) -> Profile:
    """For later commands: one saved-profile .json loads it; anything else is read as logs
    (workers, ray_address: as `profile_logs` takes them). Either way at most `max_routes` routes
    keep their own profile (`fold_routes`)."""
    if len(paths) == 1 and is_saved_profile(paths[0]):
        return fold_routes(load_profile(paths[0]), max_routes)
    if options is None:
        options = IngestOptions()
    return profile_logs(paths, options, progress=progress, max_routes=max_routes, workers=workers,
                        ray_address=ray_address)
