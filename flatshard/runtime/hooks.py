"""The hooks that drive a unit through a step.

- pre-forward: gather (or wait for a prefetch), register the unsharded parameters on the
  modules, start the next unit's gather; an identity autograd function on the inputs marks
  where this unit's backward ends.
- post-forward: register the sharded DTensor parameters again; ZeRO-3 frees the unsharded
  buffer unless the unit stays gathered into backward (schedule.py); hooks on the outputs
  mark where this unit's backward starts.
- pre-backward (first output gradient): gather again if freed, register the unsharded
  parameters (activation checkpointing recomputes with them), prepare the flat gradient
  buffers, prefetch the next unit.
- post-backward (gradient of the inputs computed): reduce-scatter (grad_sync.py). The
  trigger is the same on every rank even when a rank leaves some parameter unused (its
  gradient is then zeros), so collectives always pair up; never a count of gradients.
- end of backward (autograd callback): units whose inputs needed no gradient (the root,
  the embedding), then every reduce-scatter still in flight.
A unit that is one embedding may look its forward up from its shards instead
(sharded_lookup.py): its pre-forward decides, for this call, and nothing else runs.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from flatshard.runtime.activation_offload import offloads_of, prefetch_activations
from flatshard.runtime.offload import wait_for_host_gradients
from flatshard.runtime.schedule import RootContext, context_of
from flatshard.runtime.states import ShardedState, TrainingState


def _outside_compile(hook):
    """As FSDP2's hooks: dynamo never traces them, so a compiled block holds only its math.
    (Disabled directly: a wrapper of ours that called `disable` would itself be traced.)"""
    return torch._dynamo.disable(hook, recursive=True, reason="flatshard's unit hooks")


def attach(unit, module) -> None:
    module.register_forward_pre_hook(
        _outside_compile(lambda m, args, kwargs: pre_forward(unit, args, kwargs)),
        prepend=True,
        with_kwargs=True,
    )
    module.register_forward_hook(
        _outside_compile(lambda m, args, output: post_forward(unit, output))
    )


def pre_forward(unit, args, kwargs):
    unit.check_states_here()
    context = context_of(unit)
    if not context.in_backward:  # not an activation-checkpointing recompute
        unit.follow_requires_grad()
        unit.move_to(TrainingState.FORWARD)
    lookup = unit.lookup
    if lookup is not None:
        lookup.looking_up = unit is not context.root and lookup.decide(args, kwargs)
    if lookup is not None and lookup.looking_up:
        # Not gathered, so outside the prefetch order and the backward hooks; a gather
        # started for it (a prefetch in an earlier step's order) is dropped.
        unit.reshard()
        return args, kwargs
    if not context.in_backward:
        if unit is context.root:
            context.start_forward()
            # as FSDP2's root: inputs go where the parameters are (CPU token ids reach a
            # CUDA model, and NCCL collectives only ever see device tensors)
            args, kwargs = inputs_to_device((args, kwargs), unit.mesh.device)
        context.ran_pre_forward(unit)
    unit.unshard()
    unit.register("unsharded")
    if not context.in_backward:
        for target in context.prefetch_targets(unit, forward=True):
            target.unshard(async_op=True)
    if unit.mp_policy.cast_forward_inputs and unit.mp_policy.param_dtype is not None:
        args, kwargs = _cast_floats((args, kwargs), unit.mp_policy.param_dtype)
    if torch.is_grad_enabled() and not context.in_backward:
        args, kwargs = _mark_backward_end(unit, (args, kwargs))
        for offload in offloads_of(unit):  # its saved activations go to the host
            offload.start()
    return args, kwargs


def post_forward(unit, output):
    for offload in offloads_of(unit):
        offload.stop()
    context = unit.context
    if not context.in_backward:
        unit.move_to(TrainingState.IDLE)
    if unit.lookup is not None and unit.lookup.looking_up:
        unit.lookup.looking_up = False
        return _cast_output(unit, output)
    grad_enabled = torch.is_grad_enabled()
    if not context.in_backward:
        context.ran_post_forward(unit)
        unit.step.kept_for_backward = grad_enabled and context.stays_gathered(unit)
        if not grad_enabled or (unit.resharding.after_forward and not unit.kept_for_backward):
            unit.reshard(keep_for_backward=grad_enabled)
        if unit is context.root:
            context.end_forward()
    # As FSDP2: a unit that stays gathered until its backward keeps its unsharded
    # parameters registered (plain tensors, usable by a loss outside forward), else the
    # sharded DTensors.
    gathered = unit.sharded_state is ShardedState.UNSHARDED and not context.in_backward
    unit.register("unsharded" if gathered and grad_enabled else "sharded")
    if grad_enabled:
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: pre_backward(unit, grad))
    return _cast_output(unit, output)


class _MarkBackwardEnd(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients are computed."""

    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        if unit.step.input_gradients_arrived():
            post_backward(unit)
        return (None, *grads)


def _mark_backward_end(unit, tree):
    leaves, spec = tree_flatten(tree)
    positions = [
        i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    if not positions:
        # no input gradient marks where this call's backward ends (token ids into an
        # embedding): the unit's gradients are complete only at the end of backward
        unit.step.post_backward_at_end = True
        return tree
    unit.step.marked_forward()
    marked = _MarkBackwardEnd.apply(unit, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, marked):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


def pre_backward(unit, grad):
    if unit.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
        return grad
    context = unit.context
    if not context.in_backward:
        context.start_backward()
        Variable._execution_engine.queue_callback(lambda: end_backward(context))
    unit.move_to(TrainingState.PRE_BACKWARD)
    if unit.unshard_in_backward:
        unit.unshard()
    unit.register("unsharded")  # activation checkpointing recomputes with these
    unit.grads.prepare()
    prefetch_activations(unit)  # any not fetched ahead (the first unit of backward)
    for target in context.prefetch_targets(unit, forward=False):
        target.unshard(async_op=True)
        prefetch_activations(target)  # back from the host while this unit's backward runs
    return grad


def post_backward(unit) -> None:
    started = unit.training_state is TrainingState.PRE_BACKWARD
    has_grads = any(
        p.unsharded is not None and p.unsharded.grad is not None for p in unit.trainable
    )
    if unit.training_state is TrainingState.POST_BACKWARD or not (started or has_grads):
        return
    if not started:
        unit.grads.prepare()  # gradients autograd put on the parameters without our hook
    unit.move_to(TrainingState.POST_BACKWARD)
    unit.register("sharded")
    if unit.resharding.after_backward:
        unit.reshard()
    unit.grads.reduce()


def end_backward(context: RootContext) -> None:
    """Runs once autograd has finished the whole backward pass."""
    for unit in context.post_forward_order[::-1] + context.units:
        post_backward(unit)
    context.reduces.finish()
    wait_for_host_gradients(context.units)
    for unit in context.units:
        unit.step.finish()
        unit.wait_unshard()  # a prefetch nobody used must not outlive the step
        unit.register("sharded")
        if unit.resharding.after_backward:
            unit.reshard()
    context.end_backward()


def sync_held_gradients(context: RootContext) -> None:
    """Reduce what backwards without gradient sync held, and reshard: a pipeline schedule
    runs every micro-batch's backward so and then this once, where FSDP2 calls each
    group's post_backward."""
    for unit in context.units:
        if unit.grads.holds_unsynced:
            unit.grads.reduce()
    context.reduces.finish()
    wait_for_host_gradients(context.units)
    for unit in context.units:
        unit.wait_unshard()
        unit.register("sharded")
        if unit.resharding.after_backward:
            unit.reshard()


def reset_iteration(root) -> None:
    """FSDP2's `reset_iter_state`: after a forward or backward that raised, wait for the
    collectives in flight (their results dropped), drop the iteration's gradients and
    reshard every unit of the model, so the next iteration starts clean."""
    context = root.context
    if context is None:  # no forward ran yet: nothing in flight
        return
    for pending in context.reduces.pending:
        pending.work.wait()
    context.reduces.pending.clear()
    for unit in context.units:
        for offload in offloads_of(unit):  # a forward that raised left it started
            offload.stop()
        unit.wait_unshard()
        unit.grads.discard()
        unit.step.reset()
        unit.register("sharded")
        unit.reshard()
    context.reset()  # nothing runs now; pooled buffers go back


def _cast_output(unit, output):
    if unit.mp_policy.output_dtype is not None:
        return _cast_floats(output, unit.mp_policy.output_dtype)
    return output


def inputs_to_device(tree, device: torch.device):
    return tree_map_only(
        torch.Tensor, lambda t: t if t.device == device else t.to(device, non_blocking=True), tree
    )


def _cast_floats(tree, dtype: torch.dtype):
    return tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree
    )
