"""A unit: what one `fully_shard(module)` call manages, and its forward/backward hooks.

State machine of a unit's parameters: sharded -> gathering -> unsharded -> sharded.
- pre-forward: gather (or wait for a prefetch), register the unsharded parameters on the
  modules, start the next unit's gather; an identity autograd function on the inputs marks
  where this unit's backward ends.
- post-forward: register the sharded DTensor parameters again; ZeRO-3 frees the unsharded
  buffer; hooks on the outputs mark where this unit's backward starts.
- pre-backward (first output gradient): gather again if freed, register the unsharded
  parameters (activation checkpointing recomputes with them), point their `.grad` into one
  flat gradient buffer per bucket (autograd then accumulates in place), prefetch the next.
- post-backward (gradient of the inputs computed): reduce-scatter each bucket
  asynchronously; the previous unit's reduce-scatter is finished then, so at most two are
  in flight. The trigger is the same on every rank even when a rank leaves some parameter
  unused (its gradient is then zeros), so collectives always pair up.
- end of backward (autograd callback): units whose inputs needed no gradient (the root,
  the embedding), then everything pending; DTensor `.grad`s are set.
The model root, its first-use groups (first_use.py) and the last unit to run forward
before them stay gathered from forward to backward. Buffers freed during a pass go to the
root's pool for the next unit (comm.py).
A unit that is one embedding may skip all of this for a forward call and look up from its
shards instead (sharded_lookup.py): its pre-forward decides, its forward looks up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from flatshard import comm
from flatshard.errors import UnevenShardError, WrappingError
from flatshard.flat_bucket import FlatBucket
from flatshard.layout import UnitLayout
from flatshard.policy import MixedPrecisionPolicy
from flatshard.row_shard import RowShard, local_data, make_row_sharded_dtensor
from flatshard.sharded_lookup import ShardedLookup, lookup_capable


@dataclass
class ManagedParam:
    """One parameter of a unit: where it is registered, its sharded and unsharded forms."""

    fqn: str
    occurrences: list[tuple[nn.Module, str]]  # (module, attribute); >1 when tied
    bucket: int
    index: int  # position in the bucket's slots
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None


@dataclass
class PendingReduce:
    unit: Unit
    bucket: FlatBucket
    work: object
    output: torch.Tensor
    keep_alive: torch.Tensor
    post_scale: float | None


@dataclass
class RootContext:
    """State shared by the units of one model: run-time order and backward bookkeeping."""

    units: list[Unit]
    root: Unit
    pre_forward_order: list[Unit] = field(default_factory=list)
    previous_pre_forward_order: list[Unit] = field(default_factory=list)
    post_forward_order: list[Unit] = field(default_factory=list)
    in_forward: bool = False
    in_backward: bool = False
    buffers: comm.BufferPool = field(default_factory=comm.BufferPool)  # emptied every pass
    pending: list[PendingReduce] = field(default_factory=list)


class _MarkBackwardEnd(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients are computed."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit._on_input_gradients()
        return (None, *grads)


class Unit:
    def __init__(
        self,
        modules: list[nn.Module],
        mesh,
        layout: UnitLayout,
        buckets: list[FlatBucket],
        params: list[ManagedParam],
        zero_stage: int,
        mp_policy: MixedPrecisionPolicy,
        kept_through_backward: bool = False,
    ):
        self.modules = modules  # usually one; a first-use group of a root's children: more
        self.mesh = mesh  # a ShardMesh
        self.group = mesh.shard_group
        self.rank = mesh.shard_rank
        self.world_size = mesh.shard_size
        self.layout = layout
        self.buckets = buckets
        self.params = params
        self.zero_stage = zero_stage
        self.mp_policy = mp_policy
        self.reshard_after_forward = zero_stage == 3
        self.reshard_after_backward = zero_stage != 1
        # Needed again early in backward (the model root and its first-use groups): stays
        # gathered from forward to backward, as FSDP2 keeps its root.
        self.kept_through_backward = kept_through_backward
        # ZeRO-3: whether its last forward with gradients kept it gathered for backward
        self.kept_for_backward = False
        self.requires_gradient_sync = True
        self.gradient_divide_factor = float(self.world_size)
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.context: RootContext | None = None
        self._trainable = [p for p in params if p.sharded.requires_grad]
        self._wrapped_requires_grad = [p.sharded.requires_grad for p in params]
        # parameter state
        self._gather_works: list | None = None
        self._unsharded = False
        self._forced_stale = False
        # backward state
        self._backward_started = False
        self._post_backward_done = False
        self._grads_prepared = False
        self._holds_unsynced_grads = False
        self._forward_calls = 0
        self._input_gradients_seen = 0
        # A unit that is one embedding may look up from its shards instead of gathering.
        capable = lookup_capable(modules, params, zero_stage, self.world_size)
        self.lookup = ShardedLookup(self) if capable else None
        self.looking_up = False  # set for the forward call between the hooks

    # --- parameters ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False):
        """Start gathering the parameters (no-op while a gathered copy is up to date)."""
        if self._gather_works is None and (not self._unsharded or self._is_stale()):
            pool = self._pool()
            self._gather_works = [bucket.start_all_gather(pool) for bucket in self.buckets]
            self._unsharded = True
            self._forced_stale = False
        if not async_op:
            self.wait_unshard()

    def _is_stale(self) -> bool:
        # Any write to the sharded weights (optimizer step, checkpoint load, a user's
        # in-place edit of `to_local()`) bumps the version of the bucket's main buffer.
        return self._forced_stale or any(b.gathered_version_changed() for b in self.buckets)

    def wait_unshard(self) -> None:
        if self._gather_works is None:
            return
        for work, bucket in zip(self._gather_works, self.buckets):
            bucket.finish_all_gather(work)
        self._gather_works = None
        self._make_unsharded_params()

    def _make_unsharded_params(self) -> None:
        if self.params and self.params[0].unsharded is not None:
            return
        for param in self.params:
            bucket = self.buckets[param.bucket]
            view = bucket.unsharded_view(bucket.unsharded, param.index)
            param.unsharded = nn.Parameter(view, requires_grad=param.sharded.requires_grad)

    def reshard(self) -> None:
        self.wait_unshard()
        if self._unsharded:
            for bucket in self.buckets:
                bucket.free_unsharded(self._pool())
            self._unsharded = False

    def mark_stale(self) -> None:
        """Force the next use to gather again."""
        self._forced_stale = True

    def looked_up_from_shards(self) -> bool:
        """Whether this unit's last forward looked its embedding up from the shards."""
        return self.lookup is not None and self.lookup.last_counts is not None

    def _register(self, which: str) -> None:
        for param in self.params:
            value = param.unsharded if which == "unsharded" else param.sharded
            for module, name in param.occurrences:
                module._parameters[name] = value

    # --- forward ---------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        context = self._context()
        if not context.in_backward:  # not an activation-checkpointing recompute
            self._check_requires_grad()
        self.looking_up = (
            self.lookup is not None and self is not context.root and self.lookup.plan(args, kwargs)
        )
        if self.looking_up:
            # Not gathered, so outside the prefetch order and the backward hooks; a gather
            # started for it (a prefetch in an earlier step's order) is dropped.
            self.reshard()
            return args, kwargs
        if not context.in_backward:
            if self is context.root:
                context.in_forward = True
                context.previous_pre_forward_order = context.pre_forward_order
                context.pre_forward_order, context.post_forward_order = [], []
            if self not in context.pre_forward_order:  # a unit over several modules: once
                context.pre_forward_order.append(self)
        self.unshard()
        self._register("unsharded")
        if not context.in_backward:
            for unit in self._prefetch_targets(forward=True):
                unit.unshard(async_op=True)
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled() and not context.in_backward:
            args, kwargs = self._mark_backward_end((args, kwargs))
        return args, kwargs

    def _mark_backward_end(self, tree):
        leaves, spec = tree_flatten(tree)
        positions = [
            i
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        if not positions:
            return tree
        self._forward_calls += 1
        marked = _MarkBackwardEnd.apply(self, *(leaves[i] for i in positions))
        for i, tensor in zip(positions, marked):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def post_forward(self, module, args, output):
        if self.looking_up:
            self.looking_up = False
            if self.mp_policy.output_dtype is not None:
                output = _cast_floats(output, self.mp_policy.output_dtype)
            return output
        self._register("sharded")
        context = self.context
        grad_enabled = torch.is_grad_enabled()
        if not context.in_backward:
            if self in context.post_forward_order:  # the last call orders backward
                context.post_forward_order.remove(self)
            context.post_forward_order.append(self)
            self.kept_for_backward = grad_enabled and self._needed_first_in_backward()
            if not grad_enabled or (self.reshard_after_forward and not self.kept_for_backward):
                self.reshard()
            if self is context.root:
                context.in_forward = False
                # Buffers the blocks freed would sit idle through the loss and the start of
                # backward, where memory peaks: let them go (backward refills the pool).
                context.buffers.clear()
        if grad_enabled:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _needed_first_in_backward(self) -> bool:
        """Whether to stay gathered from forward into backward, as FSDP2 keeps its root:
        the model root and its first-use groups (needed again early in backward), and the
        last unit to run forward before them (last step's order), whose backward comes next
        (torchtitan keeps its last block gathered by hand for the same reason)."""
        context = self.context
        if len(context.units) == 1:
            return False
        stays = lambda unit: unit.kept_through_backward or unit is context.root
        order = context.previous_pre_forward_order
        if stays(self) or self not in order:
            return stays(self)
        return all(stays(unit) for unit in order[order.index(self) + 1 :])

    def _prefetch_targets(self, forward: bool) -> list[Unit]:
        """The unit(s) to gather next: set by the user, else the one after this unit in the
        order recorded at run time (pre-forward order of the previous step for forward,
        reversed post-forward order of this step for backward)."""
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            return explicit
        if forward:
            order = self.context.previous_pre_forward_order
        else:
            order = self.context.post_forward_order[::-1]
        if self not in order:
            return []
        return order[order.index(self) + 1 :][:1]

    def _check_requires_grad(self) -> None:
        now = [p.sharded.requires_grad for p in self.params]
        if now != self._wrapped_requires_grad:
            changed = [
                p.fqn for p, a, b in zip(self.params, now, self._wrapped_requires_grad) if a != b
            ]
            raise WrappingError(
                f"requires_grad of {changed} changed after fully_shard; freeze or unfreeze "
                "parameters before wrapping (the layout groups trainable and frozen ones apart)"
            )

    # --- backward --------------------------------------------------------------------------
    def _pre_backward(self, grad):
        if self._backward_started:
            return grad
        context = self.context
        if not context.in_backward:
            context.in_backward = True
            Variable._execution_engine.queue_callback(lambda: end_backward(context))
        self._backward_started = True
        self.unshard()
        self._register("unsharded")  # activation checkpointing recomputes with these
        self._prepare_grads()
        for unit in self._prefetch_targets(forward=False):
            unit.unshard(async_op=True)
        return grad

    def _prepare_grads(self) -> None:
        """Zeroed flat gradient buffers that the unsharded parameters' `.grad` views; autograd
        then adds each gradient in place. Accumulated unsynced gradients are kept."""
        if self._grads_prepared:
            return
        self._grads_prepared = True
        self._make_unsharded_params()
        for bucket in self.buckets:
            if bucket.layout.requires_grad:
                bucket.prepare_unsharded_grad(self._holds_unsynced_grads, self.context.buffers)
        for param in self._trainable:
            bucket = self.buckets[param.bucket]
            view = bucket.unsharded_view(bucket.unsharded_grad, param.index)
            grad = param.unsharded.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                view.add_(grad)  # a gradient autograd allocated itself (no hook ran first)
            param.unsharded.grad = view

    def _on_input_gradients(self) -> None:
        self._input_gradients_seen += 1
        if self._input_gradients_seen == self._forward_calls:
            self.post_backward()

    def post_backward(self) -> None:
        has_grads = any(
            p.unsharded is not None and p.unsharded.grad is not None for p in self._trainable
        )
        if self._post_backward_done or not (self._backward_started or has_grads):
            return
        self._post_backward_done = True
        self._prepare_grads()
        self._register("sharded")
        if self.reshard_after_backward:
            self.reshard()
        if not self.requires_gradient_sync:
            for bucket in self.buckets:
                if bucket.layout.requires_grad and bucket.hold_unsynced_grad():
                    self._detach_grad_views(bucket)
            self._holds_unsynced_grads = True
            return
        context = self.context
        started = 0
        for bucket in self.buckets:
            if bucket.layout.requires_grad:
                work, output, keep_alive, post_scale = bucket.start_reduce_scatter(
                    self.gradient_divide_factor, self.world_size, context.buffers
                )
                context.pending.append(
                    PendingReduce(self, bucket, work, output, keep_alive, post_scale)
                )
                started += 1
        self._holds_unsynced_grads = False
        for param in self._trainable:
            param.unsharded.grad = None
        # Bound memory: finish every earlier reduce-scatter, keep only this unit's in flight.
        _finish_pending(context, keep=started)

    def _detach_grad_views(self, bucket: FlatBucket) -> None:
        for param in self._trainable:
            if self.buckets[param.bucket] is bucket:
                param.unsharded.grad = None

    def _finish_reduce(self, pending: PendingReduce) -> None:
        pending.work.wait()
        reduced = pending.output
        if pending.post_scale is not None:
            reduced.mul_(pending.post_scale)
        bucket = pending.bucket
        self.add_sharded_grad(bucket, reduced)
        pool = self.context.buffers
        if pending.keep_alive is not bucket.unsharded_grad:
            pool.give_back(pending.keep_alive)  # a copy in the reduce dtype
        if self.zero_stage != 1:
            bucket.release_unsharded_grad(pool)

    def add_sharded_grad(self, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        """Add a bucket's reduced gradient shard to its parameters' `.grad`s (set them
        to views of it when there are none yet)."""
        params = [p for p in self._trainable if self.buckets[p.bucket] is bucket]
        if bucket.sharded_grad is not None and all(
            p.sharded.grad is not None
            and local_data(p.sharded.grad).data_ptr()
            == bucket.grad_rows(bucket.sharded_grad, p.index).data_ptr()
            for p in params
        ):
            bucket.sharded_grad.add_(reduced)  # gradient accumulation: one flat add
        else:
            fresh = reduced.to(bucket.main.dtype)
            for param in params:
                if param.sharded.grad is not None:  # a gradient flatshard does not own yet
                    rows = bucket.grad_rows(fresh, param.index)
                    rows.add_(_own_rows(param, rows))
            bucket.sharded_grad = fresh
            for param in params:
                param.sharded.grad = self._sharded_like(param, bucket.grad_rows(fresh, param.index))

    def _sharded_like(self, param: ManagedParam, local: torch.Tensor):
        spec = self.buckets[param.bucket].specs[param.index]
        return make_row_sharded_dtensor(local, self.mesh.device_mesh, spec)

    def end_backward(self) -> None:
        self._backward_started = False
        self._post_backward_done = False
        self._grads_prepared = False
        self._forward_calls = 0
        self._input_gradients_seen = 0
        self.wait_unshard()  # a prefetch nobody used must not outlive the step
        self._register("sharded")
        if self.reshard_after_backward:
            self.reshard()

    def _pool(self) -> comm.BufferPool | None:
        """Buffers freed in a forward or backward pass are kept for the next unit; outside
        them (a user's `unshard()` / `reshard()`) memory goes straight back."""
        context = self.context
        if context is not None and (context.in_forward or context.in_backward):
            return context.buffers
        return None

    def _context(self) -> RootContext:
        """The first unit to run forward becomes the root of every unit below it."""
        if self.context is None:
            below = [m for member in self.modules for m in member.modules()]
            units = dict.fromkeys(_unit_of(m) for m in below if _unit_of(m) is not None)
            context = RootContext(units=[u for u in units if u.context is None], root=self)
            for unit in context.units:
                unit.context = context
        return self.context


def _own_rows(param: ManagedParam, rows: torch.Tensor) -> torch.Tensor:
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


def _unit_of(module: nn.Module):
    return getattr(module, "_flatshard_unit", None)


def _finish_pending(context: RootContext, keep: int) -> None:
    while len(context.pending) > keep:
        pending = context.pending.pop(0)
        pending.unit._finish_reduce(pending)


def end_backward(context: RootContext) -> None:
    """Runs once autograd has finished the whole backward pass."""
    for unit in context.post_forward_order[::-1] + context.units:
        unit.post_backward()
    _finish_pending(context, keep=0)
    for unit in context.units:
        unit.end_backward()
    context.in_backward = False
    context.buffers.clear()


def _cast_floats(tree, dtype: torch.dtype):
    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree
    )
