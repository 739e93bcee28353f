"""Hugging Face import/export against transformers itself (offline, tiny random models).

Every checkpoint is written by transformers' own `save_pretrained` from a model built from
a config object, with every weight (norms and biases included) drawn at random, so a
swapped, transposed or missed tensor changes the logits. Imports run on 1, 2 and 3 gloo
ranks into `fully_shard`-ed models; exports are loaded back by transformers.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch
from distributed import run_distributed
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import flatshard
from flatshard import hf
from flatshard.hf.checkpoint import INDEX_FILE, SINGLE_FILE
from flatshard.layout import describe_param
from flatshard.models import Llama
from flatshard.models.llama import LLAMA_RULES, config_to_hf, hf_to_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
SIZES = dict(
    vocab_size=61,  # prime: embedding rows never split evenly
    hidden_size=32,
    intermediate_size=45,  # gate_up has 90 rows; the gate/up cut at 45 falls inside shards
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=8.0, original_max_position_embeddings=256,
)  # fmt: skip
ARCHS = {
    "llama": lambda: transformers.LlamaConfig(**SIZES, rope_theta=5000.0, rms_norm_eps=1e-5),
    "llama_tied": lambda: transformers.LlamaConfig(**SIZES, tie_word_embeddings=True),
    # Llama 3.1 RoPE scaling; with head_dim 8 its 4 frequencies meet all three cases: kept
    # (wavelength < 256/8), smoothed, and divided by factor (> 256/1)
    "llama31": lambda: transformers.LlamaConfig(**SIZES, rope_parameters=LLAMA3_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES, rope_theta=20000.0),
    # head_dim 16 != hidden / heads: q_proj is wider than the model
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=16),
}


# --------------------------------------------------------------------------------------------
# Reference checkpoints (built once, in the parent process)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (directory, tokens, transformers' fp32 logits)."""
    out = {}
    for seed, (arch, make_config) in enumerate(ARCHS.items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(make_config()).float().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.3 * torch.randn_like(param))  # not the trivial ones
                else:
                    param.normal_(0.0, 0.2)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        tokens = torch.randint(0, SIZES["vocab_size"], (2, 11))
        out[arch] = (str(path), tokens, hf_logits(path, tokens))
    return out


def hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


def read_all(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or index + shards)."""
    files = [SINGLE_FILE]
    if not os.path.exists(os.path.join(path, SINGLE_FILE)):
        with open(os.path.join(path, INDEX_FILE)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors.update(load_file(os.path.join(path, file)))
    return tensors


def assert_bit_exact(ours_path, reference_path):
    ours, reference = read_all(ours_path), read_all(reference_path)
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name


# --------------------------------------------------------------------------------------------
# Worker-side functions (module level: run_distributed sends them by reference)
# --------------------------------------------------------------------------------------------


def _shard(model, zero_stage=3, root=True):
    for layer in model.layers:
        flatshard.fully_shard(layer, zero_stage=zero_stage)
    if root:  # else embeddings, final norm and lm_head stay unsharded (replicated)
        flatshard.fully_shard(model, zero_stage=zero_stage)


def _forward(model, tokens):
    with torch.no_grad():
        return model(tokens).detach().clone()


def _gate_up_ranges(model):
    return [flatshard.row_range(layer.mlp.gate_up_proj.weight) for layer in model.layers]


def _import(path, tokens, zero_stage=3, root=True):
    """from_pretrained into a fully_shard-ed model built on the meta device."""
    shard = functools.partial(_shard, zero_stage=zero_stage, root=root)
    model = hf.from_pretrained(path, shard=shard)
    stats = hf.load_pretrained(model, path)  # again, to measure what one load reads
    return _forward(model, tokens), stats.bytes_read, _gate_up_ranges(model)


def _import_into_trained_zero1(path, tokens):
    """load_pretrained into an eagerly built ZeRO-1 model that already ran forward (so it
    keeps unsharded copies of the old weights): the load must reach the forward."""
    model = Llama(hf_to_config(hf.read_hf_config(path)))
    _shard(model, zero_stage=1)
    _forward(model, tokens)
    hf.load_pretrained(model, path)
    return _forward(model, tokens)


def _import_export(path, out, tokens, max_shard_size="5GB"):
    model = hf.from_pretrained(path, shard=_shard)
    hf.save_pretrained(model, out, max_shard_size=max_shard_size)
    return _forward(model, tokens)


def _save_error(path):
    model = hf.from_pretrained(path, shard=_shard)
    try:
        hf.save_pretrained(model, os.path.join(path, "config.json"))  # a file, not a directory
    except hf.HFCheckpointError as e:
        return str(e)
    return None


def _load_error(path):
    """The error message of loading `path` (built for the llama fixture's config)."""
    cfg = hf_to_config(hf.read_hf_config(path))
    with torch.device("meta"):
        model = Llama(cfg)
    _shard(model)
    flatshard.materialize(model)
    try:
        hf.load_pretrained(model, path)
    except hf.HFCheckpointError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_matches_transformers(checkpoints, arch, world_size):
    path, tokens, reference = checkpoints[arch]
    results = run_distributed(_import, world_size, path, tokens)
    total = sum(t.numel() * t.element_size() for t in read_all(path).values())
    for logits, _, _ in results:
        assert rel(logits, reference) <= TOLERANCE
    # every checkpoint byte read exactly once, by the rank that holds it
    assert sum(read for _, read, _ in results) == total


def _imported_full_weights(path):
    model = hf.from_pretrained(path, shard=_shard)
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def _expected_from_transformers(hf_state: dict, n_layers: int, tied: bool) -> dict:
    """flatshard's parameters written out by hand from transformers' own state dict (not
    through the import's name rules): a mapping error the import and export made alike
    still shows here."""
    expected = {"embed_tokens.weight": hf_state["model.embed_tokens.weight"]}
    for n in range(n_layers):
        ours, theirs = f"layers.{n}.", f"model.layers.{n}."
        expected[ours + "attn_norm.weight"] = hf_state[theirs + "input_layernorm.weight"]
        expected[ours + "mlp_norm.weight"] = hf_state[theirs + "post_attention_layernorm.weight"]
        for key, value in hf_state.items():
            if key.startswith(theirs + "self_attn."):
                expected[ours + "attn." + key.removeprefix(theirs + "self_attn.")] = value
        gate, up = (hf_state[f"{theirs}mlp.{part}_proj.weight"] for part in ("gate", "up"))
        expected[ours + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])  # gate first
        expected[ours + "mlp.down_proj.weight"] = hf_state[theirs + "mlp.down_proj.weight"]
    expected["norm.weight"] = hf_state["model.norm.weight"]
    if not tied:
        expected["lm_head.weight"] = hf_state["lm_head.weight"]
    return expected


@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_equals_transformers_state_dict_tensor_by_tensor(checkpoints, arch):
    path = checkpoints[arch][0]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tied = theirs.config.tie_word_embeddings
    expected = _expected_from_transformers(theirs.state_dict(), SIZES["num_hidden_layers"], tied)
    ours = run_distributed(_imported_full_weights, 2, path)[0]
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name


def test_gate_up_split_across_ranks(checkpoints):
    """At world 3 the fused [gate; up] rows are cut inside the parameter: some rank's range
    spans the gate/up boundary and some rank holds part of one component only."""
    path, tokens, reference = checkpoints["llama"]
    results = run_distributed(_import, 3, path, tokens)
    boundary, rows = SIZES["intermediate_size"], 2 * SIZES["intermediate_size"]
    ranges = [r for _, _, layer_ranges in results for r in layer_ranges]
    assert any(start < boundary < end for start, end in ranges), ranges
    assert any(0 < end - start < rows and end <= boundary for start, end in ranges) or any(
        start >= boundary and end - start < boundary for start, end in ranges
    ), ranges
    for logits, _, _ in results:
        assert rel(logits, reference) <= TOLERANCE


@pytest.mark.parametrize("world_size", [1, 2])
def test_import_into_zero1_model_after_forward(checkpoints, world_size):
    path, tokens, reference = checkpoints["qwen3"]
    for logits in run_distributed(_import_into_trained_zero1, world_size, path, tokens):
        assert rel(logits, reference) <= TOLERANCE


def test_import_with_unsharded_root_params(checkpoints):
    """Only the blocks sharded: embeddings, norm and lm_head stay plain on every rank."""
    path, tokens, reference = checkpoints["llama_tied"]
    results = run_distributed(_import, 2, path, tokens, root=False)
    for logits, _, _ in results:
        assert rel(logits, reference) <= TOLERANCE
    # the replicated tensors are read by both ranks, the sharded ones once
    tensors = read_all(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    replicated = sum(
        t.numel() * t.element_size() for k, t in tensors.items() if not k.startswith("model.layers")
    )
    assert sum(read for _, read, _ in results) == total + replicated


def test_import_unsharded_plain_model(checkpoints):
    for arch, (path, tokens, reference) in checkpoints.items():
        model = hf.from_pretrained(path)  # no process group, no sharding
        assert rel(_forward(model, tokens), reference) <= TOLERANCE, arch
        if arch == "llama_tied":
            assert model.lm_head.weight is model.embed_tokens.weight


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_round_trip(checkpoints, tmp_path, arch, world_size):
    path, tokens, reference = checkpoints[arch]
    out = str(tmp_path / "export")
    run_distributed(_import_export, world_size, path, out, tokens)
    assert sorted(os.listdir(out)) == ["config.json", SINGLE_FILE]
    assert_bit_exact(out, path)
    assert rel(hf_logits(out, tokens), reference) == 0.0  # the very same weights
    ours = hf_to_config(hf.read_hf_config(out))
    assert ours == hf_to_config(hf.read_hf_config(path))
    if arch == "llama_tied":
        assert "lm_head.weight" not in read_all(out)


def test_sharded_export_with_index(checkpoints, tmp_path):
    """Small max_shard_size: several files + index, loadable by transformers and by us."""
    path, tokens, reference = checkpoints["qwen2"]
    out = str(tmp_path / "sharded")
    run_distributed(_import_export, 2, path, out, tokens, max_shard_size="20KB")
    with open(os.path.join(out, INDEX_FILE)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and not os.path.exists(os.path.join(out, SINGLE_FILE))
    assert sorted(os.listdir(out)) == sorted([*files, INDEX_FILE, "config.json"])
    for file in files:  # each shard respects the limit unless it holds one big tensor
        with safe_open(os.path.join(out, file), "pt") as f:
            names = list(f.keys())
        size = sum(
            t.numel() * t.element_size() for t in load_file(os.path.join(out, file)).values()
        )
        assert size <= 20_000 or len(names) == 1
    assert_bit_exact(out, path)
    assert rel(hf_logits(out, tokens), reference) == 0.0
    for logits, _, _ in run_distributed(_import, 3, out, tokens):  # index path of the loader
        assert rel(logits, reference) <= TOLERANCE
    # saving again unsharded replaces the shards instead of leaving them to shadow the file
    run_distributed(_import_export, 1, out, out, tokens)
    assert sorted(os.listdir(out)) == ["config.json", SINGLE_FILE]
    assert_bit_exact(out, path)


def test_export_failure_raises_on_every_rank(checkpoints):
    messages = run_distributed(_save_error, 2, checkpoints["qwen3"][0])
    assert messages[0] == messages[1] and "config.json" in messages[0], messages


def test_export_bf16(checkpoints, tmp_path):
    path, tokens, _ = checkpoints["llama"]
    model = hf.from_pretrained(path)
    hf.save_pretrained(model, tmp_path, dtype=torch.bfloat16, extra_config={"bos_token_id": 7})
    config = hf.read_hf_config(tmp_path)
    assert config["dtype"] == "bfloat16" and config["bos_token_id"] == 7
    expected = {k: v.to(torch.bfloat16) for k, v in read_all(path).items()}
    ours = read_all(tmp_path)
    assert (
        all(torch.equal(ours[k], expected[k]) for k in expected) and ours.keys() == expected.keys()
    )


# --------------------------------------------------------------------------------------------
# Strictness: one error naming every problem, before anything is written
# --------------------------------------------------------------------------------------------


def _corrupt(src, dst, drop=(), add=(), reshape=()):
    tensors = read_all(src)
    for name in drop:
        del tensors[name]
    for name in add:
        tensors[name] = torch.zeros(3, 4)
    for name in reshape:
        tensors[name] = tensors[name][:-1].clone()
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(tensors, os.path.join(dst, SINGLE_FILE), metadata={"format": "pt"})
    return str(dst)


MISSING = "model.layers.1.self_attn.k_proj.weight"
EXTRA = "model.layers.0.mlp.extra_proj.weight"
RESHAPED = "model.layers.0.mlp.gate_proj.weight"


@pytest.mark.parametrize(
    "kind, keys",
    [
        ("missing", dict(drop=[MISSING])),
        ("unexpected", dict(add=[EXTRA])),
        ("shape", dict(reshape=[RESHAPED])),
    ],
)
def test_bad_checkpoint_names_the_key(checkpoints, tmp_path, kind, keys):
    path = _corrupt(checkpoints["llama"][0], tmp_path / kind, **keys)
    model = Llama(hf_to_config(hf.read_hf_config(path)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hf.HFCheckpointError) as error:
        hf.load_pretrained(model, path)
    message = str(error.value)
    key = {"missing": MISSING, "unexpected": EXTRA, "shape": RESHAPED}[kind]
    assert key in message and kind in message, message
    if kind == "shape":
        assert "[44, 32]" in message and "[45, 32]" in message, message
    # nothing was written: the check runs on headers before any copy
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_all_problems_in_one_error_on_every_rank(checkpoints, tmp_path):
    path = _corrupt(
        checkpoints["llama"][0], tmp_path / "bad", drop=[MISSING], add=[EXTRA], reshape=[RESHAPED]
    )
    messages = run_distributed(_load_error, 2, path)
    assert messages[0] == messages[1]  # every rank raises, none waits in a collective
    for key in (MISSING, EXTRA, RESHAPED):
        assert key in messages[0], messages[0]


def test_tied_checkpoint_into_untied_model(checkpoints):
    path = checkpoints["llama_tied"][0]
    cfg = hf_to_config(hf.read_hf_config(path))
    cfg.tie_embeddings = False
    with pytest.raises(hf.HFCheckpointError, match="tie_embeddings"):
        hf.load_pretrained(Llama(cfg), path)  # the config check catches it first
    with pytest.raises(hf.HFCheckpointError, match="missing.*\n.*lm_head.weight"):
        hf.load_pretrained(Llama(cfg), path, check_config=False)


def test_broken_index(checkpoints, tmp_path):
    path, tokens, _ = checkpoints["llama"]
    out = tmp_path / "sharded"
    hf.save_pretrained(hf.from_pretrained(path), out, max_shard_size="20KB")
    with open(out / INDEX_FILE) as f:
        second = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(out / second)
    with pytest.raises(hf.HFCheckpointError, match=second):
        hf.from_pretrained(out)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(hf.HFConfigError, match="config.json"):
        hf.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(_cfg())))
    with pytest.raises(hf.HFCheckpointError, match="neither model.safetensors nor"):
        hf.from_pretrained(tmp_path)


def _cfg():
    return hf_to_config(hf_dict("llama"))


# --------------------------------------------------------------------------------------------
# Config translation
# --------------------------------------------------------------------------------------------


def hf_dict(arch: str, **changes) -> dict:
    config = ARCHS[arch]().to_dict()
    config["architectures"] = [type(ARCHS[arch]()).__name__.replace("Config", "ForCausalLM")]
    return {**config, **changes}


def test_config_fields():
    llama = hf_to_config(hf_dict("llama"))
    assert (llama.dim, llama.ffn_dim, llama.n_heads, llama.n_kv_heads, llama.head_dim) == (
        32, 45, 4, 2, 8,
    )  # fmt: skip
    assert (llama.rope_theta, llama.norm_eps, llama.max_seq_len) == (5000.0, 1e-5, 64)
    assert not (llama.tie_embeddings or llama.qk_norm or llama.attention_bias)
    assert hf_to_config(hf_dict("llama_tied")).tie_embeddings
    assert hf_to_config(hf_dict("qwen2")).attention_bias
    llama31 = hf_to_config(hf_dict("llama31"))
    assert (llama31.rope_type, llama31.rope_factor, llama31.rope_high_freq_factor) == (
        "llama3", 8.0, 8.0,
    )  # fmt: skip
    assert (llama31.rope_original_max_seq_len, llama31.rope_theta) == (256, 500000.0)
    assert hf_to_config(hf_dict("llama")).rope_type == "default"
    qwen3 = hf_to_config(hf_dict("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 16 and not qwen3.attention_bias


@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_round_trip(arch):
    ours = hf_to_config(hf_dict(arch))
    exported = config_to_hf(ours, torch.float32)
    assert hf_to_config(exported) == ours
    # and transformers reads the exported dict as the same model
    theirs = transformers.AutoConfig.for_model(**exported)
    assert type(theirs).__name__ == type(ARCHS[arch]()).__name__
    assert theirs.head_dim == ours.head_dim and theirs.tie_word_embeddings == ours.tie_embeddings


def test_config_legacy_rope_and_missing_fields():
    legacy = hf_dict("llama")
    del legacy["rope_parameters"]
    legacy.update(rope_theta=500000.0, rope_scaling=None)
    assert hf_to_config(legacy).rope_theta == 500000.0
    # absent fields take transformers' class defaults (Qwen3: head_dim 128, eps 1e-6)
    minimal = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}
    minimal.update(num_attention_heads=8, num_key_value_heads=4)
    config = hf_to_config(minimal)
    assert (config.head_dim, config.norm_eps, config.vocab_size) == (128, 1e-6, 151936)


@pytest.mark.parametrize(
    "arch, changes, field",
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 8.0}}, "rope_type"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ("llama31", {"rope_parameters": {**LLAMA3_ROPE, "beta_fast": 2}}, "beta_fast"),
        ("llama31", {"rope_parameters": {**LLAMA3_ROPE, "factor": 0.5}}, "factor"),
        ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("llama", {"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "factor"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"attention_dropout": 0.1}, "attention_dropout"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("llama", {"quantization_config": {"bits": 4}}, "quantization_config"),
        ("llama", {"architectures": ["MistralForCausalLM"]}, "architectures"),
        ("llama", {"model_type": "qwen2"}, "model_type"),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ],
)
def test_unsupported_config_is_an_error_naming_the_field(arch, changes, field):
    with pytest.raises(hf.HFConfigError, match=field):
        hf_to_config(hf_dict(arch, **changes))


def test_ignored_fields_are_ignored():
    config = hf_dict("llama", bos_token_id=5, eos_token_id=[1, 2], initializer_range=0.5)
    config.update(torch_dtype="bfloat16", pretraining_tp=2, use_cache=False)
    assert hf_to_config(config) == hf_to_config(hf_dict("llama"))


def test_export_refuses_models_hf_cannot_express():
    config = _cfg()
    config.qk_norm = config.attention_bias = True
    with pytest.raises(hf.HFConfigError, match="qk_norm"):
        config_to_hf(config)


# --------------------------------------------------------------------------------------------
# The generic adapter: a transformers model, sharded in place (names are the HF names)
# --------------------------------------------------------------------------------------------


def _transformers_in_place(path, out, tokens):
    """A transformers model with random weights, fully_shard-ed per decoder layer and at the
    root, loaded from `path` and exported to `out` with no adapter of its own."""
    torch.manual_seed(123)  # weights the load must overwrite
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    for layer in model.model.layers:
        flatshard.fully_shard(layer)
    flatshard.fully_shard(model)
    assert hf.adapter_for(model) is hf.TRANSFORMERS
    hf.load_pretrained(model, path)
    with torch.no_grad():
        logits = model(tokens).logits.detach().clone()
    hf.save_pretrained(model, out)
    return logits


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
def test_transformers_model_loads_and_saves_without_an_adapter(checkpoints, tmp_path, arch):
    path, tokens, reference = checkpoints[arch]
    for logits in run_distributed(_transformers_in_place, 2, path, str(tmp_path), tokens):
        assert rel(logits, reference) < TOLERANCE
    assert_bit_exact(tmp_path, path)


# --------------------------------------------------------------------------------------------
# Name rules
# --------------------------------------------------------------------------------------------


def test_name_rules_cover_every_tensor_once(checkpoints):
    for arch, (path, _, _) in checkpoints.items():
        with torch.device("meta"):
            model = Llama(hf_to_config(hf.read_hf_config(path)))
        mappings, unmapped = hf.adapter_for(model).plan(model)
        assert not unmapped
        names = [m.hf_name for m in mappings]
        assert sorted(names) == sorted(read_all(path)), arch
        gate, up = (m for m in mappings if m.param_name == "layers.0.mlp.gate_up_proj.weight")
        assert (gate.hf_name, gate.component, gate.shape) == (
            "model.layers.0.mlp.gate_proj.weight", "gate_proj.weight", (45, 32),
        )  # fmt: skip
        assert (up.hf_name, up.component, up.shape) == (
            "model.layers.0.mlp.up_proj.weight", "up_proj.weight", (45, 32),
        )  # fmt: skip
        fused = model.layers[0].mlp.gate_up_proj
        info = describe_param(fused, "weight", fused.weight)
        assert [(c.name, c.dim, c.start, c.stop) for c in info.components] == [
            ("gate_proj.weight", 0, 0, 45), ("up_proj.weight", 0, 45, 90),
        ]  # fmt: skip


def test_unmapped_parameter_is_reported(checkpoints):
    path = checkpoints["llama"][0]
    model = Llama(hf_to_config(hf.read_hf_config(path)))
    model.layers[0].extra = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(hf.HFCheckpointError, match="layers.0.extra.weight"):
        hf.load_pretrained(model, path)
    rules = (
        *LLAMA_RULES,
        hf.NameRule("model.layers.{n}.extra.weight", "layers.{n}.extra.weight"),
    )
    with pytest.raises(hf.HFCheckpointError, match="missing.*\n.*model.layers.0.extra.weight"):
        hf.load_pretrained(model, path, rules=rules)


def test_llama3_rope_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from flatshard.models.llama import rope_inv_freq

    config = ARCHS["llama31"]()
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = rope_inv_freq(hf_to_config(hf_dict("llama31")), torch.device("cpu"))
    assert torch.equal(ours, theirs)
    plain = rope_inv_freq(hf_to_config(hf_dict("llama")), torch.device("cpu"))
    assert not torch.equal(ours, plain) and torch.equal(ours[0], plain[0])  # kept, scaled
