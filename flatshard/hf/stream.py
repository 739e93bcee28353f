"""A sharded model's full tensors, streamed: gathered a few parameters at a time within a
byte budget, cut into Hugging Face tensors (or kept under the model's own names), and each
parameter dropped after its last tensor. `save_pretrained` writes what this yields; an RL
trainer pushes it into its inference engine after every update (`flatshard.full_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard import registry
from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.adapter import StateDictAdapter, adapter_for
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import TensorMapping
from flatshard.runtime.managed_param import home_of

NAMES = ("hf", "model")


def full_weights(
    model: nn.Module,
    names: str = "hf",
    *,
    max_bytes: int = 2**30,
    to_rank: int | None = None,
    dtype: torch.dtype | None = None,
    adapter: StateDictAdapter | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs of `model` (sharded or not): Hugging Face names and layout
    (`names="hf"`: fused weights cut into their components, grouped experts one tensor per
    expert, parameter by parameter) or the model's own (`"model"`: its state dict's keys).
    Parameters are gathered a group at a time, at most `max_bytes` of them held at once (a
    larger one alone): a bucket that fits comes in one collective, its tensors views of it
    (clone one to keep it alone). A tensor yielded is let go before the next group is
    gathered. Every rank must exhaust the iterator (it runs collectives); with `to_rank`,
    only that rank receives the tensors. `dtype`: cast them."""
    if names not in NAMES:
        raise ValueError(f"full_weights names={names!r}: use one of {NAMES}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"full_weights max_bytes={max_bytes!r}: use a byte count >= 0")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if to_rank is not None and not 0 <= to_rank < world:
        raise ValueError(f"full_weights to_rank={to_rank}: there are ranks 0..{world - 1}")
    receiving = to_rank is None or world == 1 or dist.get_rank() == to_rank
    for unit in registry.units_below(model):
        unit.check_states_here()  # not while offload_states has them on the host
    order, params = hf_order(model, adapter) if names == "hf" else model_order(model)
    with torch.no_grad():
        for name, tensor in gathered(order, params, max_bytes):
            if receiving:
                yield name, tensor if dtype is None else tensor.to(dtype)
            del tensor  # not held while the next group is gathered


def hf_order(model: nn.Module, adapter: StateDictAdapter | None = None, mappings=None):
    """(the HF tensors as (name, parameter name, cut), the parameters by name); `mappings`:
    in the order to produce them (default: parameter by parameter, each one's tensors
    together, so that one parameter is held at a time)."""
    adapter = adapter or adapter_for(model)
    if mappings is None:
        mappings, unmapped = adapter.plan(model)
        if unmapped:
            raise HFCheckpointError(
                f"no Hugging Face name for parameter(s) {unmapped}; add a NameRule for them"
            )
    params = adapter.tensors(model)
    infos = {name: param_spec(model, name, param).info for name, param in params.items()}

    def cut(mapping: TensorMapping) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda full: hf_tensor(mapping, infos[mapping.param_name], full)

    return [(m.hf_name, m.param_name, cut(m)) for m in mappings], params


def model_order(model: nn.Module):
    """(the state dict's entries as (key, the key of the tensor it shares, None), the
    tensors by key: tied ones once)."""
    state = model.state_dict()
    first_key: dict[int, str] = {}  # tied parameters: gathered once
    for key, value in state.items():
        first_key.setdefault(id(value), key)
    order = [(key, first_key[id(value)], None) for key, value in state.items()]
    return order, {key: state[key] for key in first_key.values()}


def hf_tensor(mapping: TensorMapping, info, full: torch.Tensor) -> torch.Tensor:
    """HF tensor `mapping` cut from its parameter's full value `full`."""
    if mapping.component is not None:
        return info.component(mapping.component).select_global(full)
    if mapping.tile is not None:
        block = mapping.tile.inverse(mapping.hf_name)  # parameter -> HF
        return block.take(full[block.box.slices])
    return full


class _Group:
    """What one gather brings: a bucket's parameters (one collective for the whole bucket,
    where it holds them whole: no tensor or expert parallelism on its unit) or one
    parameter (its DTensor's `full_tensor()`)."""

    def __init__(self, nbytes: int, gather: Callable[[], dict[str, torch.Tensor]]):
        self.nbytes, self.gather = nbytes, gather


def _groups(params: dict, max_bytes: int) -> dict[str, _Group]:
    """The group of every parameter: its bucket's where that fits in `max_bytes`."""
    by_bucket: dict[int, list[tuple[str, int]]] = {}
    buckets = {}
    groups: dict[str, _Group] = {}
    for name, param in params.items():
        home = home_of(param)
        if home is not None and home.unit.mesh.inner_mesh is None:
            bucket = home.bucket
            if bucket.layout.padded_size * bucket.shard.dtype.itemsize <= max_bytes:
                by_bucket.setdefault(id(bucket), []).append((name, home.index))
                buckets[id(bucket)] = bucket
                continue
        groups[name] = _Group(_bytes(param), lambda p=param, n=name: {n: _full(p)})
    for key, members in by_bucket.items():
        bucket = buckets[key]

        def gather(bucket=bucket, members=members):
            flat = bucket.gather_main()
            return {name: bucket.unsharded_view(flat, index) for name, index in members}

        group = _Group(bucket.layout.padded_size * bucket.shard.dtype.itemsize, gather)
        groups.update({name: group for name, _ in members})
    return groups


def gathered(order, params: dict, max_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each (name, parameter name, cut) of `order`. A parameter's group
    is gathered (by every rank, in the same order) when its first tensor comes, together
    with the next groups to come while all held stay within `max_bytes` (a larger one
    alone), and dropped after its last tensor."""
    group_of = _groups(params, max_bytes)
    last_use = {group_of[param_name]: i for i, (_, param_name, _) in enumerate(order)}
    upcoming = list(dict.fromkeys(group_of[param_name] for _, param_name, _ in order))
    next_up = 0
    held: dict[_Group, dict[str, torch.Tensor]] = {}
    for i, (name, param_name, cut) in enumerate(order):
        group = group_of[param_name]
        if group not in held:  # it is upcoming[next_up]: gather it and what fits after it
            held_bytes = sum(g.nbytes for g in held)
            while next_up < len(upcoming):
                ahead = upcoming[next_up]
                if ahead is not group and held_bytes + ahead.nbytes > max_bytes:
                    break
                held[ahead] = ahead.gather()
                held_bytes += ahead.nbytes
                next_up += 1
        full = held[group][param_name]
        yield name, full if cut is None else cut(full)
        del full  # held here past its last use, it would count against the next group
        if last_use[group] == i:
            del held[group]


def _bytes(param) -> int:
    return param.numel() * param.element_size()


def _full(param) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()
