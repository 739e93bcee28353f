"""How one bucket's collectives move its bytes, chosen once per bucket (at build, and by the
module's comm settings: `set_comm_policy`, `set_custom_all_gather` / `_reduce_scatter`).

- `gather`: None runs the shard group's all-gather; a function (bucket, output, shard,
  group, pieces) -> work replaces it, e.g. to move quantized (qwZ) or a user's bytes and
  fill `output` (the compute dtype) at wait().
- `scatter`: None runs the group's reduce-scatter; a function (bucket, output, flat,
  average, group) -> work leaves this rank's summed (averaged) shard of `flat` in `output`
  at wait() (qgZ, a user's ReduceScatter).
- `subclass_bytes`: a unit's tensor-subclass parameters (subclass_params.py) whose bytes
  travel in this bucket's plain all-gather, after its shard's: one collective a unit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flatshard import comm


@dataclass
class Transport:
    gather: Callable | None = None
    scatter: Callable | None = None
    subclass_bytes: object = None  # a runtime.subclass_params.SubclassGather

    def all_gather(self, bucket, output, shard, group, pieces=None):
        if self.gather is not None:
            return self.gather(bucket, output, shard, group, pieces)
        if self.subclass_bytes is not None and pieces is not None:  # not hpZ's in a subgroup
            return self.subclass_bytes.gather_with(output, shard, group)
        return comm.for_group(group).all_gather(output, shard, pieces)

    def reduce_scatter(self, bucket, output, flat, average: bool, group, pool):
        if self.scatter is not None:
            return self.scatter(bucket, output, flat, average, group)
        return comm.for_group(group).reduce_scatter(output, flat, average, pool)
