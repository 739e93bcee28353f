"""One parameter of a unit (unit.py): where it is registered, its sharded DTensor and the
unsharded view of the gathered buffer that forward and backward use; and its home (the
bucket and storage its rows live in), what any reader of a parameter's storage asks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from flatshard import registry


@dataclass
class ManagedParam:
    """One parameter of a unit: where it is registered, its sharded and unsharded forms."""

    fqn: str
    occurrences: list[tuple[nn.Module, str]]  # (module, attribute); >1 when tied
    bucket: int
    index: int  # position in the bucket's slots
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    tp_placement: object = None  # a TP parameter's placement on the TP mesh (None: not TP)
    shard_dim: int = 0  # the dim its pieces split (FSDP2's Shard(d) from shard_placement_fn)

    def as_unsharded(self, tensor: torch.Tensor, mesh, spec) -> torch.Tensor:
        """A view of the gathered buffer (or its gradient) as forward sees the parameter:
        for a TP parameter, the DTensor of its TP-local piece on the TP mesh."""
        if self.tp_placement is None:
            return tensor
        return DTensor.from_local(
            tensor,
            mesh.inner_mesh,
            [self.tp_placement],
            run_check=False,
            shape=torch.Size(spec.global_shape),
            stride=spec.global_strides,
        )


@dataclass(frozen=True)
class ParamHome:
    """Where a sharded parameter's rows live: its unit, its bucket and its place there. The
    optimizer, loaders and state movement ask this instead of walking the unit's buckets."""

    unit: object  # runtime.unit.Unit
    managed: ManagedParam

    @property
    def index(self) -> int:
        return self.managed.index

    @property
    def bucket(self):
        return self.unit.buckets[self.managed.bucket]

    @property
    def storage(self):
        """The bucket's shard storage (runtime.shard_storage.ShardStorage)."""
        return self.bucket.shard

    @property
    def spec(self):
        """The parameter's ShardSpec: its rows, offsets and global shape."""
        return self.bucket.specs[self.index]

    def rows(self) -> torch.Tensor:
        """Its rows of the main weights (a view of the flat shard)."""
        return self.storage.rows(self.index)

    @property
    def on_host(self) -> bool:
        """Whether optimizer offload keeps its piece on the host."""
        return self.storage.on_host(self.index)

    @property
    def tier(self):
        """The disk tier its optimizer state goes to (None: next to its piece)."""
        return self.storage.tier_of(self.index)

    def side_offset(self) -> tuple[bool, int]:
        """(on the host, offset of its piece in that side's flat buffer)."""
        return self.storage.side_offset(self.index)

    def holds_flat_grad(self, grad: torch.Tensor, kept=None) -> bool:
        """Whether `grad` (the local tensor of its `.grad`) is still its rows of the kept
        flat gradient shard, so a flat step may read the whole shard's gradient at once.
        `kept`: the storage's kept gradient parts, where the caller has read them already."""
        if self.spec.numel == 0:
            return True  # nothing to step (an empty tensor's address means nothing)
        kept = self.storage.grad if kept is None else kept
        host, start = self.side_offset()
        part = None if kept is None else kept[1 if host else 0]
        if part is None or grad.dtype != part.dtype:
            return False
        expected = part.data_ptr() + start * part.element_size()
        return grad.data_ptr() == expected and grad.is_contiguous()


def home_of(param) -> ParamHome | None:
    """The home of one of flatshard's sharded parameters; None for any other tensor."""
    found = registry.managed_of(param)
    return None if found is None else ParamHome(*found)
