"""Expert parallelism: each rank of an EP group owns `E / ep` of a layer's experts, and
tokens travel to the rank owning the expert they were routed to and back.

`ExpertParallel` is a `ParallelStyle` for a grouped-experts module (3-D `gate_up_proj
(E, 2I, H)` and `down_proj (E, H, I)`, and `expert_outputs(rows, gate_up, down, counts)`
computing runs of rows sorted by expert, as `flatshard.models.GroupedExperts` has). Its
parameters become `Shard(0)` DTensors on the EP mesh (rank p holds experts `[p * E/ep,
(p + 1) * E/ep)`), so `fully_shard` then shards each rank's experts over the
expert-data-parallel ranks (`efsdp`) and checkpoints are keyed by global expert whatever
`ep`. The EP ranks train on different tokens, so the experts' gradients are divided over
`efsdp x ep` ranks, not `efsdp` (fully_shard derives it from the parameters'
mark (flatshard.registry); FSDP2 + EP leaves them `ep` times too large, pytorch#160285).

Forward: copies of tokens sorted by expert (so by owning rank), per-expert counts
exchanged first and checked (gloo aborts the process on mismatched split sizes), rows moved
with an autograd all-to-all, computed per local expert, moved back, weighted and summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from flatshard import comm, registry
from flatshard.errors import MeshError


class ExpertParallel(ParallelStyle):
    """Split a `GroupedExperts` module's experts over a 1-D EP mesh."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        n_experts = module.gate_up_proj.shape[0]
        if n_experts % size:
            raise MeshError(
                f"expert parallelism over {size} ranks needs n_experts ({n_experts}) "
                f"divisible by {size}; pick an ep that divides it"
            )
        local = n_experts // size
        for name, param in list(module.named_parameters(recurse=False)):
            piece = param.detach()[rank * local : (rank + 1) * local]
            sharded = DTensor.from_local(
                piece, device_mesh, [Shard(0)], run_check=False,
                shape=param.shape, stride=param.stride(),
            )  # fmt: skip
            new = nn.Parameter(sharded, param.requires_grad)
            registry.mark_expert_parallel(new)  # the EP ranks see different tokens
            module.register_parameter(name, new)

        def forward(x, indices, weights):
            return _dispatch_compute_combine(module, device_mesh, x, indices, weights)

        module.forward = forward
        return module


def _dispatch_compute_combine(module, mesh, x, indices, weights):
    """sum_j weights[t, j] * expert_{indices[t, j]}(x[t]), the experts spread over `mesh`."""
    gate_up, down = module.gate_up_proj.to_local(), module.down_proj.to_local()
    ep, local = mesh.size(), gate_up.shape[0]
    group = mesh.get_group()
    top_k, n_experts = indices.shape[1], ep * local
    flat = indices.flatten()
    bad = bool(flat.numel()) and bool((flat.min() < 0) | (flat.max() >= n_experts))
    order = torch.argsort(flat, stable=True)  # by expert, so by owning rank
    token_of_row = order // top_k
    counts = torch.bincount(flat.clamp(0, n_experts - 1), minlength=n_experts)
    received = _exchange_counts(counts, bad, ep, local, group)  # [source rank, local expert]
    send = counts.view(ep, local).sum(1).tolist()
    recv = received.sum(1).tolist()
    rows = comm.all_to_all(x[token_of_row], recv, send, group)
    # received rows come by source rank, then expert: order them by local expert
    expert_of_row = torch.arange(local, device=x.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(received.flatten())
    by_expert = torch.argsort(expert_of_row, stable=True)
    out = module.expert_outputs(rows[by_expert], gate_up, down, received.sum(0))
    out = torch.empty_like(out).index_copy(0, by_expert, out)  # back to arrival order
    out = comm.all_to_all(out, send, recv, group)
    out = out * weights.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of_row, out)


def _exchange_counts(counts: torch.Tensor, bad: bool, ep: int, local: int, group) -> torch.Tensor:
    """Every source rank's row count for each of this rank's experts, agreed before any row
    moves: a rank whose router chose an expert that does not exist tells every rank of
    the group in the same exchange, and they all raise (a mismatched split would abort
    the process inside gloo's all-to-all)."""
    flags = torch.full((ep, 1), int(bad), dtype=counts.dtype, device=counts.device)
    send = torch.cat([counts.view(ep, local), flags], dim=1).flatten()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    received = received.view(ep, local + 1)
    sources = [rank for rank, flag in enumerate(received[:, -1].tolist()) if flag]
    if sources:
        raise ValueError(
            f"the router on expert-parallel rank(s) {sources} of this group chose an expert "
            f"index outside [0, {ep * local}): check the router's number of experts "
            "against the experts module's"
        )
    received = received[:, :-1]
    if bool((received < 0).any()):
        raise RuntimeError(f"expert parallelism received negative row counts {received.tolist()}")
    return received
