"""Smoke test of benchmarks/compare.py: the tiny preset runs every mode end to end and
writes a table whose flatshard losses match the single process. No timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "compare.py")
MODES = [
    "single process",
    "DDP",
    "FSDP2",
    "flatshard ZeRO-3",
    "flatshard ZeRO-2",
    "flatshard ZeRO-1",
]
LOSS_COLUMN = "loss Δ vs single"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_compare_tiny(tmp_path):
    out = tmp_path / "results.md"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "tiny", "--steps", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = _cells(lines[0])
    assert header[0] == "mode" and LOSS_COLUMN in header, header
    rows = {_cells(line)[0]: _cells(line) for line in lines[2:]}
    assert sorted(rows) == sorted(MODES), sorted(rows)
    loss_index = header.index(LOSS_COLUMN)
    for mode in MODES:
        assert len(rows[mode]) == len(header), rows[mode]
        if mode.startswith("flatshard"):
            assert float(rows[mode][loss_index]) <= 1e-5, (mode, rows[mode][loss_index])
    assert "python" in text and "--preset tiny" in text  # the exact command is recorded


def test_gloo_collectives_script():
    script = os.path.join(ROOT, "benchmarks", "gloo_collectives.py")
    proc = subprocess.run(
        [sys.executable, script, "--world", "2", "--elements", "4096", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timed = [line for line in proc.stdout.splitlines() if line.startswith("world 2")]
    assert len(timed) == 5 and all(" ms" in line for line in timed), proc.stdout
