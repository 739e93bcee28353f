"""`flatshard convert` both ways on a tiny Hugging Face model built offline by transformers:
HF -> flatshard checkpoint -> HF gives back every tensor exactly, and transformers loads it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from flatshard.cli.main import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def test_hf_round_trip(tmp_path, capsys):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=45, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        expected = model(tokens).logits

    assert main(["convert", "hf-to-checkpoint", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # after the "wrote" line
    assert info["step"] == 0 and info["world_size"] == 1 and not info["optimizer_tensors"]
    assert info["model_tensors"]["layers.0.mlp.gate_up_proj.weight"]["shape"] == [90, 32]

    assert main(["sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "5,6",
                 "--tokens", "3", "--temperature", "0"]) == 0  # fmt: skip
    greedy = [int(i) for i in capsys.readouterr().out.split()]
    with torch.no_grad():
        assert greedy[2] == int(model(torch.tensor([[5, 6]])).logits[0, -1].argmax())

    assert main(["convert", "checkpoint-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)

    assert main(["convert", "checkpoint-to-hf", str(tmp_path / "nowhere"), "x"]) == 2
    assert "checkpoint" in capsys.readouterr().err


def test_moe_checkpoint_export_is_refused(tmp_path, capsys):
    """An MoE checkpoint has no Hugging Face adapter yet: a one-line error, no partial export."""
    from flatshard import checkpoint
    from flatshard.models import MoE, MoEConfig

    checkpoint.save(tmp_path / "ckpt", model=MoE(MoEConfig.tiny()), step=1).wait()
    assert main(["convert", "checkpoint-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 2
    assert "holds an MoE model" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_tied_round_trip_in_one_process(tmp_path, capsys):
    """A tied model (SmolLM-style) exported in one process keeps its tie: no lm_head.weight
    in the export, which is bitwise the original and imports again; sampling reads it."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=45, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "hf")
    hf, ckpt, out = (str(tmp_path / name) for name in ("hf", "ckpt", "out"))
    assert main(["convert", "hf-to-checkpoint", hf, ckpt]) == 0
    assert main(["convert", "checkpoint-to-hf", ckpt, out]) == 0
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in exported and original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert main(["convert", "hf-to-checkpoint", out, str(tmp_path / "again")]) == 0
    capsys.readouterr()
    assert main(["sample", "--checkpoint", ckpt, "--prompt-ids", "5,6",
                 "--tokens", "2", "--temperature", "0"]) == 0  # fmt: skip
    greedy = [int(i) for i in capsys.readouterr().out.split()]
    with torch.no_grad():
        assert greedy[2] == int(model(torch.tensor([[5, 6]])).logits[0, -1].argmax())


def _generation(path) -> dict:
    config = transformers.GenerationConfig.from_pretrained(path)
    return {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


@pytest.mark.parametrize("with_generation_config", [True, False])
def test_export_keeps_token_ids_and_generation_config(tmp_path, capsys, with_generation_config):
    """A Llama 3 style model (bos 10, eos [11, 12], pad 0) converted to a checkpoint and back
    keeps its token ids in config.json and the generation config transformers reads
    (written from the source's generation_config.json, or derived from the ids as
    transformers does); an export over a previous one needs --overwrite."""
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=45, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=10, eos_token_id=[11, 12], pad_token_id=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.generation_config.temperature = 0.6  # a generation setting beyond the token ids
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path / "hf")
    if not with_generation_config:
        (tmp_path / "hf" / "generation_config.json").unlink()
    hf, ckpt, out = (str(tmp_path / name) for name in ("hf", "ckpt", "out"))
    assert main(["convert", "hf-to-checkpoint", hf, ckpt]) == 0
    assert main(["convert", "checkpoint-to-hf", ckpt, out]) == 0
    exported = transformers.AutoConfig.from_pretrained(out)
    assert (exported.bos_token_id, exported.eos_token_id, exported.pad_token_id) == (
        10, [11, 12], 0,
    )  # fmt: skip
    expected = {"bos_token_id": 10, "eos_token_id": [11, 12], "pad_token_id": 0}
    assert _generation(out) == expected
    temperature = transformers.GenerationConfig.from_pretrained(out).temperature
    assert (temperature == 0.6) == with_generation_config  # the source file, whole
    capsys.readouterr()
    assert main(["convert", "checkpoint-to-hf", ckpt, out]) == 2
    error = capsys.readouterr().err
    assert "not empty" in error and "--overwrite" in error and len(error.splitlines()) == 1
    (tmp_path / "out" / "model-00001-of-00002.safetensors").write_bytes(b"old")  # an earlier
    assert main(["convert", "checkpoint-to-hf", ckpt, out, "--overwrite"]) == 0
    assert not (tmp_path / "out" / "model-00001-of-00002.safetensors").exists()
    assert _generation(out) == expected
