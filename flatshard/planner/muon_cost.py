"""What `flatshard plan --optimizer muon` adds: which matrices `flatshard.optim.Muon` takes
(the hidden 2-D weights and each expert's, as `muon_param_groups` chooses them; experts'
owners are taken here as balanced as the others'), the owners it would give them
and the Newton-Schulz work per rank that follows, and the bytes its owner exchange moves."""

from __future__ import annotations

from flatshard.optim.matrix_owners import assign_owners, newton_schulz_flops
from flatshard.planner.activations import FP32

NS_STEPS = 5  # torch's Muon's default
ADAMW_NAMES = ("embed", "lm_head", "wte", "wpe")  # and a module named `output`


def matrices_in(
    name: str, shape: tuple[int, ...], split_fused: bool = False
) -> list[tuple[int, int]]:
    """The Muon matrices of a parameter: a hidden 2-D weight is one (`split_fused`:
    SwiGLU's fused `gate_up` two halves; other fused projections stay whole here), grouped
    experts `(E, R, C)` are E of `(R, C)`; embeddings, the output head and the rest none."""
    parts = name.split(".")
    if "output" in parts or any(word in name for word in ADAMW_NAMES):
        return []
    if len(shape) == 2:
        if split_fused and "gate_up" in name:
            return [(shape[0] // 2, shape[1])] * 2
        return [tuple(shape)]
    return [tuple(shape[1:])] * shape[0] if len(shape) == 3 else []


def muon_figures(spec, setup) -> dict:
    """matrices, their share of the trained elements, Newton-Schulz flops per rank and
    step (max and mean over the shard group's ranks), exchange bytes per rank and step.
    `spec`: the model before TP splits it (Muon's matrices are the TP-global ones; the
    owners of a TP group each orthogonalise the whole matrix)."""
    shapes, trained, in_muon, in_dense = [], 0, 0, 0
    for unit in spec.units:
        for param in unit.params:
            if not param.requires_grad:
                continue
            trained += param.numel * unit.count
            found = matrices_in(param.name, tuple(param.shape), setup.muon_split_fused)
            shapes += found * unit.count
            in_muon += param.numel * unit.count if found else 0
            in_dense += param.numel * unit.count if found and len(param.shape) == 2 else 0
    ranks, tp = setup.dp_shard, setup.tp
    costs = [newton_schulz_flops(shape, NS_STEPS) for shape in shapes]
    owners = assign_owners(costs, ranks)
    loads = [0] * ranks
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    # each matrix's rows held away from its owner go there in bf16 and come back: on
    # average (ranks - 1) / ranks of each TP block, spread over the ranks; under TP the
    # owners join their blocks (fp32) into the whole matrix. Experts held whole by a rank
    # (as many experts as ranks or more) move nothing.
    exchanged = 2 * 2 * in_dense // tp * (ranks - 1) // ranks // ranks
    joined = FP32 * in_dense * (tp - 1) // tp // ranks
    return {
        "matrices": len(shapes),
        "share": in_muon / trained if trained else 0.0,
        "ns_flops_max": max(loads) if loads else 0,
        "ns_flops_mean": sum(loads) / ranks,
        "exchange_bytes": exchanged + joined,
    }


def muon_lines(figures: dict) -> list[str]:
    mean, most = figures["ns_flops_mean"], figures["ns_flops_max"]
    above = 100 * (most / mean - 1) if mean else 0.0
    return [
        f"  Muon: {figures['matrices']} hidden matrices ({100 * figures['share']:.1f}% of the "
        "trained elements: one fp32 state; AdamW's two on the rest)",
        f"    Newton-Schulz per step, per rank: max {most / 1e12:.3f} TFLOP, mean "
        f"{mean / 1e12:.3f} (+{above:.1f}%)",
        f"    owner exchange per step, per rank (bf16 both ways; TP: blocks joined) "
        f"{figures['exchange_bytes'] / 2**30:.3f} GiB",
    ]
