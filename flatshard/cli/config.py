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

from flatshard.cli.config_rules import check
from flatshard.cli.errors import ConfigError
from flatshard.cli.options import (
    BY_KEY,
    OPTIONS,
    PRESETS,
    SECTIONS,
    Option,
    fine_tune_defaults,
)

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
