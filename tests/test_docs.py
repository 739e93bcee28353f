"""The documentation site builds with warnings as errors, documents every public name, and
shows no code that nothing checks: each fenced block of README.md and docs/ is a
`flatshard` command (run as written by tests/test_readme_commands.py), an include of a
script in examples/ (run by tests/test_examples.py), a Python fragment whose flatshard
names all exist, a command's output (`text`), or is marked as needing what CI has not
(`<!-- not run: gpu ... -->`)."""

from __future__ import annotations

import ast
import glob
import importlib
import os
import re
import subprocess
import sys
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOC_FILES = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
# what a block may need that CI does not run: GPUs, several nodes, minutes of benchmarks,
# the set-up of a fresh machine (what scripts/test.sh itself does), commands that wait for
# each other (paired: a test runs them together)
NOT_RUN = re.compile(r"<!-- not run: (gpu|cluster|minutes|setup|paired)\b[^>]*-->")
FRAGMENT = "<!-- fragment -->"
INCLUDE = re.compile(r'^--8<-- "(examples/[\w.]+\.py)(:\d+)*"$')
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def code_blocks(path: str) -> list[tuple[str, str, str]]:
    """(language, code, the marker line before the fence or '') of each fenced block."""
    blocks, lines, i = [], open(path).read().splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language, body = fence.group(1), fence.group(2), []
        marker = lines[i - 1].strip() if i and lines[i - 1].strip().startswith("<!--") else ""
        i += 1
        while not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent) :])
            i += 1
        blocks.append((language, "\n".join(body), marker))
        i += 1
    return blocks


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    return proc, out


def test_the_docs_build_with_warnings_as_errors(site):
    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    home = open(out / "index.html").read()
    assert "fully_shard" in home and "benchmark_ratios.png" in home


def _inventory(out) -> set[str]:
    """The names the site documents: its objects.inv (Sphinx's format: four header lines,
    then zlib-compressed 'name domain:role priority uri display' lines)."""
    data = open(out / "objects.inv", "rb").read()
    body = data.split(b"\n", 4)[4]
    return {line.split(" ", 1)[0] for line in zlib.decompress(body).decode().splitlines()}


def test_every_public_name_has_a_docstring_and_a_reference_entry(site):
    import griffe

    proc, out = site
    assert proc.returncode == 0, proc.stderr[-4000:]
    documented = _inventory(out)
    package = griffe.load("flatshard", search_paths=[ROOT], resolve_aliases=True,
                          resolve_external=False)  # fmt: skip
    reference = "".join(open(f).read() for f in glob.glob(os.path.join(ROOT, "docs/reference/*")))
    problems, packages = [], [package]
    while packages:
        module = packages.pop()
        packages += [m for m in module.modules.values() if m.is_init_module]
        for name in module.exports or ():
            member = module[name]
            if _torch_name(package, member):
                if f"`{name}`" not in reference:  # torch's own, documented by torch
                    problems.append(f"{module.path}.{name}: torch's, not named in docs/reference")
                continue
            if member.is_module:
                continue
            if not member.docstring:
                problems.append(f"{module.path}.{name}: no docstring")
            elif f"{module.path}.{name}" not in documented:
                problems.append(f"{module.path}.{name}: not in the API reference")
    assert not problems, "\n".join(problems)


def _torch_name(package, member) -> bool:
    """Whether a public name is torch's own, re-exported (possibly through another module),
    followed without resolving anything outside flatshard."""
    while member.is_alias:
        path = member.target_path
        if not path.startswith("flatshard."):
            return path.startswith("torch.")
        member = package[path.removeprefix("flatshard.")]
    return False


def _flatshard_names(tree: ast.AST) -> list[str]:
    """The dotted flatshard names a fragment uses: `from flatshard[.x] import y` and
    attribute chains rooted at `flatshard` or at a name imported from it."""
    roots, names = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flatshard"):
            for alias in node.names:
                roots[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                names.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            roots.update({a.asname or a.name: a.name for a in node.names if a.name == "flatshard"})
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in roots and chain:
            names.append(".".join([roots[node.id], *chain]))
    return names


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_every_code_block_runs_in_a_test_or_is_marked():
    examples_tested = open(os.path.join(ROOT, "tests", "test_examples.py")).read()
    problems, counts = [], {"command": 0, "include": 0, "fragment": 0, "not run": 0}
    for path in DOC_FILES:
        where = os.path.relpath(path, ROOT)
        for language, code, marker in code_blocks(path):
            include = INCLUDE.match(code.strip())
            if include:
                counts["include"] += 1
                if f'"{os.path.basename(include.group(1))}"' not in examples_tested:
                    problems.append(f"{where}: {include.group(1)} is not run by test_examples")
            elif NOT_RUN.match(marker):
                counts["not run"] += 1
            elif language == "text":
                continue  # what a command prints
            elif language == "python":
                if marker != FRAGMENT:
                    problems.append(f"{where}: a Python block neither included nor marked:\n{code}")
                    continue
                counts["fragment"] += 1
                missing = [n for n in _flatshard_names(ast.parse(code)) if not _resolves(n)]
                if missing:
                    problems.append(f"{where}: a fragment names what flatshard lacks: {missing}")
            else:
                lines = [line for line in code.splitlines() if line.strip()]
                if lines and all(line.startswith("flatshard ") for line in lines):
                    counts["command"] += 1  # tests/test_readme_commands.py runs each
                else:
                    problems.append(f"{where}: a shell block that no test runs:\n{code}")
    assert not problems, "\n\n".join(problems)
    assert min(counts.values()) >= 1, counts


def test_the_readme_fits_two_screens_and_its_links_exist():
    text = open(README).read()
    assert len(text.splitlines()) < 200
    links = re.findall(r"\]\(([^)#]+)[^)]*\)", text)
    local = [link for link in links if not link.startswith("http")]
    assert any(link.startswith("docs/") for link in local), links
    assert all(os.path.exists(os.path.join(ROOT, link)) for link in local), local


def test_every_error_class_is_in_the_troubleshooting_guide():
    import pkgutil

    import flatshard
    from flatshard.errors import FlatShardError

    for module in pkgutil.walk_packages(flatshard.__path__, "flatshard."):
        importlib.import_module(module.name)
    classes, todo = [], [FlatShardError]
    while todo:
        cls = todo.pop()
        classes.append(cls.__name__)
        todo += cls.__subclasses__()
    guide = open(os.path.join(ROOT, "docs", "guides", "troubleshooting.md")).read()
    assert len(classes) >= 15
    assert [name for name in classes if f"`{name}`" not in guide] == []
