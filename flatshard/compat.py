"""What differs between the torch versions flatshard runs on, detected by feature (never by
version string), in one place.

- The single-tensor collectives: torch 2.13 names them `all_gather_single` /
  `reduce_scatter_single` (the older `all_gather_into_tensor` / `reduce_scatter_tensor`
  warn and forward to them); earlier releases have only the older names. Looked up at each
  call, so anything that wraps `torch.distributed`'s functions (a byte counter, a test)
  still sees the call.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op=False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
