"""Where a unit's shards live, and the sharded parameters that view them.

A unit built on the meta device gets real shards on its device (`allocate`, FSDP2's
`to_empty`); optimizer offload moves each bucket's shard from its cut on to the host
(`place_offloaded`, the layout's choice made over the whole model: offload.py). Either
way the moved pieces get new sharded parameters in the modules, and the old ones are
marked, so an optimizer built on them is an error rather than silently idle.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flatshard import registry
from flatshard.dtensor.sharded_param import RowShardedParameter, make_row_sharded_dtensor
from flatshard.errors import WrappingError
from flatshard.runtime.flat_bucket import FlatBucket


def sharded_parameter(
    bucket: FlatBucket, index: int, mesh, requires_grad: bool, tp_placement=None
) -> nn.Parameter:
    """The sharded parameter of slot `index` of `bucket`: a `RowShardedParameter` (a DTensor)
    whose local tensor is this rank's rows, a view of the bucket's main weights (on the
    host when the piece is offloaded: the optimizer then steps it there)."""
    rows, spec = bucket.shard.rows(index), bucket.specs[index]
    base, tier = bucket.shard.base(index), bucket.shard.tier_of(index)
    dtensor = make_row_sharded_dtensor(rows, mesh, spec, base, tp_placement, tier)
    param = nn.Parameter(dtensor, requires_grad=requires_grad)
    param.__class__ = RowShardedParameter  # `.data =` loads instead of being dropped
    return param


def allocate(unit, device: torch.device) -> None:
    """Give a unit built on the meta device real (zeroed) shards on `device`, as FSDP2's
    `to_empty` does: new sharded parameters take the meta ones' places."""
    if not any(b.on_meta for b in unit.buckets):
        return
    for bucket in unit.buckets:
        bucket.allocate(device)
    _renew_sharded_params(unit)


def convert(unit, fn) -> None:
    """A module conversion (`to_empty`, `.to(dtype)`, `.double()`, ...) applied to a unit's
    shards: `to_empty` of a unit still on meta allocates them on the mesh's device; a new
    floating-point dtype converts them (and the compute and reduce dtypes the mixed
    precision policy leaves open), as FSDP2 converts its sharded parameters. Moving them
    to another device is refused: they live where the mesh communicates."""
    changed = False
    for bucket in unit.buckets:
        probe = bucket.shard.main.new_empty(0)
        converted = fn(probe)
        if not isinstance(converted, torch.Tensor):
            continue
        if bucket.on_meta and converted.device == unit.mesh.device:
            allocate(unit, unit.mesh.device)  # to_empty of a model built on meta
        elif converted.device != probe.device:
            raise WrappingError(
                f"moving a fully_shard-ed module to {converted.device} would leave its "
                f"sharded parameters on {probe.device}, where its mesh communicates. Move "
                "the model before fully_shard, or build it on the meta device."
            )
        if converted.dtype != bucket.shard.dtype and converted.dtype.is_floating_point:
            bucket.convert(converted.dtype, unit.mp_policy)
            changed = True
    if changed:
        _renew_sharded_params(unit)


def place_offloaded(unit, cuts: list[int], pin_memory: bool, tier) -> None:
    """Move each bucket's shard from its cut on to the host; the moved pieces get new
    sharded parameters there (before an optimizer is built on them)."""
    moved = [bucket.shard.place(cut, pin_memory, tier) for bucket, cut in zip(unit.buckets, cuts)]
    if any(moved):
        _renew_sharded_params(unit)


def _renew_sharded_params(unit) -> None:
    for param in unit.params:
        old = param.sharded
        param.sharded = sharded_parameter(
            unit.buckets[param.bucket], param.index, unit.mesh, old.requires_grad,
            param.tp_placement,
        )  # fmt: skip
        registry.bind_param(param.sharded, unit, param)
        registry.mark_replaced(old, param.sharded)  # an optimizer built on it: an error
        param.unsharded = None
        for module, name in param.occurrences:
            module._parameters[name] = param.sharded
