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
import sys
from collections.abc import Iterator
from pathlib import Path

import kvtune

ROOT = Path(kvtune.__file__).parent

#: What the floor may import besides itself: the error types every layer raises, and userfiles
#: (which imports only kvtune.errors) for brief(), the bounded repr in its error lines.
FLOOR_MAY_IMPORT = ("kvtune.domain", "kvtune.errors", "kvtune.userfiles")

#: Edges between packages not yet cut: (importing package, imported module prefix): why it is
#: still there. Empty since issue 28's floor was finished (13 edges closed cycles between bench,
#: sim, policy and deploy); it may only stay empty.
NOT_YET_CUT: dict[tuple[str, str], str] = {}

#: What is worth deferring to the function that needs it (start-up time): a third-party package,
#: or one of the standard modules tests/unit/test_startup_imports.py keeps off the light paths. A
#: function-local kvtune import must load at least one its module does not load already.
STDLIB = sys.stdlib_module_names
COSTLY_STDLIB = frozenset({"concurrent", "logging", "tempfile", "subprocess", "difflib", "ctypes", "multiprocessing"})

#: kvtune modules worth deferring for themselves: tests/unit/test_startup_imports.py keeps them off
#: `kvtune kv`'s path (kvtune.controls compiles its pattern only for an error line).
KEPT_OFF_LIGHT_PATHS = frozenset({"kvtune.controls"})

#: Modules whose function-local imports the rule below does not judge yet. Empty since the CLI,
#: the api and planning became one door (issue 28: their 133 were judged); it may only stay empty.
DEFERRAL_NOT_YET_JUDGED: tuple[str, ...] = ()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


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
                # `from kvtune.pkg import module` imports that module, not only the package's face
                submodules = [f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}")]
                yield from submodules or [target]


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
                 "Api": "kvtune/gateway/endpoints.py",
                 # the documents (issue 28, branch floor-docs): recommendation.json, the what-if
                 # table, the verdict, and the types they embed
                 "Recommendation": "kvtune/policy/recommendation.py", "WhatIfRow": "kvtune/policy/whatif.py",
                 "Predicted": "kvtune/policy/whatif.py", "Verdict": "kvtune/policy/feasibility.py",
                 "TailClass": "kvtune/profile/routes.py", "StepTimeModel": "kvtune/steptime.py"}
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


def _path_of(module: str) -> Path | None:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else \
        path / "__init__.py" if (path / "__init__.py").exists() else None


def _targets(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The kvtune modules an import statement loads (`from kvtune.pkg import module`: the module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "kvtune"]
    base = package[:len(package) - node.level + 1] if node.level else []
    target = ".".join(base + ([node.module] if node.module else []))
    if target.split(".")[0] != "kvtune":
        return []
    return [f"{target}.{a.name}" for a in node.names if _path_of(f"{target}.{a.name}")] or [target]


@functools.cache
def _loads_at_import(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(kvtune modules, third-party packages and costly standard ones) that importing `module`
    runs at its top level: not under TYPE_CHECKING, not inside a function or class."""
    path = _path_of(module)
    if path is None:
        return frozenset(), frozenset()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    kvtune_modules: set[str] = set()
    third_party: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                targets = _targets(node, package)
                kvtune_modules.update(targets)
                if not targets and not (isinstance(node, ast.ImportFrom) and node.level):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    third_party.update(n.split(".")[0] for n in names
                                       if n.split(".")[0] not in STDLIB or n.split(".")[0] in COSTLY_STDLIB)
            elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                for field in ("body", "orelse", "handlers", "finalbody"):
                    visit(getattr(node, field, None) or [])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    third_party.discard("__future__")
    return frozenset(kvtune_modules), frozenset(third_party)


@functools.cache
def third_party_loaded(module: str) -> frozenset[str]:
    """Every third-party package (and costly standard module) importing `module` loads, through
    kvtune's modules (and the packages above each, which Python runs first)."""
    seen: set[str] = set()
    found: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for m in [".".join(parts[:i]) for i in range(2, len(parts) + 1)]:
            if m not in seen:
                seen.add(m)
                kvtune_modules, third_party = _loads_at_import(m)
                found |= third_party
                todo.extend(kvtune_modules - seen)
    return frozenset(found)


def test_function_local_imports_only_defer_heavy_imports() -> None:
    """A function-local import of kvtune is for start-up time, never to dodge a cycle: it loads a
    third-party package (numpy, pyarrow, aiohttp, jinja2, …) or a costly standard module
    (logging, tempfile, …) that its module does not load already (or a module the start-up test
    keeps off `kvtune kv`'s path: KEPT_OFF_LIGHT_PATHS), and says which in a comment."""
    bad = []
    for path in ROOT.rglob("*.py"):
        module = module_name(path)
        if module.startswith(DEFERRAL_NOT_YET_JUDGED):
            continue
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for function in ast.walk(ast.parse(source)):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if not isinstance(node, ast.Import | ast.ImportFrom):
                    continue
                for target in _targets(node, package):
                    deferred = third_party_loaded(target) - third_party_loaded(module)
                    if target in KEPT_OFF_LIGHT_PATHS and target not in _loads_at_import(module)[0]:
                        deferred = deferred | {target}
                    if not deferred or "#" not in lines[node.end_lineno - 1]:
                        bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {target} defers {sorted(deferred)}")
    assert bad == []


def test_no_module_cycle_even_through_function_local_imports() -> None:
    """Every import counted (function-local ones too), modules form no cycle: hoisting any
    function-local import to the top of its module would not make one."""
    graph: dict[str, set[str]] = {}
    for source, target in edges():
        if not source.startswith(target + "."):  # a package's face importing its own modules
            graph.setdefault(source, set()).add(target)
    assert cycles(graph) == []
