"""A unit's gradients: one flat buffer per bucket that autograd accumulates into, the
reduce-scatter into the sharded gradients, and accumulation without sync.

Before a unit's backward, each unsharded parameter's `.grad` is pointed at its place in a
zeroed flat buffer per bucket, so autograd adds every gradient in place (no per-parameter
copy). After it, each bucket is reduce-scattered asynchronously; the previous unit's
reduce-scatter finishes then, so at most two are in flight (`ReduceQueue`). Finished
shards become the parameters' DTensor `.grad`s (views of one flat shard, added to when
gradients accumulate). Under `set_requires_gradient_sync(False)` the flat buffers are kept
(low-precision ones summed in the reduce dtype) and reduced with the next synced backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flatshard import comm
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import gradient_dtensor, local_data
from flatshard.errors import UnevenShardError
from flatshard.runtime import subclass_grads
from flatshard.runtime.flat_bucket import FlatBucket
from flatshard.runtime.managed_param import ParamHome


@dataclass
class PendingReduce:
    sync: GradientSync
    bucket: FlatBucket
    work: object
    output: torch.Tensor
    keep_alive: torch.Tensor
    post_scale: float | None


class ReduceQueue:
    """Reduce-scatters in flight, oldest first (one per model root)."""

    def __init__(self):
        self.pending: list[PendingReduce] = []

    def finish(self, keep: int = 0) -> None:
        """Finish all but the newest `keep` (memory stays bounded)."""
        while len(self.pending) > keep:
            pending = self.pending.pop(0)
            pending.sync.finish(pending)


class GradientSync:
    def __init__(self, unit):
        self.unit = unit
        self.requires_sync = True
        self.requires_all_reduce = True  # HSDP: sum over the replicas on every sync
        self.force_sum = False  # SUM then divide, never the collective's AVG
        self.divide_factor = float(unit.mesh.dp_size)
        self.all_reduce_hook = None  # FSDP2's set_all_reduce_hook: sees each reduced shard
        self._holds_unsynced = False

    @property
    def holds_unsynced(self) -> bool:
        """Gradients of backwards without sync wait to be reduced."""
        return self._holds_unsynced

    def _trainable_in(self, bucket: FlatBucket):
        return [p for p in self.unit.trainable if self.unit.buckets[p.bucket] is bucket]

    def _trained_buckets(self) -> list[FlatBucket]:
        """Buckets holding a parameter that requires gradients now."""
        trained = {id(self.unit.buckets[p.bucket]) for p in self.unit.trainable}
        return [b for b in self.unit.buckets if id(b) in trained]

    def prepare(self) -> None:
        """Zeroed flat gradient buffers that the unsharded parameters' `.grad` views;
        autograd then adds each gradient in place. Unsynced gradients are kept."""
        unit = self.unit
        unit.make_unsharded_params()
        for bucket in self._trained_buckets():
            bucket.grads.prepare(
                self._holds_unsynced, unit.context.buffers, bucket.shard.main.device
            )
        for param in unit.trainable:
            bucket = unit.buckets[param.bucket]
            view = bucket.unsharded_view(bucket.grads.unsharded, param.index)
            grad = param.unsharded.grad
            if grad is not None:
                grad = grad.to_local() if param.tp_placement is not None else grad
                if grad.data_ptr() != view.data_ptr():
                    view.add_(grad)  # a gradient autograd allocated itself (no hook ran first)
            param.unsharded.grad = param.as_unsharded(view, unit.mesh, bucket.specs[param.index])

    def reduce(self) -> None:
        """The unit's backward is done: reduce-scatter its gradients (or hold them)."""
        unit = self.unit
        if not self.requires_sync:
            for bucket in self._trained_buckets():
                if bucket.grads.hold_unsynced():
                    for param in self._trainable_in(bucket):
                        param.unsharded.grad = None
            if unit.subclass is not None:
                subclass_grads.hold(unit.subclass)
            self._holds_unsynced = True
            return
        queue = unit.context.reduces
        keeps_buffers = unit.resharding.keep_grad_buffers
        started = 0
        for bucket in self._trained_buckets():  # an entirely frozen bucket moves nothing
            if bucket.grads.pending:
                work, output, keep_alive, post_scale = bucket.start_reduce_scatter(
                    self.divide_factor,
                    unit.world_size,
                    unit.mesh.replicate_size,
                    unit.context.buffers,
                    self.force_sum,
                )
                queue.pending.append(
                    PendingReduce(self, bucket, work, output, keep_alive, post_scale)
                )
                started += 1
                if keep_alive is not bucket.grads.unsharded and not keeps_buffers:
                    # the reduce-scatter reads a copy in the reduce dtype: the param-dtype
                    # buffer is free now, not when the reduce-scatter ends
                    bucket.grads.release(unit.context.buffers)
        self._holds_unsynced = False
        for param in unit.trainable:
            param.unsharded.grad = None
        if unit.subclass is not None:
            subclass_grads.reduce(unit.subclass, self)
        # Bound memory: finish every earlier reduce-scatter, keep only this unit's in flight.
        queue.finish(keep=started)

    def finish(self, pending: PendingReduce) -> None:
        pending.work.wait()
        reduced = pending.output
        if pending.post_scale is not None:
            reduced.mul_(pending.post_scale)
        bucket = pending.bucket
        self.accumulate(bucket, reduced)
        pool = self.unit.context.buffers
        if pending.keep_alive is not bucket.grads.unsharded:
            pool.give_back(pending.keep_alive)  # a copy in the reduce dtype
        if not self.unit.resharding.keep_grad_buffers:
            bucket.grads.release(pool)

    def accumulate(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        """A bucket's gradient shard, summed over the shard group and divided: sum it over
        the replicas (HSDP; held back while `requires_all_reduce` is off) and add it to the
        parameters' gradients."""
        mesh = self.unit.mesh
        if mesh.replicate_group is not None:
            held = bucket.grads.unreplicated
            if held is not None:
                reduced = held.add_(reduced)
            if not self.requires_all_reduce:
                bucket.grads.unreplicated = reduced
                return
            bucket.grads.unreplicated = None
            comm.all_reduce(reduced, mesh.replicate_group)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(reduced)
        self.add_reduced(bucket, reduced)

    def discard(self) -> None:
        """Drop every gradient not yet added to the parameters (a failed iteration's)."""
        for bucket in self.unit.buckets:
            bucket.grads.drop(self.unit.context.buffers)
        self._holds_unsynced = False
        for param in self.unit.params:
            if param.unsharded is not None:
                param.unsharded.grad = None
        if self.unit.subclass is not None:
            subclass_grads.drop(self.unit.subclass)

    def add_reduced(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        """Add a bucket's reduced gradient shard to its parameters' `.grad`s (set them
        to views of it when there are none yet)."""
        params = self._trainable_in(bucket)
        kept = bucket.shard.grad
        if kept is not None and all(
            p.sharded.grad is not None
            and ParamHome(self.unit, p).holds_flat_grad(local_data(p.sharded.grad), kept)
            for p in params
        ):
            bucket.shard.add_to_grad(reduced)  # gradient accumulation: one flat add (per part)
            return
        fresh = reduced.to(bucket.shard.dtype)
        for param in params:
            if param.sharded.grad is not None:  # a gradient flatshard does not own yet
                rows = bucket.shard.piece(fresh, param.index)
                rows.add_(_own_rows(param, rows).to(rows.device))
        kept = bucket.shard.keep_grad(fresh)
        for param in params:
            param.sharded.grad = gradient_dtensor(
                bucket.shard.grad_rows(kept, param.index),
                param.sharded,
                tier=bucket.shard.tier_of(param.index),  # SGD's momentum is a clone of it
            )


def _own_rows(param, rows: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a gradient someone else put on a flatshard parameter; it must
    use flatshard's row layout (a chunk-sharded one would land on the wrong rows)."""
    local = param.sharded.grad._local_tensor
    if not isinstance(local, RowShard):  # the same answer on every rank: safe to raise
        raise UnevenShardError(
            f"the gradient on {param.fqn!r} was not produced in flatshard's row layout (e.g. "
            "by differentiating through full_tensor()); compute losses on the module's "
            "parameters, or set .grad from to_local() rows"
        )
    return local.data_
