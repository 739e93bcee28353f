"""`flatshard.optim.Muon`: torch's Muon for the hidden matrices and AdamW for everything
else, in one optimizer (as Moonlight and Kimi train), on flatshard's sharded matrices.

Muon orthogonalises each matrix's momentum update whole (Newton-Schulz), which FSDP shards
by rows. torch's Muon on sharded parameters has every rank gather and orthogonalise every
matrix. Here each matrix has one owner rank, chosen by its Newton-Schulz cost so every rank
does the same share (matrix_owners.py); the momentum stays sharded and is updated where it
lives; each rank sends its rows of the update (bf16, as torch's Newton-Schulz takes it) to
the owner, which orthogonalises the whole matrix and sends each rank its rows back: one
all-to-all each way per shard group and step, the matrices' bf16 bytes in all. The ops, their
order and their dtypes are torch's `Muon` (its `_zeropower_via_newtonschulz` and learning-rate
adjustment), so results equal `torch.optim.Muon` in one process.

Param groups say which algorithm steps them: `use_muon` (default True: every parameter a
2-D matrix). `muon_param_groups(model)` puts the 2-D weights in a Muon group and the rest —
embeddings, the output head, norms, biases — in an AdamW group. The AdamW groups are
flatshard's flat AdamW (`lr`, `betas`, `eps`, `weight_decay` per group; `adamw_betas` and
`adamw_eps` are their defaults). State: `momentum_buffer` per Muon parameter (torch's
Muon's key), AdamW's `step`, `exp_avg`, `exp_avg_sq` per AdamW parameter.

Under tensor parallelism a matrix is the TP-global one, as torch's Muon sees the parameter in
one process: the owners of a TP group (the same dp rank in each) join their TP-local blocks,
orthogonalise the whole matrix (each of them: Newton-Schulz work x TP) and keep their
block. A matrix that is not flatshard's (a plain tensor) is stepped by torch's own Muon
code; grouped experts `(E, R, C)` are E matrices; one split along another dim
(`Shard(d)`) is refused. A fused parameter (SwiGLU's `[gate;
up]`, QKV) is one matrix, as torch's Muon sees it in one process; with `split_fused=True`
(per group too) each component it declares along dim 0 (`fused_components`) is a matrix of
its own, as if the model kept them apart (under TP, each component's TP-global matrix).
`torch.optim.Muon` itself also runs on flatshard's parameters (every rank orthogonalising
every whole matrix, as on FSDP2: dtensor/patches.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _single_tensor_muon,
    _zeropower_via_newtonschulz,
)

from flatshard import registry
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import local_data
from flatshard.optim.adamw import AdamW
from flatshard.optim.matrix_owners import ShardGroup, matrices_of, newton_schulz_flops

_MUON_OPTIONS = (
    "momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn", "split_fused"
)  # fmt: skip


class Muon(AdamW):
    """torch's `Muon` on the hidden matrices (each orthogonalised whole by one owner rank,
    chosen to share the Newton-Schulz work evenly) and the flat AdamW on the rest, in one
    optimizer; build its groups with `muon_param_groups(model)`."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        split_fused: bool = False,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ) -> None:
        if not 0.0 <= momentum:  # torch's Muon's checks and messages (AdamW checks the rest)
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        self._muon_defaults = dict(
            zip(
                _MUON_OPTIONS,
                (momentum, nesterov, ns_coefficients, ns_steps, adjust_lr_fn, split_fused),
            ),
            muon_eps=eps,
        )
        self._owners: dict[tuple, list[ShardGroup]] = {}
        super().__init__(params, lr=lr, betas=adamw_betas, eps=adamw_eps, weight_decay=weight_decay)

    def add_param_group(self, param_group: dict) -> None:
        param_group.setdefault("use_muon", True)
        if param_group["use_muon"]:
            for name, value in self._muon_defaults.items():
                param_group.setdefault(name, value)
            params = param_group["params"]
            for param in [params] if isinstance(params, torch.Tensor) else params:
                if param.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon steps matrices (2-D, or grouped experts' 3-D, a matrix per "
                        f"expert); a parameter of shape {tuple(param.shape)} is in a Muon "
                        "group: give it a group with use_muon=False (AdamW), e.g. with "
                        "flatshard.optim.muon_param_groups(model)"
                    )
                if isinstance(getattr(param, "_local_tensor", None), RowShard) and not (
                    _rebuilt_from_rows(param)
                ):
                    raise NotImplementedError(
                        f"flatshard.optim.Muon: a matrix of shape {tuple(param.shape)} placed "
                        f"{tuple(param.placements)} (split along another dim than its rows) "
                        "is not supported yet: give it a group with use_muon=False"
                    )
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        # AdamW's converts each state's "step"; a Muon state has none, so its groups are
        # hidden from it (the same group dicts become self.param_groups)
        muon_groups = [g for g in state["param_groups"] if g.get("use_muon")]
        params = [g["params"] for g in muon_groups]
        for group in muon_groups:
            group["params"] = []
        try:
            super().__setstate__(state)
        finally:
            for group, kept in zip(muon_groups, params):
                group["params"] = kept

    def _own_step(self, group: dict) -> bool:
        if not group["use_muon"]:
            return False
        params = [p for p in group["params"] if p.grad is not None]
        by_owner = [_by_owner(p) for p in params]
        spread = [p for p, owned in zip(params, by_owner) if owned]
        if len(spread) < len(params):
            self._torch_muon([p for p, owned in zip(params, by_owner) if not owned], group)
        if not spread:
            return True
        momentum = group["momentum"]
        updates = []
        for param in spread:  # torch's momentum step, on this rank's rows
            grad, buf = local_data(param.grad), local_data(self._momentum(param))
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)

        def orthogonalise(matrix):
            return _zeropower_via_newtonschulz(
                matrix, group["ns_coefficients"], group["ns_steps"], group["muon_eps"]
            )

        lr, decay, split = group["lr"], group["weight_decay"], group["split_fused"]
        for shard_group, indices in self._shard_groups(spread, group["ns_steps"], split):
            matrices, me = shard_group.matrices, shard_group.me
            params = [spread[indices[m.param]] for m in matrices]
            shapes = [_one_process_shape(p, m) for p, m in zip(params, matrices)]
            fns = [
                on_whole_matrix(p, orthogonalise, s, m)
                for p, s, m in zip(params, shapes, matrices)
            ]
            ins = [_rows(updates[indices[m.param]], m, me) for m in matrices]
            updated = shard_group.transform(ins, fns)
            for matrix, param, shape, update in zip(matrices, params, shapes, updated):
                main = _rows(local_data(param), matrix, me)
                main.mul_(1 - lr * decay)
                main.add_(
                    update.to(main.device), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape)
                )
        # every rank marks every written piece's flat buffer (an empty piece is no view of
        # it): a unit kept gathered (ZeRO-1/2) then regathers on all ranks alike
        bases = [p._local_tensor.version_base for p in spread]
        torch.autograd.graph.increment_version([b for b in bases if b is not None])
        return True

    def _torch_muon(self, params: list, group: dict) -> None:
        """torch's Muon step of `params` (not flatshard's), a grouped 3-D one per expert."""
        lists = ([], [], [])
        for param in params:
            buf = self._momentum(param)
            split = param.ndim == 3
            for target, tensor in zip(lists, (param, param.grad, buf)):
                target.extend(tensor.unbind(0) if split else [tensor])
        _single_tensor_muon(
            *lists, lr=group["lr"], weight_decay=group["weight_decay"],
            momentum=group["momentum"], nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"],
            eps=group["muon_eps"], adjust_lr_fn=group["adjust_lr_fn"], has_complex=False,
        )  # fmt: skip

    def _momentum(self, param) -> torch.Tensor:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(
                param.grad, memory_format=torch.preserve_format
            )
        return state["momentum_buffer"]

    def _shard_groups(
        self, params: list, ns_steps: int, split_fused: bool
    ) -> list[tuple[ShardGroup, list[int]]]:
        """The matrices by the shard group that splits their rows, with their owners (kept
        while the same parameters are stepped)."""
        key = (tuple(id(p) for p in params), ns_steps, split_fused)
        if key in self._owners:
            return self._owners[key]
        by_group: dict[tuple, list[int]] = {}
        for index, param in enumerate(params):
            by_group.setdefault((param.device_mesh, param._local_tensor.mesh_dim), [])
            by_group[(param.device_mesh, param._local_tensor.mesh_dim)].append(index)
        self._owners[key] = []
        for (mesh, dim), indices in by_group.items():
            me, matrices, costs = mesh.get_local_rank(dim), [], []
            for position, index in enumerate(indices):
                param = params[index]
                split = split_fused and _splittable(param)
                for matrix in matrices_of(param._local_tensor.spec, position, me, split):
                    matrices.append(matrix)
                    costs.append(newton_schulz_flops(_one_process_shape(param, matrix), ns_steps))
            self._owners[key].append((ShardGroup(mesh, dim, matrices, costs), indices))
        return self._owners[key]


def _rows(local: torch.Tensor, matrix, me: int) -> torch.Tensor:
    """This rank's rows of `matrix` in a parameter's local piece (a view of it)."""
    start = matrix.local_start
    return local.view(-1, matrix.shape[1])[start : start + matrix.rows(me)]


def _by_owner(param) -> bool:
    """Whether `param`'s owner rebuilds it from the rows this step (its gradient too is in
    flatshard's rows)."""
    return _rebuilt_from_rows(param) and isinstance(
        getattr(param.grad, "_local_tensor", None), RowShard
    )


def _rebuilt_from_rows(param) -> bool:
    """Whether `param` holds flatshard matrices whose owners can rebuild them: a 2-D
    parameter, or grouped experts (a matrix per expert), split by rows over one shard group
    (no `Shard(d)`), replicated over HSDP's replicas, and split over a TP group (whose
    ranks' owners join their blocks) or, experts, over an EP group at most."""
    local = getattr(param, "_local_tensor", None)
    if not isinstance(local, RowShard):
        return False
    info = local.spec.info
    if info.shard_dim != 0 or len(info.shape) not in (2, 3):
        return False
    if len(info.shape) == 2 and info.row_dims != 1:
        return False
    found = registry.managed_of(param)
    experts = found is not None and found[0].mesh.expert_parallel
    tp_mesh, _ = tensor_parallel_of(param)
    if len(info.shape) == 3 and tp_mesh is not None:
        return False
    if tp_mesh is None and not experts and tuple(info.shape) != tuple(info.global_shape):
        return False
    others = [p for dim, p in enumerate(param.placements) if dim != local.mesh_dim]
    return sum(not isinstance(p, Replicate) for p in others) <= (tp_mesh is not None or experts)


def tensor_parallel_of(param) -> tuple:
    """(TP mesh, the parameter's placement on it) of a flatshard parameter, or (None, None)."""
    found = registry.managed_of(param)
    if found is None or found[1].tp_placement is None or found[0].mesh.tp_mesh is None:
        return None, None
    return found[0].mesh.tp_mesh, found[1].tp_placement


def _one_process_shape(param, matrix) -> tuple[int, int]:
    """The matrix as torch's Muon sees it in one process (its learning-rate adjustment and
    Newton-Schulz cost): a 2-D parameter's global shape, an expert's or a component's own
    (under TP, the component's TP-global one)."""
    if matrix.component is None:
        return tuple(param.shape) if param.ndim == 2 else matrix.shape
    shape = list(matrix.shape)
    tp_mesh, placement = tensor_parallel_of(param)
    if tp_mesh is not None:
        shape[placement.dim] *= tp_mesh.size()
    return tuple(shape)


def _splittable(param) -> bool:
    """Whether each fused component of `param` is a block of this rank's matrix: always
    without TP; under TP where the parameter holds a part of every component (`[gate_r;
    up_r]`) or TP splits the columns."""
    tp_mesh, placement = tensor_parallel_of(param)
    info = param._local_tensor.spec.info
    return tp_mesh is None or info.split_by_components or placement.dim == 1


def on_whole_matrix(param, orthogonalise, shape: tuple[int, int], matrix):
    """What the owner runs on `matrix`, rebuilt from the rows (of `shape` in one process):
    `orthogonalise`; under TP, on the TP-global matrix (the TP group's blocks joined, each
    owner of the group computing it, as torch's Muon sees the parameter in one process),
    keeping its block."""
    tp_mesh, placement = tensor_parallel_of(param)
    if tp_mesh is None:
        return orthogonalise
    if matrix.component is not None and isinstance(placement, _StridedShard):
        # a fused weight's component (gate of `[gate_r; up_r]`): each rank holds one
        # block of it, in rank order; the fused placement would join its rows permuted
        placement = Shard(placement.dim)
    shape, stride = torch.Size(shape), (shape[1], 1)

    def tp_global(block):
        # joined in fp32 (exact for bf16 values; gloo gathers no bf16)
        full = DTensor.from_local(
            block.float(), tp_mesh, [placement], run_check=False, shape=shape, stride=stride
        ).full_tensor()
        result = orthogonalise(full.bfloat16())
        replicated = DTensor.from_local(result, tp_mesh, [Replicate()], run_check=False)
        return replicated.redistribute(tp_mesh, [placement]).to_local()

    return tp_global


def muon_param_groups(model: nn.Module, adamw_modules: tuple[str, ...] = ("output", "lm_head")):
    """[Muon group, AdamW group] of `model`'s trainable parameters: the 2-D weights and
    grouped experts' 3-D ones (a matrix per expert) go to Muon, except those of embeddings,
    of the output head (`get_output_embeddings()` where the model has it) and of modules
    named in `adamw_modules`; every other parameter (norms, biases, ...) goes to AdamW. Add
    `lr` etc. to either group as you would to torch's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    to_adamw = set()
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.Embedding)
            or module is head
            or name.split(".")[-1] in adamw_modules
        ):
            to_adamw.update(id(p) for p in module.parameters(recurse=False))
    matrices, others = [], []
    for param in model.parameters():
        if param.requires_grad:
            chosen = matrices if param.ndim in (2, 3) and id(param) not in to_adamw else others
            chosen.append(param)
    return [{"params": matrices, "use_muon": True}, {"params": others, "use_muon": False}]
