"""Generation with a KV cache: flatshard's Llama and MoE fed in pieces give the logits of
one whole forward, and sampling with the cache (flatshard's, and transformers' own
past_key_values) chooses the tokens it chooses without, also once the text outgrows
max_seq_len and the window moves."""

from __future__ import annotations

import pytest
import torch

from flatshard.cli.generate import generate
from flatshard.models import KVCache, Llama, LlamaConfig, MoE, MoEConfig

MODELS = {
    "llama": lambda: Llama(LlamaConfig.tiny(max_seq_len=24)),
    "qwen3": lambda: Llama(LlamaConfig.tiny(max_seq_len=24, qk_norm=True)),
    "moe": lambda: MoE(MoEConfig.tiny(max_seq_len=24)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_pieces_through_the_cache_give_one_forwards_logits(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 13))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache()
        pieces = [model(tokens[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 13))]
    assert cache.length == 13
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(tokens[:, :12], cache=cache)  # 25 positions


@pytest.mark.parametrize("name", list(MODELS))
def test_sampling_with_the_cache_chooses_the_same_tokens(name):
    torch.manual_seed(1)
    model = MODELS[name]().eval()
    for temperature in (0.0, 0.8):  # greedy, and sampled with the same generator
        kwargs = dict(new_tokens=30, max_seq_len=24, temperature=temperature, seed=3)
        cached = generate(model, [5, 6, 7], cache=True, **kwargs)
        plain = generate(model, [5, 6, 7], cache=False, **kwargs)
        assert cached == plain and len(cached) == 30  # 33 tokens: the window moved


def test_a_transformers_model_samples_the_same_with_its_own_cache():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=45, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    kwargs = dict(new_tokens=20, max_seq_len=16, temperature=0.0)
    assert generate(model, [1, 2, 3], cache=True, **kwargs) == generate(
        model, [1, 2, 3], cache=False, **kwargs
    )
