"""What differs between the torch versions flatshard runs on, detected by feature (never by
version string), in one place.

- The single-tensor collectives: torch 2.13 names them `all_gather_single` /
  `reduce_scatter_single` (the older `all_gather_into_tensor` / `reduce_scatter_tensor`
  warn and forward to them); earlier releases have only the older names. Looked up at each
  call, so anything that wraps `torch.distributed`'s functions (a byte counter, a test)
  still sees the call. Their autograd form (context parallelism's K/V gather) likewise:
  `all_gather_single_autograd` (2.13), `all_gather_tensor_autograd` before.
- FSDP2's `DataParallelMeshDims` (torch 2.13): defined here alike where torch lacks it.
- Moving one storage's memory into another (`UntypedStorage._swap_data_ptr_`, which the CPU
  buffer pool uses): tried once on two small storages, and the pool keeps nothing where the
  memory, its size and its address do not all move.
- torch.save's CRC-32 of every zip record (`torch.serialization.set_crc32_options`, torch
  2.5 on): switched off while a checkpoint's rank file is written, whose manifest holds a
  CRC-32 of the whole file; a torch without the switch computes it.
- The tensor types torch's optimizers and `clip_grad_norm_` step with foreach (or fused)
  kernels: an exact-type list in `torch.optim.optimizer` and one in
  `torch.utils._foreach_utils` (DTensor adds itself to both). A subclass not listed silently
  gets the per-tensor loop: on a GPU, AdamW's step took 5x as long.
- torch's ring attention (`_templated_ring_attention` and its backward, in the module its
  `context_parallel` lives in since 2.9): None where that module or those functions are
  missing or take a mesh in place of a process group (as before 2.9); context parallelism
  then all-gathers the keys and values itself.
- torch's multi-stage pipeline schedules compute every rank's action list when built, from
  their stages' indices and group size alone: `pipeline_actions` builds one from stand-in
  stages for `flatshard plan` (None where a schedule wants more of a stage). Their `step`
  keeps every micro-batch's output of the last stage (its logits) to return them unless
  told `return_outputs=False` (where it takes that argument): `pipeline_step_options`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op=False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)


def all_gather_autograd(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0; its backward reduce-scatters."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None)
    return (gather or funcol.all_gather_tensor_autograd)(tensor, 0, group)


@functools.cache
def storage_memory_moves() -> bool:
    """Whether `empty._swap_data_ptr_(full)` leaves `empty` with `full`'s memory (address and
    size) and `full` empty: the buffer pool's one storage operation."""
    full, empty = torch.UntypedStorage(64), torch.UntypedStorage(0)
    address = full.data_ptr()
    try:
        empty._swap_data_ptr_(full)
    except (AttributeError, RuntimeError):
        return False
    return empty.size() == 64 and empty.data_ptr() == address and full.size() == 0


@contextlib.contextmanager
def torch_save_without_record_crc32():
    """torch.save without its per-record CRC-32 inside (process-wide while it lasts: the
    switch is torch's one global)."""
    serialization = torch.serialization
    if not hasattr(serialization, "set_crc32_options"):
        yield
        return
    previous = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        yield
    finally:
        serialization.set_crc32_options(previous)


@functools.cache
def torch_ring_attention():
    """torch's context-parallel attention module, where it has the ring functions."""
    try:
        ring = importlib.import_module(
            "torch.distributed.tensor.experimental._context_parallel._attention"
        )
    except ImportError:
        return None
    needed = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options")
    if not all(hasattr(ring, name) for name in needed):
        return None
    # earlier releases took the mesh where these take its process group
    first = next(iter(inspect.signature(ring._templated_ring_attention).parameters))
    return ring if first == "group" else None


def pipeline_step_options(step) -> dict:
    """Keyword arguments for a torch schedule's `step`: its last stage not to keep the
    micro-batches' outputs, where `step` takes `return_outputs`."""
    return {"return_outputs": False} if _takes(step, "return_outputs") else {}


def _takes(function, name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


PIPELINE_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
                  "BACKWARD_WEIGHT": "W"}  # fmt: skip


def pipeline_actions(schedule_type: type, stage_indices: list[int], pp: int, rank: int,
                     microbatches: int) -> list[tuple[str, int, int]] | None:  # fmt: skip
    """Pipeline rank `rank`'s computations under torch's multi-stage `schedule_type`, in the
    order it runs them: (F, B (a whole backward), I (its input half) or W (its weight half),
    stage, micro-batch); an overlapped forward-backward pair as its two. None where the
    schedule cannot be built from stand-in stages."""
    from types import SimpleNamespace

    stages = [
        SimpleNamespace(num_stages=pp * len(stage_indices), group_size=pp, group_rank=rank,
                        stage_index=index, is_first=index == 0,
                        is_last=index == pp * len(stage_indices) - 1,
                        submod=torch.nn.Module())  # fmt: skip
        for index in stage_indices
    ]
    try:
        order = schedule_type(stages, microbatches, loss_fn=lambda *_: None).pipeline_order
    except Exception:  # noqa: BLE001 - a torch whose schedules want more of a stage
        return None
    actions = []

    def add(action) -> None:
        if getattr(action, "sub_actions", None):
            for sub in action.sub_actions:
                add(sub)
            return
        kind = PIPELINE_KINDS.get(getattr(action.computation_type, "name", ""))
        if kind is not None:
            actions.append((kind, action.stage_index, action.microbatch_index))

    for action in order.get(rank, []):
        if action is not None:
            add(action)
    return actions


def fused_tail_unit(device: torch.device, dtype: torch.dtype) -> int | None:
    """How many elements torch's fused optimizer kernels step at once on `device`: a CPU
    kernel runs each tensor in vectors of the CPU's width (`Vectorized`) and its last
    numel % width elements in plain scalar code, which rounds differently (no fused
    multiply-add); a GPU kernel computes every element alike (1). None: a CPU whose width
    flatshard does not know (each piece is then stepped on its own)."""
    if device.type != "cpu":
        return 1
    width = {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())
    return None if width is None else width // dtype.itemsize


def allow_foreach(tensor_type: type) -> None:
    """Let torch's optimizers and gradient clipping take `tensor_type` (a DTensor subclass)
    in their foreach and fused kernels, as they take DTensor."""
    for name in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        module = importlib.import_module(name)  # (torch.optim hides its `optimizer` attribute)
        listed = getattr(module, "_foreach_supported_types", None)
        if listed is not None and tensor_type not in listed:
            listed.append(tensor_type)


@dataclass
class OwnDataParallelMeshDims:
    """Which dims of a whole SPMD mesh are data parallel: FSDP2's `DataParallelMeshDims`,
    for a torch without it. `shard` and `replicate` are one dim name or a tuple of names
    (flattened into one)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs a shard or a replicate dim name")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(dims) -> tuple[str, ...]:
    if dims is None:
        return ()
    return (dims,) if isinstance(dims, str) else tuple(dims)


try:  # FSDP2's full-SPMD-mesh argument, new in torch 2.13
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    DataParallelMeshDims = OwnDataParallelMeshDims
