"""Every change flatshard makes to PyTorch's own behaviour, in one place, installed once
(by the first `fully_shard` or TP split of a fused weight). Each one only changes what
happens to flatshard's own tensors (a `RowShard` local tensor, a parameter `fully_shard`
replaced, a fused weight's `_StridedShard` on a one-dim mesh, which FSDP2 never makes);
everything else goes to PyTorch's original function. Besides them, one scoped change:
`parameters_on_meta` (while a transformers model is built).
"""

from __future__ import annotations

import contextlib
import importlib
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatshard.dtensor import full_state_dict, strided_parts
from flatshard.dtensor.optimizer_check import check_first_step
from flatshard.dtensor.redistribute import redistribute_rows
from flatshard.dtensor.row_shard import RowShard
from flatshard.dtensor.sharded_param import in_row_layout

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _route_redistribution()
    _route_full_state_dict_loading()
    _route_optimizer_state_loading()
    _route_newton_schulz()
    # An optimizer built before fully_shard holds the replaced parameters and would
    # silently train nothing: its first step raises instead.
    register_optimizer_step_pre_hook(check_first_step)
    _installed = True


def _route_redistribution() -> None:
    """DTensor redistributes by `torch.chunk` pieces, which flatshard's row pieces are not:
    `full_tensor()`, `redistribute()` and full state dicts would return wrong rows. DTensor
    calls `redistribute_local_tensor` from three modules (explicit `redistribute`, its
    autograd function, implicit redistribution during op dispatch); each gets the wrapper.
    A fused TP weight's parts on a one-dim mesh go by strided_parts.py (torch 2.11 raises)."""
    from torch.distributed.tensor import _api, _dispatch, _redistribute

    original = _redistribute.redistribute_local_tensor

    def redistribute_local_tensor(local_tensor, current_spec, target_spec, **kwargs):
        if isinstance(local_tensor, RowShard):
            return redistribute_rows(local_tensor, current_spec, target_spec)
        if strided_parts.handles(current_spec, target_spec):
            return strided_parts.redistribute(local_tensor, current_spec, target_spec)
        return original(local_tensor, current_spec, target_spec, **kwargs)

    for module in (_api, _dispatch, _redistribute):
        module.redistribute_local_tensor = redistribute_local_tensor


def _route_newton_schulz() -> None:
    """torch's `Muon` orthogonalises each update with DTensor matrix products, whose
    redistribution assumes `torch.chunk` rows: on flatshard's pieces it hung in a collective
    or failed. A flatshard piece is gathered whole (its own rows), orthogonalised as in one
    process, and this rank's rows of the result are returned: what torch's Muon does on
    FSDP2 (each rank the whole matrix). flatshard.optim.Muon spreads that work instead."""
    try:
        muon = importlib.import_module("torch.optim._muon")
    except ImportError:  # a torch without Muon
        return
    original = getattr(muon, "_zeropower_via_newtonschulz", None)
    if original is None:
        return

    def zeropower_via_newtonschulz(grad, *args, **kwargs):
        local = grad._local_tensor if isinstance(grad, DTensor) else None
        if not isinstance(local, RowShard):
            return original(grad, *args, **kwargs)
        whole = original(grad.full_tensor(), *args, **kwargs)
        rows = torch.zeros_like(grad, dtype=whole.dtype)
        rows.to_local().copy_(local.spec.piece_of(whole))
        return rows

    muon._zeropower_via_newtonschulz = zeropower_via_newtonschulz


def _route_optimizer_state_loading() -> None:
    """`optimizer.load_state_dict` keeps each state as given: a DTensor cut by another
    layout (the FSDP2 example rebuilds Adam's state with `distribute_tensor(full,
    p.device_mesh, p.placements)`, which cuts `torch.chunk` rows) is re-cut to flatshard's
    rows as it enters the optimizer (sharded_param.in_row_layout)."""
    from torch.optim import Optimizer

    original = Optimizer._process_value_according_to_param_policy

    def process_value(param, value, param_id, param_groups, key=None):
        return original(param, in_row_layout(param, value), param_id, param_groups, key)

    Optimizer._process_value_according_to_param_policy = staticmethod(process_value)


def _route_full_state_dict_loading() -> None:
    """`set_model_state_dict` / `set_optimizer_state_dict(full_state_dict=True)` cut full
    tensors into `torch.chunk` pieces: flatshard's DTensors take their layout rows instead
    (full_state_dict.py)."""
    from torch.distributed import _state_dict_utils
    from torch.distributed.checkpoint import state_dict

    state_dicts = partial(
        full_state_dict.distribute_state_dict, _state_dict_utils._distribute_state_dict
    )
    tensors = partial(full_state_dict.distribute_tensors, _state_dict_utils._distribute_tensors)
    _state_dict_utils._distribute_state_dict = state_dicts
    state_dict._distribute_state_dict = state_dicts
    _state_dict_utils._distribute_tensors = tensors


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside put their parameters on the meta device (allocated empty, then
    replaced, so nothing is initialised); buffers are built as the code says."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
