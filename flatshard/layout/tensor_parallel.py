"""Where a tensor-parallel rank's local parameter sits in the global tensor.

Before FSDP shards a TP parameter by rows, the layout needs its TP-local shape and the
global coordinates of that local tensor: one block at an offset (`Shard(d)` or
`Replicate` over TP), or, for a fused parameter split per component (`[gate_r; up_r]`,
`_StridedShard`), rank r's share of every component. Components keep their global
meaning (the gate tensor, the up tensor), so checkpoints never depend on the TP size.
"""

from __future__ import annotations

from collections.abc import Sequence

from flatshard.errors import LayoutError
from flatshard.layout.params import Component, ParamInfo


def tp_block_info(
    name: str,
    dtype,
    requires_grad: bool,
    global_shape: Sequence[int],
    local_shape: Sequence[int],
    offset: Sequence[int],
    components: Sequence[Component] = (),
) -> ParamInfo:
    """A local parameter that is the block of its global tensor at `offset`; `components`
    are the global parameter's (declared for its global shape)."""
    local_shape, offset = tuple(local_shape), tuple(offset)
    local = []
    for c in components:
        low = min(max(c.start, offset[c.dim]), offset[c.dim] + local_shape[c.dim])
        high = max(min(c.stop, offset[c.dim] + local_shape[c.dim]), low)
        slab_shape = tuple(c.size if d == c.dim else n for d, n in enumerate(global_shape))
        slab_offset = tuple(low - c.start if d == c.dim else o for d, o in enumerate(offset))
        local.append(
            Component(
                c.name,
                c.dim,
                low - offset[c.dim],
                high - offset[c.dim],
                slab_shape,
                slab_offset,
                fused_start=c.start,
            )
        )
    return ParamInfo(
        name, local_shape, dtype, requires_grad, tuple(local), tuple(global_shape), offset
    )


def tp_split_info(
    name: str,
    dtype,
    requires_grad: bool,
    global_shape: Sequence[int],
    components: Sequence[Component],
    rank: int,
    size: int,
) -> ParamInfo:
    """A local parameter holding TP rank `rank`'s `1/size` of every component, stacked in
    order along their dim (`[gate_r; up_r]`)."""
    if not components:
        raise LayoutError(f"{name!r}: a parameter split by components needs components")
    dim = components[0].dim
    local, start = [], 0
    for c in components:
        if c.dim != dim or c.size % size:
            raise LayoutError(
                f"{name!r}: component {c.name!r} ({c.size} along dim {c.dim}) cannot be split "
                f"evenly over {size} tensor-parallel ranks"
            )
        part = c.size // size
        slab_shape = tuple(c.size if d == dim else n for d, n in enumerate(global_shape))
        slab_offset = tuple(rank * part if d == dim else 0 for d in range(len(global_shape)))
        local.append(Component(c.name, dim, start, start + part, slab_shape, slab_offset, c.start))
        start += part
    local_shape = tuple(start if d == dim else n for d, n in enumerate(global_shape))
    return ParamInfo(
        name,
        local_shape,
        dtype,
        requires_grad,
        tuple(local),
        tuple(global_shape),
        split_by_components=True,
    )
