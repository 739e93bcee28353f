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

from flatshard.dtensor.sharded_param import param_spec
from flatshard.hf.adapter import StateDictAdapter, adapter_for
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import TensorMapping

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
    larger one alone); a tensor yielded is let go before the next group is gathered. Every
    rank must exhaust the iterator (it runs collectives); with `to_rank`, only that rank
    receives the tensors. `dtype`: cast them."""
    if names not in NAMES:
        raise ValueError(f"full_weights names={names!r}: use one of {NAMES}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"full_weights max_bytes={max_bytes!r}: use a byte count >= 0")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if to_rank is not None and not 0 <= to_rank < world:
        raise ValueError(f"full_weights to_rank={to_rank}: there are ranks 0..{world - 1}")
    receiving = to_rank is None or world == 1 or dist.get_rank() == to_rank
    order, params = hf_order(model, adapter) if names == "hf" else _model_order(model)
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


def _model_order(model: nn.Module):
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


def gathered(order, params: dict, max_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each (name, parameter name, cut) of `order`. A parameter is
    gathered (by every rank, in the same order) when its first tensor comes, together with
    the next ones to come while all held stay within `max_bytes`, and dropped after its
    last tensor."""
    last_use = {param_name: i for i, (_, param_name, _) in enumerate(order)}
    upcoming = list(dict.fromkeys(param_name for _, param_name, _ in order))  # first uses
    next_up = 0
    held: dict[str, torch.Tensor] = {}
    for i, (name, param_name, cut) in enumerate(order):
        if param_name not in held:  # it is upcoming[next_up]: start a group with it
            held_bytes = sum(_bytes(params[n]) for n in held)
            while next_up < len(upcoming):
                ahead = upcoming[next_up]
                if ahead != param_name and held_bytes + _bytes(params[ahead]) > max_bytes:
                    break
                held[ahead] = _full(params[ahead])
                held_bytes += _bytes(params[ahead])
                next_up += 1
        full = held[param_name]
        yield name, full if cut is None else cut(full)
        del full  # held here past its last use, it would count against the next group
        if last_use[param_name] == i:
            del held[param_name]


def _bytes(param) -> int:
    return param.numel() * param.element_size()


def _full(param) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()
