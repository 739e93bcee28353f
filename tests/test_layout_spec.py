"""`ShardSpec`s tile every parameter and every component exactly, for random layouts.

Values make mistakes visible: each parameter is filled with distinct numbers, placed in a
larger global tensor (as a TP/EP shard would be), and every rank's piece, cut by its spec,
must be the same numbers as the global tensor's box and each component's stored tensor.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flatshard.layout import Component, ParamInfo, plan_unit_layout, whole_param_spec


@st.composite
def placed_params(draw):
    """A parameter, where it sits in a larger global tensor, and its components."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    extra = draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim))
    offset = tuple(draw(st.integers(0, e)) for e in extra)
    global_shape = tuple(n + e for n, e in zip(shape, extra))
    components = ()
    dim = draw(st.integers(0, ndim - 1))
    if shape[dim] > 0 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, shape[dim]), max_size=3)))
        edges = [0, *cuts, shape[dim]]
        components = tuple(
            Component(f"c{i}", dim, a, b, _component_global(shape, dim, b - a, i), _at(ndim, i))
            for i, (a, b) in enumerate(zip(edges, edges[1:]))
        )
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return ParamInfo("p", shape, dtype, True, components, global_shape, offset)


def _component_global(shape, dim, size, i):
    # a stored component tensor a little larger than the slab, the slab at offset i
    return tuple((size if d == dim else n) + i for d, n in enumerate(shape))


def _at(ndim, i):
    return (i,) * ndim


param_lists = st.lists(placed_params(), max_size=6).map(
    lambda ps: [
        ParamInfo(f"p{i}", p.shape, p.dtype, True, p.components, p.global_shape, p.global_offset)
        for i, p in enumerate(ps)
    ]
)


def _values(info: ParamInfo, seed: int) -> torch.Tensor:
    return torch.arange(info.numel, dtype=torch.float64).add_(seed * 1000).view(info.shape)


def _check_tiling(info: ParamInfo, specs) -> None:
    param = _values(info, 1)
    global_tensor = torch.full(info.global_shape, float("nan"), dtype=torch.float64)
    global_tensor[tuple(slice(o, o + n) for o, n in zip(info.global_offset, info.shape))] = param
    covered = torch.zeros(info.global_shape, dtype=torch.int64)
    stored = {}
    for c in info.components:
        stored[c.name] = torch.full(c.global_shape, float("nan"), dtype=torch.float64)
        box = tuple(slice(o, o + n) for o, n in zip(c.global_offset, c.select(param).shape))
        stored[c.name][box] = c.select(param)
    component_cover = {
        c.name: torch.zeros(c.global_shape, dtype=torch.int64) for c in info.components
    }
    for spec in specs:
        local = spec.rows_of(param)
        assert tuple(local.shape) == spec.local_shape
        assert torch.equal(spec.piece_of(global_tensor), local)
        covered[spec.global_box.slices] += 1
        for piece in spec.components:
            assert torch.equal(local[piece.local.slices], stored[piece.name][piece.stored.slices])
            component_cover[piece.name][piece.stored.slices] += 1
    in_param = ~global_tensor.isnan()
    assert torch.equal(covered, in_param.long()), "pieces must tile the parameter's box once"
    for c in info.components:
        expected = (~stored[c.name].isnan()).long()
        assert torch.equal(component_cover[c.name], expected), f"component {c.name}"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(param_lists, st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
@example(  # a parameter with zero rows on most ranks, and one longer than a shard
    [
        ParamInfo(
            "small", (2, 3), "f", components=(Component("a", 0, 0, 1), Component("b", 0, 1, 2))
        ),
        ParamInfo(
            "long", (20, 2), "f", components=(Component("g", 1, 0, 1), Component("u", 1, 1, 2))
        ),
    ],
    8,
)
@example(  # grouped experts with fewer experts than ranks, gate/up along dim 1
    [ParamInfo("experts", (3, 4, 2), "f",
               components=(Component("gate", 1, 0, 2), Component("up", 1, 2, 4)),
               global_shape=(6, 4, 2), global_offset=(3, 0, 0))],
    4,
)  # fmt: skip
@example(  # zero-numel params: no rows, no columns (with components), 1-D empty
    [ParamInfo("empty_rows", (0, 4), "f"),
     ParamInfo("w", (1, 3), "f"),
     ParamInfo("empty_cols", (3, 0), "f",
               components=(Component("a", 0, 0, 1), Component("b", 0, 1, 3))),
     ParamInfo("empty", (0,), "f"),
     ParamInfo("v", (4, 2), "f", components=(Component("x", 1, 0, 1), Component("y", 1, 1, 2)))],
    4,
)  # fmt: skip
@example(  # grouped experts: 8 experts over 64 ranks, gate/up along dim 1, next to a norm
    [ParamInfo("experts", (8, 6, 4), "f",
               components=(Component("gate", 1, 0, 3), Component("up", 1, 3, 6))),
     ParamInfo("norm", (4,), "f")],
    64,
)  # fmt: skip
@example(  # finer rows: 2 experts (of 4, EP-like offset) over 8 ranks, gate/up along dim 1
    [ParamInfo("experts", (2, 8, 3), "f",
               components=(Component("gate", 1, 0, 4), Component("up", 1, 4, 8)),
               global_shape=(4, 8, 3), global_offset=(2, 0, 0)),
     ParamInfo("norm", (3,), "f"),
     ParamInfo("down", (1, 3, 6), "f", global_shape=(4, 3, 6), global_offset=(1, 0, 0))],
    3,
)  # fmt: skip
@example(  # finer rows: 1 local expert over 2 ranks, an odd row split of 3 rows each
    [ParamInfo("experts", (1, 6, 2), "f",
               components=(Component("gate", 1, 0, 3), Component("up", 1, 3, 6)),
               global_shape=(2, 6, 2), global_offset=(1, 0, 0))],
    2,
)  # fmt: skip
def test_spec_pieces_tile_global_tensor_and_components(params, world_size):
    layout = plan_unit_layout(params, world_size)
    for index, info in enumerate(layout.params):
        specs = [layout.spec(index, rank) for rank in range(world_size)]
        _check_tiling(info, specs)
        if info.row_dims > 1:  # a finer row: every rank holds one box of one expert
            assert all(spec.numel and spec.local_shape[0] == 1 for spec in specs)


def test_finer_row_pieces_are_one_expert_box_each():
    # 2 experts over 4 ranks: each rank holds half the rows of one expert
    info = ParamInfo(
        "e", (2, 4, 3), "f", components=(Component("gate", 1, 0, 2), Component("up", 1, 2, 4))
    )
    layout = plan_unit_layout([info], 4)
    assert layout.params[0].row_dims == 2 and layout.padding == 0
    spec = layout.spec(0, 3)
    assert (spec.local_shape, spec.global_offset) == ((1, 2, 3), (1, 2, 0))
    assert spec.pieces == (((_box((0, 0, 0), (1, 2, 3))), _box((1, 2, 0), (1, 2, 3))),)
    assert spec.component("gate").local.empty
    up = spec.component("up")
    assert up.local == _box((0, 0, 0), (1, 2, 3)) and up.stored == _box((1, 0, 0), (1, 2, 3))
    assert spec.global_row_counts == (2, 2, 2, 2)


def _box(offset, shape):
    from flatshard.layout import Box

    return Box(offset, shape)


def test_whole_param_spec_is_the_whole_parameter():
    info = ParamInfo(
        "w", (4, 3), "f", components=(Component("a", 0, 0, 1), Component("b", 0, 1, 4))
    )
    _check_tiling(info, [whole_param_spec(info)])


def test_components_along_dim_one_cut_by_rows():
    # two experts, gate/up along dim 1; world 2: one expert per rank
    info = ParamInfo(
        "e", (2, 4, 3), "f", components=(Component("gate", 1, 0, 2), Component("up", 1, 2, 4))
    )
    layout = plan_unit_layout([info], 2)
    spec = layout.spec(0, 1)
    assert (spec.row_start, spec.row_end) == (1, 2)
    up = spec.component("up")
    assert up.local.offset == (0, 2, 0) and up.local.shape == (1, 2, 3)
    assert up.stored.offset == (1, 0, 0) and up.stored_shape == (2, 2, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 5), st.integers(0, 6),
                          st.integers(0, 5)), min_size=1, max_size=3))  # fmt: skip
def test_box_intersection_is_the_overlap_of_their_cells(dims):
    """`Box.intersection` holds exactly the cells both boxes hold, and `within` finds them
    in each box's own indices (what weight sync's router and receiver cut with)."""
    from flatshard.layout import Box

    a = Box(tuple(d[0] for d in dims), tuple(d[1] for d in dims))
    b = Box(tuple(d[2] for d in dims), tuple(d[3] for d in dims))
    full = tuple(max(o + n for o, n in zip(d[::2], d[1::2])) for d in dims)
    index = torch.arange(int(torch.tensor(full).prod())).reshape(full)
    cells_a, cells_b = (set(index[box.slices].flatten().tolist()) for box in (a, b))
    both = a.intersection(b)
    if both is None:
        assert not cells_a & cells_b
        return
    assert set(index[both.slices].flatten().tolist()) == cells_a & cells_b
    assert torch.equal(index[a.slices][both.within(a)], index[both.slices])
    assert torch.equal(index[b.slices][both.within(b)], index[both.slices])
