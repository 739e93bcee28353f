"""A frozen weight kept as int8 rows with one fp32 scale a row, implementing FSDP2's
all-gather protocol the way torchao's NF4 tensor does (test_qlora_nf4.py runs NF4 itself):
the pre hook hands over its inner tensors, the post hook wraps the gathered ones without a copy
(and on later gathers checks that `out` already views them), and a linear layer dequantizes
it in forward and again in backward, from the tensor autograd saved. The ops FSDP2 runs on
a parameter while sharding it (chunk, new_zeros, narrow, copy_, view, as_strided) are
implemented on the inner tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


class Int8Weight(torch.Tensor):
    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=torch.float32, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor):
        self.qdata = qdata  # int8, the weight's shape
        self.scale = scale  # fp32, (rows, 1) for a 2-D weight

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return cls((weight / scale).round().clamp(-127, 127).to(torch.int8), scale)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.qdata.to(dtype) * self.scale.to(dtype)

    def __repr__(self):
        return f"Int8Weight({tuple(self.shape)})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Weight(inner["qdata"], inner["scale"])

    # --- FSDP2's all-gather protocol ------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.qdata, self.scale), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        qdata, scale = outputs
        if out is not None:
            assert out.qdata.untyped_storage().data_ptr() == qdata.untyped_storage().data_ptr()
            return None
        return Int8Weight(qdata, scale), (qdata, scale)

    # --- the ops sharding and compute need ------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return _Int8Linear.apply(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return Int8Weight(func(self.qdata), func(self.scale))
        if func is aten.split.Tensor:
            size, dim = args[1], args[2] if len(args) > 2 else 0
            assert dim == 0
            return [
                Int8Weight(q, s) for q, s in zip(self.qdata.split(size), self.scale.split(size))
            ]
        if func is aten.new_zeros.default:
            size = args[1]
            return Int8Weight(
                self.qdata.new_zeros(size), self.scale.new_zeros((size[0], *self.scale.shape[1:]))
            )
        if func is aten.slice.Tensor:
            dim, start, end = args[1], args[2], args[3]
            assert dim == 0
            return Int8Weight(self.qdata[start:end], self.scale[start:end])
        if func is aten.copy_.default:
            self.qdata.copy_(args[1].qdata)
            self.scale.copy_(args[1].scale)
            return self
        if func in (aten.view.default, aten._unsafe_view.default):
            size = list(args[1])
            if size == list(self.shape):
                return Int8Weight(self.qdata, self.scale)
            return Int8Weight(self.qdata.view(size), self.scale)  # FSDP2's view(-1)
        if func is aten.as_strided.default:
            rows = args[1][0]
            assert list(args[1][1:]) == list(self.shape[1:]) and (len(args) < 4 or args[3] == 0)
            return Int8Weight(self.qdata[:rows], self.scale[:rows])
        if func is aten.is_pinned.default:
            return self.qdata.is_pinned()
        raise NotImplementedError(f"Int8Weight does not implement {func}")


class _Int8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None):
        assert bias is None  # the layers here have none
        ctx.weight = weight  # as NF4's linear: the frozen tensor itself, refilled by a gather
        return F.linear(input, weight.dequantize(input.dtype))

    @staticmethod
    def backward(ctx, grad):
        grad_input = grad @ ctx.weight.dequantize(grad.dtype)
        return grad_input, None, None


# DCP reads with torch.load(weights_only=True); torchao allowlists its tensor classes too
torch.serialization.add_safe_globals([Int8Weight])
