"""The layout rules of the package: small modules and functions, layers that import downward
(nothing outside the command line imports it), and no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "remat"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """remat modules imported anywhere in the tree (functions included), except under TYPE_CHECKING."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("remat"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names) and node.module != "remat":
                found.add(node.module)  # names from the module itself (the package `remat` only re-exports)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}


def test_no_module_is_over_the_line_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_line_limit():
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_only_the_command_line_imports_the_command_line():
    bad = {m: sorted(i for i in imps if i.startswith("remat.cli")) for m, imps in _graph().items() if not m.startswith("remat.cli")}
    assert not {m: i for m, i in bad.items() if i}


def test_no_import_cycle():
    graph = _graph()
    # Tarjan's strongly connected components: any with two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not cycles, f"import cycles: {cycles}"


# The layers, lowest first: a module imports only from layers below its own, or from its
# own folder. Folders are layers; the top-level modules are placed among them.
LAYERS = [
    {"errors"},
    {"serialize", "gc_pause", "defaults", "budget", "launch", "models", "progress"},
    {"ops"},  # what remat knows of single ops
    {"capture"},  # one iteration traced into a TrainGraph, the user's Python state, a call's inputs
    {"memory"},  # the memory model: analysis, graph index, schedule, simulator
    {"passes", "profile"},  # graph passes; measuring a graph
    {"planners"},
    {"build", "workloads"},
    {"ranks", "failed_step", "step_report", "compile_notes", "batch_signature"},
    {"runtime"},
    {"remat"},  # the package's public names
    {"measurement", "integrations"},  # measuring plans; remat inside Trainer, Lightning
    {"cli"},
]
MAX_FOLDER_MODULES = 16


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_layers_import_only_downward():
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    unplaced = sorted({_layer(m) for m in _graph()} - set(rank))
    assert not unplaced, f"modules or folders in no layer (add them to LAYERS): {unplaced}"
    upward = sorted(
        (m, i) for m, imps in _graph().items() for i in imps if _layer(i) != _layer(m) and rank[_layer(i)] >= rank[_layer(m)]
    )  # fmt: skip
    assert not upward, f"imports that run up or sideways between layers: {upward}"


def test_no_folder_holds_more_than_16_modules():
    folders = {path.parent for path in _modules().values()}
    big = {str(f.relative_to(PACKAGE.parent)): n for f in folders if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MAX_FOLDER_MODULES}
    assert not big, f"folders over {MAX_FOLDER_MODULES} modules: {big}"


def test_the_checks_see_the_package():
    """The checks above would pass on nothing: they must see every layer."""
    graph = _graph()
    assert {"remat.capture.capture", "remat.planners.milp", "remat.measurement.sweep", "remat.cli.main"} <= set(graph)
    assert "remat.memory.graph_index" in graph["remat.memory.schedule"]


def test_tests_and_benchmarks_share_code_through_packages_not_the_path():
    """What they share is tests/support, imported by name; nothing edits sys.path to
    reach another folder's modules."""
    root = PACKAGE.parent
    edits = []
    for path in [*root.joinpath("tests").rglob("*.py"), *root.joinpath("benchmarks").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("insert", "append"):
                target = node.func.value
                if isinstance(target, ast.Attribute) and target.attr == "path" and getattr(target.value, "id", None) == "sys":
                    edits.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not edits, edits
