"""The package's structure as docs/concepts/architecture.md draws it: every import goes down the
layers (or stays inside its own folder), no modules import each other in a circle, no module
reads another's private names (tests included), and nothing but the package face and a few
leaves lies loose in `flatshard/`. Read from the source with `ast`: nothing is imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flatshard"

# bottom to top; a unit may import its own modules and those of lower layers only
LAYERS = [
    {"errors", "compat", "registry"},
    {"policy", "layout", "comm", "data"},
    {"dtensor", "mesh"},
    {"shard_mesh"},  # a mesh as fully_shard uses it (over mesh.py's meshes)
    {"runtime", "parallel"},
    {"api", "optim"},
    {"checkpoint"},
    {"hf"},
    {"models"},
    {"__init__"},  # the package face
    {"planner"},
    {"cli"},
    {"__main__"},  # python -m flatshard
]
# loose in flatshard/: the face, leaves, mesh.py (the one owner of the device meshes) and
# shard_mesh.py (fully_shard's view of one)
LEAVES = {"errors", "compat", "registry", "policy", "mesh", "shard_mesh", "__init__", "__main__"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _unit(module: str) -> str:
    """The folder (or loose module) of flatshard a module belongs to; "__init__": the face."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: pathlib.Path):
    """(imported module, names taken from it) for every flatshard import in the file,
    function-local ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flatshard":
                    yield _resolve(alias.name), alias.asname or alias.name, ()
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "flatshard":
                continue
            for alias in node.names:
                whole = f"{node.module}.{alias.name}"
                if whole in MODULES:  # a module itself
                    yield whole, alias.asname or alias.name, ()
                else:
                    yield _resolve(node.module), None, (alias.name,)


def _level(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def test_every_unit_has_a_layer_and_only_leaves_lie_loose():
    units = {_unit(m) for m in MODULES}
    assert units <= set().union(*LAYERS), units - set().union(*LAYERS)
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == LEAVES, loose ^ LEAVES


def test_imports_go_down_the_layers():
    upward = []
    for module, path in MODULES.items():
        source = _unit(module)
        for target, _, _ in _imports(path):
            unit = _unit(target)
            if unit != source and _level(unit) >= _level(source):
                upward.append(f"{module} imports {target} ({source} -> {unit})")
    assert not upward, "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph = {m: {t for t, _, _ in _imports(p) if t != m} for m, p in MODULES.items()}
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, circles


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reads_another_modules_private_names():
    files = list(MODULES.values()) + sorted((ROOT / "tests").glob("*.py"))
    reads = []
    for path in files:
        modules = {}
        for target, alias, names in _imports(path):
            reads += [f"{path.name}: {target}.{n}" for n in names if _private(n)]
            if alias:
                modules[alias] = target
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and _private(node.attr)):  # fmt: skip
                reads.append(f"{path.name}: {modules[node.value.id]}.{node.attr}")
    assert not reads, "\n".join(reads)
