"""Padding of the row-aligned layout on the transformer layers of real models.

The models are `flatshard plan`'s zoo (flatshard/planner/zoo.py, shapes from the public
configs; the one home of model shapes); each distinct layer shape is laid out at several
data-parallel sizes and compared with the single-LCM rule. "finer" counts the grouped
expert weights laid out with a finer row (fewer experts than ranks: each rank holds some
dim-1 rows of one expert, planner.py `finer_row`). Run:

    python scripts/padding_report.py

tests/test_layout_padding.py asserts the bound on the same layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runnable from a checkout without installing flatshard.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatshard.layout import ParamInfo, plan_unit_layout, single_lcm_padded_size  # noqa: E402
from flatshard.planner.zoo import ZOO, resolve  # noqa: E402

WORLD_SIZES = (2, 8, 64)


def layers() -> dict[str, tuple[ParamInfo, ...]]:
    """Every zoo model's transformer layer shapes (not the embedding or head)."""
    out = {}
    for model in ZOO:
        blocks = [unit for unit in resolve(model).units if not unit.is_root]
        for unit in blocks:
            kind = unit.name.partition(" ")[2]  # "(MoE)", "(dense)" where a model has both
            out[f"{model} {kind}".strip()] = unit.params
    return out


def padding_rows(world_sizes=WORLD_SIZES) -> list[tuple[str, int, float, float, int, int]]:
    """(layer, world size, our padding %, single-LCM padding %, buckets, params with a
    finer row) per layer and size."""
    rows = []
    for model, params in layers().items():
        for world_size in world_sizes:
            layout = plan_unit_layout(params, world_size)
            used = layout.used_size
            naive = single_lcm_padded_size(params, world_size) - used
            ours = 100 * layout.padding / used
            finer = sum(info.row_dims > 1 for info in layout.params)
            rows.append((model, world_size, ours, 100 * naive / used, len(layout.buckets), finer))
    return rows


def format_table(rows) -> str:
    header = (
        f"{'layer':<28} {'world':>5} {'padding %':>10} {'single-LCM %':>13} {'buckets':>7} "
        f"{'finer':>5}"
    )
    lines = [header, "-" * len(header)]
    for model, world_size, ours, naive, buckets, finer in rows:
        lines.append(
            f"{model:<28} {world_size:>5} {ours:>10.4f} {naive:>13.4f} {buckets:>7} {finer:>5}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print("padding per transformer layer (% of parameter elements)")
    print(format_table(padding_rows()))
