"""The model a training run config describes, as its train.* keys split it: sharded over
the run's ranks (model.py builds it), or this rank's pipeline stages (train.pp > 1) of the
reference model or of a Hugging Face model."""

from __future__ import annotations

import torch

import flatshard
from flatshard import hf
from flatshard.api.parallel_plan import plan_for
from flatshard.cli.errors import ConfigError
from flatshard.cli.model import (
    activation_options,
    build_hf,
    build_sharded,
    lora_spec,
    mixed_precision,
    offload_policy,
    reference_model,
    stage_options,
    warn_eager_selective,
)
from flatshard.cli.pipeline_step import StepLoss
from flatshard.errors import MeshError, WrappingError
from flatshard.mesh import ParallelDims
from flatshard.models import LlamaConfig, MoE
from flatshard.models.lora import LoRAError, LoRASpec, add_lora, init_adapters
from flatshard.models.lora_parallel import lora_plan
from flatshard.models.moe import count_transformers_routers


def build_run_model(
    config, model_config: LlamaConfig | None, dims: ParallelDims, device: torch.device, load: bool
):
    """The model a training run config describes, sharded over `dims` as its train.* keys
    say: the Hugging Face model of model.hf (read from its files when `load`), else the
    reference model of `model_config`; under train.pp a `flatshard.Pipeline` of this
    rank's stages."""
    train = config.train
    sharding = dict(
        zero_stage=train.zero_stage,
        precision=train.precision,
        device=device,
        dims=dims,
        hpz_group=train.hpz_group,
        offload=offload_policy(train.offload, train.offload_dir),
        activations=activation_options(train.ac, train.compile),
    )
    warn_eager_selective(train, device)
    lora = lora_spec(train.lora_rank, train.lora_alpha, train.lora_dropout, train.lora_targets)
    if dims.pp > 1:  # the stages this rank runs, with the whole model's weights
        piped = dict(schedule=train.pp_schedule,
                     microbatches=train.global_batch // (train.micro_batch * dims.dp))  # fmt: skip
        if config.model.hf:
            pipe = build_hf_pipeline(config.model.hf, load=load, lora=lora, seed=train.seed,
                                     **piped, **sharding)  # fmt: skip
            _count_routers(config, pipe.model)
            return pipe
        return build_pipeline(model_config, seed=train.seed, **piped, **sharding)
    if config.model.hf:
        # a LoRA run's checkpoints hold its adapters: the base is read from its files anyway
        model = build_hf(config.model.hf, load=load or lora is not None, lora=lora,
                         nf4_bases=train.qlora, **sharding)  # fmt: skip
        if lora is not None:
            init_adapters(model, train.seed)  # a resume's checkpoint overwrites them
        _count_routers(config, model)
    else:
        model = build_sharded(model_config, seed=train.seed, **sharding)
    chosen = {k: getattr(train, k) for k in ("quantize_weights", "quantize_grads")}
    if any(value != "none" for value in chosen.values()):
        quantized = {k: None if value == "none" else value for k, value in chosen.items()}
        model.set_comm_policy(flatshard.CommPolicy(**quantized))
    return model


def _count_routers(config, model) -> None:
    """model.bias_update_speed on a Hugging Face model: its routers' score-correction biases
    (DeepSeek-V3's) move after each step, from the assignments they count."""
    if config.model.bias_update_speed and not count_transformers_routers(model):
        raise ConfigError(
            f"model.bias_update_speed: {config.model.hf}'s routers have no score-correction "
            "bias to move (DeepSeek-V3, GLM-4-MoE and dots.llm1 have one: "
            "e_score_correction_bias); set model.bias_update_speed=0"
        )


def build_pipeline(cfg: LlamaConfig, *, seed: int, device, **options) -> flatshard.Pipeline:
    """The stages of the reference model this rank runs, with the whole model's weights
    for `seed` (`options`: `_pipeline`'s)."""
    with torch.device("meta"):
        whole = reference_model(cfg)
    balancing = getattr(cfg, "aux_loss_coef", 0.0)
    if balancing > 0:  # every stage hands on its routers' totals (MoE.forward)
        whole.carries_router_totals = True
    pipe = _pipeline(whole, device=device, **options)
    if balancing > 0:
        tokens = pipe.meshes.token_ranks.get_group()  # every rank holding other tokens
        pipe.loss_fn.balance = (balancing, pipe.microbatches, tokens)
    torch.manual_seed(seed)
    flatshard.materialize(pipe.model, device, replay=whole)
    return pipe


def build_hf_pipeline(path: str, *, load: bool, device, lora: LoRASpec | None = None,
                      seed: int = 0, **options) -> flatshard.Pipeline:  # fmt: skip
    """The stages of the Hugging Face model at `path` this rank runs, each rank reading only
    its stages' slices of the files (load False: allocated only, a checkpoint will fill
    them; `options`: `_pipeline`'s). lora: adapters on the whole model before it is split
    (drawn for `seed` as the whole model's; the base read whatever `load` says: a LoRA
    checkpoint holds the adapters only)."""
    hf_config = hf.read_hf_config(path)
    adapter = hf.adapter_for_config(hf_config)
    with torch.device("meta"):
        whole = adapter.build(hf_config)
    coef = _balancing_loss_weight(whole)
    if coef > 0:  # every stage hands on its routers' totals (stage_forward)
        whole.carries_router_totals = _experts_of(whole, path)
    if lora is not None:
        try:
            add_lora(whole, lora)
        except LoRAError as error:
            raise ConfigError(f"train.lora_*: {error}") from None
        options["plan"] = lora_plan(plan_for(whole))
    pipe = _pipeline(whole, device=device, **options)
    if coef > 0:
        tokens = pipe.meshes.token_ranks.get_group()  # every rank holding other tokens
        pipe.loss_fn.balance = (coef, pipe.microbatches, tokens)
    adapter.allocate(pipe.model, device)
    if load or lora is not None:
        hf.load_pretrained(pipe.model, path, adapter=adapter, whole=whole)
    if lora is not None:
        init_adapters(pipe.model, seed, whole=whole)  # a resume's checkpoint overwrites them
    return pipe


def _experts_of(whole, path: str) -> int:
    """How many experts a transformers MoE routes to (its config names it by family)."""
    names = ("num_local_experts", "num_experts", "n_routed_experts")
    found = [getattr(whole.config, name) for name in names if hasattr(whole.config, name)]
    if not found:
        raise ConfigError(
            f"{path}: config.json asks for a load-balancing loss (output_router_logits) but "
            f"names its experts by none of {', '.join(names)}; set output_router_logits to "
            "false to train it in pipeline stages"
        )
    return int(found[0])


def _balancing_loss_weight(whole) -> float:
    """The weight of the load-balancing loss an MoE model trains with (0: none): flatshard's
    MoE's aux_loss_coef; a transformers MoE's router_aux_loss_coef where its config sets
    output_router_logits."""
    if isinstance(whole, MoE):
        return whole.config.aux_loss_coef
    config = getattr(whole, "config", None)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _pipeline(whole, *, zero_stage: int, precision: str, device, dims: ParallelDims,
              schedule: str, microbatches: int, hpz_group: int = 0, offload=None,
              activations=None, plan=None) -> flatshard.Pipeline:  # fmt: skip
    """`flatshard.pipeline` over `dims.pp` of the meta-device `whole`, each stage
    parallelized as `build_sharded`'s model (by `plan`, default its family's); its loss is
    `StepLoss` (summed over each step's micro-batches)."""
    stage = stage_options(zero_stage, hpz_group, offload, activations)
    if plan is not None:
        stage["plan"] = plan
    try:
        return flatshard.pipeline(whole, dims.build(device.type), loss_fn=StepLoss(),
                                  microbatches=microbatches, schedule=schedule,
                                  scale_grads=False, mp_policy=mixed_precision(precision),
                                  **stage)  # fmt: skip
    except (MeshError, WrappingError, ValueError) as error:  # torch's: too few micro-batches
        raise ConfigError(f"train.pp={dims.pp}, train.pp_schedule={schedule}: {error}") from None
