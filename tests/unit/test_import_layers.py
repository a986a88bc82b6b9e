"""kvtune's import graph keeps its layers (issue 28): shared types live on the floor
(kvtune/domain/), which imports no feature package; no package imports another that imports it
back; policy never imports deploy; sim never imports bench or the gateway's config.

The graph is read from the source with ast: every `import` counts, at module level, under
TYPE_CHECKING or inside a function (a function-local import hides a back-edge, it does not
remove it).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import kvtune

ROOT = Path(kvtune.__file__).parent

#: What the floor may import besides itself: the error types every layer raises, and userfiles
#: (which imports only kvtune.errors) for brief(), the bounded repr in its error lines.
FLOOR_MAY_IMPORT = ("kvtune.domain", "kvtune.errors", "kvtune.userfiles")

#: Edges between packages not yet cut (issue 28's floor is not finished): each closes a cycle
#: between bench, sim, policy and deploy, or breaks a rule below. The lead sees this list; it only
#: ever shrinks. (importing package, imported module prefix): why it is still there.
NOT_YET_CUT: dict[tuple[str, str], str] = {
    ("kvtune.bench", "kvtune.policy.recommendation"): "bench's verdict reads a Recommendation document",
    ("kvtune.deploy", "kvtune.policy.recommendation"): "the Recommendation document lives in policy",
    ("kvtune.deploy", "kvtune.policy.whatif"): "the what-if document lives in policy",
    ("kvtune.deploy", "kvtune.policy.feasibility"): "check runs policy's feasibility",
    ("kvtune.deploy", "kvtune.policy.search"): "check runs policy's search (function-local)",
    ("kvtune.deploy", "kvtune.policy.replica_search"): "check runs policy's replica search (function-local)",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> Iterator[str]:
    """Every kvtune module `path` imports, wherever the import statement sits."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "kvtune")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "kvtune":
                yield target


@functools.cache
def edges() -> frozenset[tuple[str, str]]:
    """(importing module, imported module) over kvtune, read once per test run."""
    return frozenset({(module_name(p), t) for p in ROOT.rglob("*.py") for t in imported(p)})


def package_of(module: str) -> str:
    """kvtune.X: the unit the layering speaks of (a subpackage, or a top-level module)."""
    return ".".join(module.split(".")[:2])


def not_yet_cut(source: str, target: str) -> bool:
    return any(package_of(source) == pkg and (target == prefix or target.startswith(prefix + "."))
               for pkg, prefix in NOT_YET_CUT)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_floor_imports_no_feature_package() -> None:
    bad = sorted((s, t) for s, t in edges()
                 if s.startswith("kvtune.domain") and not t.startswith(FLOOR_MAY_IMPORT))
    assert bad == []


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for source, target in edges():
        if package_of(source) != package_of(target) and not not_yet_cut(source, target):
            graph.setdefault(package_of(source), set()).add(package_of(target))
    assert cycles(graph) == []


def test_no_cycle_between_modules_at_import_time() -> None:
    """Module-level imports (TYPE_CHECKING blocks included) form no cycle: gateway's ledger and
    statistical ledger used to import each other for Demand."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import | ast.If)]
        source = module_name(path)
        for node in top:
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and not sub.level and (sub.module or "").startswith("kvtune."):
                    graph.setdefault(source, set()).add(sub.module or "")
    # a package's __init__ importing its own modules is not a back-edge
    for source in graph:
        graph[source] = {t for t in graph[source] if not source.startswith(t + ".")}
    assert cycles(graph) == []


def test_shared_types_come_from_the_floor() -> None:
    """Policy never imports deploy; sim never imports bench or the gateway's config; nobody
    imports a floor type from its old home."""
    rules = {"kvtune.policy": ("kvtune.deploy",), "kvtune.sim": ("kvtune.bench", "kvtune.gateway.config")}
    bad = sorted((s, t) for s, t in edges() for pkg, banned in rules.items()
                 if package_of(s) == pkg and t.startswith(banned) and not not_yet_cut(s, t))
    assert bad == []
    old_homes = {"Slo": "kvtune/bench/report.py", "OutputLaw": "kvtune/gateway/overflow.py",
                 "Demand": "kvtune/gateway/statistical.py", "EngineSettings": "kvtune/sim/scheduler.py",
                 "AdmissionPolicy": "kvtune/gateway/policy.py",
                 "LoadShape": "kvtune/bench/loads.py", "RetryPolicy": "kvtune/bench/client.py",
                 "RouteMatch": "kvtune/gateway/config.py", "Route": "kvtune/deploy/deployed.py",
                 "Api": "kvtune/gateway/endpoints.py"}
    for name, home in old_homes.items():
        old = ROOT.parent / home
        assert not old.exists() or f"class {name}" not in old.read_text(encoding="utf-8"), name
        assert any(f"class {name}" in p.read_text(encoding="utf-8") for p in (ROOT / "domain").glob("*.py")), name


def test_one_route_type() -> None:
    """A route is kvtune.domain.route.Route (matching with RouteMatch) in every layer: the gateway's
    GatewayRoute, deploy's DeployedRoute and the recommendation's Match are gone."""
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        assert not classes & {"GatewayRoute", "DeployedRoute", "Match"}, path


def test_not_yet_cut_lists_only_edges_that_exist() -> None:
    """An allow-list entry whose edge is gone must be removed, so the list only shrinks."""
    present = edges()
    stale = [key for key in NOT_YET_CUT
             if not any(package_of(s) == key[0] and (t == key[1] or t.startswith(key[1] + "."))
                        for s, t in present)]
    assert stale == []
