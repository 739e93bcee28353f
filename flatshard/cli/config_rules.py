"""The rules between a run config's keys (checked when a config is built, and with the
number of processes when a run starts) and the run's degrees of parallelism from them."""

from __future__ import annotations

from flatshard.api.pipeline import V_SHAPED
from flatshard.cli.errors import ConfigError
from flatshard.errors import MeshError
from flatshard.mesh import ParallelDims


def parallel_dims(config, world_size: int) -> ParallelDims:
    """The run's degrees over `world_size` processes (dp_shard: what the others leave)."""
    train = config.train
    try:
        return ParallelDims(
            world_size, dp_replicate=train.dp_replicate, tp=train.tp, ep=train.ep,
            sequence_parallel=train.sp, cp=train.cp, pp=train.pp,
        )  # fmt: skip
    except MeshError as error:  # it names the degree: say which key holds it, and the fix
        named = str(error).replace("sequence_parallel", "sp (sequence parallelism)", 1)
        raise ConfigError(f"train.{named}{_process_fix(train)}") from None


def _process_fix(train) -> str:
    """The smallest number of processes these degrees work on, as the flag that sets it."""
    for world in range(1, 1025):
        try:
            ParallelDims(
                world, dp_replicate=train.dp_replicate, tp=train.tp, ep=train.ep,
                sequence_parallel=train.sp, cp=train.cp, pp=train.pp,
            )  # fmt: skip
        except MeshError:
            continue
        return f"; run {world} processes or a multiple (--nproc {world})"
    return ""


def _batch_fixes(global_batch: int, micro_batch: int, dp: int) -> str:
    """Flags that make `global_batch` split over `dp` ranks in micro-batches."""
    fixes = []
    if global_batch % dp == 0:
        fixes.append(
            f"--micro-batch {max(d for d in range(1, micro_batch) if global_batch // dp % d == 0)}"
        )
    fixes.append(f"--global-batch {-(-global_batch // (micro_batch * dp)) * micro_batch * dp}")
    return "pass " + " or ".join(fixes) + ", or change the number of processes (--nproc)"


def check(config, world_size: int | None = None) -> None:
    """Rules between keys; with `world_size`, also the batch split over processes."""
    train = config.train
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr ({train.min_lr}) must not exceed train.lr ({train.lr})")
    if train.global_batch % train.micro_batch:
        raise ConfigError(
            f"train.global_batch ({train.global_batch}) must be a multiple of train.micro_batch "
            f"({train.micro_batch})"
        )
    if train.sp and config.data.seq_len % train.tp:
        raise ConfigError(
            f"train.sp splits each sequence over the {train.tp} TP ranks: data.seq_len "
            f"({config.data.seq_len}) must be a multiple of train.tp"
        )
    if train.cp > 1 and config.data.pack:
        raise ConfigError(
            "train.cp splits each sequence by plain positions; packed conversations "
            "(data.pack) restart them: use one of the two"
        )
    if train.cp > 1 and config.data.seq_len % (2 * train.cp):
        raise ConfigError(
            f"train.cp ({train.cp}) splits each sequence into {2 * train.cp} equal chunks: "
            f"data.seq_len ({config.data.seq_len}) must be a multiple of {2 * train.cp}"
        )
    _check_bias_balancing(config)
    if train.pp > 1 and config.data.eval and train.pp_schedule in V_SHAPED:
        raise ConfigError(
            f"data.eval runs the held-out batches through the schedule's forwards only, "
            f"which torch's V-shaped schedules cannot (train.pp_schedule="
            f"{train.pp_schedule}): pick 1f1b or interleaved-1f1b, or drop data.eval"
        )
    if world_size is not None:  # the run's whole config (a resume's merged with its own)
        _check_lora(config)
        _check_sync(config)
        dims = parallel_dims(config, world_size)
        config = with_microbatches(config, world_size)
        train = config.train
        if train.hpz_group and (
            train.zero_stage != 3
            or dims.dp_shard % train.hpz_group
            or train.dp_replicate > 1
            or train.tp > 1
            or train.ep > 1
            or train.cp > 1
        ):
            raise ConfigError(
                f"train.hpz_group ({train.hpz_group}) needs train.zero_stage=3, no HSDP "
                f"(train.dp_replicate=1), no TP or EP (train.tp=1, train.ep=1) and must divide "
                f"the processes "
                f"({dims.dp_shard})"
            )
        if train.global_batch % (train.micro_batch * dims.dp):
            per_step = train.micro_batch * dims.dp
            sharing = train.tp * train.cp
            shared = f"; the {sharing} TP/CP ranks of a group share a batch" if sharing > 1 else ""
            raise ConfigError(
                f"train.global_batch ({train.global_batch}) must be a multiple of "
                f"train.micro_batch x data-parallel ranks ({train.micro_batch} x {dims.dp} = "
                f"{per_step}{shared}; {world_size} processes asked for): "
                + _batch_fixes(train.global_batch, train.micro_batch, dims.dp)
            )
    model, seq_len = config.model, config.data.seq_len
    if model.max_seq_len and model.max_seq_len < seq_len:
        raise ConfigError(
            f"model.max_seq_len ({model.max_seq_len}) is shorter than data.seq_len ({seq_len})"
        )
    if config.run.stop_at_step > train.steps:
        raise ConfigError(
            f"run.stop_at_step ({config.run.stop_at_step}) is past train.steps ({train.steps})"
        )
    if "{" in config.run.out_dir.replace("{time}", ""):
        raise ConfigError(f"run.out_dir {config.run.out_dir!r}: only {{time}} may be substituted")


def with_microbatches(config, world_size: int):
    """train.microbatches M: train.micro_batch becomes what M leaves of each data-parallel
    rank's share of the global batch."""
    train = config.train
    if not train.microbatches:
        return config
    dp = parallel_dims(config, world_size).dp
    share = dp * train.microbatches
    if train.global_batch % share:
        raise ConfigError(
            f"train.microbatches ({train.microbatches}) must divide each data-parallel rank's "
            f"share of train.global_batch ({train.global_batch} / {dp} ranks): pass "
            f"--global-batch {dp * train.microbatches * max(1, train.global_batch // share)}"
        )
    return config.replace(train__micro_batch=train.global_batch // (dp * train.microbatches))


def _check_bias_balancing(config) -> None:
    model = config.model
    if not model.bias_update_speed:
        return
    if model.hf:  # whether its routers have a bias to move: known once it is built
        return
    if not (model.preset.startswith("moe") or model.n_experts > 0):
        raise ConfigError(
            "model.bias_update_speed balances a mixture-of-experts model's routers: pick one "
            "(--model moe-tiny, or set model.n_experts)"
        )


def _check_sync(config) -> None:
    address = config.sync.address
    if not address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"sync.address {address!r}: give it as host:port (--sync-to)")
    if config.train.qlora:
        raise ConfigError(
            "sync.address with QLoRA (train.qlora): its bases are NF4, and weight sync sends "
            "full-precision weights with the adapters merged; sync a LoRA run without "
            "train.qlora, or export (flatshard convert checkpoint-to-hf)"
        )
    if config.train.lora_rank and config.sync.names != "hf":
        raise ConfigError(
            "sync.address with LoRA (train.lora_rank) sends the weights with the adapters "
            f"merged, by their Hugging Face names: set sync.names=hf (not {config.sync.names!r})"
        )


def qlora_refused(degree: str, qlora: str) -> str:
    """Why QLoRA does not take `degree` (a key or flag), for train and plan alike."""
    return (
        f"{qlora} with {degree} > 1 is not supported: its NF4 bases are quantized from the "
        f"whole model read at once and split by whole rows and scale groups over the "
        f"data-parallel ranks only; set {degree} to 1 (LoRA without {qlora} takes it)"
    )


def _check_lora(config) -> None:
    train = config.train
    if train.lora_rank and not config.model.hf:
        raise ConfigError(
            "train.lora_rank needs a pretrained model to adapt: set model.hf (--hf DIR)"
        )
    if train.qlora and not train.lora_rank:
        raise ConfigError("train.qlora quantizes the bases LoRA adapts: set train.lora_rank "
                          "(--lora R) too")  # fmt: skip
    for degree in ("tp", "pp", "cp"):
        if train.qlora and getattr(train, degree) > 1:
            raise ConfigError(qlora_refused(f"train.{degree}", "train.qlora"))
