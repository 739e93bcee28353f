"""Per-rank memory of a model under flatshard, from the layout (the units' figures:
unit_figures.py; the per-step communication: communication.py).

Every size comes from `plan_unit_layout` (the layout `fully_shard` uses) at the
data-parallel shard size, the degrees from `ParallelDims` (the mesh's own validation), and
what is gathered when and what a lookup costs from the runtime's own policy
(runtime/gather_policy.py); the rest follows what the runtime allocates:

- persistent: the fp32 main-weight shards and the optimizer state (AdamW: two fp32 states
  per trainable element); ZeRO-1 also keeps every unit's unsharded parameters and gradients.
- gradient shards (fp32) live from backward until `zero_grad(set_to_none=True)`; the next
  forward frees them, so they do not coexist with a forward's activations.
- ZeRO-3 gathers a unit for its forward and again for its backward; the root (and the last
  block, whose backward comes next) stays gathered from forward to the end of its backward
  and holds its unsharded gradient buffer meanwhile;
  a block's backward overlaps the next block's prefetch and the previous block's
  reduce-scatter. ZeRO-2 keeps every unit gathered from its forward to its backward.
- a unit over one embedding (ZeRO-2/3) is looked up from its shards while the ranks' tokens
  are fewer than its rows (runtime/sharded_lookup.py): never gathered, it moves token
  ids, rows and output gradients instead, and holds the gathered output gradients at the
  end of backward.
- on gloo (CPU) a reduce-scatter receives every rank's copy of this rank's shard into a
  buffer as large as the gradient bucket (an all-to-all, see comm/collectives.py); NCCL needs none.
- tensor parallelism (`tp`) splits each block's parameters by flatshard.parallel's plan
  before FSDP shards them (the embedding, norms and head stay whole); each block then
  all-reduces its row-parallel outputs in forward and its column-parallel input gradients
  in backward (`tp_all_reduce`, apart from the data-parallel `total` the trainer measures).
  Activations are counted as without TP (an upper bound), per activation checkpointing
  mode (activations.py).

- optimizer offload moves a share of the shards' weights, gradients and optimizer state
  off the device (offload_split.py); `total` is then device + host.

Peak = max(start of backward: persistent + activations + the gathered units and gradient
buffers in use; end of backward: persistent + gradient shards + the buffers in use).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from flatshard import compat
from flatshard.errors import ConfigError
from flatshard.layout.offload import needs_bucket_per_param
from flatshard.mesh import ParallelDims
from flatshard.planner.activations import MODES as AC_MODES
from flatshard.planner.checkpoint_cost import checkpoint_figures
from flatshard.planner.communication import step_communication
from flatshard.planner.model_spec import FP32, ModelSpec
from flatshard.planner.muon_cost import muon_figures
from flatshard.planner.offload_split import offloaded_share, split_memory
from flatshard.planner.parallel_cost import (
    DTYPE_BYTES,
    context_parallel_keys,
    cp_communication,
    embedding_shape,
    ep_communication,
    ep_local,
    tp_communication,
    tp_local,
)
from flatshard.planner.pipeline_cost import bubble_fraction, check_pipeline_setup, rank_parts
from flatshard.planner.sync_cost import sync_figures
from flatshard.planner.unit_figures import (
    UnitFigures,
    is_looked_up,
    unit_figures,
    unit_lookup_payloads,
)

# More ranks than any machine runs (2^20); larger world sizes are typos (and each rank's
# row of padding would make the figures meaningless).
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class Setup:
    world_size: int
    dp_shard: int
    zero_stage: int
    param_dtype: str  # compute / all-gather dtype
    reduce_dtype: str  # reduce-scatter dtype
    micro_batch: int
    seq_len: int
    grad_accum: int
    backend: str = "nccl"  # gloo needs a receive buffer per reduce-scatter
    optimizer: str = "adamw"  # adamw(-fused), torch-adamw (two fp32 states), sgd (momentum: one)
    hpz_group: int = 0  # ZeRO-3: ranks a block stays sharded over after forward (0: all)
    tp: int = 1  # tensor-parallel ranks (innermost)
    sp: bool = False  # sequence parallelism: TP also splits the norms and residual stream
    cp: int = 1  # context-parallel ranks each sequence is split over (within dp_shard)
    ep: int = 1  # expert-parallel ranks (borrowed from dp_shard x tp)
    offload: float = 0.0  # share of each rank's shards offloaded to the host
    offload_disk: bool = False  # the offloaded optimizer state in the disk tier's files
    ac: str = "none"  # activation checkpointing: none, full or selective (activations.py)
    write_gbps: float = 1.0  # how fast each rank writes its checkpoint file (GB/s)
    muon_share: float = 0.0  # muon: the trained elements in its matrices (plan() sets it)
    muon_split_fused: bool = False  # muon: each fused component ([gate; up]) a matrix
    quantize_weights: str = "none"  # int8 / fp8: weights all-gathered in 8 bits (qwZ)
    quantize_grads: str = "none"  # int8 / fp8: gradients reduce-scattered in 8 bits (qgZ)
    sync_wire: str = "none"  # weight sync's wire dtype (sync_cost.py)
    pp: int = 1  # pipeline stages, a rank each (outermost; pipeline_cost.py)
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved-1f1b or looped-bfs
    pack: bool = False  # packed documents: attention masked by their positions (data.pack)

    @property
    def optimizer_states(self) -> float:
        """fp32 states per trained element (Muon: one on its matrices, AdamW's two else)."""
        if self.optimizer == "muon":
            return 2 - self.muon_share
        return 1 if self.optimizer == "sgd" else 2

    @property
    def cp_ring(self) -> bool:
        """Whether context parallelism runs torch's ring (flatshard.parallel.ring_attention):
        where torch has it, on the CPU kernel (gloo) or CUDA flash attention (half
        precision); else it all-gathers the keys and values."""
        has_kernel = self.backend == "gloo" or self.param_dtype in ("bf16", "fp16")
        return self.cp > 1 and has_kernel and compat.torch_ring_attention() is not None

    @property
    def kv_grouped(self) -> bool:
        """Whether attention saves keys and values as the KV heads, not repeated to the query
        heads: on CUDA in half precision, whose flash kernel reads them grouped (flatshard's
        models: comm/devices.attends_grouped_kv; transformers' alike), on a GPU where flash
        runs (Ampere or newer, a head size it takes: assumed). Packed documents' mask keeps
        them repeated; context parallelism's attention is counted apart
        (context_parallel_keys)."""
        half = self.param_dtype in ("bf16", "fp16")
        return self.cp == 1 and self.backend != "gloo" and half and not self.pack

    @property
    def optimizer_name(self) -> str:
        names = {"sgd": "SGD", "torch-adamw": "torch AdamW", "muon": "Muon + AdamW"}
        names["adamw-fused"] = "fused AdamW"
        return names.get(self.optimizer, "AdamW")

    def __post_init__(self):
        for name in (
            "world_size", "dp_shard", "micro_batch", "seq_len", "grad_accum", "tp", "ep", "cp",
            "pp",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                flag = f"--{name.replace('_', '-')}"
                hint = " (leave it out to shard over all ranks)" if name == "dp_shard" else ""
                raise ConfigError(f"{flag} {getattr(self, name)}: it must be >= 1{hint}")
        if self.world_size > MAX_WORLD_SIZE:
            raise ConfigError(
                f"--world-size {self.world_size}: more ranks than any machine runs; plans go "
                f"up to {MAX_WORLD_SIZE:,} ranks"
            )
        if self.ac not in AC_MODES:
            raise ConfigError(f"--ac {self.ac}: use one of {', '.join(AC_MODES)}")
        if not 0 <= self.offload <= 1:
            raise ConfigError(f"--offload {self.offload}: it must be in [0, 1]")
        if self.hpz_group < 0:
            raise ConfigError(f"--hpz-group {self.hpz_group}: it must be >= 0 (0: all ranks)")
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"--zero-stage must be 1, 2 or 3, got {self.zero_stage}")
        if self.sp and self.tp == 1:
            raise ConfigError("--sp splits the sequence over the TP ranks: it needs --tp > 1")
        if self.cp > 1 and self.dp_shard % self.cp:
            raise ConfigError(
                f"--cp {self.cp} must divide the ranks a unit is sharded over (--dp-shard "
                f"{self.dp_shard}: parameters shard over dp_shard x cp); pick a --world-size "
                f"or --dp-shard that {self.cp} divides"
            )
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ConfigError(
                f"--cp {self.cp} splits each sequence into {2 * self.cp} equal chunks: "
                f"--seq-len {self.seq_len} must be a multiple of {2 * self.cp}"
            )
        if self.pp > 1:
            check_pipeline_setup(self)
        self.dims  # noqa: B018  (validates the degrees: a MeshError names what is wrong)
        if self.hpz_group and (
            self.zero_stage != 3 or self.dp_shard % self.hpz_group or self.tp > 1
        ):
            raise ConfigError(
                f"--hpz-group {self.hpz_group} needs ZeRO-3, no TP, and must divide --dp-shard "
                f"({self.dp_shard})"
            )

    @property
    def dims(self) -> ParallelDims:
        """The degrees, validated as `fully_shard`'s mesh validates them."""
        return ParallelDims(
            self.world_size, dp_replicate=-1, dp_shard=self.dp_shard // self.cp, tp=self.tp,
            ep=self.ep, cp=self.cp, pp=self.pp,
        )  # fmt: skip

    @property
    def dp_replicate(self) -> int:
        return self.dims.dp_replicate


@dataclass(frozen=True)
class Plan:
    model: str
    num_params: int
    setup: Setup
    units: tuple[UnitFigures, ...]
    memory: dict[str, int]  # bytes per rank
    communication: dict[str, int]  # bytes per rank per step
    padding_fraction: float
    # the device's peak per rank under each activation mode (AC_MODES), to see what fits
    device_peak_by_ac: dict[str, int]
    checkpoint: dict[str, float]  # what a save writes (checkpoint_cost.py)
    weight_sync: dict[str, float]  # what a full weight sync moves (sync_cost.py)
    muon: dict | None = None  # --optimizer muon: its matrices, work and bytes (muon_cost.py)
    pipeline: dict | None = None  # --pp: each stage's memory and bytes (pipeline_cost.py)

    def to_dict(self) -> dict:
        return asdict(self)


def plan(spec: ModelSpec, setup: Setup) -> Plan:
    (vocab, hidden), num_params = embedding_shape(spec), spec.num_params
    if setup.tp > 1 and not hidden:
        raise ConfigError(f"--tp {setup.tp}: {spec.name} has no token embedding to size TP by")
    muon = muon_figures(spec, setup) if setup.optimizer == "muon" else None
    if muon is not None:
        setup = replace(setup, muon_share=muon["share"])
    if setup.tp > 1:
        spec = tp_local(spec, setup.tp, setup.sp)
    if setup.ep > 1:
        spec = ep_local(spec, setup.ep, setup.dims.efsdp)
    if setup.pp > 1:
        return _pipeline_plan(spec, setup, hidden, vocab, muon)
    separate = needs_bucket_per_param(setup.offload)
    units = tuple(
        unit_figures(unit, unit.shard_ranks or setup.dp_shard, separate, setup.hpz_group)
        for unit in spec.units
    )
    share = offloaded_share(spec.units, setup.dp_shard, setup.offload)
    by_ac = {
        mode: split_memory(_memory(spec, units, replace(setup, ac=mode)), share, setup.offload_disk)
        for mode in AC_MODES
    }
    memory = by_ac[setup.ac]
    communication = step_communication(units, setup)
    communication.update(tp_communication(spec, setup, hidden, vocab))
    communication.update(ep_communication(spec, setup, hidden))
    communication.update(cp_communication(spec, setup))
    used = sum(u.numel * u.count for u in units)
    padding = sum(u.padding * u.count for u in units) / used if used else 0.0
    peaks = {mode: figures["device"] for mode, figures in by_ac.items()}
    saved = checkpoint_figures(num_params, setup)
    synced = sync_figures(num_params, setup)
    return Plan(
        spec.name, num_params, setup, units, memory, communication, padding, peaks, saved,
        synced, muon,
    )


def _pipeline_plan(spec: ModelSpec, setup: Setup, hidden: int, vocab: int, muon) -> Plan:
    """Each pipeline rank as a flatshard run of its stages' units (their activations for
    the micro-batches in flight); the plan's memory and bytes are the heaviest rank's."""
    pb = DTYPE_BYTES[setup.param_dtype]
    separate = needs_bucket_per_param(setup.offload)
    ranks = []
    for part in rank_parts(spec, setup, hidden, pb):
        figures = lambda s: tuple(  # noqa: E731  (experts: over their stage's efsdp ranks)
            unit_figures(u, u.shard_ranks or setup.dp_shard, separate) for u in s.units
        )
        units = figures(part.whole)
        share = offloaded_share(part.whole.units, setup.dp_shard, setup.offload)
        by_ac = {
            mode: split_memory(
                _memory(part.whole, units, replace(setup, ac=mode), part.in_flight,
                        part.transient, part.tied),
                share, setup.offload_disk,
            )
            for mode in AC_MODES
        }  # fmt: skip
        moved = [
            step_communication(figures(stage), setup, not any(u.is_root for u in stage.units))
            for stage in part.stages
        ]
        communication = {key: sum(m[key] for m in moved) for key in moved[0]}
        if len(part.stages) > 1:  # torch's schedule unshards each stage's root once a step:
            # the embedding, otherwise looked up from its shards, is gathered then too
            extra = sum(u.gathered_bytes(pb) for u in units if u.embedding
                        and is_looked_up(u, setup))  # fmt: skip
            communication["all_gather"] += extra
            communication["total"] += extra
        communication.update(tp_communication(part.whole, setup, hidden, vocab))
        communication.update(ep_communication(part.whole, setup, hidden))
        communication.update(cp_communication(part.whole, setup))
        communication["pipeline_send"] = part.sent + (part.tied.sent if part.tied else 0)
        if part.tied and part.tied.collectives:  # the first stage's tied weight and gradient
            communication["tied_embedding"] = part.tied.collectives
            communication["total"] += part.tied.collectives
            communication["wire_per_rank"] += part.tied.wire
        blocks = part.whole.n_layers
        ranks.append(dict(rank=part.rank, blocks=blocks, in_flight=part.in_flight, units=units,
                          memory=by_ac[setup.ac], peaks={m: f["device"] for m, f in by_ac.items()},
                          communication=communication))  # fmt: skip
    heaviest = max(ranks, key=lambda r: r["memory"]["total"])
    busiest = max(ranks, key=lambda r: r["communication"]["total"])
    every_unit = [u for r in ranks for u in r["units"]]
    used = sum(u.numel * u.count for u in every_unit)
    padding = sum(u.padding * u.count for u in every_unit) / used if used else 0.0
    pipeline = {
        "schedule": setup.pp_schedule,
        "microbatches": setup.grad_accum,
        "bubble_fraction": bubble_fraction(setup),
        "stages": [
            {k: r[k] for k in ("rank", "blocks", "in_flight", "memory", "communication")}
            for r in ranks
        ],
    }
    return Plan(
        spec.name, spec.num_params, setup, heaviest["units"], heaviest["memory"],
        busiest["communication"], padding, heaviest["peaks"],
        checkpoint_figures(spec.num_params, setup), sync_figures(spec.num_params, setup), muon,
        pipeline,
    )  # fmt: skip


def _memory(
    spec: ModelSpec, units: tuple[UnitFigures, ...], setup: Setup, in_flight: float = 1.0,
    once: int = 0, tied=None,
) -> dict[str, int]:
    """`in_flight`: micro-batches whose activations a pipeline stage holds at once; `once`:
    activation bytes it holds besides, once (its loss's backward); `tied`: a tied
    embedding moved between pipeline stages (its TiedCost: bytes held through the step,
    and at its end)."""
    held, held_at_end = (tied.held, tied.held_at_end) if tied is not None else (0, 0)
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce_dtype]
    total = lambda f: sum(f(u) * u.count for u in units)
    params = total(lambda u: u.shard) * FP32 + total(lambda u: u.nf4) // setup.dp_shard
    grads = total(lambda u: u.shard_trainable) * FP32
    optimizer = round(setup.optimizer_states * total(lambda u: u.shard_trainable)) * FP32
    per_token = spec.activations(pb, setup.kv_grouped).on_rank(setup.tp, setup.sp)
    per_token = per_token.per_token(setup.ac)
    activations = round(in_flight * (setup.micro_batch * setup.seq_len // setup.cp * per_token))
    activations += once
    activations += context_parallel_keys(spec, setup)
    looked_up = [u for u in units if is_looked_up(u, setup)]
    # the output gradients a lookup gathers (and their fp32 copy), alive while its backward
    # adds them up
    grads_gathered = sum(unit_lookup_payloads(u, setup)[1] for u in looked_up if u.trainable)
    lookup_grads = grads_gathered + (grads_gathered // pb * FP32 if pb != FP32 else 0)
    gathered = [u for u in units if u not in looked_up]
    largest = max(gathered, key=lambda u: u.padded)

    roots = [u for u in gathered if u.is_root]
    blocks = [u for u in gathered if not u.is_root] or roots
    root_params = sum(u.gathered_bytes(pb) for u in roots)
    root_grads = sum(u.padded_trainable for u in roots) * pb
    block = max(blocks, key=lambda u: u.padded)
    block_params, block_grads = block.gathered_bytes(pb), block.padded_trainable * pb
    # a gradient reduced in another dtype is converted first, and the reduce-scatter in
    # flight holds the copy; on gloo it also holds the all-to-all's receive buffer
    in_flight = block.padded_trainable * rb if rb != pb else 0
    if setup.backend == "gloo":
        in_flight += block.padded_trainable * rb
    if setup.zero_stage == 3:
        # the root stays gathered with its gradient buffer; a block and the prefetched next
        # one are gathered; this block's gradient buffer and the previous one's (reducing)
        start = end = root_params + root_grads + 2 * block_params + 2 * block_grads + in_flight
        if setup.hpz_group:  # hpZ: every block but the last keeps 1/n of itself for backward
            kept = sum(u.padded * u.count for u in gathered if not u.is_root) - block.padded
            start += kept * pb // setup.hpz_group
    elif setup.zero_stage == 2:
        # every unit stays gathered from its forward to its backward
        every_unit = sum(u.gathered_bytes(pb) * u.count for u in gathered)
        start = every_unit + root_grads + 2 * block_grads + in_flight
        end = root_params + root_grads + block_params + 2 * block_grads + in_flight
    else:
        # unsharded parameters and gradients stay between steps
        start = end = total(lambda u: u.gathered_bytes(pb) + u.padded_trainable * pb) + in_flight
    end += lookup_grads
    # qgZ's error feedback: what each unit's rounding dropped, its whole gradient in fp32
    quantized = setup.quantize_grads != "none"
    error_feedback = total(lambda u: u.padded_trainable) * FP32 if quantized else 0
    persistent = params + optimizer + error_feedback
    # gradient shards are freed by the next forward, activations by the backward: at the
    # start of backward there are activations and no gradient shards, at its end the reverse
    start_of_backward = persistent + activations + start + held
    end_of_backward = persistent + grads + end + held + held_at_end
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "error_feedback": error_feedback,
        "largest_unsharded_unit": largest.gathered_bytes(pb),
        "unsharded_working_set": max(start, end),
        "activations": activations,
        "peak_start_of_backward": start_of_backward,
        "peak_end_of_backward": end_of_backward,
        "total": max(start_of_backward, end_of_backward),
    }
