"""The benchmark's modes and model: presets, the same model, data and loss for every mode, and
how each mode (one process, DDP, FSDP2, flatshard ZeRO-3/2/1, and on request HSDP, hpZ,
tensor parallelism with either, a mixture-of-experts model with FSDP2, flatshard ZeRO-3
or flatshard ZeRO-3 with expert parallelism, and optimizer offload: FSDP2 with
CPUOffloadPolicy, flatshard ZeRO-3 with OffloadPolicy 0.5, 1 and 1 on the disk tier)
wraps it."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `import flatshard` from a checkout without an install
    sys.path.insert(0, _ROOT)

import flatshard  # noqa: E402
from flatshard.models import (  # noqa: E402
    Llama,
    LlamaConfig,
    MoE,
    MoEConfig,
    load_balancing_loss,
)
from flatshard.models.llama import parallelize_llama  # noqa: E402
from flatshard.models.registry import next_token_loss  # noqa: E402

PRESETS = {
    # LlamaConfig.tiny(): mixed row counts (vocab 61, gate_up 90 rows) so padding shows.
    "tiny": dict(
        cfg=dict(
            vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=45, max_seq_len=64
        ),
        seq=16,
        micro_batch=2,
        steps=3,
    ),
    # The same with vocab 257 > ranks x tokens per rank: ZeRO-2/3 look the embedding up
    # from its shards (flatshard/runtime/sharded_lookup.py), as at 35M and 120M.
    "tiny-large-vocab": dict(
        cfg=dict(
            vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=45, max_seq_len=64
        ),
        seq=16,
        micro_batch=2,
        steps=3,
    ),
    # tiny with an even ffn (44: gate_up 88 rows) so it splits over tensor-parallel ranks
    # (n_heads, n_kv_heads and ffn_dim divide by TP_DEGREE), for the TP modes.
    "tiny-tp": dict(
        cfg=dict(
            vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=44, max_seq_len=64
        ),
        seq=16,
        micro_batch=2,
        steps=3,
    ),
    # Mixture of experts (flatshard.models.MoE, Qwen3-MoE options: q/k norm, top-k weights
    # renormalised), for the MoE modes: 4 experts top-2 (2 per rank at EP 2), expert ffn
    # 48 (rows of 192 bytes, as torch._grouped_mm needs), aux loss weight 0.1 so the
    # losses see it.
    "tiny-moe": dict(
        moe=True,
        cfg=dict(
            vocab_size=61,
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=64,
            max_seq_len=64,
            n_experts=4,
            top_k=2,
            expert_ffn_dim=48,
            aux_loss_coef=0.1,
            qk_norm=True,
            norm_topk_prob=True,
        ),  # fmt: skip
        seq=16,
        micro_batch=2,
        steps=3,
    ),
    # 35.5M parameters: GQA (8 query / 4 kv heads), SwiGLU 1376, untied 12k vocab.
    "35m": dict(
        cfg=dict(
            vocab_size=12000,
            dim=512,
            n_layers=8,
            n_heads=8,
            n_kv_heads=4,
            ffn_dim=1376,
            max_seq_len=256,
        ),
        seq=256,
        micro_batch=4,
        steps=6,
    ),
    # 124.7M parameters.
    "120m": dict(
        cfg=dict(
            vocab_size=32000,
            dim=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=4,
            ffn_dim=2048,
            max_seq_len=256,
        ),
        seq=256,
        micro_batch=4,
        steps=4,
    ),
    # Many small parameters (issue 38's host-cost case): 24 blocks of dim 256, 220
    # parameters of 256-256x704 elements, 21.5M in all; short sequences, so the per-parameter
    # host work of an optimizer step shows against the math.
    "many-small": dict(
        cfg=dict(
            vocab_size=2048,
            dim=256,
            n_layers=24,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=704,
            max_seq_len=64,
        ),
        seq=64,
        micro_batch=2,
        steps=6,
    ),
    # MoE, 17.6M parameters (12.6M of them experts; 8.1M active per token): dim 256, 4
    # layers, 8 experts top-2 of ffn 512 each (torch._grouped_mm), 8k vocab, aux weight 0.01.
    "moe-small": dict(
        moe=True,
        cfg=dict(
            vocab_size=8192,
            dim=256,
            n_layers=4,
            n_heads=8,
            n_kv_heads=4,
            ffn_dim=1024,
            max_seq_len=128,
            n_experts=8,
            top_k=2,
            expert_ffn_dim=512,
            aux_loss_coef=0.01,
            qk_norm=True,
            norm_topk_prob=True,
        ),  # fmt: skip
        seq=128,
        micro_batch=4,
        steps=6,
    ),
}

MODES = ["single", "ddp", "fsdp2", "zero3", "zero2", "zero1"]
# HSDP (2 replicas x world/2 shards) and hpZ (reshard_after_forward=2: backward gathers
# inside pairs of ranks), run when asked for with --modes
HSDP_MODES = ["fsdp2-hsdp", "hsdp3", "fsdp2-hpz", "hpz3"]
# Tensor parallelism (flatshard.models.llama.parallelize_llama over TP_DEGREE ranks) composed
# with FSDP2's / flatshard's fully_shard over the data-parallel dim of a (world / TP_DEGREE,
# TP_DEGREE) mesh, run when asked for with --modes
TP_MODES = ["fsdp2-tp", "tp3"]
# Long sequences (run when asked for with --modes): TP + sequence parallelism (torchtitan's
# plan: parallelize_llama(sequence_parallel=True)) under FSDP2 and flatshard over the same
# (world / TP_DEGREE, TP_DEGREE) mesh; flatshard's context parallelism over CP_DEGREE ranks
# (each sequence split in load-balanced chunks, K/V all-gathered, parameters sharded over
# dp_shard x cp), beside plain fsdp2 / zero3 on the same tokens (torch's own CP needs CUDA)
SP_MODES = ["fsdp2-sp", "sp3"]
LONG_MODES = [*SP_MODES, "cp3"]
# The MoE model (presets with moe=True; with them only these and `single`): FSDP2's or
# flatshard's fully_shard per block and root, no expert parallelism; and flatshard ZeRO-3
# with flatshard.parallel.ExpertParallel over EP_DEGREE ranks, the experts sharded over the
# world / EP_DEGREE expert-data-parallel ranks. Every rank trains on its own slice; the
# loss adds the load-balancing loss over the world (the data-parallel group).
MOE_MODES = ["fsdp2-moe", "moe3", "ep3"]
# Optimizer offload (run when asked for with --modes): FSDP2 with CPUOffloadPolicy (all
# sharded parameters, gradients and the optimizer on the host), and flatshard ZeRO-3 with
# OffloadPolicy(f): f = 0.5 and 1 on the host, and 1 with the optimizer state in
# memory-mapped files in a temporary directory per rank (the disk tier). Plain `fsdp2` and
# `zero3` are the f = 0 rows.
OFFLOAD_MODES = ["fsdp2-cpuoff", "off50", "off100", "offdisk"]
# torch.compile of every block (run when asked for with --modes): FSDP2 with
# `block.compile(fullgraph=True)` after fully_shard (torchtitan's recipe) and flatshard ZeRO-3
# with `parallelize(compile=True)` (the same call: its hooks stay outside the graphs). The
# first (warm-up) step of each build compiles; plain `fsdp2` and `zero3` are the eager rows.
COMPILE_MODES = ["fsdp2-compile", "compile3"]
# Activation checkpointing of every block (run when asked for with --modes): flatshard ZeRO-3
# with parallelize(activation_checkpointing="full" / "selective"); `zero3` is the none row.
# acoff3: activation offload (saved activations on the host; on a CPU the same memory, so
# it shows the copies' cost, not the memory it saves on a GPU).
AC_MODES = ["acfull3", "acsel3", "acoff3"]
AC_OF_MODE = {"acfull3": "full", "acsel3": "selective", "acoff3": "offload"}
# flatshard's own optimizer (flatshard.optim.AdamW: flat moments per bucket, a few ops per
# param group) in place of torch.optim.AdamW (run when asked for with --modes)
FLAT_OPTIMIZER_MODES = ["zero3f", "zero1f", "zero3ff"]
# AdamW(fused=True): torch's fused kernel per parameter on FSDP2, over flat ranges on flatshard
FUSED_OPTIMIZER_MODES = ["fsdp2-fused", "zero3ff"]
# Muon on the hidden matrices, AdamW on the rest (run when asked for with --modes): FSDP2 with
# torch's Muon (every rank gathers and orthogonalises every matrix) and torch's AdamW, and
# flatshard ZeRO-3 with flatshard.optim.Muon (an owner rank per matrix), and flatshard ZeRO-3
# with torch's Muon (as on FSDP2: every rank every matrix); all with Moonlight's lr match, so
# LR and WEIGHT_DECAY serve both parts
MUON_MODES = ["fsdp2-muon", "zero3m", "zero3tm"]
# flatshard ZeRO-3 with the weights all-gathered in int8 / fp8 (CommPolicy, ZeRO++'s qwZ)
# (run when asked for with --modes, beside zero3)
# and the gradients reduce-scattered in int8 (qgZ), alone and with int8 weight gathers
QUANTIZED_MODES = {
    "zero3q8": dict(quantize_weights="int8"),
    "zero3qf8": dict(quantize_weights="fp8"),
    "zero3qg8": dict(quantize_grads="int8"),
    "zero3q8g8": dict(quantize_weights="int8", quantize_grads="int8"),
}
# flatshard's offload modes: (fraction, on the disk tier)
OFFLOAD_FRACTIONS = {"off50": (0.5, False), "off100": (1.0, False), "offdisk": (1.0, True)}
MODE_NAMES = {
    "single": "single process",
    "ddp": "DDP",
    "fsdp2": "FSDP2",
    "zero3": "flatshard ZeRO-3",
    "zero2": "flatshard ZeRO-2",
    "zero1": "flatshard ZeRO-1",
    "fsdp2-hsdp": "FSDP2 HSDP",
    "hsdp3": "flatshard HSDP ZeRO-3",
    "fsdp2-hpz": "FSDP2 hpZ",
    "hpz3": "flatshard hpZ",
    "fsdp2-tp": "FSDP2 TP",
    "tp3": "flatshard TP ZeRO-3",
    "fsdp2-sp": "FSDP2 TP+SP",
    "sp3": "flatshard TP+SP ZeRO-3",
    "cp3": "flatshard CP ZeRO-3",
    "fsdp2-moe": "FSDP2 (no EP)",
    "moe3": "flatshard ZeRO-3 (no EP)",
    "ep3": "flatshard EP ZeRO-3",
    "fsdp2-cpuoff": "FSDP2 + CPUOffloadPolicy",
    "off50": "flatshard ZeRO-3 offload 0.5",
    "off100": "flatshard ZeRO-3 offload 1",
    "offdisk": "flatshard ZeRO-3 offload 1 (disk)",
    "fsdp2-compile": "FSDP2 compiled blocks",
    "compile3": "flatshard ZeRO-3 compiled blocks",
    "acfull3": "flatshard ZeRO-3 full AC",
    "zero3f": "flatshard ZeRO-3 + flat AdamW",
    "zero1f": "flatshard ZeRO-1 + flat AdamW",
    "zero3ff": "flatshard ZeRO-3 + flat fused AdamW",
    "fsdp2-fused": "FSDP2 + fused AdamW",
    "fsdp2-muon": "FSDP2 + torch Muon",
    "zero3m": "flatshard ZeRO-3 + Muon",
    "zero3tm": "flatshard ZeRO-3 + torch Muon",
    "zero3q8": "flatshard ZeRO-3, int8 weight gathers",
    "zero3qf8": "flatshard ZeRO-3, fp8 weight gathers",
    "zero3qg8": "flatshard ZeRO-3, int8 gradient reduce-scatters",
    "zero3q8g8": "flatshard ZeRO-3, int8 gathers and reduce-scatters",
    "acsel3": "flatshard ZeRO-3 selective AC",
    "acoff3": "flatshard ZeRO-3 activation offload",
}
FLATSHARD_STAGES = {
    "zero3": 3, "zero2": 2, "zero1": 1, "hsdp3": 3, "hpz3": 3, "tp3": 3, "moe3": 3, "ep3": 3,
    "sp3": 3, "cp3": 3,
    "off50": 3, "off100": 3, "offdisk": 3, "compile3": 3, "acfull3": 3, "acsel3": 3,
    "acoff3": 3, "zero3f": 3, "zero1f": 1, "zero3ff": 3, "zero3m": 3, "zero3tm": 3, "zero3q8": 3,
    "zero3qf8": 3, "zero3qg8": 3, "zero3q8g8": 3,
}  # fmt: skip
HPZ_GROUP = 2
HSDP_REPLICAS = 2
TP_DEGREE = 2
EP_DEGREE = 2
CP_DEGREE = 2


@functools.cache
def parallel_dims(kind: str = "dp"):
    """The degrees of a kind of mode ("dp", "hsdp", "tp", "ep") over every rank; cached, so
    its meshes are built once per worker (every rank builds them in the first such mode)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if kind == "hsdp":
        return flatshard.ParallelDims(world, dp_replicate=HSDP_REPLICAS)
    if kind == "tp":
        return flatshard.ParallelDims(world, tp=TP_DEGREE)
    if kind == "sp":
        return flatshard.ParallelDims(world, tp=TP_DEGREE, sequence_parallel=True)
    if kind == "cp":
        return flatshard.ParallelDims(world, cp=CP_DEGREE)
    if kind == "ep":
        return flatshard.ParallelDims(world, ep=EP_DEGREE)
    return flatshard.ParallelDims(world)


def dims_for(mode: str):
    """The `parallel_dims` a mode runs on."""
    if mode in ("hsdp3", "fsdp2-hsdp"):
        return parallel_dims("hsdp")
    if mode in TP_MODES:
        return parallel_dims("tp")
    if mode in SP_MODES:
        return parallel_dims("sp")
    return parallel_dims({"ep3": "ep", "cp3": "cp"}.get(mode, "dp"))


def is_moe(preset: str) -> bool:
    return bool(PRESETS[preset].get("moe"))


def data_slice(mode: str) -> tuple[int, int]:
    """(this rank's index, number of slices) of the global batch: the rank and the world,
    but in the TP modes the data-parallel rank and size (every rank of a TP group takes the
    same sequences, as the TP split needs)."""
    import torch.distributed as dist

    if mode in TP_MODES or mode in LONG_MODES:  # TP/CP ranks share their group's sequences
        dims = dims_for(mode)
        return dims.build().dp_rank, dims.dp
    return dist.get_rank(), dist.get_world_size()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_SEED, DATA_SEED = 0, 1
LR, WEIGHT_DECAY = 1e-3, 0.1


def make_config(preset: str) -> LlamaConfig:
    """The preset's LlamaConfig, or MoEConfig (a LlamaConfig) for an MoE preset."""
    return (MoEConfig if is_moe(preset) else LlamaConfig)(**PRESETS[preset]["cfg"])


def make_data(cfg: LlamaConfig, steps: int, global_batch: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(DATA_SEED)
    return [
        torch.randint(0, cfg.vocab_size, (global_batch, seq + 1), generator=generator)
        for _ in range(steps)
    ]


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def moe_loss(model, tokens: torch.Tensor, group, coef: float) -> torch.Tensor:
    """Next-token cross-entropy plus `coef` (aux_loss_coef) x the load-balancing loss of this
    forward's router statistics, with its counts summed over `group`, the ranks that split
    the batch (None: one process), as tests/test_moe_training.py: the mean over the ranks
    (and its gradient) is the global batch's loss."""
    logits, stats = model(tokens[:, :-1], return_router_stats=True)
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return lm + coef * load_balancing_loss(stats, group)


def loss_for(cfg: LlamaConfig, distributed: bool):
    """`loss(model, tokens)` for the config: the LM loss, or for an MoE model with the
    load-balancing loss over the world (every MoE mode is data-parallel over all ranks)."""
    if not isinstance(cfg, MoEConfig):
        return lm_loss
    import torch.distributed as dist

    group = dist.group.WORLD if distributed else None
    return lambda model, tokens: moe_loss(model, tokens, group, cfg.aux_loss_coef)


class _TorchMuonAndAdamW:
    """torch's Muon on the Muon group, torch's AdamW on the other: one optimizer's face."""

    def __init__(self, groups):
        muon, rest = groups
        self.parts = [
            torch.optim.Muon(muon["params"], lr=LR, weight_decay=WEIGHT_DECAY,
                             adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest["params"], lr=LR, weight_decay=WEIGHT_DECAY),
        ]  # fmt: skip
        self.param_groups = [g for part in self.parts for g in part.param_groups]
        self.state = {p: s for part in self.parts for p, s in part.state.items()}

    def step(self):
        for part in self.parts:
            part.step()
        self.state = {p: s for part in self.parts for p, s in part.state.items()}

    def zero_grad(self):
        for part in self.parts:
            part.zero_grad()


def make_optimizer(mode: str, model):
    """A mode's optimizer: torch's AdamW, flatshard's flat AdamW, or Muon + AdamW."""
    if mode == "zero3m":
        groups = flatshard.optim.muon_param_groups(model)
        return flatshard.optim.Muon(
            groups, lr=LR, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"
        )
    if mode in ("fsdp2-muon", "zero3tm"):
        return _TorchMuonAndAdamW(flatshard.optim.muon_param_groups(model))
    make = flatshard.optim.AdamW if mode in FLAT_OPTIMIZER_MODES else torch.optim.AdamW
    # fused only when asked: an explicit fused=False keeps torch from its foreach default
    fused = {"fused": True} if mode in FUSED_OPTIMIZER_MODES else {}
    return make(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **fused)


def build_model(cfg: LlamaConfig) -> Llama | MoE:
    torch.manual_seed(MODEL_SEED)
    return MoE(cfg) if isinstance(cfg, MoEConfig) else Llama(cfg)


class SingleProcess:
    """The reference: one process, the global batch. With a low param dtype it does what
    FSDP2's MixedPrecisionPolicy does: fp32 main weights (and optimizer), a param-dtype
    compute copy refreshed every step, gradients cast back to fp32."""

    def __init__(self, cfg: LlamaConfig, param_dtype: torch.dtype) -> None:
        self.loss = loss_for(cfg, distributed=False)
        self.main = build_model(cfg)
        self.compute = None
        if param_dtype != torch.float32:
            self.compute = copy.deepcopy(self.main).to(param_dtype)
            for param in self.compute.parameters():
                param.grad = None

    def parameters(self):
        return self.main.parameters()

    def forward_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.compute is None:
            return self.loss(self.main, tokens)
        with torch.no_grad():
            for low, full in zip(self.compute.parameters(), self.main.parameters()):
                low.copy_(full)
        return self.loss(self.compute, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.compute is not None:
            for low, full in zip(self.compute.parameters(), self.main.parameters()):
                full.grad = low.grad.float()
                low.grad = None


# the disk tier's directories made on this rank (a fresh temporary directory per build;
# the tier unlinks its files as it makes them), removed with `remove_offload_dirs`
OFFLOAD_DIRS: list[str] = []


def remove_offload_dirs(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
        if path in OFFLOAD_DIRS:
            OFFLOAD_DIRS.remove(path)


def offload_policy(mode: str):
    """flatshard's OffloadPolicy for an offload mode (None for the others): the same policy
    object for every block and the root."""
    if mode not in OFFLOAD_FRACTIONS:
        return None
    fraction, disk = OFFLOAD_FRACTIONS[mode]
    path = None
    if disk:
        path = tempfile.mkdtemp(prefix="flatshard-bench-offload-")
        OFFLOAD_DIRS.append(path)
    return flatshard.OffloadPolicy(fraction, pin_memory=True, path=path)


def build_mode(mode: str, cfg: LlamaConfig, param_dtype: torch.dtype):
    """Returns (model, loss function, backward function). The disk-tier mode leaves a
    temporary directory in OFFLOAD_DIRS: `remove_offload_dirs` once the model is freed."""
    if mode == "single":
        model = SingleProcess(cfg, param_dtype)
        return model, model.forward_loss, model.backward
    model = build_model(cfg)
    loss = loss_for(cfg, distributed=True)
    low = param_dtype != torch.float32
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if low:
            # DDP's own `_MixedPrecision` records CUDA events and fails on CPU: use autocast
            # (fp32 weights and gradients, matmuls in param_dtype).
            def autocast_loss(tokens):
                with torch.autocast("cpu", dtype=param_dtype):
                    return loss(model, tokens)

            return model, autocast_loss, (lambda loss: loss.backward())
    elif mode.startswith("fsdp2"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        policy = policy if low else MixedPrecisionPolicy()
        meshes = dims_for(mode).build("cpu")
        mesh = meshes.fsdp
        if mode in ("fsdp2-tp", "fsdp2-sp"):
            # the same plan as flatshard's (the fused gate_up _StridedShard(0, 2) over TP):
            # FSDP2 2.13 accepts it and shards it _StridedShard(0, TP) over dp_shard
            parallelize_llama(model, meshes.tp, sequence_parallel=mode == "fsdp2-sp")
        # None is FSDP2's default: blocks reshard after forward, the root stays gathered for
        # its backward (an explicit True reshards the root too and gathers it again)
        reshard = HPZ_GROUP if mode == "fsdp2-hpz" else None
        # CPU: no pinned memory without an accelerator (FSDP2 would pin_memory() and fail)
        extra = {}
        if mode == "fsdp2-cpuoff":
            extra["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy, mesh=mesh, reshard_after_forward=reshard, **extra)
        fully_shard(model, mp_policy=policy, mesh=mesh, reshard_after_forward=reshard, **extra)
        if mode == "fsdp2-compile":
            for layer in model.layers:
                layer.compile(fullgraph=True)
    else:
        stage = FLATSHARD_STAGES[mode]
        policy = flatshard.MixedPrecisionPolicy(
            param_dtype=param_dtype if low else None, reduce_dtype=torch.float32 if low else None
        )
        extra = {"reshard_after_forward": HPZ_GROUP} if mode == "hpz3" else {"zero_stage": stage}
        offload = offload_policy(mode)
        if offload is not None:
            extra["offload_policy"] = offload  # the same policy object everywhere
        # TP, then each EP rank's experts (Shard(0) over ep) sharded over efsdp, then the
        # blocks and the root
        flatshard.parallelize(
            model,
            dims_for(mode).build("cpu"),
            mp_policy=policy,
            compile=mode == "compile3",
            activation_checkpointing=AC_OF_MODE.get(mode),
            **extra,
        )
        if mode in QUANTIZED_MODES:
            model.set_comm_policy(flatshard.CommPolicy(**QUANTIZED_MODES[mode]))
        if mode == "cp3":  # this rank's part of each sequence, at its positions
            loss = next_token_loss
    return model, (lambda tokens: loss(model, tokens)), (lambda value: value.backward())
