"""transformers' own tensor-parallel plans, honoured by flatshard's styles.

transformers 5 ships, on every config, `base_model_tp_plan`: module globs of the base model
("layers.*.self_attn.q_proj") mapped to style names. This module reads it and applies, over
a 1-D TP mesh, the `torch.distributed.tensor.parallel` style (or flatshard's) each name
means, so `flatshard.parallelize` splits any transformers causal LM the way transformers
itself would -- with differences that keep flatshard's checkpoints TP-independent and
its gradients right:

- a fused projection (Phi-3's `qkv_proj` [q; k; v] and `gate_up_proj` [gate; up]) is split
  per component (`FusedColwiseParallel`): each TP rank holds its share of every part, and
  the global tensor stays the one on disk whatever the TP size;
- a Gated DeltaNet layer (Qwen3-Next) is split by heads as a whole
  (`GatedDeltaNetParallel`), where transformers gathers its projections' outputs;
- multi-head latent attention (DeepSeek-V3), which transformers leaves whole, is split
  by heads (`LatentAttentionParallel`);
- the embedding and the output head stay replicated over TP (`embedding_rowwise` and the
  head's `colwise_gather_output` are not applied): FSDP already shards them over the
  data-parallel ranks, and a vocabulary split would cost an all-reduce of every token's
  activations.

MoE experts (`moe_tp_experts`, `packed_colwise` and the expert entries under them) stay
whole on every TP rank, as in flatshard's own MoE: split them over ranks holding different
tokens with expert parallelism -- the experts modules `base_model_ep_plan` names, split by
`ExpertParallel` (tokens dispatched by all-to-all), their routers, shared experts and
score-correction biases left to transformers' own code. A style flatshard does not know
is refused by name.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from flatshard.errors import MeshError
from flatshard.parallel.expert_parallel import ExpertParallel
from flatshard.parallel.gated_deltanet import (
    GatedDeltaNetParallel,
    check_gated_deltanet,
    is_gated_deltanet,
)
from flatshard.parallel.latent_attention import LatentAttentionParallel, is_latent_attention
from flatshard.parallel.tensor_parallel import FusedColwiseParallel, HeadNormParallel

# styles under which a module's parameters stay whole on every TP rank (see above)
_KEPT_WHOLE = {"embedding_rowwise", "moe_tp_experts", "packed_colwise", "ep_router"}


def tensor_parallel_plan(model: nn.Module, field: str = "base_model_tp_plan") -> dict[str, str]:
    """{module name (relative to the model): transformers' style name} for every module the
    model's `config.base_model_tp_plan` (or another `field`) names."""
    config = model.config
    globs = getattr(config, field, None) or {}
    base = model.base_model
    prefix = _prefix_of(model, base)
    names = [name for name, _ in base.named_modules() if name]
    params = [name for name, _ in base.named_parameters()]
    found: dict[str, str] = {}
    for glob, style_name in globs.items():
        for name in names + params:
            if _matches(glob, name):
                found[prefix + name] = style_name
    return found


def apply_transformers_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Split a transformers causal LM over the 1-D `tp_mesh` by its own
    `config.base_model_tp_plan`, in place. Every check runs before anything is split, and
    depends only on the config, so every rank raises alike."""
    for name, style in tensor_parallel_styles(model, tp_mesh.size()).items():
        parallelize_module(model.get_submodule(name), tp_mesh, style)


def tensor_parallel_splits(model: nn.Module, tp: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """How `apply_transformers_tensor_parallel` splits each parameter, without a mesh (the
    planner's view): {parameter name: (dim, parts)}, the dim split over `tp` ranks, each of
    `parts` (stacked along it) split alike, or the whole dim when `parts` is empty.
    Parameters not named stay whole on every TP rank. Runs the same checks."""
    splits = {}
    for name, style in tensor_parallel_styles(model, tp).items():
        for param, split in _splits_of(style, model.get_submodule(name)).items():
            splits[f"{name}.{param}"] = split
    return splits


def tensor_parallel_styles(model: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    """{module name: the style that splits it over `tp` ranks}, every check done."""
    kinds = tensor_parallel_plan(model)
    if not kinds:
        raise MeshError(
            f"tp={tp}, but {type(model).__name__} (model_type "
            f"{model.config.model_type!r}) has no tensor-parallel plan in transformers "
            "(config.base_model_tp_plan is empty); use tp=1 or pass parallelize(..., "
            "plan=flatshard.ParallelPlan(tensor_parallel=...))"
        )
    _check_heads(model.config, kinds, tp)
    declare_fused_projections(model)
    # layers split by heads as a whole, not as transformers' plan says (it gathers Gated
    # DeltaNet's projections and leaves MLA whole)
    by_heads: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if is_gated_deltanet(module):
            check_gated_deltanet(module, tp)
            by_heads[name] = GatedDeltaNetParallel()
        elif is_latent_attention(module):
            _check_heads(model.config, {name: "colwise"}, tp)
            by_heads[name] = LatentAttentionParallel()
    whole = [n for n, k in kinds.items() if k == "moe_tp_experts"] + list(by_heads)
    styles = {}
    for name, kind in kinds.items():
        if kind in _KEPT_WHOLE or any(name.startswith(w + ".") for w in whole):
            continue
        styles[name] = _style(name, kind, _module(model, name), tp)
    return {**styles, **by_heads}


def _splits_of(style: ParallelStyle, module: nn.Module) -> dict[str, tuple[int, tuple]]:
    """{parameter name in `module`: (dim, parts)} as `style` splits them."""
    if isinstance(style, (GatedDeltaNetParallel, LatentAttentionParallel)):
        return style.splits(module)
    if isinstance(style, FusedColwiseParallel):
        fused = dict(module.fused_components)
        return {
            p: (0, tuple(int(n) for _, n in fused[p]))
            for p, _ in module.named_parameters(recurse=False)
        }
    if isinstance(style, ColwiseParallel):  # its own parameters (LoRA's: lora_parallel.py)
        return {p: (0, ()) for p, _ in module.named_parameters(recurse=False)}
    if isinstance(style, RowwiseParallel):
        return {"weight": (1, ())}
    return {}  # HeadNormParallel: the same weight on every TP rank


def apply_transformers_expert_parallel(model: nn.Module, ep_mesh) -> list[nn.Module]:
    """Split the grouped experts `config.base_model_ep_plan` names (`moe_tp_experts`) over
    the 1-D `ep_mesh`, in place; returns their modules (none for a dense model)."""
    experts = grouped_experts(model)
    for name, module in experts.items():  # every check before anything is split
        _check_experts(name, module, ep_mesh.size())
    experts = list(experts.values())
    for module in experts:
        module.expert_outputs = _expert_outputs(module)
        parallelize_module(module, ep_mesh, ExpertParallel())
    return experts


def grouped_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The grouped experts modules `config.base_model_ep_plan` names (`moe_tp_experts`), by
    name (none for a dense model)."""
    kinds = tensor_parallel_plan(model, "base_model_ep_plan")
    names = [name for name, kind in kinds.items() if kind == "moe_tp_experts"]
    return {name: model.get_submodule(name) for name in names}


def _check_experts(name: str, module: nn.Module, ep: int) -> None:
    """transformers' grouped experts that `ExpertParallel` can split: 3-D `gate_up_proj`
    and `down_proj` (and their biases, if any) with the experts first."""
    params = dict(module.named_parameters(recurse=False))
    grouped = all(getattr(params.get(a), "ndim", 0) == 3 for a in ("gate_up_proj", "down_proj"))
    if not grouped or not getattr(module, "has_gate", True):
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        raise MeshError(
            f"ep={ep}: {name} ({type(module).__name__}, parameters {shapes}) is not a "
            "grouped-experts module flatshard can split (3-D gate_up_proj and down_proj, "
            "experts first); use ep=1"
        )
    experts = params["gate_up_proj"].shape[0]
    if experts % ep:
        raise MeshError(
            f"expert parallelism over {ep} ranks: {name} has {experts} experts, not "
            f"divisible by {ep}; pick an ep that divides it"
        )


def _expert_outputs(module: nn.Module):
    """What `ExpertParallel` computes on the rows each local expert received (sorted by
    expert, `counts` of them): transformers' own expert math, `down(gate(gate_up(x)))`
    with the module's `_apply_gate` (SwiGLU, or the family's: GPT-OSS's clamped GLU of
    interleaved gate/up), weights stored `(out, in)` or transposed (`is_transposed`), with
    the family's biases (`has_bias`)."""
    transposed = getattr(module, "is_transposed", False)
    biased = getattr(module, "has_bias", False)

    def project(x, weight, bias):
        out = x @ weight if transposed else F.linear(x, weight)
        return out + bias if bias is not None else out

    def expert_outputs(rows, gate_up, down, counts):
        gate_up_bias = module.gate_up_proj_bias.to_local() if biased else None
        down_bias = module.down_proj_bias.to_local() if biased else None
        outs = []
        for expert, chunk in enumerate(rows.split(counts.tolist())):
            first_bias = gate_up_bias[expert] if biased else None
            second_bias = down_bias[expert] if biased else None
            hidden = module._apply_gate(project(chunk, gate_up[expert], first_bias))
            outs.append(project(hidden, down[expert], second_bias))
        width = down.shape[2] if transposed else down.shape[1]
        return torch.cat(outs) if outs else rows.new_zeros((0, width))

    return expert_outputs


def declare_fused_projections(model: nn.Module) -> None:
    """Declare the parts of transformers' fused Linear projections (`fused_components`):
    `qkv_proj` is `[q; k; v]` (heads x head_dim rows each), `gate_up_proj` `[gate; up]`
    (equal halves), so TP splits each part and the layout knows where each lies."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or getattr(module, "fused_components", None):
            continue
        attr, rows = name.rpartition(".")[2], module.out_features
        if attr == "qkv_proj" and heads and rows % (heads + 2 * kv_heads) == 0:
            head_dim = rows // (heads + 2 * kv_heads)
            kv_rows = kv_heads * head_dim
            parts = (("q", heads * head_dim), ("k", kv_rows), ("v", kv_rows))
        elif attr == "gate_up_proj" and rows % 2 == 0:
            parts = (("gate", rows // 2), ("up", rows // 2))
        else:
            continue
        module.fused_components = {p: parts for p, _ in module.named_parameters(recurse=False)}


def _style(name: str, kind: str, module: nn.Module, tp: int) -> ParallelStyle:
    linear = isinstance(module, nn.Linear)
    if kind in ("colwise", "colwise_gather_output") and linear:
        _check_divides(name, "output features", module.out_features, tp, module)
        gather = kind == "colwise_gather_output"
        if getattr(module, "fused_components", None):
            return FusedColwiseParallel(gather_output=gather)
        return ColwiseParallel(output_layouts=Replicate()) if gather else ColwiseParallel()
    if kind in ("rowwise", "rowwise_split_input") and linear:
        _check_divides(name, "input features", module.in_features, tp, module)
        if kind == "rowwise_split_input":
            return RowwiseParallel(input_layouts=Replicate())
        return RowwiseParallel()
    if kind == "replicated_with_grad_allreduce":
        return HeadNormParallel()
    raise MeshError(
        f"tp={tp}: {name} ({type(module).__name__}) has transformers' tensor-parallel style "
        f"{kind!r}, which flatshard does not apply to it; use tp=1, or pass "
        "parallelize(..., plan=flatshard.ParallelPlan(tensor_parallel=...)) with your own"
    )


def _check_heads(config, kinds: dict[str, str], tp: int) -> None:
    """Attention splits by heads: q and k/v heads must divide by tp (a projection whose
    features divide can still cut a head in two)."""
    if not any(k.startswith(("colwise", "rowwise")) for k in kinds.values()):
        return
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise MeshError(
                f"tensor parallelism over {tp} ranks splits attention by heads, but "
                f"{field} is {heads}, not divisible by {tp}; pick a tp that divides it"
            )


def _check_divides(name: str, what: str, size: int, tp: int, module: nn.Module) -> None:
    parts = dict(getattr(module, "fused_components", None) or {}).get("weight") or ()
    for part, rows in [(None, size)] + [(p, n) for p, n in parts]:
        if rows % tp:
            inside = f" (its part {part!r} has {rows})" if part else f" ({rows})"
            raise MeshError(
                f"tensor parallelism over {tp} ranks: {name} has {what}{inside} not "
                f"divisible by {tp}; pick a tp that divides it"
            )


def _matches(glob: str, name: str) -> bool:
    """transformers' globs: `*` stands for one dot-free name part."""
    glob_parts, parts = glob.split("."), name.split(".")
    return len(glob_parts) == len(parts) and all(
        fnmatchcase(p, g) for g, p in zip(glob_parts, parts)
    )


def _prefix_of(model: nn.Module, base: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is base:
            return name + "." if name else ""
    return ""


def _module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:  # a parameter the plan names (an expert tensor)
        raise MeshError(
            f"transformers' tensor-parallel plan of {type(model).__name__} names {name!r}, "
            "a parameter flatshard cannot split on its own; use tp=1"
        ) from None
