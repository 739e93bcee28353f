"""Parameters whose tensor subclass decides what is all-gathered: FSDP2's extension protocol
(`fsdp_pre_all_gather` / `fsdp_post_all_gather`), through which torchao's NF4 weights make
QLoRA possible and its float8 weights gather in 8 bits.

Such a parameter cannot live in a flat bucket (its bytes are the subclass's business), so it
is sharded as FSDP2 shards it: dim-0 chunks of the parameter, each padded to the first
chunk's size, its DTensor `Shard(0)`. What its pre hook returns moves as bytes in the unit's
one all-gather: appended to the first bucket's shard where the unit has a plain bucket
gather (its `Transport.subclass_bytes`), else in one all-gather of its own. As in FSDP2, the
gathered outputs are kept per parameter, their memory freed on reshard and given back before the
next gather, and every gather after the first calls the post hook with `out=` the same
unsharded tensor: a frozen base saved for backward sees the values gathered again there.

A frozen one (a quantized QLoRA base) keeps nothing but its shard; a trainable one's
gradients are subclass_grads.py's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from flatshard import comm


def has_gather_protocol(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (a DTensor's local tensor counts) decides its own all-gather."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return hasattr(local, "fsdp_pre_all_gather") and hasattr(local, "fsdp_post_all_gather")


def problem_with(fqn: str, param: torch.Tensor) -> str | None:
    """Why `param` cannot be gathered through its protocol here, as one line (None: it can)."""
    name = type(param._local_tensor if isinstance(param, DTensor) else param).__name__
    if isinstance(param, DTensor):
        return (
            f"parameter {fqn!r} is a tensor-parallel DTensor of a {name} (a tensor subclass "
            "with fsdp_pre_all_gather): flatshard gathers such subclasses only as plain "
            "parameters; shard it without TP or leave it out with ignored_params"
        )
    if param.is_meta:
        return (
            f"parameter {fqn!r} is a {name} on the meta device: a tensor subclass with "
            "fsdp_pre_all_gather must hold its real data when fully_shard is called"
        )
    return None


@dataclass
class SubclassParam:
    """One such parameter: its FSDP2-style shard and what its last gather made."""

    fqn: str
    occurrences: list[tuple[nn.Module, str]]
    sharded: nn.Parameter  # a DTensor, Shard(0) of torch.chunk rows, its local the subclass
    padded: torch.Tensor  # this rank's chunk, padded to the first chunk's rows
    orig_size: torch.Size
    orig_stride: tuple[int, ...]  # contiguous, as FSDP2 passes it: worked out once, not per gather
    metadata: object = None  # the pre hook's, for the post hook
    input_specs: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # kept from gather to gather
    inner: tuple = ()  # what the post hook said to free on reshard
    unsharded: nn.Parameter | None = None
    unsynced: torch.Tensor | None = None  # gradients of unsynced micro-batches, reduce dtype


def shard(fqn, original, occurrences, mesh) -> SubclassParam:
    """`original`'s chunk on this rank, padded as FSDP2 pads it, as a sharded DTensor."""
    rank, ranks = mesh.shard_rank, mesh.shard_size
    with torch.no_grad():
        chunks = list(torch.chunk(original, ranks, dim=0))
        # on the mesh's device, as FSDP2 moves it (a model built on the host shards to GPU)
        padded = original.new_zeros(chunks[0].size(), device=mesh.device)
        rows = chunks[rank].size(0) if rank < len(chunks) else 0
        if rows:
            padded.narrow(0, 0, rows).copy_(chunks[rank])
        local = padded.narrow(0, 0, rows)
        dtensor = DTensor.from_local(
            local,
            mesh.device_mesh,
            mesh.placements,
            run_check=False,
            shape=original.size(),
            stride=original.stride(),
        )
    sharded = nn.Parameter(dtensor, requires_grad=original.requires_grad)
    stride = torch.empty(original.size(), device="meta").stride()
    return SubclassParam(fqn, occurrences, sharded, padded, original.size(), stride)


class SubclassGather:
    """The subclass parameters of one unit, gathered together."""

    def __init__(self, params: list[SubclassParam], mesh, module: nn.Module, mp_policy):
        self.params = params
        self.mesh = mesh
        self.module = module
        self.mp_policy = mp_policy
        self.in_bucket_gather = False  # the current gather travels in a bucket's
        device_mesh, names = mesh.device_mesh, mesh.device_mesh.mesh_dim_names
        # the hooks see the shard dim's mesh (HSDP's last dim), as FSDP2's do
        self.shard_mesh = (
            device_mesh if device_mesh.ndim == 1 or not names else device_mesh[names[-1]]
        )

    def pack(self) -> torch.Tensor:
        """This rank's all-gather inputs, every parameter's, as one run of bytes."""
        pieces = []
        for param in self.params:
            inputs, param.metadata = self._pre_all_gather(param)
            param.input_specs = [(t.size(), t.dtype) for t in inputs]
            if any(t.size() != param.padded.size() for t in inputs) and (
                param.sharded._local_tensor.size() != param.padded.size()
            ):
                raise AssertionError(
                    f"{param.fqn}: fsdp_pre_all_gather must return inputs of the padded shard "
                    f"size {tuple(param.padded.size())} (as FSDP2 requires of unevenly sharded "
                    f"parameters), got {[tuple(t.size()) for t in inputs]}"
                )
            pieces += [t.contiguous().view(-1).view(torch.uint8) for t in inputs]
        return torch.cat(pieces)

    def _pre_all_gather(self, param: SubclassParam):
        local = param.sharded._local_tensor  # FSDP2 asks the same tensor
        hook = local.fsdp_pre_all_gather
        if _takes_the_mesh_only(type(local), hook):  # FSDP2's older signature
            return hook(self.shard_mesh)
        return hook(
            self.shard_mesh, param.orig_size, param.orig_stride, self.module, self.mp_policy
        )

    def gather_alone(self, group):
        """One all-gather of these parameters' bytes (a unit without a plain bucket gather)."""
        return self._all_gather(self.pack(), None, group)

    def gather_with(self, output: torch.Tensor, shard: torch.Tensor, group):
        """A bucket's all-gather with these parameters' bytes after its shard's: one
        collective; the bucket's part is copied into `output` at wait()."""
        self.in_bucket_gather = True
        return self._all_gather(torch.cat([shard.view(torch.uint8), self.pack()]), output, group)

    def _all_gather(self, packed: torch.Tensor, output, group):
        ranks = self.mesh.shard_size
        wire = torch.empty(ranks * packed.numel(), dtype=torch.uint8, device=packed.device)
        work = comm.for_group(group).all_gather(wire, packed)
        return _Unpack(work, wire.view(ranks, -1), output, self)

    def finish(self, wire: torch.Tensor) -> None:
        """Every parameter's outputs from the gathered bytes (one row a rank), then its
        post hook: the first time it makes the unsharded tensor, later it refills it."""
        offset = 0
        for param in self.params:
            offset = _unpack(param, wire, offset)
            gathered = tuple(
                output.view(-1, *size[1:])
                for output, (size, _) in zip(param.outputs, param.input_specs)
            )
            dtype = self.mp_policy.param_dtype or param.sharded.dtype
            if param.unsharded is None:
                tensor, param.inner = param.sharded._local_tensor.fsdp_post_all_gather(
                    gathered, param.metadata, dtype
                )
                unsharded = torch.as_strided(tensor, param.orig_size, param.orig_stride, 0)
                requires_grad = param.sharded.requires_grad
                param.unsharded = nn.Parameter(unsharded, requires_grad=requires_grad)
            else:
                for inner in param.inner:  # views of the outputs come back with them
                    if inner.untyped_storage().size() == 0:
                        comm.alloc_storage(inner)
                param.sharded._local_tensor.fsdp_post_all_gather(
                    gathered, param.metadata, dtype, out=param.unsharded
                )
            param.metadata = None

    def free(self) -> None:
        """Free what the gathers hold (the tensors stay, for the next gather to refill)."""
        for param in self.params:
            for tensor in (*param.outputs, *param.inner):
                comm.free_storage(tensor)

    def register(self, which: str) -> None:
        for param in self.params:
            value = param.unsharded if which == "unsharded" else param.sharded
            if value is None:
                continue
            for module, name in param.occurrences:
                module._parameters[name] = value


_PRE_HOOK_ARITY: dict[type, bool] = {}


def _takes_the_mesh_only(cls: type, hook) -> bool:
    """Whether `cls`'s pre hook has FSDP2's older `(mesh)` signature: read once per class."""
    older = _PRE_HOOK_ARITY.get(cls)
    if older is None:
        older = _PRE_HOOK_ARITY[cls] = len(inspect.signature(hook).parameters) == 1
    return older


def _unpack(param: SubclassParam, wire: torch.Tensor, offset: int) -> int:
    """Copy `param`'s inputs from every rank's row of `wire` (from byte `offset`) into its
    kept outputs (allocated on the first gather); returns the offset after them."""
    ranks = wire.shape[0]
    if not param.outputs:
        param.outputs = [
            torch.empty(ranks * size.numel(), dtype=dtype, device=wire.device)
            for size, dtype in param.input_specs
        ]
    for output in param.outputs:
        comm.alloc_storage(output)
        nbytes = output.numel() * output.element_size() // ranks
        # views of it saved for backward must not see a refill of the same values as a write
        with torch.autograd._unsafe_preserve_version_counter(output):
            output.view(torch.uint8).view(ranks, nbytes).copy_(wire[:, offset : offset + nbytes])
        offset += nbytes
    return offset


class _Unpack:
    """The all-gather's work: waiting on it unpacks the bytes where they belong."""

    def __init__(self, work, wire: torch.Tensor, output: torch.Tensor | None, gather):
        self._work, self._wire, self._output, self._gather = work, wire, output, gather

    def wait(self) -> bool:
        self._work.wait()
        wire = self._wire
        if self._output is not None:
            own = self._output.view(torch.uint8).view(wire.shape[0], -1)
            own.copy_(wire[:, : own.shape[1]])
            wire = wire[:, own.shape[1] :]
        self._gather.finish(wire)
        self._wire = None
        return True
