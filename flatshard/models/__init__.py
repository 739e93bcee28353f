"""Reference models for flatshard's tests and examples."""

from flatshard.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
