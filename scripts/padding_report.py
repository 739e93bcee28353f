"""Padding of the row-aligned layout on one transformer layer of real models.

Shapes come from the models' public configs; no tensors are built. Run:

    python scripts/padding_report.py

The builders below are imported by tests/test_layout_padding.py, which asserts the bound.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

# Runnable from a checkout without installing flatshard.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatshard.layout import ParamInfo, plan_unit_layout, single_lcm_padded_size  # noqa: E402

DTYPE = "bfloat16"  # the layout only compares dtypes; a name keeps this script torch-free
WORLD_SIZES = (2, 8, 64)


def _p(name: str, *shape: int) -> ParamInfo:
    return ParamInfo(name, tuple(shape), DTYPE)


def attention(hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool = False):
    params = [
        _p("self_attn.q_proj.weight", heads * head_dim, hidden),
        _p("self_attn.k_proj.weight", kv_heads * head_dim, hidden),
        _p("self_attn.v_proj.weight", kv_heads * head_dim, hidden),
        _p("self_attn.o_proj.weight", hidden, heads * head_dim),
    ]
    if qk_norm:
        params += [_p("self_attn.q_norm.weight", head_dim), _p("self_attn.k_norm.weight", head_dim)]
    return params


def layer_norms(hidden: int) -> list[ParamInfo]:
    return [_p("input_layernorm.weight", hidden), _p("post_attention_layernorm.weight", hidden)]


def dense_mlp(hidden: int, ffn: int, prefix: str = "mlp") -> list[ParamInfo]:
    # SwiGLU with gate and up fused along dim 0.
    return [
        _p(f"{prefix}.gate_up_proj.weight", 2 * ffn, hidden),
        _p(f"{prefix}.down_proj.weight", hidden, ffn),
    ]


def grouped_experts(hidden: int, experts: int, moe_ffn: int) -> list[ParamInfo]:
    return [
        _p("mlp.gate.weight", experts, hidden),  # the router
        _p("mlp.experts.gate_up_proj", experts, 2 * moe_ffn, hidden),
        _p("mlp.experts.down_proj", experts, hidden, moe_ffn),
    ]


def llama3_8b() -> list[ParamInfo]:
    return attention(4096, 32, 8, 128) + dense_mlp(4096, 14336) + layer_norms(4096)


def llama3_70b() -> list[ParamInfo]:
    return attention(8192, 64, 8, 128) + dense_mlp(8192, 28672) + layer_norms(8192)


def qwen3_30b_a3b() -> list[ParamInfo]:
    return (
        attention(2048, 32, 4, 128, qk_norm=True)
        + grouped_experts(2048, 128, 768)
        + layer_norms(2048)
    )


def qwen3_235b_a22b() -> list[ParamInfo]:
    return (
        attention(4096, 64, 4, 128, qk_norm=True)
        + grouped_experts(4096, 128, 1536)
        + layer_norms(4096)
    )


def deepseek_v3_moe() -> list[ParamInfo]:
    hidden, heads = 7168, 128
    mla = [
        _p("self_attn.q_a_proj.weight", 1536, hidden),
        _p("self_attn.q_a_layernorm.weight", 1536),
        _p("self_attn.q_b_proj.weight", heads * 192, 1536),
        _p("self_attn.kv_a_proj_with_mqa.weight", 576, hidden),
        _p("self_attn.kv_a_layernorm.weight", 512),
        _p("self_attn.kv_b_proj.weight", heads * 256, 512),
        _p("self_attn.o_proj.weight", hidden, heads * 128),
    ]
    shared = dense_mlp(hidden, 2048, prefix="mlp.shared_experts")
    return mla + grouped_experts(hidden, 256, 2048) + shared + layer_norms(hidden)


def mixtral_8x7b() -> list[ParamInfo]:
    return attention(4096, 32, 8, 128) + grouped_experts(4096, 8, 14336) + layer_norms(4096)


MODELS: dict[str, Callable[[], list[ParamInfo]]] = {
    "Llama-3-8B": llama3_8b,
    "Llama-3-70B": llama3_70b,
    "Qwen3-30B-A3B": qwen3_30b_a3b,
    "Qwen3-235B-A22B": qwen3_235b_a22b,
    "DeepSeek-V3 (MoE layer)": deepseek_v3_moe,
    "Mixtral-8x7B": mixtral_8x7b,
}


def padding_rows(world_sizes=WORLD_SIZES) -> list[tuple[str, int, float, float, int]]:
    """(model, world size, our padding %, single-LCM padding %, buckets) per model and size."""
    rows = []
    for model, build in MODELS.items():
        params = build()
        for world_size in world_sizes:
            layout = plan_unit_layout(params, world_size)
            used = layout.used_size
            naive = single_lcm_padded_size(params, world_size) - used
            ours = 100 * layout.padding / used
            rows.append((model, world_size, ours, 100 * naive / used, len(layout.buckets)))
    return rows


def format_table(rows) -> str:
    header = f"{'model':<24} {'world':>5} {'padding %':>10} {'single-LCM %':>13} {'buckets':>7}"
    lines = [header, "-" * len(header)]
    for model, world_size, ours, naive, buckets in rows:
        lines.append(f"{model:<24} {world_size:>5} {ours:>10.4f} {naive:>13.4f} {buckets:>7}")
    return "\n".join(lines)


if __name__ == "__main__":
    print("padding per transformer layer (% of parameter elements)")
    print(format_table(padding_rows()))
