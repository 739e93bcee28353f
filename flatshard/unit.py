"""A unit: what one `fully_shard(module)` call manages, and its forward/backward hooks.

State machine of a unit's parameters: sharded -> gathering -> unsharded -> sharded.
- pre-forward: gather (or wait for a prefetch), register the unsharded parameters on the
  modules, start the next unit's gather.
- post-forward: register the sharded DTensor parameters again; ZeRO-3 frees the unsharded
  buffer; hooks on the outputs mark the start of this unit's backward.
- pre-backward (first output gradient): gather again if freed, point the unsharded
  parameters' `.grad` into one flat gradient buffer per bucket, prefetch the next unit.
- post-backward (all gradients accumulated): reduce-scatter each bucket asynchronously;
  the previous unit's reduce-scatter is finished then, so at most two are in flight.
- end of backward (autograd callback): finish everything, set DTensor `.grad`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map_only

from flatshard.flat_bucket import FlatBucket
from flatshard.layout import UnitLayout
from flatshard.policy import MixedPrecisionPolicy
from flatshard.row_shard import local_data, make_row_sharded_dtensor


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
    in_backward: bool = False
    pending: list[PendingReduce] = field(default_factory=list)


class Unit:
    def __init__(
        self,
        module: nn.Module,
        mesh,
        layout: UnitLayout,
        buckets: list[FlatBucket],
        params: list[ManagedParam],
        zero_stage: int,
        mp_policy: MixedPrecisionPolicy,
    ):
        self.module = module
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self.layout = layout
        self.buckets = buckets
        self.params = params
        self.zero_stage = zero_stage
        self.mp_policy = mp_policy
        self.reshard_after_forward = zero_stage == 3
        self.reshard_after_backward = zero_stage != 1
        self.requires_gradient_sync = True
        self.gradient_divide_factor = float(self.world_size)
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.context: RootContext | None = None
        self.has_frozen = any(not p.sharded.requires_grad for p in params)
        self._trainable = [p for p in params if p.sharded.requires_grad]
        # parameter state
        self._gather_works: list | None = None
        self._unsharded = False
        self._stale = True
        # backward state
        self._backward_started = False
        self._post_backward_done = False
        self._grads_ready = 0
        self._holds_unsynced_grads = False

    # --- parameters ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False):
        """Start gathering the parameters (no-op when gathered and fresh)."""
        if self._gather_works is None and not (self._unsharded and not self._stale):
            self._gather_works = [bucket.start_all_gather() for bucket in self.buckets]
            self._unsharded = True
            self._stale = False
        if not async_op:
            self.wait_unshard()

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
            if param.unsharded.requires_grad:
                param.unsharded.register_post_accumulate_grad_hook(self._on_grad_accumulated)

    def reshard(self) -> None:
        self.wait_unshard()
        if self._unsharded:
            for bucket in self.buckets:
                bucket.free_unsharded()
            self._unsharded = False

    def mark_stale(self) -> None:
        """The sharded weights changed (optimizer step): the unsharded copy is out of date."""
        self._stale = True

    def _register(self, which: str) -> None:
        for param in self.params:
            value = param.unsharded if which == "unsharded" else param.sharded
            for module, name in param.occurrences:
                module._parameters[name] = value

    # --- forward ---------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        context = self._context()
        if not context.in_backward:
            if self is context.root:
                context.previous_pre_forward_order = context.pre_forward_order
                context.pre_forward_order, context.post_forward_order = [], []
            context.pre_forward_order.append(self)
        self.unshard()
        self._register("unsharded")
        for unit in self._prefetch_targets(forward=True):
            unit.unshard(async_op=True)
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def post_forward(self, module, args, output):
        self._register("sharded")
        context = self.context
        grad_enabled = torch.is_grad_enabled()
        if not context.in_backward:
            context.post_forward_order.append(self)
            # The model root is needed again first thing in backward: keep it, like FSDP2.
            keep_for_backward = self is context.root and len(context.units) > 1
            if not grad_enabled or (self.reshard_after_forward and not keep_for_backward):
                self.reshard()
        if grad_enabled:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        return output

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
        self._point_grads_into_flat_buffers()
        for unit in self._prefetch_targets(forward=False):
            unit.unshard(async_op=True)
        return grad

    def _point_grads_into_flat_buffers(self) -> None:
        """AccumulateGrad then adds each gradient in place into its bucket's flat buffer."""
        for bucket in self.buckets:
            if bucket.layout.requires_grad:
                fresh = bucket.unsharded_grad is None
                flat = bucket.zeroed_unsharded_grad()
                if not fresh and not self._holds_unsynced_grads:
                    flat.zero_()
        for param in self._trainable:
            bucket = self.buckets[param.bucket]
            param.unsharded.grad = bucket.unsharded_view(bucket.unsharded_grad, param.index)

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        self._grads_ready += 1
        if self._grads_ready == len(self._trainable):
            self.post_backward()

    def post_backward(self) -> None:
        if self._post_backward_done:
            return
        if not self._backward_started:
            if not self._adopt_stray_grads():
                return
        self._post_backward_done = True
        self._adopt_stray_grads()
        if self.reshard_after_backward and not self.has_frozen:
            # Frozen weights may still be read to compute input gradients: such units are
            # resharded at the end of backward instead.
            self.reshard()
        if not self.requires_gradient_sync:
            for bucket in self.buckets:
                if bucket.layout.requires_grad:
                    bucket.hold_unsynced_grad()
            self._holds_unsynced_grads = True
            return
        context = self.context
        started = 0
        for bucket in self.buckets:
            if bucket.layout.requires_grad:
                work, output, keep_alive, post_scale = bucket.start_reduce_scatter(
                    self.gradient_divide_factor, self.world_size
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

    def _adopt_stray_grads(self) -> bool:
        """Move gradients autograd allocated itself (no pre-backward hook ran for them)
        into the flat buffer. Returns whether any parameter has a gradient."""
        found = False
        for param in self._trainable:
            grad = param.unsharded.grad if param.unsharded is not None else None
            if grad is None:
                continue
            found = True
            bucket = self.buckets[param.bucket]
            fresh = bucket.unsharded_grad is None
            flat = bucket.zeroed_unsharded_grad()
            view = bucket.unsharded_view(flat, param.index)
            if grad.data_ptr() != view.data_ptr():
                if fresh and not self._backward_started:
                    flat.zero_()
                view.copy_(grad)
                param.unsharded.grad = view
        if found:
            self._backward_started = True
        return found

    def _finish_reduce(self, pending: PendingReduce) -> None:
        pending.work.wait()
        reduced = pending.output
        if pending.post_scale is not None:
            reduced.mul_(pending.post_scale)
        bucket = pending.bucket
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
                    bucket.grad_rows(fresh, param.index).add_(param.sharded.grad.to_local())
            bucket.sharded_grad = fresh
            for param in params:
                param.sharded.grad = self._sharded_like(param, bucket.grad_rows(fresh, param.index))
        if self.zero_stage != 1:
            bucket.unsharded_grad = None

    def _sharded_like(self, param: ManagedParam, local: torch.Tensor):
        bucket = self.buckets[param.bucket]
        slot = bucket.layout.slots[param.index]
        return make_row_sharded_dtensor(
            local, self.mesh, slot.info.shape, bucket.layout.row_bounds(slot), self.rank
        )

    def end_backward(self) -> None:
        self._backward_started = False
        self._post_backward_done = False
        self._grads_ready = 0
        if self.reshard_after_backward:
            self.reshard()

    def _context(self) -> RootContext:
        """The first unit to run forward becomes the root of every unit below it."""
        if self.context is None:
            units = [_unit_of(m) for m in self.module.modules() if _unit_of(m) is not None]
            context = RootContext(units=[u for u in units if u.context is None], root=self)
            for unit in context.units:
                unit.context = context
        return self.context


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


def _cast_floats(tree, dtype: torch.dtype):
    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree
    )
