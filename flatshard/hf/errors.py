"""Errors of the Hugging Face import/export, part of flatshard's user-error family."""

from flatshard.errors import CheckpointError


class HFCheckpointError(CheckpointError):
    """A Hugging Face checkpoint directory does not match the model, or cannot be written."""


class HFConfigError(HFCheckpointError):
    """A Hugging Face `config.json` describes a model flatshard cannot reproduce exactly."""
