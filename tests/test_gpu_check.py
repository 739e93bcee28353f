"""`scripts/gpu_check.py --cpu-dry-run`: the device check runs end to end on gloo with tiny
sizes, so the script is not broken when a GPU arrives; every section passes its own check
and the report holds its figures. Its compiled sections trace their graphs with the
aot_eager backend (inductor's CPU code generation is not what the GPU runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_dry_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = ["cpu_parity", "bf16", "quantized", "offload", "state_offload", "checkpoint",
                "compile", "activation_memory", "activation_offload_1b", "ac_1b",
                "ac_compiled_1b", "fsdp2_1b", "fused_adamw", "ring_attention", "scale_8b",
                "scale_8b_compiled"]  # fmt: skip
    for name in sections:
        assert report[name]["ok"] is True, (name, report[name])
    assert report["cpu_parity"]["max_rel"] == 0  # CPU against CPU here
    assert max(report["ring_attention"]["max_rel_out_dq_dk_dv"]) <= 1e-5
    assert report["compile"]["graph_breaks"] == 0 and report["compile"]["graphs"] >= 1
    assert report["compile"]["backend"] == "aot_eager"  # inductor's C++ is not the GPU's
    memory = report["activation_memory"]
    assert memory["offload_equal_losses"]
    assert memory["offload"]["moved_bytes_per_step"] > 0
    assert all(memory[mode]["plan_device_bytes"] > 0 for mode in ("none", "full", "selective"))
    assert report["fsdp2_1b"]["ratio"] > 0 and report["fsdp2_1b"]["ratio_flat_adamw"] > 0
    assert set(report["fsdp2_1b"]["phases_ms"]["fsdp2"]) >= {"forward", "backward", "optimizer"}
    for name in ("scale_8b", "scale_8b_compiled"):  # the same model and data as FSDP2's
        scale = report[name]
        assert scale["loss_max_rel_fsdp2"] <= 1e-6, scale
        assert all(scale[run]["peak_bytes"] is None and scale[run]["phases_ms"]["backward_host"] > 0
                   for run in ("flatshard", "flatshard_flat_adamw", "fsdp2"))  # fmt: skip
    assert all(0 < report["quantized"][f]["max_rel_vs_fp32"] <= 2e-2 for f in ("int8", "fp8"))
    assert all(ms > 0 for ms in report["fused_adamw"]["optimizer_ms"].values())
    saved = report["checkpoint"]
    assert saved["equal_weights_after"] and saved["async"]["peak_staging_bytes"] > 0
    moved = report["state_offload"]
    assert moved["equal_losses"] and moved["moved_bytes"] > 0 and moved["offload_gb_per_s"] > 0
    summary = (tmp_path / "gpu_check.txt").read_text()
    assert summary.count("ok=True") == len(sections)


def test_memory_peak_names_what_is_alive_at_the_peak():
    # scripts/gpu_memory_peak.py replays a CUDA allocator trace (no GPU here: a made one):
    # the peak, and what was alive then by the first frame outside torch
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from gpu_memory_peak import peak_report
    finally:
        sys.path.pop(0)
    packages = "/opt/torch/venv/site-packages/"  # (a path that holds `/torch/` itself)
    frames = lambda name: [  # innermost first, as torch records them
        {"filename": packages + "torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": packages + "transformers/llama/model.py", "line": 9, "name": name},
    ]  # fmt: skip
    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * mib, "frames": frames("a")},
        {"action": "alloc", "addr": 2, "size": 8 * mib, "frames": frames("b")},
        {"action": "free_requested", "addr": 1, "size": 4 * mib},
        {"action": "free_completed", "addr": 1, "size": 4 * mib},
        {"action": "alloc", "addr": 3, "size": 2 * mib, "frames": frames("b")},
        {"action": "alloc", "addr": 4, "size": 1 * mib, "frames": []},
    ]
    lines = peak_report({"device_traces": [trace]})
    assert lines[0] == "peak 12 MiB at event 1 of 6 (replayed)"
    assert [line.split() for line in lines[1:]] == [
        ["8.0", "MiB", "1", "llama/model.py:9", "b", "->", "linear"],
        ["4.0", "MiB", "1", "llama/model.py:9", "a", "->", "linear"],
    ]
