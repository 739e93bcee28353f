"""The progress of a run: a bar on a terminal, the plain step lines anywhere else, a
terminal of no size (a pseudo-terminal under `script` from a pipe) included."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from flatshard.cli.progress import Progress

RECORD = dict(loss=2.5, lr=1e-3, grad_norm=1.0, tokens_per_s=100.0)


def _lines_shown(tmp_path, columns: int) -> str:
    """What a two-step Progress prints when stderr and stdout are a pseudo-terminal of
    `columns` columns."""
    script = (
        "import sys; from flatshard.cli.progress import Progress\n"
        f"p = Progress(total_steps=2, start_step=0, log_interval=1, "
        f"metrics_path={str(tmp_path / 'm.jsonl')!r}, tensorboard_dir=None)\n"
        f"for step in (1, 2): p.step(dict({RECORD!r}, step=step))\n"
        "p.close(); print('bar' if p.interactive else 'lines')\n"
    )
    leader, follower = pty.openpty()
    if columns:
        import fcntl
        import struct
        import termios

        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [sys.executable, "-c", script], stdout=follower, stderr=follower, env=env, timeout=60
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.returncode == 0, out
    return out.decode(errors="replace")


def test_a_terminal_of_no_size_gets_the_plain_step_lines(tmp_path):
    shown = _lines_shown(tmp_path, columns=0)
    assert "lines" in shown and "step 1/2 | loss 2.5000" in shown and "step 2/2" in shown
    assert "bar" in _lines_shown(tmp_path, columns=100)


def test_a_pipe_gets_the_plain_step_lines(tmp_path, capsys):
    progress = Progress(total_steps=1, start_step=0, log_interval=1,
                        metrics_path=str(tmp_path / "m.jsonl"), tensorboard_dir=None)  # fmt: skip
    progress.step(dict(RECORD, step=1))
    progress.close()
    assert not progress.interactive and "step 1/1 | loss 2.5000" in capsys.readouterr().out
