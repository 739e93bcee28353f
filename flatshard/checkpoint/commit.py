"""Atomic commit of checkpoint directories on a file system.

A checkpoint is written into `.step-N.partial/`, made durable (fsync of every file and of
the directory), then renamed to `step-N/`; only after that does the `latest` marker move
(written to a temporary file, fsync-ed, renamed). A crash at any moment leaves `latest`
pointing at a complete checkpoint; a leftover `.partial` is never read and is removed by
the next save of that step (and by `flatshard train --resume`). Without a `latest` marker,
the newest complete step is the default one to load (with a warning).
"""

from __future__ import annotations

import os
import re
import shutil

from flatshard.checkpoint.manifest import MANIFEST

LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_PARTIAL_DIR = re.compile(r"^\.step-(\d{8})\.partial$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(root: str, step: int) -> str:
    return os.path.join(root, f".{step_dir_name(step)}.partial")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            fsync_tree(path)
        else:
            fsync_path(path)
    fsync_path(directory)


def write_durably(path: str, data: bytes) -> None:
    """Write `path` so that it is either absent/old or complete, never half-written."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_path(os.path.dirname(path) or ".")


def commit(root: str, step: int) -> str:
    """Publish `.step-N.partial` as `step-N` and point `latest` at it."""
    source, target = partial_dir(root, step), os.path.join(root, step_dir_name(step))
    fsync_tree(source)
    os.replace(source, target)
    fsync_path(root)
    write_durably(os.path.join(root, LATEST), step_dir_name(step).encode())
    return target


def discard(root: str, step: int) -> None:
    """Remove what a failed save of `step` wrote: its partial directory, and its `step-N`
    directory if the `latest` marker never moved to it."""
    shutil.rmtree(partial_dir(root, step), ignore_errors=True)
    target = os.path.join(root, step_dir_name(step))
    latest = latest_dir(root)
    if os.path.isdir(target) and not (
        latest and os.path.isdir(latest) and os.path.samefile(latest, target)
    ):
        shutil.rmtree(target, ignore_errors=True)


def remove_partials(root: str) -> list[str]:
    """Delete the `.step-N.partial` directories interrupted saves left (call only when no
    save into `root` can be running); returns their names."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _PARTIAL_DIR.match(n))
    for name in names:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return names


def exists(root: str, step: int) -> bool:
    return os.path.exists(os.path.join(root, step_dir_name(step)))


def latest_dir(root: str) -> str | None:
    marker = os.path.join(root, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as handle:
        return os.path.join(root, handle.read().strip())


def step_of(path: str) -> int | None:
    """N of a `step-N` directory (None for another name)."""
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def resolve_latest(root: str) -> tuple[str | None, str | None]:
    """(the checkpoint to load by default, a warning or None). The `latest` marker names it;
    when the marker is missing (deleted by hand, lost with a crash) or names no directory,
    the newest complete step (one with its manifest) stands in, with a warning."""
    marked = latest_dir(root)
    if marked is not None and os.path.isdir(marked):
        return marked, None
    complete = [
        step
        for step in committed_steps(root)
        if os.path.isfile(os.path.join(root, step_dir_name(step), MANIFEST))
    ]
    if not complete:
        return None, None
    newest = os.path.join(root, step_dir_name(complete[-1]))
    why = "no 'latest' marker" if marked is None else f"a 'latest' marker naming {marked}"
    return newest, (
        f"{root} has {why}; using the newest complete checkpoint {os.path.basename(newest)}"
    )


def committed_steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root)) if m)


def prune(root: str, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` committed steps (never the `latest` one)."""
    latest = latest_dir(root)
    removed = []
    for step in committed_steps(root)[:-keep_last]:
        path = os.path.join(root, step_dir_name(step))
        if latest and os.path.samefile(path, latest):
            continue
        shutil.rmtree(path)
        removed.append(step)
    return removed
