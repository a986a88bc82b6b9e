"""The door to `kvtune check`: deployed files judged against a recommendation."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtune.deploy.read import Deployed, DeployedKind, load_deployed
from kvtune.domain.recommendation import Recommendation
from kvtune.errors import KvtuneError
from kvtune.model import resolve_model
from kvtune.weights import weights_for

if TYPE_CHECKING:
    from kvtune.deploy.check import CheckResult


def check(rec: Recommendation, deployed: Sequence[str | os.PathLike[str]], *,
          max_truncation: float | None = None) -> CheckResult:
    """Deployed files (a vllm serve command or script, gateway.yaml, nginx.conf) judged together
    against the recommendation: `result.passed` is False on a risk. An estimated capacity is
    recomputed from each engine file's flags (the recommendation's model resolved again), and
    the gateway budgets are held to that pool.

    >>> result = kvtune.check(rec, ["deploy/vllm-serve.sh", "deploy/gateway.yaml"])
    >>> result.passed, [f.code for f in result.findings]                # doctest: +SKIP
    (True, [])
    """
    from kvtune.deploy.check import lua_module_findings  # logging: only to check
    from kvtune.deploy.render import lua_modules  # jinja2: only to check

    files = [load_deployed(p) for p in deployed]
    result = _check_loaded(rec, files, max_truncation)
    nginx = [(p, d) for p, d in zip(deployed, files, strict=True) if d.kind is DeployedKind.NGINX]
    shipped = lua_modules() if nginx else {}
    beside = [f for p, d in nginx for f in lua_module_findings(d.source, _lua_beside(Path(p).parent, shipped), shipped)]
    return dataclasses.replace(result, findings=(*result.findings, *beside)) if beside else result


def _lua_beside(folder: Path, names: Iterable[str]) -> dict[str, str | None]:
    """The Lua modules nginx.conf loads (`names`), as found in `folder` (None: absent or unreadable)."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = (folder / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            found[name] = None
    return found


def _check_loaded(rec: Recommendation, files: list[Deployed], max_truncation: float | None) -> CheckResult:
    """check's findings for loaded files: the pool recomputed from an engine file's flags where
    the recommendation's capacity was an estimate."""
    from kvtune.deploy.check import Finding, Severity, check_deployment  # logging: only to check

    engines = [d for d in files if d.is_engine]
    if rec.capacity.source != "estimate" or not engines:
        return check_deployment(files, rec, max_truncation=max_truncation)
    try:
        spec = resolve_model(rec.model)
    except KvtuneError as exc:
        result = check_deployment(files, rec, max_truncation=max_truncation)
        unresolved = Finding(Severity.INFO, "pool-not-recomputed",
                             f"the KV pool was not recomputed from the engine's flags: {exc.message}",
                             "budgets are held to the recommendation's estimated pool", engines[0].source)
        return dataclasses.replace(result, findings=(*result.findings, unresolved))
    return check_deployment(files, rec, max_truncation=max_truncation, spec=spec, weights=weights_for(spec))
