"""benchmarks/plots.py: the documentation's three figures are drawn, and what they show is
flatshard's own data: the layout's spans (whole rows per rank, checked against the layout's
`row_bounds`), the planner's bytes, and the cells of RESULTS.md's tables."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
_spec = importlib.util.spec_from_file_location(
    "plots", os.path.join(ROOT, "benchmarks", "plots.py")
)
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)


def _assert_png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000  # a drawn figure, not an empty canvas


def test_layout_figure_covers_every_parameter_once_in_whole_rows(tmp_path):
    world = 4
    out = plots.layout_figure(str(tmp_path), world)
    _assert_png(out["path"])
    drawn = [span.name for _, spans in out["buckets"] for span in spans]
    assert sorted(drawn) == sorted(out["params"])  # each of the block's parameters, once
    for (shard, spans), bucket in zip(out["buckets"], out["unit"].buckets, strict=True):
        assert bucket.padded_size == world * shard  # equal shards
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # no overlap
        assert spans[-1].end <= world * shard
        slots = {slot.info.name: slot for slot in bucket.slots}
        for span in spans:
            bounds = bucket.row_bounds(slots[span.name])  # rank r: rows [b[r], b[r + 1])
            for r in range(world):
                lo, hi = max(span.start, r * shard), min(span.end, (r + 1) * shard)
                held = max(0, hi - lo)
                # the rank's piece starts on a row boundary and is whole rows: the layout's own
                assert held == 0 or (lo - span.start) % span.row == 0
                assert held == (bounds[r + 1] - bounds[r]) * span.row
    assert out["unit"].padding_fraction < 0.01


def test_memory_figure_splits_the_planners_peak(tmp_path):
    out = plots.memory_figure(str(tmp_path))
    _assert_png(out["path"])
    setups = {name: plan["setup"] for name, plan in out["plans"].items()}
    assert [s["zero_stage"] for s in setups.values()] == [1, 2, 3, 3, 3, 3]
    assert setups["ZeRO-3\noffload 0.5"]["offload"] == 0.5
    assert setups["ZeRO-3\nAC full"]["ac"] == "full"
    for name, plan in out["plans"].items():
        memory, moments = plan["memory"], out["moments"][name]
        assert all(v >= 0 for parts in moments.values() for v in parts.values()), name
        # the taller bar is the planner's device peak, to the byte
        assert max(sum(parts.values()) for parts in moments.values()) == memory["device"]
        assert moments["start of backward"]["activations"] == memory["activations"]
    zero3, lora = out["moments"]["ZeRO-3"], out["moments"]["ZeRO-3\nLoRA r16"]
    state = "optimizer state (AdamW)"
    assert lora["end of backward"][state] < zero3["end of backward"][state] / 100


def test_ratios_figure_reads_the_sections_table(tmp_path):
    out = plots.ratios_figure(str(tmp_path))
    _assert_png(out["path"])
    # one row, parsed here on its own: the section's first flatshard row
    with open(RESULTS, encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"## {plots.SECTION}")
    section = text[start : text.index("\n## ", start)]
    row = next(line for line in section.splitlines() if line.startswith("| flatshard "))
    mode, _, vs_fsdp2, vs_ddp = [cell.strip() for cell in row.split("|")[1:5]]
    assert section.count("| mode |") == len(out["tables"]) >= 2
    _, bars = out["groups"][0]
    assert bars[0] == (mode, float(vs_fsdp2), float(vs_ddp))


def test_ratios_figure_redraws_a_fresh_report(tmp_path):
    """--results / --section: a report as compare.py writes it, without a DDP column."""
    report = tmp_path / "run.md"
    report.write_text(
        "## preset 35m, fp32, world 2 (2026-12-01)\n\n"
        "- command: `python benchmarks/compare.py --modes fsdp2,zero3 --out /tmp/x.md`\n"
        "- model: Llama preset `35m` (35,496,448 parameters)\n"
        "- run: world 2 (gloo, CPU)\n\n"
        "| mode | step ms (median) | ×FSDP2 | ×DDP | fwd ms |\n|---|---|---|---|---|\n"
        "| FSDP2 | 2598.2 | 1.00 | n/a | 860.7 |\n"
        "| flatshard ZeRO-3 | 2300.7 | 0.88 | n/a | 758.4 |\n\n"
        "## another section\n\n| mode | ×FSDP2 |\n|---|---|\n| flatshard ZeRO-1 | 0.5 |\n"
    )
    out = plots.ratios_figure(str(tmp_path), str(report), "preset 35m")
    _assert_png(out["path"])
    assert out["groups"] == [("35m, world 2", [("flatshard ZeRO-3", 0.88, None)])]
    assert out["tables"][0]["command"].endswith("--out /tmp/x.md")
