"""The benchmark's modes and model: presets, the same model, data and loss for every mode, and
how each mode (one process, DDP, FSDP2, flatshard ZeRO-3/2/1, and on request HSDP, hpZ and
tensor parallelism with either) wraps it."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `import flatshard` from a checkout without an install
    sys.path.insert(0, _ROOT)

import flatshard  # noqa: E402
from flatshard.models import Llama, LlamaConfig  # noqa: E402
from flatshard.parallel import parallelize_llama  # noqa: E402

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
}

MODES = ["single", "ddp", "fsdp2", "zero3", "zero2", "zero1"]
# HSDP (2 replicas x world/2 shards) and hpZ (reshard_after_forward=2: backward gathers
# inside pairs of ranks), run when asked for with --modes
HSDP_MODES = ["fsdp2-hsdp", "hsdp3", "fsdp2-hpz", "hpz3"]
# Tensor parallelism (flatshard.parallel.parallelize_llama over TP_DEGREE ranks) composed
# with FSDP2's / flatshard's fully_shard over the data-parallel dim of a (world / TP_DEGREE,
# TP_DEGREE) mesh, run when asked for with --modes
TP_MODES = ["fsdp2-tp", "tp3"]
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
}
FLATSHARD_STAGES = {"zero3": 3, "zero2": 2, "zero1": 1, "hsdp3": 3, "hpz3": 3, "tp3": 3}
HPZ_GROUP = 2
HSDP_REPLICAS = 2
TP_DEGREE = 2


def hsdp_mesh():
    """(2 replicas, world / 2 shards), for the HSDP modes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shards = dist.get_world_size() // HSDP_REPLICAS
    return init_device_mesh("cpu", (HSDP_REPLICAS, shards), mesh_dim_names=("rep", "shard"))


_TP_MESH = []


def tp_mesh():
    """(world / TP_DEGREE data-parallel, TP_DEGREE tensor-parallel), named as torchtitan's;
    built once per worker (every rank builds it in the first TP mode) and shared by the TP
    modes and their data slicing."""
    if not _TP_MESH:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dp = dist.get_world_size() // TP_DEGREE
        _TP_MESH.append(init_device_mesh("cpu", (dp, TP_DEGREE), mesh_dim_names=("dp_shard", "tp")))
    return _TP_MESH[0]


def data_slice(mode: str) -> tuple[int, int]:
    """(this rank's index, number of slices) of the global batch: the rank and the world,
    but in the TP modes the data-parallel rank and size (every rank of a TP group takes the
    same sequences, as the TP split needs)."""
    import torch.distributed as dist

    if mode in TP_MODES:
        dp = tp_mesh()["dp_shard"]
        return dp.get_local_rank(), dp.size()
    return dist.get_rank(), dist.get_world_size()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_SEED, DATA_SEED = 0, 1
LR, WEIGHT_DECAY = 1e-3, 0.1


def make_config(preset: str) -> LlamaConfig:
    return LlamaConfig(**PRESETS[preset]["cfg"])


def make_data(cfg: LlamaConfig, steps: int, global_batch: int, seq: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(DATA_SEED)
    return [
        torch.randint(0, cfg.vocab_size, (global_batch, seq + 1), generator=generator)
        for _ in range(steps)
    ]


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def build_model(cfg: LlamaConfig) -> Llama:
    torch.manual_seed(MODEL_SEED)
    return Llama(cfg)


class SingleProcess:
    """The reference: one process, the global batch. With a low param dtype it does what
    FSDP2's MixedPrecisionPolicy does: fp32 main weights (and optimizer), a param-dtype
    compute copy refreshed every step, gradients cast back to fp32."""

    def __init__(self, cfg: LlamaConfig, param_dtype: torch.dtype) -> None:
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
            return lm_loss(self.main, tokens)
        with torch.no_grad():
            for low, full in zip(self.compute.parameters(), self.main.parameters()):
                low.copy_(full)
        return lm_loss(self.compute, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.compute is not None:
            for low, full in zip(self.compute.parameters(), self.main.parameters()):
                full.grad = low.grad.float()
                low.grad = None


def build_mode(mode: str, cfg: LlamaConfig, param_dtype: torch.dtype):
    """Returns (model, loss function, backward function)."""
    if mode == "single":
        model = SingleProcess(cfg, param_dtype)
        return model, model.forward_loss, model.backward
    model = build_model(cfg)
    low = param_dtype != torch.float32
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if low:
            # DDP's own `_MixedPrecision` records CUDA events and fails on CPU: use autocast
            # (fp32 weights and gradients, matmuls in param_dtype).
            def autocast_loss(tokens):
                with torch.autocast("cpu", dtype=param_dtype):
                    return lm_loss(model, tokens)

            return model, autocast_loss, (lambda loss: loss.backward())
    elif mode in ("fsdp2", "fsdp2-hsdp", "fsdp2-hpz", "fsdp2-tp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        policy = policy if low else MixedPrecisionPolicy()
        mesh = hsdp_mesh() if mode == "fsdp2-hsdp" else None
        if mode == "fsdp2-tp":
            # the same plan as flatshard's (the fused gate_up _StridedShard(0, 2) over TP):
            # FSDP2 2.13 accepts it and shards it _StridedShard(0, TP) over dp_shard
            parallelize_llama(model, tp_mesh()["tp"])
            mesh = tp_mesh()["dp_shard"]
        reshard = HPZ_GROUP if mode == "fsdp2-hpz" else True
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy, mesh=mesh, reshard_after_forward=reshard)
    else:
        stage = FLATSHARD_STAGES[mode]
        policy = flatshard.MixedPrecisionPolicy(
            param_dtype=param_dtype if low else None, reduce_dtype=torch.float32 if low else None
        )
        mesh = hsdp_mesh() if mode == "hsdp3" else None
        if mode == "tp3":
            parallelize_llama(model, tp_mesh()["tp"])
            mesh = tp_mesh()["dp_shard"]
        extra = {"reshard_after_forward": HPZ_GROUP} if mode == "hpz3" else {"zero_stage": stage}
        for layer in model.layers:
            flatshard.fully_shard(layer, mp_policy=policy, mesh=mesh, **extra)
        flatshard.fully_shard(model, mp_policy=policy, mesh=mesh, **extra)
    return model, (lambda tokens: lm_loss(model, tokens)), (lambda loss: loss.backward())
