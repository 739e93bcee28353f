"""The run configuration: where its values come from and the rules between them (every key,
its default and check: options.py).

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
from collections.abc import Iterable
from types import SimpleNamespace

from flatshard.cli.errors import ConfigError
from flatshard.cli.options import (
    BY_KEY,
    OPTIONS,
    PRESETS,
    SECTIONS,
    Option,
    fine_tune_defaults,
)
from flatshard.errors import MeshError
from flatshard.mesh import ParallelDims

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


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
    if values["model.hf"]:  # a fine-tune: its defaults where nothing set a value
        lora = bool(values["train.lora_rank"])
        tuned = fine_tune_defaults(values["train.steps"], given.get("train.lr"), lora)
        values.update({key: value for key, value in tuned.items() if key not in given})
    config = RunConfig(values)
    check(config)
    return config


# What a resumed run keeps from its own config: the model and the data (its order and the
# position in it), the LoRA adapters its checkpoints hold. Everything else (train.steps, the
# lr schedule, the batch split, ZeRO stage, precision, checkpoint.*, run.*) may change on
# --resume.
FIXED_ON_RESUME = ("model.", "data.", "train.seed", "train.lora_")


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
    try:
        return ParallelDims(
            world_size, dp_replicate=train.dp_replicate, tp=train.tp, ep=train.ep,
            sequence_parallel=train.sp, cp=train.cp,
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
                sequence_parallel=train.sp, cp=train.cp,
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
    if world_size is not None:  # the run's whole config (a resume's merged with its own)
        _check_lora(config)
        dims = parallel_dims(config, world_size)
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


def _check_lora(config: RunConfig) -> None:
    train = config.train
    if train.lora_rank and not config.model.hf:
        raise ConfigError(
            "train.lora_rank needs a pretrained model to adapt: set model.hf (--hf DIR)"
        )
    if train.qlora and not train.lora_rank:
        raise ConfigError("train.qlora quantizes the bases LoRA adapts: set train.lora_rank "
                          "(--lora R) too")  # fmt: skip
    if train.lora_rank and (train.tp > 1 or train.ep > 1 or train.cp > 1):
        raise ConfigError(
            "LoRA (train.lora_rank) runs data-parallel only for now: set train.tp=1, "
            "train.cp=1 and train.ep=1 (the adapters are small; ZeRO shards the frozen base "
            "already)"
        )


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
