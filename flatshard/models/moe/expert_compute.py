"""The routed experts' SwiGLU, computed from grouped 3-D weights.

`gate_up (E, 2I, H)` holds each expert's `[gate; up]` rows, `down (E, H, I)` its down
projection. Token copies are sorted by expert, so each expert reads one contiguous run of
rows; then either one matmul per expert (`loop`, the reference) or one `torch._grouped_mm`
per projection (`grouped_mm`). Both produce the same sums in the same order.

`torch._grouped_mm` on torch 2.13 CPU (checked) takes fp32, bf16 and fp16 (not fp64),
int32 group offsets, and row strides that are multiples of 16 bytes, i.e. H and I times the
element size. On CUDA, PyTorch documents bf16 only, on compute capability 8.0 or newer, and
the kernels also want 16-byte aligned base pointers (not run here: no GPU in the tests).
`grouped_mm_supported` says whether a call may use it; other devices take the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MM_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}
_ALIGN_BYTES = 16


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can compute these experts on x's device, dtype and sizes."""
    device = x.device.type
    if not hasattr(torch, "_grouped_mm") or x.dtype not in GROUPED_MM_DTYPES.get(device, ()):
        return False
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return False
    if device == "cuda":
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
        if any(t.data_ptr() % _ALIGN_BYTES for t in (gate_up, down)):
            return False
    size = x.element_size()
    hidden, inner = down.shape[1], down.shape[2]
    return (hidden * size) % _ALIGN_BYTES == 0 and (inner * size) % _ALIGN_BYTES == 0


def routed_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    use_grouped_mm: bool,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{indices[t, j]}(x[t]) for every token t: x (T, H) ->
    (T, H); indices and weights (T, k)."""
    n_experts, top_k = gate_up.shape[0], indices.shape[1]
    flat_experts = indices.flatten()
    # stable: a token's copies keep token order within each expert's run of rows
    order = torch.argsort(flat_experts, stable=True)
    token_of_row = order // top_k
    counts = torch.bincount(flat_experts, minlength=n_experts)
    out = expert_outputs(x[token_of_row], gate_up, down, counts, use_grouped_mm)
    out = out * weights.flatten()[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, token_of_row, out)


def expert_outputs(rows, gate_up, down, counts, use_grouped_mm: bool) -> torch.Tensor:
    """Each expert's SwiGLU of its run of `rows` (sorted by expert, `counts` rows each)."""
    if use_grouped_mm:
        return _grouped(rows, gate_up, down, counts)
    return _loop(rows, gate_up, down, counts)


def _swiglu(gate_up_out: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_out.chunk(2, dim=-1)
    return F.silu(gate) * up


def _loop(rows, gate_up, down, counts) -> torch.Tensor:
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        piece = rows[start : start + count]
        outputs.append(F.linear(_swiglu(F.linear(piece, gate_up[expert])), down[expert]))
        start += count
    if not outputs:
        return rows.new_zeros(0, down.shape[1])
    return torch.cat(outputs)


def _grouped(rows, gate_up, down, counts) -> torch.Tensor:
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    hidden = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offsets)
    # contiguous: the grouped matmul needs 16-byte row strides, the chunked halves are views
    inner = _swiglu(hidden).contiguous()
    return torch._grouped_mm(inner, down.transpose(-2, -1), offs=offsets)
