"""Padding of the layout on one transformer layer of real models (shapes from public configs)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from padding_report import WORLD_SIZES, format_table, layers, padding_rows  # noqa: E402

from flatshard.layout import UnitLayout, plan_unit_layout  # noqa: E402

MAX_PADDING_FRACTION = 0.005
LAYERS = layers()


def check_invariants(layout: UnitLayout) -> None:
    """The layout invariants by interval arithmetic (no per-element walk: billions of them);
    every rank's piece is one box of the parameter, and the boxes tile it exactly once."""
    for bucket in layout.buckets:
        assert bucket.padded_size == layout.world_size * bucket.shard_size
        filled = sorted((s for s in bucket.slots if s.numel), key=lambda s: s.offset)
        for before, after in zip(filled, filled[1:], strict=False):
            assert before.end <= after.offset
        for slot in bucket.slots:
            assert slot.end <= bucket.padded_size
            assert slot.info.dtype == bucket.dtype
            if slot.info.row_dims > 1:  # a finer row: a bucket of its own
                assert len(bucket.slots) == 1
            held_rows = 0
            boxes = []
            for rank in range(layout.world_size):
                piece = bucket.spec(slot, rank)
                assert piece.row_start == held_rows
                held_rows = piece.row_end
                assert math.prod(piece.local_shape) == piece.numel
                if piece.numel:
                    # The piece is whole rows at the same place in the bucket and the shard.
                    start = slot.offset + piece.row_start * slot.row_size
                    assert bucket.bucket_to_shard(start) == (rank, piece.shard_offset)
                    assert piece.shard_offset + piece.numel <= bucket.shard_size
                    (_, box), = piece.pieces  # fmt: skip
                    assert box == piece.global_box
                    boxes.append(box)
            assert held_rows == slot.rows
            _check_boxes_tile(slot.info, boxes)


def _check_boxes_tile(info, boxes) -> None:
    """The boxes lie in the parameter's place in its global tensor, are disjoint and cover
    it (their volumes add up to it): it is tiled exactly once."""
    low = info.global_offset
    high = tuple(o + n for o, n in zip(low, info.shape))
    for box in boxes:
        ends = zip(box.offset, box.shape, low, high)
        assert all(lo <= o and o + n <= hi for o, n, lo, hi in ends)
    assert sum(math.prod(box.shape) for box in boxes) == info.numel
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert any(
                oa + na <= ob or ob + nb <= oa
                for oa, na, ob, nb in zip(a.offset, a.shape, b.offset, b.shape)
            ), f"{info.name}: {a} and {b} overlap"


@pytest.mark.parametrize("model", LAYERS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layer_padding_is_small(model, world_size):
    layout = plan_unit_layout(LAYERS[model], world_size)
    check_invariants(layout)
    assert layout.padding_fraction <= MAX_PADDING_FRACTION, layout.report()
    assert not layout.empty_ranks()


def test_mixtral_at_64_takes_a_finer_row_for_its_experts():
    # 8 experts over 64 ranks: each rank holds 1/8 of one expert's rows, one box per rank
    layout = plan_unit_layout(LAYERS["mixtral-8x7b"], 64)
    check_invariants(layout)
    finer = {info.name: info for info in layout.params if info.row_dims == 2}
    assert sorted(finer) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"], finer
    index = [info.name for info in layout.params].index("mlp.experts.gate_up_proj")
    gate_up = layout.params[index]
    experts, rows, cols = gate_up.shape
    for rank in (0, 7, 8, 63):
        spec = layout.spec(index, rank)
        assert spec.local_shape == (1, rows // 8, cols)
        assert spec.global_offset == (rank // 8, rank % 8 * rows // 8, 0)
    assert layout.padding == 0 or layout.padding_fraction < MAX_PADDING_FRACTION


def test_finer_row_only_where_ranks_split_experts_evenly():
    from flatshard.layout import ParamInfo

    def row_dims(shape, world_size):
        return plan_unit_layout([ParamInfo("w", shape, "f")], world_size).params[0].row_dims

    assert row_dims((8, 16, 4), 64) == 2  # 8 ranks per expert, 16 rows: 2 each
    assert row_dims((8, 16, 4), 8) == 1  # one expert per rank already
    assert row_dims((8, 12, 4), 64) == 1  # 8 does not divide 12 rows: today's layout
    assert row_dims((6, 16, 4), 64) == 1  # 64 ranks are not a multiple of 6 experts
    assert row_dims((8, 64), 64) == 1  # 2-D: a row is already small


def test_print_padding_table():
    rows = padding_rows()
    print("\n" + format_table(rows))
    grouped_beats_naive = [ours <= naive for _, _, ours, naive, _, _ in rows]
    assert all(grouped_beats_naive)
