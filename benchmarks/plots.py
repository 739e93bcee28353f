"""The documentation's figures, drawn from flatshard's own output (no number typed in here).

    python benchmarks/plots.py --out docs/images
    python benchmarks/plots.py --results /tmp/run.md --section "preset 35m, fp32, world 2"

layout.png            one Llama block's buckets at world 4 (flatshard.layout's own packing)
memory_per_rank.png   llama3-8b per-rank memory at world 8 (`flatshard plan ... --json`)
benchmark_ratios.png  step time against FSDP2 and DDP (compare.py's tables in RESULTS.md)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import textwrap
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")  # files only: no display, the same output on every machine
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
SECTION = "Issue 38, evening run"
DPI = 110
FLATSHARD, FSDP2, DDP = "#2a6fdb", "#ee7733", "#8c8c8c"  # one colour per framework, everywhere
GIB = 2**30


def _text(ax, x, y, s, **kw):
    ax.text(x, y, s, **{"ha": "center", "va": "center", "fontsize": 7, **kw})


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# -- 1. the layout ---------------------------------------------------------------------------


class Span(NamedTuple):
    name: str
    shape: tuple[int, ...]
    start: int  # offset in the bucket
    end: int
    row: int  # elements per row

    @property
    def short(self) -> str:
        return self.name.removesuffix(".weight").split(".")[-1]


def pieces(span: Span, shard_size: int, world: int) -> list[tuple[int, int, int]]:
    """(rank, start, end) in the bucket of each rank's non-empty piece of `span`."""
    cut = lambda r: min(max(r * shard_size, span.start), span.end)
    return [(r, cut(r), cut(r + 1)) for r in range(world) if cut(r) < cut(r + 1)]


def layout_figure(out_dir: str, world: int = 4) -> dict:
    """Block 0 of the tiny Llama packed for `world` ranks; returns the spans it drew."""
    from flatshard.layout import describe_param, plan_unit_layout
    from flatshard.models import Llama, LlamaConfig

    block = Llama(LlamaConfig.tiny()).layers[0]
    infos = [describe_param(block, name, p) for name, p in block.named_parameters()]
    unit = plan_unit_layout(infos, world)  # the packing fully_shard(block) uses
    span = lambda s: Span(s.info.name, s.info.shape, s.offset, s.end, s.row_size)
    by_offset = lambda b: sorted(map(span, b.slots), key=lambda s: s.start)
    buckets = [(b.shard_size, by_offset(b)) for b in unit.buckets]  # (shard size, spans)
    # one axis per bucket, each on its own scale: the norms' bucket is 64 elements long
    fig, axes = plt.subplots(len(buckets), 1, figsize=(8, 1.9 * len(buckets) + 0.6), dpi=DPI)
    colours = plt.get_cmap("Pastel1").colors + plt.get_cmap("Pastel2").colors
    for i, (ax, (S, spans)) in enumerate(zip(axes, buckets)):
        cursor = 0
        for j, s in enumerate(spans + [Span("", (), world * S, world * S, 1)]):
            if s.start > cursor:  # padding, hatched
                ax.barh(0, s.start - cursor, left=cursor, color="w", hatch="////", ec="0.4")
            cursor = s.end
            if s.name:
                ax.barh(0, s.end - s.start, left=s.start, color=colours[j % len(colours)], ec="k")
                # the label goes in the param's largest piece, clear of the rank cuts
                _, a, b = max(pieces(s, S, world), key=lambda p: p[2] - p[1])
                _text(ax, (a + b) / 2, 0, s.short + "\n" + "×".join(map(str, s.shape)))
        # the rank cuts, each with the rows of the param it splits either side of it
        for r in range(1, world):
            ax.axvline(r * S, color="k", lw=2)
            left, right = "between params ", ""
            for s in spans:
                if s.start < r * S < s.end:
                    k, rows = (r * S - s.start) // s.row, (s.end - s.start) // s.row
                    left, right = f"{s.short} rows 0–{k - 1} ", f" {k}–{rows - 1}"
            _text(ax, r * S, -0.6, left, ha="right")
            _text(ax, r * S, -0.6, right, ha="left")
        for r in range(world):
            _text(ax, (r + 0.5) * S, 0.6, f"rank {r}: {S:,} el.", fontsize=8, color=FLATSHARD)
        used = sum(s.end - s.start for s in spans)
        if world * S > used:
            _text(ax, world * S, 0.85, f"padding {world * S - used} el. ", ha="right")
        ax.set_title(f"bucket {i}: {used:,} elements + {world * S - used:,} padding", fontsize=9)
        ax.set(xlim=(0, world * S), ylim=(-1, 1), yticks=[])
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("offset in the flat bucket (elements)")
    fig.suptitle(
        f"How flatshard lays out one Llama block (LlamaConfig.tiny) for {world} ranks: padding "
        f"{100 * unit.padding_fraction:.2f}%\nequal shards; every cut falls on a row boundary, "
        "so each rank holds whole rows",
        fontsize=10,
    )
    fig.tight_layout()
    path = _save(fig, out_dir, "layout.png")
    names = [name for name, _ in block.named_parameters()]
    return dict(path=path, world=world, buckets=buckets, params=names, unit=unit)


# -- 2. per-rank memory from the planner -----------------------------------------------------

LAYOUTS = {
    "ZeRO-1": ["--zero-stage", "1"],
    "ZeRO-2": ["--zero-stage", "2"],
    "ZeRO-3": [],
    "ZeRO-3\noffload 0.5": ["--offload", "0.5"],
    "ZeRO-3\nAC full": ["--ac", "full"],
    "ZeRO-3\nLoRA r16": ["--lora", "16"],
}
OTHER = "gathered weights + gradient buffers"  # the unsharded working set
PARTS = {  # stacked segment -> colour
    "fp32 weight shards": FLATSHARD,
    "fp32 gradient shards": "#8fb8f0",
    "optimizer state (AdamW)": "#5b3fa8",
    "activations": "#59a14f",
    OTHER: "#9edae5",
}
HOST = "on the host (offload), not the device"


def plan_json(*args: str) -> dict:
    """`flatshard plan ... --json`, run in-process: the CLI's own defaults and arithmetic."""
    from flatshard.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *args, "--json"])
    if code:
        raise RuntimeError(f"flatshard plan {' '.join(args)} exited with {code}")
    return json.loads(out.getvalue())


def moments(memory: dict) -> dict[str, dict[str, int]]:
    """The device's bytes at the planner's two candidate peaks, split by what is alive.

    Start of backward: activations, no gradient shards yet; end of backward: gradient
    shards, activations freed (planner/estimate.py). Offload moves a share of the shards to
    the host, rounded as planner/offload_split.py does. The rest is the unsharded working set.
    """
    share = memory["offloaded_share"]
    kept = {k: memory[k] - round(share * memory[k]) for k in ("params", "grads", "optimizer")}
    out = {}
    for moment, alive in (("start of backward", "activations"), ("end of backward", "grads")):
        parts = {
            "fp32 weight shards": kept["params"],
            "fp32 gradient shards": kept["grads"] if alive == "grads" else 0,
            "optimizer state (AdamW)": kept["optimizer"],
            "activations": memory["activations"] if alive == "activations" else 0,
        }
        # the peak less what offload moved of the shards alive then
        moved = sum(memory[k] - kept[k] for k in ("params", "optimizer", alive) if k in kept)
        on_device = memory[f"peak_{moment.replace(' ', '_')}"] - moved
        parts[OTHER] = on_device - sum(parts.values())
        out[moment] = parts
    return out


def memory_figure(out_dir: str, model: str = "llama3-8b", world: int = 8) -> dict:
    plans = {name: plan_json(model, "--world-size", str(world), *a) for name, a in LAYOUTS.items()}
    fig, ax = plt.subplots(figsize=(8, 4.4), dpi=DPI)
    drawn, w, labelled = {}, 0.4, set()
    label = lambda s: None if s in labelled or labelled.add(s) else s  # each legend entry once
    for x, (name, plan) in enumerate(plans.items()):
        memory, drawn[name] = plan["memory"], moments(plan["memory"])
        # two bars per layout, start and end of backward: the peak is the taller
        for dx, parts in zip((-w / 2, w / 2), drawn[name].values()):
            bottom = 0.0
            for part, value in parts.items():
                ax.bar(x + dx, value / GIB, w * 0.95, bottom, color=PARTS[part], label=label(part))
                bottom += value / GIB
            if memory["host"]:  # the offloaded share lives on the host at both moments
                host = memory["host"] / GIB
                hatched = dict(color="w", ec="0.4", hatch="///", label=label(HOST))
                ax.bar(x + dx, host, w * 0.95, bottom, **hatched)
                boxed = dict(fontsize=6, bbox=dict(fc="w", ec="none", pad=0.5))
                _text(ax, x + dx, bottom + host / 2, f"host\n{host:.1f}", **boxed)
                bottom += host
            peak = sum(parts.values()) == memory["device"]
            total = f"{sum(parts.values()) / GIB:.1f}"
            _text(ax, x + dx, bottom + 0.5, total, va="bottom", weight="bold" if peak else None)
    s = next(iter(plans.values()))["setup"]
    ax.set_xticks(range(len(plans)), list(plans), fontsize=8)
    ax.set_ylabel("GiB per rank on the device")
    ax.set_ylim(0, max(p["memory"]["total"] for p in plans.values()) / GIB * 1.35)
    ax.set_title(
        f"Per-rank memory: flatshard plan {model} --world-size {world} --json\n"
        f"{s['param_dtype']} compute, micro-batch {s['micro_batch']} × {s['seq_len']} tokens. "
        "Left bar: start of backward, right: end of backward; bold: the peak",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper right", ncol=3)
    fig.tight_layout()
    return dict(path=_save(fig, out_dir, "memory_per_rank.png"), moments=drawn, plans=plans)


# -- 3. step-time ratios from RESULTS.md -----------------------------------------------------


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse_section(text: str, title: str) -> tuple[str, list[dict]]:
    """The first `##`/`###` section whose heading contains `title` (up to the next heading
    of its level or above): its heading, and compare.py's tables in it, one dict each with
    its preset, world, command and rows {mode: {column: cell}}."""
    lines = text.splitlines()
    heads = [(i, len(m[1])) for i, line in enumerate(lines) if (m := re.match(r"(#+) ", line))]
    first = next(((i, level) for i, level in heads if title in lines[i]), None)
    if first is None:
        raise ValueError(f"no section titled like {title!r}")
    end = next((i for i, level in heads if i > first[0] and level <= first[1]), len(lines))
    tables, above, in_table = [], [], False
    for line in lines[first[0] + 1 : end]:
        if line.startswith("| mode |"):
            tables.append(dict(_describe("\n".join(above)), header=_cells(line), rows={}))
            above, in_table = [], True
        elif in_table and line.startswith("|"):
            cells = _cells(line)
            if not set(cells[0]) <= set("-: "):  # not the |---| rule
                tables[-1]["rows"][cells[0]] = dict(zip(tables[-1]["header"], cells))
        else:
            above.append(line)
            in_table = False
    return lines[first[0]].lstrip("# "), tables


def _describe(text: str) -> dict:
    """Preset, world and command from the lines compare.py writes above its table."""
    found = lambda pattern: (m := re.search(pattern, text)) and m[1]
    return dict(
        command=found(r"- command: `([^`]*)`") or "",
        preset=found(r"preset `([^`]+)`") or "?",
        world=int(found(r"- run: world (\d+)") or 0),
    )


def ratios_figure(out_dir: str, results: str = RESULTS, section: str = SECTION) -> dict:
    with open(results, encoding="utf-8") as f:
        heading, tables = parse_section(f.read(), section)
    ratio = lambda row, col: None if row.get(col, "n/a") == "n/a" else float(row[col])
    groups = []  # one group of bars per table: (label, [(mode, ×FSDP2, ×DDP)])
    for t in tables:
        bars = [(m, ratio(r, "×FSDP2"), ratio(r, "×DDP")) for m, r in t["rows"].items()]
        bars = [bar for bar in bars if bar[0].startswith("flatshard")]
        if bars:
            groups.append((f"{t['preset']}, world {t['world']}", bars))
    if not groups:
        raise ValueError(f"section {section!r} of {results} has no flatshard rows")
    fig, ax = plt.subplots(figsize=(8, 4.6), dpi=DPI)
    w, x, ticks, labels, values = 0.38, 0.0, [], [], []
    for group, bars in groups:
        first = x
        for mode, *peers in bars:
            for dx, value, colour in zip((-w / 2, w / 2), peers, (FSDP2, DDP)):
                if value is not None:
                    ax.bar(x + dx, value, w, color=colour)
                    _text(ax, x + dx, value + 0.01, f"{value:.2f}", va="bottom")
                    values.append(value)
            ticks.append(x)
            labels.append(textwrap.fill(mode.removeprefix("flatshard "), 12))
            x += 1
        # the table's preset and world, under its modes
        xaxis = ax.get_xaxis_transform()
        _text(ax, (first + x - 1) / 2, -0.2, group, va="top", fontsize=8, transform=xaxis)
        x += 0.5  # a gap between tables
    for i, (peer, colour) in enumerate((("PyTorch FSDP2", FSDP2), ("DDP", DDP))):
        if any(bar[1 + i] is not None for _, bars in groups for bar in bars):
            ax.bar(0, 0, color=colour, label=f"flatshard step ÷ {peer} step")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("wall time per step: ratio\n(< 1: flatshard faster)", fontsize=9)
    ax.set_ylim(0, max(values) * 1.2)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(
        "Step time against PyTorch FSDP2 and DDP (step-paired medians), from "
        f"{os.path.basename(results)}:\n{textwrap.shorten(heading, 110)}",
        fontsize=9,
    )
    # the commands that made the tables; the output path is no part of the experiment
    commands = [re.sub(r"^python benchmarks/|\s--out\s+\S+", "", t["command"]) for t in tables]
    caption = "\n".join(textwrap.shorten(c, 130) for c in dict.fromkeys(commands) if c)
    fig.text(0.01, 0.01, caption, fontsize=6.5, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.025 * (caption.count("\n") + 1), 1, 1))
    path = _save(fig, out_dir, "benchmark_ratios.png")
    return dict(path=path, heading=heading, tables=tables, groups=groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"))
    parser.add_argument("--results", default=RESULTS, help="compare.py's markdown output")
    parser.add_argument("--section", default=SECTION, help="(part of) a section's heading")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(layout_figure(args.out)["path"])
    print(memory_figure(args.out)["path"])
    print(ratios_figure(args.out, args.results, args.section)["path"])


if __name__ == "__main__":
    main()
