"""The models of a run: the reference Llama, the reference MoE (`model.n_experts` > 0) or a
Hugging Face model (`model.hf`), built on the meta device and sharded, or plain (one
process, no sharding) for sampling and conversion; and the train.* keys as `parallelize`
settings. run_model.py picks among them for a training run (and builds its pipeline
stages)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

import flatshard
from flatshard import hf
from flatshard.api.parallel_plan import plan_for
from flatshard.cli import runs
from flatshard.cli.config import RunConfig
from flatshard.cli.errors import ConfigError, RunError, warn
from flatshard.cli.saved_model import config_from_dict, is_transformers_config
from flatshard.errors import MeshError
from flatshard.mesh import ParallelDims
from flatshard.models import Llama, LlamaConfig, MoE, MoEConfig, family_of_config
from flatshard.models.llama import check_tp
from flatshard.models.lora import (
    LoRAError,
    LoRASpec,
    add_lora,
    lora_spec_of,
    merge_adapters,
)
from flatshard.models.lora_parallel import lora_plan
from flatshard.models.qlora import quantize_bases
from flatshard.models.transformers import TRANSFORMERS, build_causal_lm, shard_decoder_layers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_config(config: RunConfig, data_vocab_size: int) -> LlamaConfig:
    """The LlamaConfig a run config describes (a MoEConfig, its subclass, when
    model.n_experts > 0); `data_vocab_size` fills model.vocab_size=0."""
    model = config.model
    vocab_size = model.vocab_size or data_vocab_size
    if vocab_size < data_vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is too small for the data, whose tokens need "
            f"{data_vocab_size}; raise it or leave it 0"
        )
    fields = dict(
        vocab_size=vocab_size,
        dim=model.dim,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads or None,
        ffn_dim=model.ffn_dim,
        norm_eps=model.norm_eps,
        rope_theta=model.rope_theta,
        max_seq_len=model.max_seq_len or config.data.seq_len,
        tie_embeddings=model.tie_embeddings,
    )
    try:
        if not model.n_experts:
            return LlamaConfig(**fields)
        return MoEConfig(
            **fields,
            n_experts=model.n_experts,
            top_k=model.top_k,
            expert_ffn_dim=model.expert_ffn_dim or model.ffn_dim,
            norm_topk_prob=model.norm_topk_prob,
            aux_loss_coef=model.aux_loss_coef,
            score_bias=model.bias_update_speed > 0,
        )
    except ValueError as error:
        raise ConfigError(f"model: {error}") from None


def mixed_precision(precision: str) -> flatshard.MixedPrecisionPolicy | None:
    if precision == "fp32":
        return None
    return flatshard.MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def offload_policy(fraction: float, directory: str) -> flatshard.OffloadPolicy | None:
    """train.offload / train.offload_dir as a policy (a directory alone: everything)."""
    if not fraction and not directory:
        return None
    return flatshard.OffloadPolicy(fraction=fraction or 1.0, path=directory or None)


def warn_eager_selective(train, device: torch.device) -> None:
    """Eager selective AC on a GPU is host-bound (torch's per-op dispatch mode, forward and
    recompute: benchmarks/RESULTS-gpu.md); compiled, the policy runs inside the graphs."""
    if train.ac == "selective" and not train.compile and device.type == "cuda":
        warn(
            "--ac selective without --compile runs every op of a block through torch's "
            "dispatch mode on the host (at 1B on an H200, slower than --ac full); add --compile"
        )


def reference_model(cfg: LlamaConfig) -> Llama | MoE:
    """The reference model a config describes (on the current default device)."""
    return family_of_config(cfg).model_type(cfg)


def lora_spec(rank: int, alpha: float, dropout: float, targets: str) -> LoRASpec | None:
    """The LoRA adapters train.lora_* ask for (None: rank 0, train every weight)."""
    if not rank:
        return None
    names = tuple(name.strip() for name in targets.split(",") if name.strip())
    return LoRASpec(rank, alpha or 2.0 * rank, dropout, names)


def lora_of_checkpoint(step_path: str) -> tuple[str, LoRASpec] | None:
    """(the base model directory, the adapters) of a LoRA run's checkpoint, whose files hold
    the adapters only; None for any other checkpoint."""
    saved = runs.saved_run_config(step_path) or {}
    train, base = saved.get("train", {}), saved.get("model", {}).get("hf", "")
    if not train.get("lora_rank"):
        return None
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise RunError(
            f"{step_path} holds LoRA adapters of the model in {base!r}, which is not there any "
            "more: the base weights come from it. Put the model directory back at that path"
        )
    spec = lora_spec(train["lora_rank"], train.get("lora_alpha", 0.0),
                     train.get("lora_dropout", 0.0), train["lora_targets"])  # fmt: skip
    return base, spec


def build_lora_model(base: str, spec: LoRASpec, *, sharded: bool, device):
    """The base model of `base` with `spec`'s adapters (to be filled from a checkpoint):
    sharded by decoder layer, or plain in one process."""

    def shard(model):
        add_lora(model, spec)
        if sharded:
            shard_decoder_layers(model)

    return hf.from_pretrained(base, shard=shard, device=device)


def build_sharded(
    cfg: LlamaConfig,
    *,
    zero_stage: int,
    precision: str,
    seed: int,
    device: torch.device,
    dims: ParallelDims | None = None,
    hpz_group: int = 0,
    offload: flatshard.OffloadPolicy | None = None,
    activations: dict | None = None,
) -> Llama | MoE:
    """`flatshard.parallelize` over `dims` (default: every rank data-parallel): attention
    and dense MLPs split over `tp` ranks, MoE experts over `ep` data-parallel ranks (sharded
    over the rest), every block and the root `fully_shard`-ed (HSDP over `dp_replicate`
    replicas); weights equal `reference_model(cfg)` built eagerly after
    `torch.manual_seed(seed)`, at any layout, and no rank ever holds them all."""
    dims = dims or ParallelDims(dist.get_world_size())
    tp, ep = dims.tp, dims.ep
    if tp > 1:
        try:
            check_tp(cfg, tp)
        except MeshError as error:
            raise ConfigError(f"train.tp: {error}") from None
    if ep > 1 and not getattr(cfg, "n_experts", 0):
        raise ConfigError("train.ep > 1 needs a mixture-of-experts model (e.g. --model moe-tiny)")
    if ep > 1 and cfg.n_experts % ep:
        raise ConfigError(f"train.ep ({ep}) must divide model.n_experts ({cfg.n_experts})")
    with torch.device("meta"):
        model = reference_model(cfg)
    stage = stage_options(zero_stage, hpz_group, offload, activations)
    policy = mixed_precision(precision)
    with _as_config_error(_degrees(dims)):
        flatshard.parallelize(model, dims.build(device.type), mp_policy=policy, **stage)
    torch.manual_seed(seed)
    flatshard.materialize(model, device)
    return model


def stage_options(zero_stage: int, hpz_group: int, offload, activations: dict | None) -> dict:
    """The parallelize settings every unit of a trainer's model shares besides precision."""
    stage = {"reshard_after_forward": hpz_group} if hpz_group else {"zero_stage": zero_stage}
    return {**stage, "offload_policy": offload, **(activations or {})}


def activation_options(ac: str, compile: bool) -> dict:
    """parallelize's activation checkpointing and compile settings of train.ac/compile."""
    return {"activation_checkpointing": None if ac == "none" else ac, "compile": compile}


def build_plain(cfg: LlamaConfig, device: torch.device | str = "cpu") -> Llama | MoE:
    """An unsharded model with uninitialised weights, to load a checkpoint into."""
    with torch.device("meta"):
        model = reference_model(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:
        # to_empty gives every module a tensor of its own, so the tie is lost: an untied
        # model would load both names and export a lm_head.weight HF's tied model lacks
        model.lm_head.weight = model.embed_tokens.weight
    return model


def plain_copy(model, to_rank: int = 0):
    """An unsharded copy of a sharded run model on rank `to_rank` (None elsewhere), its
    weights gathered parameter group by parameter group; call on every rank."""
    from flatshard.checkpoint.manifest import model_config

    receiving = dist.get_rank() == to_rank
    plain, lora = None, lora_spec_of(model)
    if receiving:
        config = config_from_dict(model_config(model))
        if is_transformers_config(config):
            plain = build_transformers(config, sharded=False)
        else:
            plain = build_plain(config)
        if lora is not None:
            add_lora(plain, lora)  # the same names, so the gathered adapters load
    weights = {}
    for name, tensor in flatshard.full_weights(model, "model", to_rank=to_rank):
        tensor = tensor.detach()
        if type(tensor) is not torch.Tensor:  # a QLoRA base (NF4): the values it stands for
            tensor = tensor.to(torch.float32)
        weights[name] = tensor.to("cpu", copy=True)
    if receiving:
        plain.load_state_dict(weights)
        if lora is not None:
            merge_adapters(plain)  # one matmul a projection while sampling
        return plain.eval()
    return None


def build_hf(
    path: str,
    *,
    zero_stage: int,
    precision: str,
    device: torch.device,
    dims: ParallelDims,
    hpz_group: int = 0,
    offload: flatshard.OffloadPolicy | None = None,
    activations: dict | None = None,
    load: bool = True,
    lora: LoRASpec | None = None,
    nf4_bases: bool = False,
):
    """The Hugging Face model at `path` (config.json + safetensors), split by
    `flatshard.parallelize` over `dims` as build_sharded does (TP and EP by the model's
    plan: transformers' own for a transformers model), each rank reading only its slices:
    flatshard's Llama for Llama/Qwen2/Qwen3 checkpoints, the transformers model otherwise.
    load False: allocated only (a checkpoint will fill it). lora: adapters added before
    the model is split (init_adapters draws them); nf4_bases (QLoRA): their bases in NF4,
    quantized whole, so every rank reads the whole model once before it is split."""
    parallelize = functools.partial(
        flatshard.parallelize,
        dims=dims.build(device.type),
        mp_policy=mixed_precision(precision),
        **stage_options(zero_stage, hpz_group, offload, activations),
    )

    def shard(model):
        if lora is not None:
            try:
                add_lora(model, lora)
                if nf4_bases:
                    quantize_bases(model, dims.dp_shard)
            except LoRAError as error:
                raise ConfigError(f"train.lora_*: {error}") from None
            return parallelize(model, plan=lora_plan(plan_for(model)))
        return parallelize(model)

    with _as_config_error(_degrees(dims)):
        if nf4_bases:  # NF4 quantizes a weight whole: load it unsplit, then split it
            model = hf.from_pretrained(path, device="cpu")
            shard(model)
            return model
        if load:
            return hf.from_pretrained(path, shard=shard, device=device)
        hf_config = hf.read_hf_config(path)
        adapter = hf.adapter_for_config(hf_config)
        with torch.device("meta"):
            model = adapter.build(hf_config)
        shard(model)
    adapter.allocate(model, device)
    return model


def _degrees(dims: ParallelDims) -> str:
    """The config keys of the degrees a model is split by."""
    named = f"train.tp={dims.tp}, train.ep={dims.ep}"
    named += f", train.cp={dims.cp}" if dims.cp > 1 else ""
    return named + (", train.sp" if dims.sequence_parallel else "")


@contextlib.contextmanager
def _as_config_error(key: str):
    """A mesh error (a degree the model cannot split by) as a config error naming `key`."""
    try:
        yield
    except MeshError as error:
        raise ConfigError(f"{key}: {error}") from None


def build_transformers(hf_config: dict, *, sharded: bool, device: torch.device | str = "cpu"):
    """The transformers model a checkpoint's saved config describes (sharded: every decoder
    layer and the root), allocated but not filled: a checkpoint load fills it."""
    with torch.device("meta"):
        model = build_causal_lm(hf_config)
    if sharded:
        shard_decoder_layers(model)
    TRANSFORMERS.allocate(model, torch.device(device))
    return model
