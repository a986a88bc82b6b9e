"""A recommendation.json written by `kvtune recommend --out`, read back strictly: what `kvtune
check` and `kvtune bench --expect` hold a deployment to."""

from __future__ import annotations

import os

from kvtune.domain.recommendation import Recommendation
from kvtune.policy.recommendation import load_recommendation as load_recommendation_file


def load_recommendation(path: str | os.PathLike[str], *, field: str | None = None) -> Recommendation:
    """A recommendation.json written by `kvtune recommend --out`, read back strictly: a missing
    or mistyped field is an InputError naming the file and the field's path (after `field`, the
    option it came in, when given).

    >>> rec = kvtune.load_recommendation("deploy/recommendation.json")  # doctest: +SKIP
    >>> rec.settings["max_model_len"].value                             # doctest: +SKIP
    131072
    """
    return load_recommendation_file(path, field=field)
