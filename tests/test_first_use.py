"""Which children of a model root become first-use groups (units of their own)."""

from __future__ import annotations

import torch.nn as nn
from reference import build_model, config

from flatshard import registry
from flatshard.runtime.first_use import first_use_groups


class _StandInUnit:
    """What fully_shard(layer) leaves (the registry holds units weakly: the module owns it)."""


def _mark_blocks(model: nn.Module) -> nn.Module:
    for layer in model.layers:
        layer.stand_in_unit = _StandInUnit()
        registry.bind_unit(layer, layer.stand_in_unit)
    return model


def _names(groups) -> list[list[str]]:
    return [[name for name, _ in run] for run in groups]


def test_embedding_and_head_of_a_llama_root():
    model = _mark_blocks(build_model(config()))
    assert _names(first_use_groups(model)) == [["embed_tokens."], ["norm.", "lm_head."]]


def test_tied_embedding_and_head_stay_in_the_root():
    model = _mark_blocks(build_model(config(tie_embeddings=True)))
    assert _names(first_use_groups(model)) == [["norm."]]


def test_a_module_over_no_units_is_not_split():
    assert first_use_groups(build_model(config())) == []
    assert first_use_groups(build_model(config()).layers[0]) == []


def test_hugging_face_layout():
    class CausalLM(nn.Module):  # `model` holds embedding, blocks and norm; `lm_head` beside
        def __init__(self):
            super().__init__()
            self.model = _mark_blocks(build_model(config()))
            del self.model.lm_head
            self.lm_head = nn.Linear(4, 4, bias=False)

    assert _names(first_use_groups(CausalLM())) == [["lm_head."]]
