"""One parameter of a unit (unit.py): where it is registered, its sharded DTensor and the
unsharded view of the gathered buffer that forward and backward use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


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
