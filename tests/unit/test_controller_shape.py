"""The controller's shape, read from its source (AST only, nothing imported): no import cycle
among its modules, type-only imports under TYPE_CHECKING included; the stages of a tick import
only downwards (a module imports its own stage or an earlier one); and no function longer than
MAX_FUNCTION_LINES lines (ruff's statement counts do not measure lines)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "wattserve.controller"
ROOT = Path(__file__).resolve().parents[2] / "wattserve" / "controller"
MAX_FUNCTION_LINES = 80

# The stages of a tick, in the order data flows through them (docs/control.md, "One tick").
# A new module takes its place here: the test below fails for a module with none.
STAGES: dict[str, tuple[str, ...]] = {
    # 0. the vocabulary: inputs, policy, tuning, value types, the models' arithmetic
    "vocabulary": (
        "__init__",
        "signals",
        "policy",
        "params",
        "schema",
        "state",
        "models",
        "speed_table",
        "limits",
        "guard_state",
    ),
    # 1. measure: telemetry and engine stats -> the learned models -> the tick's Outlook
    "measure": ("learner", "outlook", "part"),
    # 2. constrain: each guard reads the Outlook and returns its bound and reason (or None)
    "constrain": ("power_guard", "latency_guard", "reference"),
    # 3. choose: each knob's timescale picks within the bounds
    "choose": ("pacing", "clock", "batch_caps", "quant"),
    # 4. actuate: the core runs the stages in order and clamps, records and returns the one
    # Decision
    "actuate": ("controller",),
}


def module_name(path: Path, root: Path, package: str) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def imported_modules(tree: ast.AST, this: str, known: set[str]) -> set[str]:
    """Every module of `known` this one imports, wherever the import sits (module level,
    inside a function, under `if TYPE_CHECKING:`). `from pkg import mod` counts as mod."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = this.split(".")[: -node.level]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports mod; `from pkg.mod import name` imports pkg.mod.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for name in names:
            # An import of a.b.c also runs a and a.b: the closest known module is the edge.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    files = {module_name(p, root, package): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    return {
        name: imported_modules(ast.parse(path.read_text()), name, known)
        for name, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at its end), or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == grey:
                return [*stack[stack.index(nxt) :], nxt]
            if colour[nxt] == white and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        colour[node] = black
        return None

    for node in sorted(graph):
        if colour[node] == white and (cycle := visit(node)) is not None:
            return cycle
    return None


def long_functions(root: Path, limit: int) -> list[str]:
    """'path:line name (N lines)' for each function or method over `limit` lines, from its
    `def` line to its last line (decorators not counted)."""
    over = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    over.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return over


def test_controller_modules_import_no_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 10  # the package was found and read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def stage_of(module: str) -> int:
    short = module.removeprefix(PACKAGE).lstrip(".") or "__init__"
    for rank, members in enumerate(STAGES.values()):
        if short in members:
            return rank
    raise AssertionError(f"{module} has no stage in STAGES")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a later stage's module."""
    return sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if stage_of(b) > stage_of(a)
    )


def test_controller_stages_import_only_downwards() -> None:
    graph = import_graph(ROOT, PACKAGE)
    for module in graph:
        stage_of(module)  # every module has its stage
    assert upward_imports(graph) == []


def test_an_upward_import_is_found() -> None:
    graph = {f"{PACKAGE}.outlook": {f"{PACKAGE}.latency_guard"}, f"{PACKAGE}.latency_guard": set()}
    assert upward_imports(graph) == [f"{PACKAGE}.outlook -> {PACKAGE}.latency_guard"]


def test_controller_functions_fit_80_lines() -> None:
    assert long_functions(ROOT, MAX_FUNCTION_LINES) == []


def write(root: Path, name: str, text: str) -> None:
    (root / name).write_text(text)


def test_a_type_only_import_cycle_is_found(tmp_path: Path) -> None:
    write(tmp_path, "__init__.py", "")
    write(tmp_path, "a.py", "from pkg.b import B\n")
    write(
        tmp_path,
        "b.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
    )
    write(tmp_path, "c.py", "from pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_relative_imports_and_function_lines_are_measured(tmp_path: Path) -> None:
    write(tmp_path, "__init__.py", "")
    write(tmp_path, "a.py", "from .b import x\n")
    write(tmp_path, "b.py", "def f():\n" + "    x = 1\n" * 80 + "    return x\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"} and find_cycle(graph) is None
    assert long_functions(tmp_path, 80) == ["b.py:1 f (82 lines)"]
    assert long_functions(tmp_path, 82) == []
