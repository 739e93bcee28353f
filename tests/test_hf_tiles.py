"""Tiled stand-ins against real tensors, and the transformers builder's refusals.

A Tiled run through torch's block operations must say exactly where every element of the
result comes from: `Tile.take` of the origin's block equals the same operations run on real
data, `Tile.clip` keeps only the part inside a box, and `Tile.inverse` maps back."""

from __future__ import annotations

import os

import pytest
import torch

from flatshard import hf
from flatshard.hf.tiles import Tiled
from flatshard.layout import Box

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def assemble(tiled: Tiled, sources: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor `tiled` describes, built from real `sources` tile by tile."""
    out = torch.full(tuple(tiled.shape), float("nan"))
    for tile in tiled.tiles:
        block = tile.take(sources[tile.origin][tile.box.slices])
        out[tuple(slice(o, o + n) for o, n in zip(tile.offset, tile.shape))] = block
    return out


def test_stack_cat_chunk_squeeze_transpose_match_torch():
    """transformers' MoE conversion both ways: per-expert [gate], [up] -> (E, 2I, H) and back."""
    torch.manual_seed(0)
    experts, inter, hidden = 3, 5, 4
    real = {f"{part}{e}": torch.randn(inter, hidden) for part in "gu" for e in range(experts)}
    stand = {name: Tiled.leaf(name, t.shape) for name, t in real.items()}
    gates, ups = ([f"{p}{e}" for e in range(experts)] for p in "gu")
    fused = torch.cat(
        [torch.stack([stand[n] for n in gates]), torch.stack([stand[n] for n in ups])], dim=1
    )
    expected = torch.cat(
        [torch.stack([real[n] for n in gates]), torch.stack([real[n] for n in ups])], dim=1
    )
    assert fused.shape == expected.shape
    assert torch.equal(assemble(fused, real), expected)
    # and back: chunk into gate/up, split into experts, squeeze (SplitModulelist)
    param = {"fused": expected}
    gate, up = torch.chunk(Tiled.leaf("fused", expected.shape), 2, dim=1)
    for e, piece in enumerate(torch.chunk(gate.contiguous(), experts, dim=0)):
        assert torch.equal(assemble(piece.squeeze(), param), real[f"g{e}"])
    flipped = torch.transpose(up, 1, 2)
    assert torch.equal(assemble(flipped, param), expected[:, inter:].transpose(1, 2))
    # torch.chunk's uneven split: ceil-sized chunks, the last shorter
    parts = torch.chunk(Tiled.leaf("fused", expected.shape), 4, dim=1)
    assert [p.shape[1] for p in parts] == [c.shape[1] for c in torch.chunk(expected, 4, dim=1)]


def test_clip_reads_only_the_box_and_inverse_maps_back():
    torch.manual_seed(1)
    real = {f"e{e}": torch.randn(6, 4) for e in range(5)}
    fused = torch.stack([Tiled.leaf(f"e{e}", (6, 4)) for e in range(5)])  # (5, 6, 4)
    full = assemble(fused, real)
    rows = Box((1, 0, 0), (3, 6, 4))  # a rank holding experts 1..3
    held = [t.clip(rows) for t in fused.tiles]
    assert [t is not None for t in held] == [False, True, True, True, False]
    for tile in filter(None, held):
        block = tile.take(real[tile.origin][tile.box.slices])
        assert torch.equal(
            block, full[tuple(slice(o, o + n) for o, n in zip(tile.offset, tile.shape))]
        )
    cut = fused.tiles[2].clip(Box((0, 2, 1), (5, 3, 2)))  # a box inside one expert
    assert cut.box == Box((2, 1), (3, 2)) and cut.offset == (2, 2, 1)
    back = fused.tiles[2].inverse("fused")  # expert 2 as a block of the fused tensor
    assert torch.equal(back.take(full[back.box.slices]), real["e2"])


def test_an_operation_that_is_not_a_block_rearrangement_is_refused():
    with pytest.raises(hf.HFCheckpointError, match="reshape"):
        torch.reshape(Tiled.leaf("w", (4, 6)), (6, 4))


def _config(**changes) -> dict:
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=1)
    return {**config.to_dict(), "architectures": ["LlamaForCausalLM"], **changes}


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"model_type": "no_such_model"}, "model_type"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
        ({"auto_map": {"AutoModelForCausalLM": "x.Model"}}, "auto_map"),
    ],
)
def test_unbuildable_configs_name_the_field(changes, field):
    with pytest.raises(hf.HFConfigError, match=field):
        hf.build_causal_lm(_config(**changes))


def test_a_model_that_is_not_a_causal_lm_is_refused():
    t5 = {**transformers.T5Config(d_model=32, num_layers=1).to_dict(), "architectures": ["T5Model"]}
    with pytest.raises(hf.HFConfigError, match="not a causal language model"):
        hf.build_causal_lm(t5)


def test_a_checkpoint_of_another_head_names_its_architecture():
    classifier = _config(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(hf.HFConfigError, match=r"'LlamaForSequenceClassification'\], not a "
                       r"causal language model.*model_type 'llama': LlamaForCausalLM"):  # fmt: skip
        hf.build_causal_lm(classifier)


def test_decoder_layers_must_be_named():
    with torch.device("meta"):
        model = hf.build_causal_lm(_config())
    model._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(hf.HFConfigError, match="_no_split_modules"):
        hf.shard_decoder_layers(model)


def test_a_conversion_flatshard_cannot_slice_names_the_model():
    """A conversion that interleaves rows (not a block rearrangement) is refused by name."""
    from transformers.core_model_loading import Interleave, WeightConverter

    with torch.device("meta"):
        model = hf.build_causal_lm(_config())
    model._weight_conversions = [
        WeightConverter("mlp.gate_proj.weight", "mlp.gate_proj.weight", [Interleave(dim=0)])
    ]
    with pytest.raises(hf.HFCheckpointError, match="LlamaForCausalLM.*'llama'.*rearrange"):
        hf.TRANSFORMERS.plan(model)
