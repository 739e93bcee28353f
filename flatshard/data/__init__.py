"""The default training corpus: English text that every Python installation already holds.

`pydoc_data.topics` is the Python Language Reference as `help()` shows it: about 460 KB of
prose and code examples in CPython's standard library. It is read at run time, so nothing
is downloaded and no third-party text ships with flatshard. Where a trimmed Python lacks
it, the docstrings of standard-library modules are used instead (read with `ast`, never
imported).
"""

from __future__ import annotations

import ast
import os
import sysconfig

# Modules whose docstrings are mostly prose; used only without pydoc_data.
FALLBACK_MODULES = (
    "argparse", "asyncio/events", "collections/__init__", "dataclasses", "datetime",
    "decimal", "difflib", "email/message", "enum", "fractions", "functools", "inspect",
    "logging/__init__", "pathlib", "pickle", "random", "shutil", "statistics", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest/case", "zipfile",
)  # fmt: skip
MIN_BYTES = 100_000


def corpus() -> tuple[bytes, str]:
    """(UTF-8 text, where it came from). Deterministic for a given Python version."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = None
    if topics:
        text = "\n\n".join(topics[name].strip() for name in sorted(topics))
        return text.encode(), "the Python Language Reference topics (pydoc_data.topics)"
    text = _stdlib_docstrings()
    if len(text) < MIN_BYTES:
        raise FileNotFoundError(
            "this Python has neither pydoc_data nor standard-library sources to build the "
            "bundled corpus from; pass a text file with data.path"
        )
    return text, "docstrings of standard-library modules"


def _stdlib_docstrings() -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    pieces = []
    for module in FALLBACK_MODULES:
        path = os.path.join(root, module + ".py")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    pieces.append(doc)
    return "\n\n".join(pieces).encode()
