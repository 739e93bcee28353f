"""Tensor and context parallelism for the reference Llama (and the MoE's attention), from
outside the model.

Each block's attention splits its heads over the TP ranks (q/k/v column-parallel, o
row-parallel) and its MLP its hidden units (gate/up column-parallel, down row-parallel):
one all-reduce after o and one after down per block, as Megatron and torchtitan do. The
embedding, the norms and the head stay replicated (a small model's head is cheaper
replicated than gathered; vocab-parallel is a later choice); with sequence parallelism
they split too.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from flatshard.errors import MeshError
from flatshard.models.llama.model import indexed_layers
from flatshard.parallel.context_parallel import apply_context_parallel
from flatshard.parallel.tensor_parallel import (
    FusedColwiseParallel,
    HeadNormParallel,
    require_whole_sequence_shards,
)


def check_tp(config, tp: int) -> None:
    """A clear error before anything is split: every split dimension must divide by tp."""
    dims = {
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "ffn_dim": config.ffn_dim,
    }
    bad = [f"{name} ({value})" for name, value in dims.items() if value % tp]
    if tp < 1 or bad:
        raise MeshError(
            f"tensor parallelism over {tp} ranks needs {', '.join(dims)} divisible by {tp}; "
            f"{', '.join(bad) or 'tp'} is not. Pick a tp that divides them."
        )


# Each block's TP plan, by module: "colwise" splits output features (weight and bias
# rows), "rowwise" input features (weight columns; its bias stays whole), "fused" the
# output features of each of two stacked components. `flatshard plan` reads it too.
LLAMA_BLOCK_PLAN = {
    "attn.q_proj": "colwise",
    "attn.k_proj": "colwise",
    "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
    "mlp.gate_up_proj": "fused",
    "mlp.down_proj": "rowwise",
}
"""Each block's TP style by module (colwise, rowwise, fused), read by `flatshard plan` too."""


def style(kind: str) -> ParallelStyle:
    """The ParallelStyle of a plan entry's kind."""
    if kind == "fused":
        return FusedColwiseParallel(components=2)
    if kind == "head_norm":
        return HeadNormParallel()
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def parallelize_llama(model, tp_mesh, sequence_parallel: bool = False) -> None:
    """Split every block of a reference `Llama` over the 1-D `tp_mesh`, in place.

    sequence_parallel: also split what runs outside attention and the MLP, as torchtitan
    does: the norms and residual stream by sequence (`SequenceParallel`, activations a
    `1/tp` slice), the embedding and head by vocabulary (`RowwiseParallel` /
    `ColwiseParallel`, their weights a `1/tp` slice); the head's output is gathered, so
    the loss sees full logits. Not with tied embeddings."""
    check_tp(model.config, tp_mesh.size())
    kinds = dict(LLAMA_BLOCK_PLAN)
    if model.config.qk_norm:
        kinds.update({"attn.q_norm": "head_norm", "attn.k_norm": "head_norm"})
    plan = {name: style(kind) for name, kind in kinds.items()}
    if sequence_parallel:
        split_root_by_sequence(model, tp_mesh)
        plan.update(ATTENTION_BY_SEQUENCE)
        plan.update({
            "mlp": PrepareModuleInput(
                input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
            "mlp.down_proj": RowwiseParallel(output_layouts=SEQUENCE),
        })  # fmt: skip
    for _, block in indexed_layers(model.layers):
        parallelize_module(block, tp_mesh, plan)


SEQUENCE = Shard(1)
# sequence parallelism around a block's attention: its norm on the sequence shard, the
# attention gathering it, its output projection reduce-scattering it back
ATTENTION_BY_SEQUENCE = {
    "attn_norm": SequenceParallel(),
    "attn": PrepareModuleInput(
        input_layouts=(SEQUENCE, None, None), desired_input_layouts=(Replicate(), None, None)
    ),
    "attn.o_proj": RowwiseParallel(output_layouts=SEQUENCE),
    "mlp_norm": SequenceParallel(),
}


def split_root_by_sequence(model, tp_mesh) -> None:
    """Sequence parallelism's root: the embedding and head split by vocabulary, the
    embedding's output and the final norm by sequence, the logits gathered for the loss."""
    if model.config.tie_embeddings:
        raise MeshError(
            "sequence_parallel splits the embedding and the head by vocabulary in "
            "different layouts; a tied model cannot: use sequence_parallel=False"
        )
    require_whole_sequence_shards(model.embed_tokens, tp_mesh.size())
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQUENCE),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=SEQUENCE, output_layouts=Replicate()),
    })  # fmt: skip


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape a block parameter `name` (e.g. "layers.3.attn.q_proj.weight") has on each
    of `tp` ranks under `LLAMA_BLOCK_PLAN` (the same shape whatever the rank)."""
    module, _, attr = name.rpartition(".")
    kind = next((k for key, k in LLAMA_BLOCK_PLAN.items() if module.endswith(key)), None)
    dim = {"colwise": 0, "fused": 0, "rowwise": 1 if attr == "weight" else None}.get(kind)
    if dim is None or tp == 1:
        return tuple(shape)
    if shape[dim] % (2 * tp if kind == "fused" else tp):
        raise MeshError(
            f"{name} {tuple(shape)}: dim {dim} does not split evenly over {tp} "
            "tensor-parallel ranks; pick a tp that divides it"
        )
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def split_context(model, cp_mesh) -> None:
    """Context parallelism for the reference Llama (and MoE): every block's attention
    gathers the keys and values of the sequence's other parts."""
    blocks = [block for _, block in indexed_layers(model.layers)]
    apply_context_parallel(model, [block.attn for block in blocks], cp_mesh)
