"""`clip_grad_norm_` over parameters that live on several meshes.

torch's `clip_grad_norm_` stacks the per-tensor norms, which DTensors on different meshes
cannot be (a model with expert parallelism has its dense parameters on the data-parallel
mesh and its experts on `(efsdp, ep)`). Here each mesh's gradients get their total norm
from torch (a `Partial` reduction over that mesh: every element counted once), the totals
are combined as plain tensors, and each group is scaled by the same coefficient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from flatshard.dtensor.sharded_param import dtensor_viewing


def _mesh_key(tensor) -> tuple:
    """Gradients clipped together: on one mesh and one device (optimizer offload keeps some
    of a mesh's gradients on the host, which a device scale cannot multiply)."""
    if not isinstance(tensor, DTensor):
        return None, str(tensor.device)
    mesh = tensor.device_mesh
    ranks = tuple(mesh.mesh.flatten().tolist())
    return ranks, mesh.mesh_dim_names, mesh.device_type, str(tensor.device)


@torch.no_grad()
def clip_grad_norm_(
    parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None, pp_group=None,
) -> torch.Tensor:  # fmt: skip
    """As `torch.nn.utils.clip_grad_norm_`, for parameters on any number of meshes; returns
    the total norm as a plain tensor. `pp_group`: a pipeline's group over its stages (each
    rank passing its stages' parameters): the norm is the whole model's."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for grad in grads:
        groups.setdefault(_mesh_key(grad), []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms and pp_group is None:
        return torch.tensor(0.0)
    device = norms[0].device if norms else torch.device("cpu")
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type)
    if pp_group is not None:  # the other stages' parts of the norm
        total = _over_stages(total, norm_type, pp_group)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups.values():
        scale = coefficient.to(group[0].device)
        if isinstance(group[0], DTensor):
            mesh = group[0].device_mesh
            # a host group's scale stays on the host (from_local: to the mesh's device)
            scale = dtensor_viewing(scale, mesh, [Replicate()] * mesh.ndim, (), ())
        torch._foreach_mul_(group, scale)
    return total


def _over_stages(norm: torch.Tensor, norm_type: float, group) -> torch.Tensor:
    """The norm over every stage's gradients from each stage's norm."""
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)
