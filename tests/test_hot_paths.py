"""A static check of the per-step code (the runtime, comm, the row-shard dispatch): every
tensor it creates names its device (else it lands on the CPU next to CUDA buffers), and no
`.item()` / `.tolist()` / `.cpu()` (a host sync per call on CUDA) outside the allow-list
below, each with its reason."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "flatshard"
HOT = [
    *sorted((ROOT / "runtime").glob("*.py")),
    ROOT / "comm" / "devices.py",
    ROOT / "comm" / "collectives.py",
    ROOT / "comm" / "agreement.py",  # the lookup's plan, once per forward
    ROOT / "dtensor" / "row_shard.py",
    ROOT / "dtensor" / "redistribute.py",
    ROOT / "dtensor" / "sharded_param.py",
    *sorted((ROOT / "optim").glob("*.py")),
]
CREATORS = {"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint",
            "empty_strided", "linspace", "eye"}  # fmt: skip
SYNCS = {"item", "tolist", "cpu"}
ALLOWED = {
    # (file, function): why a host sync is right there
    ("agreement.py", "all_gather_ints"): "the lookup's plan: split sizes must be known on the host "
    "before any rank posts the exchange (one sync per forward, documented)",
    ("agreement.py", "agree"): "set-up only (fully_shard, save): never per step",
    ("adamw.py", "_age"): "the step counter lives on the CPU, as torch keeps it (no device "
    "sync), and is read when the flat ranges are planned, not per step",
}


def _functions(tree):
    """(function name, node) for every node, by its innermost enclosing function."""

    def walk(node, name):
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            )
            yield inner, child
            yield from walk(child, inner)

    yield from walk(tree, "<module>")


def _findings(path: pathlib.Path) -> list[str]:
    found = []
    for function, node in _functions(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, owner = node.func.attr, node.func.value
        where = f"{path.name}:{node.lineno} in {function}()"
        is_torch = isinstance(owner, ast.Name) and owner.id == "torch"
        if is_torch and name in CREATORS and not any(k.arg == "device" for k in node.keywords):
            found.append(f"{where}: torch.{name}(...) without device=")
        if name in SYNCS and not node.args and (path.name, function) not in ALLOWED:
            found.append(f"{where}: .{name}() (a host sync on CUDA)")
    return found


def test_per_step_code_names_devices_and_does_not_sync():
    findings = [finding for path in HOT for finding in _findings(path)]
    assert not findings, "\n".join(findings)


def test_the_check_sees_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef step(x):\n    y = torch.zeros(3)\n    return x.item()\n")
    assert len(_findings(bad)) == 2
