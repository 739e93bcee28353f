"""The planner's model as tensor and expert parallelism split it, and what those
splits communicate: each TP rank's local blocks (flatshard.parallel's plan), each MoE
block's experts over EP ranks in a unit of their own, and the TP all-reduce and EP
all-to-all bytes per step (estimate.py runs these)."""

from __future__ import annotations

from dataclasses import replace

from flatshard.errors import ConfigError, MeshError
from flatshard.models.llama import LLAMA_BLOCK_PLAN, tp_local_shape
from flatshard.models.lora import adapter_base, adapter_split_dim
from flatshard.planner.model_spec import FP32, ModelSpec, UnitSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def embedding_shape(spec: ModelSpec) -> tuple[int, int]:
    """(vocabulary, hidden width): the token embedding's shape (the width of the
    activations TP communicates)."""
    for unit in spec.units:
        for param in unit.params:
            if param.name.endswith("embed_tokens.weight"):
                return tuple(param.global_shape or param.shape)
    return 0, 0


def tp_local(spec: ModelSpec, tp: int, sp: bool = False) -> ModelSpec:
    """The model as each TP rank holds it (flatshard.parallel's plan, or the spec's own;
    `sp`: the embedding and head split by vocabulary too, the larger piece on rank 0)."""
    block_shape = spec.tp_local_shape or tp_local_shape
    shapes = {p.name: p.shape for unit in spec.units for p in unit.params}

    def local_shape(name, shape, tp):
        if sp and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return (-(-shape[0] // tp), *shape[1:])
        adapter = adapter_base(name)
        if adapter is not None:  # a LoRA matrix: split as its base is
            base, matrix = adapter
            return _split(shape, adapter_split_dim(matrix, base_split_dim(base, tp)), tp)
        return block_shape(name, shape, tp)

    def base_split_dim(base: str, tp: int) -> int | None:
        if base not in shapes:  # a base the layout does not hold (QLoRA's NF4 ones)
            return None
        whole = shapes[base]
        local = block_shape(base, whole, tp)
        return next((d for d, (a, b) in enumerate(zip(whole, local)) if a != b), None)

    try:
        units = tuple(
            replace(
                unit,
                params=tuple(
                    replace(p, shape=local_shape(p.name, p.shape, tp), global_shape=None)
                    for p in unit.params
                ),
            )
            for unit in spec.units
        )
    except MeshError as error:
        raise ConfigError(f"--tp {tp}: {error}") from None
    return replace(spec, units=units)


def _split(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[int, ...]:
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def _is_expert(param) -> bool:
    """A parameter of a grouped-experts module (experts first: its weights, and biases
    such as GPT-OSS's): split over EP with them."""
    _, found, attr = f".{param.name}".rpartition(".experts.")
    return bool(found) and "." not in attr and len(param.shape) >= 2


def ep_local(spec: ModelSpec, ep: int, efsdp: int) -> ModelSpec:
    """Each MoE block's grouped experts split over `ep` ranks and, in a unit of their own
    that runs inside its block's forward, sharded over the `efsdp` others (as `flatshard
    train --ep` wraps them)."""
    units = []
    for unit in spec.units:
        experts = [p for p in unit.params if _is_expert(p)]
        if not experts:
            units.append(unit)
            continue
        if experts[0].shape[0] % ep:
            raise ConfigError(f"--ep {ep} must divide the {experts[0].shape[0]} experts")
        local = tuple(replace(p, shape=(p.shape[0] // ep, *p.shape[1:])) for p in experts)
        units.append(replace(unit, params=tuple(p for p in unit.params if not _is_expert(p))))
        units.append(
            UnitSpec(f"{unit.name} experts", local, unit.count, shard_ranks=efsdp, inner=True)
        )
    return replace(spec, units=tuple(units))


def ep_communication(spec: ModelSpec, setup, hidden: int) -> dict[str, int]:
    """Bytes per rank per step of the EP all-to-alls: each token's top_k copies out to the
    experts and back, in forward and again in backward, per MoE block and micro-batch."""
    if setup.ep == 1:
        return {"ep_all_to_all": 0, "ep_wire_per_rank": 0}
    blocks = sum(u.count for u in spec.units if u.shard_ranks is not None)
    tokens = setup.micro_batch * setup.seq_len * setup.grad_accum
    total = 4 * blocks * tokens * spec.top_k * hidden * DTYPE_BYTES[setup.param_dtype]
    return {"ep_all_to_all": total, "ep_wire_per_rank": (setup.ep - 1) * total // setup.ep}


def tp_communication(spec: ModelSpec, setup, hidden: int, vocab: int) -> dict[str, int]:
    """Bytes per rank per step of TP's collectives (the payload: the whole activation), per
    micro-batch. Without SP, all-reduces per block: in forward each row-parallel output's,
    in backward each column-parallel input gradient's (torch's ColwiseParallel reduces q, k
    and v separately). With SP (torchtitan's plan) per block the attention's and the MLP's
    inputs are all-gathered by sequence and their outputs reduce-scattered, in forward and
    (reversed) in backward, but the MLP input's gradient is all-reduced (torch's
    PrepareModuleInput hands the MLP a plain tensor, whose column-parallel gradient comes
    back partial); the embedding's output is reduce-scattered and the head's input
    all-gathered (reversed in backward), and its logits all-gathered."""
    tokens = setup.micro_batch * setup.seq_len // setup.cp * setup.grad_accum  # this rank's
    tp, a = setup.tp, DTYPE_BYTES[setup.param_dtype]
    figures = dict.fromkeys(("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"), 0)
    if tp == 1:
        return {**figures, "tp_wire_per_rank": 0}
    activation = tokens * hidden * a
    if setup.sp:
        layers = spec.n_layers
        figures.update(
            tp_all_gather=(4 * layers + 2) * activation + tokens * vocab * a,
            tp_reduce_scatter=(3 * layers + 2) * activation,
            tp_all_reduce=layers * activation,
        )
        wire = (tp - 1) * (figures["tp_all_gather"] + figures["tp_reduce_scatter"]) // tp
        wire += 2 * (tp - 1) * figures["tp_all_reduce"] // tp
        return {**figures, "tp_wire_per_rank": wire}
    per_block = len(LLAMA_BLOCK_PLAN)  # rowwise: forward; colwise and fused: backward
    figures["tp_all_reduce"] = per_block * spec.n_layers * activation
    return {**figures, "tp_wire_per_rank": 2 * (tp - 1) * figures["tp_all_reduce"] // tp}


def _projection_rows(spec: ModelSpec, suffix: str) -> int:
    """The output rows of a block's projection named `...{suffix}` on this (TP) rank."""
    for unit in spec.units:
        for param in unit.params:
            if param.name.endswith(suffix) and len(param.shape) == 2:
                return param.shape[0]
    return 0


def context_parallel_keys(spec: ModelSpec, setup) -> int:
    """Bytes per rank that context parallelism adds to what a block saves.

    torch's ring (`setup.cp_ring`) saves this rank's keys and values only, as projected
    (not repeated to the query heads); while the last block's backward runs it holds the
    whole sequence's (gathered again, KV heads) and fp32 sums of the query, key and value
    gradients. The all-gather variant saves the keys and
    values of the rest of the sequence, gathered and repeated to every query head (a local
    token's own are counted per token): every block without checkpointing (selective
    keeps them, as the gathered collective's output), the block whose backward runs with
    full or offload checkpointing."""
    if setup.cp == 1:
        return 0
    q_rows = _projection_rows(spec, "q_proj.weight")
    pb = DTYPE_BYTES[setup.param_dtype]
    if setup.cp_ring:
        kv_rows = _projection_rows(spec, "k_proj.weight")
        local = setup.micro_batch * setup.seq_len // setup.cp
        gathered = 2 * setup.micro_batch * setup.seq_len * kv_rows * pb
        # the per-token figures count keys and values repeated to the query heads, as SDPA
        # saves them; the ring saves them as projected (selective keeps those anyway)
        blocks = {"none": spec.n_layers, "selective": 0}.get(setup.ac, 1)
        unrepeated = blocks * local * 2 * (q_rows - kv_rows) * pb
        return gathered + local * (q_rows + 2 * kv_rows) * FP32 - unrepeated
    others = setup.seq_len - setup.seq_len // setup.cp
    per_block = 2 * setup.micro_batch * others * q_rows * pb
    blocks = spec.n_layers if setup.ac in ("none", "selective") else 1
    return blocks * per_block


def cp_communication(spec: ModelSpec, setup) -> dict[str, int]:
    """Bytes per rank per step of context parallelism's collectives (the payload: the whole
    gathered tensor), per block and micro-batch. Forward all-gathers the keys and values
    (the KV heads of this TP rank), and full or offload checkpointing again in the
    recompute. torch's ring gathers them once more in backward and passes their fp32
    gradients around the ring (`cp` all-to-alls of this rank's share); the all-gather
    variant reduce-scatters their gradients."""
    none = {"cp_all_gather": 0, "cp_reduce_scatter": 0, "cp_all_to_all": 0}
    if setup.cp == 1:
        return {**none, "cp_wire_per_rank": 0}
    kv_rows = _projection_rows(spec, "k_proj.weight")
    tokens = setup.micro_batch * setup.seq_len * setup.grad_accum
    each = spec.n_layers * tokens * 2 * kv_rows * DTYPE_BYTES[setup.param_dtype]
    gathers = each * (2 if setup.ac in ("full", "offload") else 1)
    if setup.cp_ring:
        gathers += each
        passed = spec.n_layers * tokens * 2 * kv_rows * FP32
        wire = (setup.cp - 1) * gathers // setup.cp + passed
        return {**none, "cp_all_gather": gathers, "cp_all_to_all": passed, "cp_wire_per_rank": wire}
    wire = (setup.cp - 1) * (gathers + each) // setup.cp
    return {**none, "cp_all_gather": gathers, "cp_reduce_scatter": each, "cp_wire_per_rank": wire}
