"""The architecture's rules, read from the code (issue 40): which package may import which, and how big a module or
a function may grow.

Data flows one way: ``neurons`` (the programs) wires ``gateway`` and ``scoring``; the gateway records what it
measured in the vocabulary of :mod:`gateway.protocol` (the measurement record, failure reasons, which answers an
audit can check, sampling, the subnet's tool format), and scoring reads that vocabulary and nothing else of the
gateway. So neither imports the other's machinery, and the vocabulary imports neither.

Sizes: no product module over 450 lines and no function over 60 is the target; the ones over it today are listed
with their size, may only shrink, and a new one fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("gateway", "scoring", "neurons")
MODULE_MAX_LINES = 450
FUNCTION_MAX_LINES = 60
# Over the limits, at their size when listed: they may shrink, not grow (none since 2026-12-06: a new one fails).
LARGE_MODULES: dict[str, int] = {}
LONG_FUNCTIONS: dict[str, int] = {}


def _modules() -> Iterator[Path]:
    for top in PRODUCT:
        yield from sorted((REPO / top).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it (a function's lazy import too), relative imports resolved;
    imports under ``if TYPE_CHECKING:`` are left out (a type-only reference is no dependency at run time)."""
    tree = ast.parse(path.read_text())
    package = module.split(".")[:-1]  # the module's own package (an __init__'s is its parent: close enough here)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for b in node.body for n in ast.walk(b))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # ``from gateway import app`` imports gateway.app
    return out


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _forbidden(rule: str, mod: str, name: str) -> bool:
    """Whether module ``mod`` importing ``name`` breaks ``rule``."""
    if rule == "gateway":  # the gateway records in the vocabulary; it never reaches into scoring
        return _under(mod, "gateway") and _under(name, "scoring")
    if rule == "scoring":  # scoring reads the vocabulary, nothing else of the gateway
        return _under(mod, "scoring") and _under(name, "gateway") and not _under(name, "gateway.protocol")
    if rule == "vocabulary":  # the vocabulary stands alone
        inside = _under(mod, "gateway.protocol") and not _under(name, "gateway.protocol")
        return inside and any(_under(name, p) for p in PRODUCT)
    # "programs": the programs wire the libraries, never the other way
    return (_under(mod, "gateway") or _under(mod, "scoring")) and _under(name, "neurons")


def _violations(rule: str) -> list[str]:
    bad: list[str] = []
    for path in _modules():
        mod = _rel(path)[:-3].replace("/", ".")
        bad += [f"{mod} imports {name}" for name in _imports(path, mod) if _forbidden(rule, mod, name)]
    return sorted(bad)


def test_the_gateway_never_imports_scoring() -> None:
    assert _violations("gateway") == []


def test_scoring_imports_only_the_gateways_vocabulary() -> None:
    assert _violations("scoring") == []


def test_the_vocabulary_imports_nothing_above_it() -> None:
    assert _violations("vocabulary") == []


def test_gateway_and_scoring_never_import_the_programs() -> None:
    assert _violations("programs") == []


def test_the_rules_see_an_import_that_breaks_them(tmp_path: Path) -> None:
    """The reader itself: a lazy import, a relative one and a type-only one, as the rules read them."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from scoring.pay import x\n"
                 "def f():\n    from scoring.rounds import y\n    from .protocol import z\n")
    got = _imports(f, "gateway.m")
    assert "scoring.rounds" in got and "gateway.protocol" in got and "scoring.pay" not in got


def _function_sizes() -> Iterator[tuple[str, int]]:
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                yield f"{_rel(path)}:{node.name}", node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("kind", ["module", "function"])
def test_no_module_or_function_grows_past_the_limits(kind: str) -> None:
    if kind == "module":
        sizes = {_rel(p): p.read_text().count("\n") for p in _modules()}
        limit, known = MODULE_MAX_LINES, LARGE_MODULES
    else:
        sizes = {}
        for name, n in _function_sizes():
            sizes[name] = max(n, sizes.get(name, 0))
        limit, known = FUNCTION_MAX_LINES, LONG_FUNCTIONS
    over = {name: n for name, n in sizes.items() if n > limit}
    grown = {name: (n, known.get(name)) for name, n in over.items() if n > known.get(name, limit)}
    assert not grown, f"{kind}s over {limit} lines that are new or grew (now, then): {grown}"
    shrunk = sorted(name for name in known if sizes.get(name, 0) <= limit)
    assert not shrunk, f"under {limit} lines now: take them off the list: {shrunk}"


def _import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (lazy imports included: a loop through a function's import is
    still a loop a reader has to hold in mind, and one run-time surprise away from an import error)."""
    graph: dict[str, set[str]] = {}
    root = REPO / Path(*package.split("."))
    for path in sorted(root.rglob("*.py")):
        mod = _rel(path)[:-3].replace("/", ".")
        if mod.endswith(".__init__"):
            continue
        graph[mod] = set()
        for name in _imports(path, mod):
            for target in (name, name.rpartition(".")[0]):  # ``from .x import y``: module x, or name y of it
                if _under(target, package) and target != mod and (REPO / (target.replace(".", "/") + ".py")).exists():
                    graph[mod].add(target)
                    break
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_validators_entry_points_share_through_a_module_not_a_loop() -> None:
    """``cli`` (the validator's entry) and ``worker`` (a gateway worker's) share logging, the open-files limit and the
    SIGTERM stop through ``process``: no import loop among the validator's modules (the worker borrowed the CLI's
    private helpers before, a run-time loop)."""
    graph = _import_graph("neurons.validator")
    assert "neurons.validator.process" in graph["neurons.validator.worker"]
    assert "neurons.validator.cli" not in graph["neurons.validator.worker"]
    assert _cycles(graph) == []


@pytest.mark.parametrize("package", PRODUCT)
def test_no_import_loop_at_run_time(package: str) -> None:
    """No loop among a package's modules through the imports that run (type-only ones left out)."""
    assert _cycles(_import_graph(package)) == []


def test_the_cycle_finder_sees_a_loop() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
