"""A trainable fp32 weight that casts itself for its all-gather: a stand-in for torchao's
float8 training weight (`WeightWithDynamicFloat8CastTensor`; torchao does not install
here). It wraps a plain fp32 tensor that the optimizer steps (every op runs on the inner
tensor; the ops that shard or copy a parameter keep the wrapper); its pre hook casts this
rank's shard to the mixed-precision policy's compute dtype, and its post hook hands the
gathered output to forward as it is, without a copy (a copy into `out` would bump the
version of a tensor saved for backward: torchao's float8 weights are views too).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten

# ops whose results are the parameter (or a piece of it) again: they keep the wrapper
_KEEP = {
    aten.detach.default,
    aten.alias.default,
    aten.split.Tensor,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.empty_like.default,
}


class CastingWeight(torch.Tensor):
    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.shape,
            strides=tensor.stride(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self):
        return f"CastingWeight({self._tensor!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return CastingWeight(inner["_tensor"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = tree_map_only(CastingWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*unwrapped[0], **unwrapped[1])
        if func in _KEEP:
            return tree_map_only(torch.Tensor, CastingWeight, out)
        return out

    # --- FSDP2's all-gather protocol ------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._tensor.detach().to(mp_policy.param_dtype or self.dtype),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:
            assert out.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
            return None
        return gathered, (gathered,)


torch.serialization.add_safe_globals([CastingWeight])
