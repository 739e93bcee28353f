"""Which torch names flatshard uses that this torch lacks: run with another torch install
(e.g. the GPU machine's) before anything else, so one run lists every gap at once.

    PYTHONPATH=. python scripts/torch_names_probe.py

Checks every `from torch... import name`, every `import torch...`, and every dotted chain
off a name bound to a torch module (`dist.all_gather_single`, `torch.ops.aten.foo`), then
imports every flatshard module, reporting each import that fails.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import sys
import types

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _resolve(dotted: str):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except Exception:
            return None, ".".join(parts[: i + 1])
    return obj, None


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def names_missing() -> list[str]:
    missing = set()
    for path in sorted((ROOT / "flatshard").rglob("*.py")):
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # local name -> dotted torch path
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch"):
                        local = alias.asname or alias.name.split(".")[0]
                        bound[local] = alias.name if alias.asname else alias.name.split(".")[0]
                        _, gap = _resolve(alias.name)
                        if gap:
                            missing.add(f"{path.relative_to(ROOT)}: {gap}")
        for dotted in set(bound.values()):
            _, gap = _resolve(dotted)
            if gap:
                missing.add(f"{path.relative_to(ROOT)}: {gap}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain = _chain(node)
            if chain is None or chain[0] not in bound:
                continue
            obj, gap = _resolve(bound[chain[0]])
            for attr in chain[1]:
                if obj is None or not isinstance(obj, (types.ModuleType, type)):
                    break  # a value (a tensor, an op overload): nothing static to check
                if not hasattr(obj, attr):
                    if isinstance(obj, types.ModuleType):
                        try:
                            obj = importlib.import_module(f"{obj.__name__}.{attr}")
                            continue
                        except Exception:
                            pass
                    missing.add(f"{path.relative_to(ROOT)}:{node.lineno}: {bound[chain[0]]}"
                                f".{'.'.join(chain[1])} (no {attr})")  # fmt: skip
                    break
                obj = getattr(obj, attr)
    return sorted(missing)


def imports_failing() -> list[str]:
    import flatshard

    failing = []
    for info in pkgutil.walk_packages(flatshard.__path__, "flatshard."):
        try:
            importlib.import_module(info.name)
        except Exception as error:
            failing.append(f"{info.name}: {type(error).__name__}: {error}")
    return failing


def main() -> int:
    print(f"torch {torch.__version__}")
    gaps = names_missing()
    for line in gaps:
        print(f"missing {line}")
    try:
        failing = imports_failing()
    except Exception as error:
        failing = [f"flatshard: {type(error).__name__}: {error}"]
    for line in failing:
        print(f"import {line}")
    print(f"{len(gaps)} names missing, {len(failing)} modules failing to import")
    return 1 if gaps or failing else 0


if __name__ == "__main__":
    sys.exit(main())
