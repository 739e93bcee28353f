"""The model a checkpoint or a Hugging Face directory describes: its saved config (a
LlamaConfig, or a transformers config dict), its vocabulary and longest sequence."""

from __future__ import annotations

from flatshard import hf
from flatshard.cli import runs
from flatshard.cli.errors import ConfigError, RunError, warn
from flatshard.models import LlamaConfig
from flatshard.models.registry import config_from_dict as family_config_from_dict


def is_transformers_config(config) -> bool:
    """Whether a saved model config is a transformers one (else a LlamaConfig)."""
    return isinstance(config, dict)


def vocab_size(config) -> int:
    return config["vocab_size"] if is_transformers_config(config) else config.vocab_size


def max_seq_len(config) -> int:
    if is_transformers_config(config):
        return config.get("max_position_embeddings") or 2048
    return config.max_seq_len


def check_hf_vocab(path: str, data_vocab_size: int) -> int:
    """The vocabulary of the Hugging Face model at `path` (config.json), which must hold
    every token of the data."""
    try:
        config = hf.read_hf_config(path)
    except hf.HFCheckpointError as error:
        raise ConfigError(f"model.hf: {error}") from None
    size = config.get("vocab_size")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"model.hf {path!r}: config.json has no positive int 'vocab_size'")
    if size < data_vocab_size:
        raise ConfigError(
            f"model.hf {path!r} has vocab_size {size}, too small for the data, whose tokens "
            f"need {data_vocab_size}; tokenise the data with the model's own tokenizer into a "
            "token file (data.format = uint16 or uint32) or pick another model"
        )
    return size


def config_from_dict(values: dict) -> LlamaConfig | dict:
    """A LlamaConfig (a MoEConfig if it has experts) from a checkpoint's saved
    `model_config`, or the transformers config dict (it has a model_type) of a model
    fine-tuned from Hugging Face."""
    if "model_type" in values:
        return values
    try:
        return family_config_from_dict(values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the checkpoint's model config is not usable: {error}") from None


def saved_model_config(checkpoint_arg: str, group=None) -> tuple[str, int, str, LlamaConfig]:
    """(root, step, step directory, model config) of the checkpoint a command was given,
    after verifying every file of it (shared among the ranks of `group`, if given)."""
    root, step = runs.resolve_checkpoint(checkpoint_arg, warn=warn)
    path, saved = runs.verified_step_dir(root, step, group)
    if not saved.get("model_config"):
        raise RunError(f"{path} has no model config: it was not saved from a flatshard Llama")
    return root, step, path, config_from_dict(saved["model_config"])
