"""What a checkpoint holds: the application state dict, per-rank RNG, and the checkpoint
process group (a separate gloo group, so async saves never share a communicator with
training collectives)."""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from flatshard import comm
from flatshard.dtensor import plain_state
from flatshard.dtensor.sharded_param import local_data

_group = _made_for = None


def checkpoint_group():
    """A gloo group over all ranks for checkpoint I/O (None without torch.distributed);
    made anew when the default group was (a process that took its group down and joined
    a new one: a restart in place, or CLI runs one after another)."""
    global _group, _made_for
    if not dist.is_initialized():
        return None
    if _group is None or _made_for is not dist.group.WORLD:
        _group, _made_for = dist.new_group(backend="gloo"), dist.group.WORLD
    return _group


def rank_and_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def gather_to_rank0(value, group) -> list | None:
    if group is None:
        return [value]
    rank, world = rank_and_world(group)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(value, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return gathered


def app_state(model, optimizer, extra: dict, trainable_only: bool = False) -> dict:
    """{"model": ..., "optim": ..., "extra": {...}} keyed by the unwrapped model's FQNs.
    trainable_only: the model's frozen parameters left out (LoRA: its base comes from the
    pretrained files, the checkpoint holds the adapters)."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        # plain-tensor optimizer states as DTensor views: DCP then sees their global shape
        plain_state.as_dtensors(model, optim_state)
        if getattr(model, "pipeline_stage", False):
            _all_stages_groups(optim_state)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model, options=options)}
    for alias, name in tied_aliases(model).items():  # a tied weight under both its names
        if name in state["model"]:
            state["model"][alias] = state["model"][name]
    if extra:
        # DCP only expands Stateful objects at the top level: expand ours here
        state["extra"] = {name: _expand(value) for name, value in extra.items()}
    return state


def tied_aliases(model) -> dict[str, str]:
    """{name: the name it stands for} of weights a pipeline stage holds for two names (the
    first stage's embedding, tied to the last stage's head): one process's checkpoint names
    both, and so does a pipeline's."""
    tie = getattr(model, "tied_across_stages", None)
    return tie.aliases() if tie is not None else {}


def _all_stages_groups(optim_state: dict) -> None:
    """A pipeline stage's optimizer groups name its own parameters, but DCP keeps one
    rank's copy of each group (keyed by its index): each group names every stage's (one
    all-gather), so a load at another split finds all of them."""
    groups = optim_state.get("param_groups", [])
    group = checkpoint_group()
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [g["params"] for g in groups], group=group)
    for index, param_group in enumerate(groups):
        names = [n for ranks_groups in everyone for n in ranks_groups[index]]
        param_group["params"] = list(dict.fromkeys(names))


def _is_stateful(value) -> bool:
    return isinstance(value, Stateful) and not isinstance(value, torch.Tensor)


def _expand(value):
    return value.state_dict() if _is_stateful(value) else value


def restore_stateful(extra: dict, loaded: dict) -> dict:
    """Hand loaded state to Stateful extras; return the loaded plain values."""
    plain = {}
    for name, value in extra.items():
        if name not in loaded:  # skipped by a non-strict load
            continue
        if _is_stateful(value):
            value.load_state_dict(loaded[name])
        else:
            plain[name] = loaded[name]
    return plain


def stage(state, reuse=None):
    """A host copy of `state` taken now, so training may change the originals during an
    asynchronous write. Buffers of `reuse` (the previous staged copy, whose write has
    finished) are refilled in place when shapes match: no allocation, no page faults."""
    if isinstance(state, dict):
        reuse = reuse if isinstance(reuse, dict) else {}
        return {key: stage(value, reuse.get(key)) for key, value in state.items()}
    if isinstance(state, list):
        reuse = (
            reuse if isinstance(reuse, list) and len(reuse) == len(state) else [None] * len(state)
        )
        return [stage(value, old) for value, old in zip(state, reuse)]
    if isinstance(state, (torch.Tensor, DTensor)):
        if _same_layout(state, reuse):
            comm.to_host(_plain_local(state), into=_plain_local(reuse))
            return reuse
        # to host memory: an async save must not double GPU memory (DTensors keep their rows)
        return comm.to_host(state)
    return copy.deepcopy(state)


def _plain_local(tensor) -> torch.Tensor:
    return local_data(tensor) if isinstance(tensor, DTensor) else tensor.detach()


def _same_layout(tensor, old) -> bool:
    if not isinstance(old, torch.Tensor) or type(old) is not type(tensor):
        return False
    if isinstance(tensor, DTensor) and (
        old.placements != tensor.placements or _plain_local(old).shape != _plain_local(tensor).shape
    ):
        return False
    return old.shape == tensor.shape and old.dtype == tensor.dtype


def rng_state() -> dict:
    """This rank's generators: Python's, the CPU's and its own CUDA device's (not every
    visible GPU's: other ranks own those)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
