"""The run configuration: every key, its default, how it is checked, and where it comes from.

Sources, each overriding the one before: the defaults, the model preset (`model.preset`
fills the model sizes you did not set), a config file (TOML, YAML or JSON, one table per
section), then the command line (`--set section.key=value` and the named flags). An unknown
key or a bad value is a `ConfigError` whose one-line message names the key.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace

from flatshard.cli.errors import ConfigError
from flatshard.mesh import ParallelDims

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Option:
    key: str  # "section.name"
    default: object
    help: str
    choices: tuple = ()
    check: Callable[[object], str | None] | None = None  # returns what is wrong, or None

    @property
    def kind(self) -> type:
        return type(self.default)


def _positive(value) -> str | None:
    return None if value > 0 else "must be > 0"


def _non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _fraction(value) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


OPTIONS: tuple[Option, ...] = (
    # model: the reference Llama (flatshard.models.Llama)
    Option("model.preset", "small", "model size preset; fills the sizes not set",
           choices=("tiny", "small", "medium", "moe-tiny")),
    Option("model.vocab_size", 0, "0: the tokenizer's (257 for bytes) or max token id + 1",
           check=_non_negative),
    Option("model.dim", 384, "hidden size", check=_positive),
    Option("model.n_layers", 6, "transformer blocks", check=_positive),
    Option("model.n_heads", 6, "attention heads", check=_positive),
    Option("model.n_kv_heads", 0, "key/value heads (0: n_heads)", check=_non_negative),
    Option("model.ffn_dim", 1024, "SwiGLU hidden size", check=_positive),
    Option("model.max_seq_len", 0, "longest sequence (0: data.seq_len)", check=_non_negative),
    Option("model.rope_theta", 10000.0, "RoPE base", check=_positive),
    Option("model.norm_eps", 1e-5, "RMSNorm epsilon", check=_positive),
    Option("model.tie_embeddings", False, "share the embedding with the output layer"),
    # mixture of experts (flatshard.models.MoE) when n_experts > 0
    Option("model.n_experts", 0, "routed experts per MoE layer (0: dense, the Llama)",
           check=_non_negative),
    Option("model.top_k", 2, "MoE: experts each token is routed to", check=_positive),
    Option("model.expert_ffn_dim", 0, "MoE: each expert's SwiGLU hidden size (0: ffn_dim)",
           check=_non_negative),
    Option("model.norm_topk_prob", True, "MoE: renormalise the top-k routing weights to one"),
    Option("model.aux_loss_coef", 0.001, "MoE: weight of the load-balancing loss in the loss",
           check=_non_negative),
    Option("model.hf", "", "Hugging Face model directory to fine-tune instead (config.json + "
           "safetensors; the other model.* keys are then unused)"),
    # data
    Option("data.path", "", "text file or directory, JSONL, or token memmap ('': bundled corpus)"),
    Option("data.format", "auto", "how to read data.path",
           choices=("auto", "text", "jsonl", "uint16", "uint32")),
    Option("data.text_field", "text", "JSONL field holding each document's text"),
    Option("data.glob", "**/*.txt", "files to read when data.path is a directory"),
    Option("data.seq_len", 256, "tokens per training sequence", check=_positive),
    # train
    Option("train.steps", 150, "optimizer steps (the schedule's length)", check=_positive),
    Option("train.micro_batch", 4, "sequences per process per forward pass", check=_positive),
    Option("train.global_batch", 8, "sequences per optimizer step, all processes",
           check=_positive),
    Option("train.lr", 3e-3, "peak learning rate (AdamW)", check=_positive),
    Option("train.min_lr", 3e-4, "learning rate at the end of the cosine decay",
           check=_non_negative),
    Option("train.warmup_steps", 15, "linear warmup steps", check=_non_negative),
    Option("train.weight_decay", 0.1, "AdamW weight decay (matrices only)", check=_non_negative),
    Option("train.beta1", 0.9, "AdamW beta1", check=_fraction),
    Option("train.beta2", 0.95, "AdamW beta2", check=_fraction),
    Option("train.grad_clip", 1.0, "clip the global gradient norm (0: off)", check=_non_negative),
    Option("train.zero_stage", 3, "ZeRO stage", choices=(1, 2, 3)),
    Option("train.hpz_group", 0, "ZeRO-3: after forward, stay sharded over groups of this "
           "many ranks so backward gathers inside them (hpZ; 0: all ranks)",
           check=_non_negative),
    Option("train.dp_replicate", 1, "HSDP: replicas of the sharded model (processes are "
           "dp_replicate x dp_shard x tp)", check=_positive),
    Option("train.tp", 1, "tensor parallelism: ranks each block's heads and hidden units "
           "are split over (innermost; processes are dp_replicate x dp_shard x tp)",
           check=_positive),
    Option("train.ep", 1, "expert parallelism: ranks each MoE layer's experts are split "
           "over (borrowed from the data-parallel ranks; experts sharded over the rest)",
           check=_positive),
    Option("train.precision", "fp32", "compute dtype; weights and optimizer stay fp32",
           choices=("fp32", "bf16")),
    Option("train.seed", 0, "seed of the initial weights and the data order",
           check=_non_negative),
    # checkpoint
    Option("checkpoint.interval", 50, "save every N steps (0: only at the end)",
           check=_non_negative),
    Option("checkpoint.keep_last", 3, "checkpoints kept (0: all)", check=_non_negative),
    Option("checkpoint.async_save", False, "write periodic checkpoints in the background"),
    Option("checkpoint.at_end", True, "save when training ends"),
    # run
    Option("run.out_dir", "runs/{time}", "run directory ({time}: the start time)"),
    Option("run.nproc", 2, "local processes when not launched by torchrun", check=_positive),
    Option("run.device", "auto", "where to compute", choices=("auto", "cpu", "cuda")),
    Option("run.threads", 0, "CPU threads per process (0: cores / processes)",
           check=_non_negative),
    Option("run.log_interval", 10, "steps between log lines", check=_positive),
    Option("run.stop_at_step", 0, "stop with a checkpoint after this step (0: never)",
           check=_non_negative),
    Option("run.sample_tokens", 120, "tokens generated at the end (0: none)",
           check=_non_negative),
    Option("run.sample_prompt", "The ", "prompt of the sample at the end"),
    Option("run.tensorboard", True, "write TensorBoard events when it is installed"),
)  # fmt: skip

BY_KEY = {option.key: option for option in OPTIONS}
SECTIONS = tuple(dict.fromkeys(key.split(".")[0] for key in BY_KEY))

PRESETS = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172),  # ~0.1M params
    "small": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=0, ffn_dim=1024),  # ~10.8M
    "medium": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=0, ffn_dim=1376),  # ~25.6M
    # MoE layers (4 experts of ffn 64, top-2) in place of tiny's MLPs: ~0.16M parameters
    "moe-tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, n_experts=4),
}


class RunConfig:
    """Validated values, by dotted key (`config["train.lr"]`) or by section (`config.train.lr`)."""

    def __init__(self, values: dict[str, object]):
        self._values = dict(values)
        for section in SECTIONS:
            prefix = section + "."
            fields = {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}
            setattr(self, section, SimpleNamespace(**fields))

    def __getitem__(self, key: str):
        return self._values[key]

    def flat(self) -> dict[str, object]:
        return dict(self._values)

    def nested(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict] = {section: {} for section in SECTIONS}
        for key, value in self._values.items():
            section, name = key.split(".", 1)
            out[section][name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.nested(), indent=1)

    def to_toml(self) -> str:
        blocks = []
        for section, values in self.nested().items():
            lines = [f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks) + "\n"

    def replace(self, **values) -> RunConfig:
        """A copy with some dotted keys (written with '__' for '.') set, unchecked."""
        updated = dict(self._values)
        updated.update({key.replace("__", "."): value for key, value in values.items()})
        return RunConfig(updated)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string uses the same escapes


# --- sources ------------------------------------------------------------------------------


def read_file(path: str) -> dict[str, object]:
    """A config file as {dotted key: value}; keys are checked later, with the file named."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".toml":
            with open(path, "rb") as handle:
                raw = tomllib.load(handle)
        elif suffix in (".yaml", ".yml"):
            raw = _read_yaml(path)
        elif suffix == ".json":
            with open(path) as handle:
                raw = json.load(handle)
        else:
            raise ConfigError(f"config file {path!r}: use .toml, .yaml/.yml or .json")
    except (tomllib.TOMLDecodeError, ValueError) as error:
        raise ConfigError(f"config file {path!r} cannot be parsed: {error}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(f"config file {path!r} must hold tables of keys, not a {kind}")
    flat = {}
    for section, values in raw.items():
        if not isinstance(values, dict):
            hint = f"; put it under a [section], e.g. {_suggest(str(section))}"
            raise ConfigError(f"config file {path!r}: {section!r} is not a section{hint}")
        for name, value in values.items():
            flat[f"{section}.{name}"] = value
    return flat


def _read_yaml(path: str):
    try:
        import yaml
    except ImportError:
        message = f"config file {path!r}: reading YAML needs PyYAML (pip install pyyaml)"
        raise ConfigError(message) from None
    try:
        with open(path) as handle:
            return yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise ValueError(str(error).replace("\n", " ")) from None


def parse_override(text: str) -> tuple[str, str]:
    """'section.key=value' -> (key, raw value)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: write it as section.key=value, e.g. model.dim=256")
    return key.strip(), value


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, BY_KEY, n=1, cutoff=0.6)
    if not close and "." in key:
        name = key.split(".", 1)[1]
        close = [k for k in BY_KEY if k.split(".", 1)[1] == name][:1]
    return f"did you mean {close[0]!r}?" if close else "see `flatshard train --help-config`"


def _option(key: str, origin: str) -> Option:
    if key not in BY_KEY:
        where = f" on the {origin}" if origin == "command line" else f" in {origin}"
        raise ConfigError(f"unknown config key {key!r}{where}; {_suggest(key)}")
    return BY_KEY[key]


def _from_text(option: Option, text: str):
    kind, raw = option.kind, text.strip()
    if kind is bool:
        lowered = raw.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise ConfigError(f"bad value for {option.key}: {text!r} is not true or false")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"bad value for {option.key}: {text!r} is not an integer") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"bad value for {option.key}: {text!r} is not a number") from None
    return text


def _typed(option: Option, value, origin: str):
    """Check a value from a file (already typed) or convert one from the command line."""
    if origin == "command line" and isinstance(value, str):
        value = _from_text(option, value)
    kind = option.kind
    where = f" (from {origin})" if origin != "command line" else ""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise ConfigError(f"bad value for {option.key}: {value!r} is not {want}{where}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"bad value for {option.key}: {value!r} is not finite{where}")
    if option.choices and value not in option.choices:
        choices = ", ".join(map(str, option.choices))
        raise ConfigError(f"bad value for {option.key}: {value!r}; choose one of {choices}{where}")
    problem = option.check(value) if option.check else None
    if problem:
        raise ConfigError(f"bad value for {option.key}: {value!r} {problem}{where}")
    return value


def _given(sources: list[tuple[dict, str]]) -> dict[str, object]:
    given: dict[str, object] = {}
    for values, origin in sources:
        for key, value in values.items():
            given[key] = _typed(_option(key, origin), value, origin)
    return given


def _user_sources(files: Iterable[str], overrides: Iterable[str]) -> list[tuple[dict, str]]:
    sources = [(read_file(path), path) for path in files]
    sources.append((dict(parse_override(text) for text in overrides), "command line"))
    return sources


def build(
    files: Iterable[str] = (),
    overrides: Iterable[str] = (),
    base: dict[str, object] | None = None,
) -> RunConfig:
    """Defaults < preset < `base` (e.g. a resumed run's config) < files < overrides."""
    sources = [(base or {}, "the resumed run's config"), *_user_sources(files, overrides)]
    given = _given(sources)
    values = {option.key: option.default for option in OPTIONS}
    preset = given.get("model.preset", values["model.preset"])
    for name, value in PRESETS[preset].items():
        values[f"model.{name}"] = value
    values.update(given)
    config = RunConfig(values)
    check(config)
    return config


# What a resumed run keeps from its own config: the model and the data (its order and the
# position in it). Everything else (train.steps, the lr schedule, the batch split, ZeRO
# stage, precision, checkpoint.*, run.*) may change on --resume.
FIXED_ON_RESUME = ("model.", "data.", "train.seed")


def resume_conflicts(
    saved: dict[str, object], files: Iterable[str], overrides: Iterable[str]
) -> list[str]:
    """The keys the config files and overrides set to other values than the resumed run's
    `saved` config holds, among those fixed for a run, as "key: run X, given Y". A preset
    other than the run's counts with the sizes it implies (those not set explicitly)."""
    run = _given([(saved, "the resumed run's config")])
    given = _given(_user_sources(files, overrides))

    def run_value(key):
        return run.get(key, BY_KEY[key].default)

    preset = given.get("model.preset")
    if preset is not None and preset != run_value("model.preset"):
        for name, value in PRESETS[preset].items():
            given.setdefault(f"model.{name}", value)
    conflicts = []
    for option in OPTIONS:  # in the documented order
        key = option.key
        if key not in given or not key.startswith(FIXED_ON_RESUME):
            continue
        a, b = run_value(key), given[key]
        if key in ("data.path", "model.hf"):
            a, b = os.path.normpath(a) if a else a, os.path.normpath(b) if b else b
        if a != b:
            conflicts.append(f"{key}: run {toml_value(run_value(key))}, given {toml_value(b)}")
    return conflicts


def parallel_dims(config: RunConfig, world_size: int) -> ParallelDims:
    """The run's degrees over `world_size` processes (dp_shard: what the others leave)."""
    train = config.train
    return ParallelDims(world_size, dp_replicate=train.dp_replicate, tp=train.tp, ep=train.ep)


def check(config: RunConfig, world_size: int | None = None) -> None:
    """Rules between keys; with `world_size`, also the batch split over processes."""
    train = config.train
    if train.min_lr > train.lr:
        raise ConfigError(f"train.min_lr ({train.min_lr}) must not exceed train.lr ({train.lr})")
    if train.global_batch % train.micro_batch:
        raise ConfigError(
            f"train.global_batch ({train.global_batch}) must be a multiple of train.micro_batch "
            f"({train.micro_batch})"
        )
    if world_size is not None:
        dims = parallel_dims(config, world_size)  # MeshError: what
        if train.hpz_group and (
            train.zero_stage != 3
            or dims.dp_shard % train.hpz_group
            or train.dp_replicate > 1
            or train.tp > 1
            or train.ep > 1
        ):
            raise ConfigError(
                f"train.hpz_group ({train.hpz_group}) needs train.zero_stage=3, no HSDP "
                f"(train.dp_replicate=1), no TP or EP (train.tp=1, train.ep=1) and must divide "
                f"the processes "
                f"({dims.dp_shard})"
            )
        if train.tp > 1 and train.ep > 1 and dims.dp % train.ep:
            raise ConfigError(
                f"train.ep ({train.ep}) must divide the data-parallel ranks ({dims.dp}): "
                "with TP, an EP group is made of ranks that hold different tokens"
            )
        if train.global_batch % (train.micro_batch * dims.dp):
            per_step = train.micro_batch * dims.dp
            shared = f"; the {train.tp} TP ranks of a group share a batch" if train.tp > 1 else ""
            raise ConfigError(
                f"train.global_batch ({train.global_batch}) must be a multiple of "
                f"train.micro_batch x data-parallel ranks ({train.micro_batch} x {dims.dp} = "
                f"{per_step}{shared})"
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


def describe_options() -> str:
    """Every key with its default and meaning, for `--help-config`."""
    lines, section = [], None
    for option in OPTIONS:
        head = option.key.split(".")[0]
        if head != section:
            section = head
            lines.append(f"[{section}]")
        choices = f" ({'|'.join(map(str, option.choices))})" if option.choices else ""
        default = toml_value(option.default)
        lines.append(f"  {option.key} = {default}{choices}\n      {option.help}")
    return "\n".join(lines)
