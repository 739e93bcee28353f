"""The gradients of a unit's trainable tensor-subclass parameters (subclass_params.py; a
float8 training weight): each unsharded gradient, summed in the reduce dtype over unsynced
micro-batches, is reduce-scattered in FSDP2's padded chunks, divided, summed over HSDP's
replicas and shown to the all-reduce hook as the unit's buckets are, and added to a
`Shard(0)` DTensor `.grad` of this rank's chunk, which the optimizer steps with the
subclass shard.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from flatshard import comm


def reduce(gather, sync) -> None:
    """Each trainable parameter's unsharded gradient (autograd's, accumulated over
    unsynced micro-batches) summed over the shard group in FSDP2's padded chunks, divided
    by `sync.divide_factor`, summed over the replicas (HSDP), shown to the all-reduce
    hook, and added to the sharded parameter's `.grad`."""
    mesh = gather.mesh
    hold(gather)
    for param in gather.params:
        grad, param.unsynced = param.unsynced, None
        if grad is None:
            continue
        rows = param.padded.size(0)
        full = grad.new_zeros((mesh.shard_size * rows, *grad.shape[1:]))
        full[: grad.size(0)].copy_(grad)
        reduced = full.new_empty((rows, *grad.shape[1:]))
        group = comm.for_group(mesh.shard_group)
        group.reduce_scatter(reduced.view(-1), full.view(-1), False).wait()
        reduced.div_(sync.divide_factor)
        if mesh.replicate_group is not None:
            comm.all_reduce(reduced, mesh.replicate_group)
        if sync.all_reduce_hook is not None:
            sync.all_reduce_hook(reduced)
        local = param.sharded._local_tensor
        mine = reduced[: local.size(0)].to(param.sharded.dtype)
        if param.sharded.grad is None:
            param.sharded.grad = DTensor.from_local(
                mine,
                param.sharded.device_mesh,
                param.sharded.placements,
                run_check=False,
                shape=param.sharded.shape,
                stride=param.sharded.stride(),
            )
        else:
            param.sharded.grad._local_tensor.add_(mine)


def hold(gather) -> None:
    """Keep this micro-batch's gradients for a later sync, summed in the reduce dtype
    (as FSDP2 and the buckets sum them)."""
    for param in gather.params:
        grad = None if param.unsharded is None else param.unsharded.grad
        if grad is None:
            continue
        param.unsharded.grad = None
        if param.unsynced is None:
            param.unsynced = grad.to(gather.mp_policy.reduce_dtype or grad.dtype)
        else:
            param.unsynced.add_(grad)


def drop(gather) -> None:
    """Forget every gradient not yet reduced (a failed iteration's)."""
    for param in gather.params:
        param.unsynced = None
        if param.unsharded is not None:
            param.unsharded.grad = None
