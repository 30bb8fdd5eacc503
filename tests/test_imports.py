"""The house's one rule on imports: core <- engines <- tools, no arrow back up, no circle.

Every import statement of the project's packages counts, function-level ones included (a
circle hidden inside a function is still a circle).

    layer 0  dual_graph_worker.core (and the package's own __init__)
    layer 1  dual_graph_worker.engines.reference | dual_graph_worker.engines.sglang
    layer 2  capture | profiling
    layer 3  bench
    layer 4  dual_graph_worker.cli (the `dgw` entry point, on top of everything)

Within one layer the groups do not import each other (the two engines, capture and profiling).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dual_graph_worker", "capture", "profiling", "bench")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            mod = _module(path)
            here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            out = edges.setdefault(mod, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = here[:len(here) - node.level + 1] if node.level else []
                    target = ".".join(base + ([node.module] if node.module else []))
                    names = [target] + [f"{target}.{a.name}" for a in node.names]
                else:
                    continue
                out.update(n for n in names if n.split(".")[0] in PACKAGES)
    modules = set(edges)
    # An imported name resolves to the longest module it names ("pkg.mod.func" -> "pkg.mod").
    return {m: {_resolve(t, modules) for t in ts if _resolve(t, modules) not in (None, m)}
            for m, ts in edges.items()}


def _resolve(name: str, modules: set[str]):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def layer(module: str) -> tuple[int, str]:
    if module == "dual_graph_worker.cli":
        return 4, "cli"
    if module == "dual_graph_worker" or module.startswith("dual_graph_worker.core"):
        return 0, "core"
    for group in ("reference", "sglang"):
        if module.startswith(f"dual_graph_worker.engines.{group}"):
            return 1, group
    if module == "dual_graph_worker.engines":
        return 1, "engines"
    top = module.split(".")[0]
    return {"capture": (2, "capture"), "profiling": (2, "profiling"),
            "bench": (3, "bench")}[top]


EDGES = _imports()


def test_every_arrow_runs_down_the_layers():
    bad = []
    for src, targets in EDGES.items():
        for dst in targets:
            (ls, gs), (ld, gd) = layer(src), layer(dst)
            if gs != gd and not ld < ls:
                bad.append(f"{src} -> {dst}")
    assert not bad, "imports that run up or sideways:\n" + "\n".join(sorted(bad))


def test_no_import_circle():
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(EDGES.get(m, ())):
            if seen.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(EDGES):
        if m not in seen:
            visit(m)


def test_the_core_imports_nothing_of_the_project_but_itself():
    outside = {f"{src} -> {dst}" for src, ts in EDGES.items() if layer(src)[0] == 0
               for dst in ts if layer(dst)[0] != 0}
    assert not outside


def test_the_checker_sees_real_edges():
    """The parser must find what is there (a test that cannot fail is no test)."""
    assert "dual_graph_worker.core.planner" in EDGES["dual_graph_worker.engines.sglang.worker"]
    assert "dual_graph_worker.core.policy" in EDGES["dual_graph_worker.core.controller"]
    assert layer("bench.sglang.policy_matrix") == (3, "bench")


def test_dgw_imports_no_tool_package():
    """`dgw` forwards to the tools by module name: it imports none of them itself."""
    tools = {dst for dst in EDGES["dual_graph_worker.cli"] if layer(dst)[1] in
             ("capture", "profiling", "bench")}
    assert not tools
