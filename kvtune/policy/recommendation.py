"""Reading a recommendation.json back: the document is kvtune.domain.recommendation's; what
reading it takes beyond strict fields is kvtune's behaviour, and lives here. The objective's
traffic profile is read by kvtune.profile, and the feasibility verdict is decided again from its
inputs (kvtune.policy.feasibility.verdict), so a file whose reasons were edited by hand reads as
the same function judges it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvtune import userfiles
from kvtune.domain.feasibility import Verdict
from kvtune.domain.fields import Fields
from kvtune.domain.recommendation import Recommendation
from kvtune.errors import InputError
from kvtune.policy.feasibility import verdict
from kvtune.profile.routes import Profile
from kvtune.userfiles import read_head

__all__ = ["read_recommendation", "load_recommendation", "looks_like_recommendation"]


def read_recommendation(data: Any, *, path: str | None = None) -> Recommendation[Profile]:
    """A parsed recommendation.json, strictly: an InputError names the missing or wrong field."""
    rec = Recommendation.from_dict(data, read_traffic=_traffic, path=path)
    if rec.feasibility is None:
        return rec
    return dataclasses.replace(rec, feasibility=_judged_again(rec.feasibility))


def _traffic(f: Fields) -> Profile:
    """The objective's traffic profile, its errors at its path in the file."""
    try:
        return Profile.from_dict(f.data)
    except InputError as exc:
        raise f.fail(exc.field, exc.message) from None


def _judged_again(v: Verdict) -> Verdict:
    """The verdict's inputs as written and its reasons derived again (the same function decides)."""
    return verdict(v.engine, pool_blocks=v.pool_blocks, block_size=v.block_size, max_model_len=v.max_model_len,
                   budget_blocks=v.budget_blocks, smallest_reservation_blocks=v.smallest_reservation_blocks,
                   longest_request_tokens=v.longest_request_tokens, fix=v.fix)


_MARKER = b'"kvtune_version"'  # the second key kvtune writes; JSON logs do not carry it


def looks_like_recommendation(path: str | os.PathLike[str]) -> bool:
    """A regular file whose first 4 KiB carry kvtune's version key (cheap; the rest is not read),
    so `check recommendation.json` is not taken for a log file."""
    head = read_head(path, 4096)
    return head is not None and _MARKER in head


def load_recommendation(path: str | os.PathLike[str], *, field: str | None = None) -> Recommendation[Profile]:
    """Read and check a recommendation.json written by `kvtune recommend --out` (a regular file,
    strict JSON, at most userfiles.RECOMMENDATION_MAX_BYTES). `field` names the option it came in."""
    data = userfiles.load_json(path, max_bytes=userfiles.RECOMMENDATION_MAX_BYTES, field=field)
    try:
        return read_recommendation(data, path=os.fspath(path))
    except InputError as exc:
        if field is None:
            raise
        raise InputError(exc.message, path=exc.path, field=f"{field}: {exc.field}" if exc.field else field) from None
