"""Weight sync to processes outside the trainer's job (`flatshard.sync_weights` on every
trainer rank, `receive_weights` in a receiver holding a plain transformers model): after a
sync the receiver's weights are the trainer's full weights bitwise (bf16 wire: their bf16
rounding), after a training step a delta sync sends only the buckets it changed, and an
update whose senders disagree is refused without touching the model."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

import flatshard
from flatshard import hf

transformers = pytest.importorskip("transformers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama_dir(path, moe: bool = False) -> str:
    torch.manual_seed(0)
    sizes = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(**sizes, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=16, head_dim=8)  # fmt: skip
    else:
        config = transformers.LlamaConfig(**sizes)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _trainer(path, port, options, steps_between, tp=1, ep=1, versions=None, flat=False,
             receivers=1, reference=False):
    """Sync, train a step, sync again; the full weights rank 0 expected after each sync.
    The transformers model itself, or (reference) flatshard's Llama with its fused gate/up."""
    adapter = None if reference else hf.TRANSFORMERS
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=tp, ep=ep) if tp * ep > 1 else None
    if dims:
        model = hf.from_pretrained(path, dims=dims, adapter=adapter)
    else:
        model = hf.from_pretrained(path, shard=hf.shard_decoder_layers, adapter=adapter)
    for name, param in model.named_parameters():
        if "embed_tokens" in name:
            param.requires_grad_(False)  # frozen: never resent
    adamw = flatshard.optim.AdamW if flat else torch.optim.AdamW  # both bump what they write
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    group = flatshard.weight_sync_group(f"127.0.0.1:{port}", receivers=receivers)
    names = options.get("names", "hf")
    expected, stats = [], []
    for sync in range(1 + steps_between):
        if sync:
            tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(sync))
            output = model(tokens[:, :-1])
            logits = getattr(output, "logits", output)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        version = versions[dist.get_rank()] if versions else None
        stats.append(flatshard.sync_weights(model, group, version=version, **options))
        full = {k: v.clone() for k, v in flatshard.full_weights(model, names, to_rank=0)}
        expected.append(full if dist.get_rank() == 0 else None)
    return expected, stats


def _sync(tmp_path, options, steps_between=1, moe=False, world=2, **trainer_kwargs):
    """(each sync's expected full weights, the trainers' stats, the receiver's weights after
    each sync, its stats or the exception it raised)."""
    path = _llama_dir(tmp_path / "model", moe)
    receiver = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in receiver.parameters():
            p.zero_()  # whatever it holds after a sync came from the trainer
    port = _free_port()
    seen, outcome = [], []

    def receive():
        try:
            group = flatshard.weight_sync_group(f"127.0.0.1:{port}", trainers=world,
                                                receiver=0, backend="gloo")  # fmt: skip
            for _ in range(1 + steps_between):
                outcome.append(flatshard.receive_weights(group, receiver))
                seen.append({k: v.clone() for k, v in receiver.state_dict().items()})
        except flatshard.WeightSyncError as error:
            outcome.append(error)
            seen.append({k: v.clone() for k, v in receiver.state_dict().items()})

    thread = threading.Thread(target=receive)
    thread.start()
    results = run_distributed(_trainer, world, path, port, options, steps_between,
                              **trainer_kwargs)  # fmt: skip
    thread.join(timeout=60)
    expected = [r for r in results[0][0]]
    return expected, [r[1] for r in results], seen, outcome


def _same(received: dict, expected: dict, cast=None):
    assert set(expected) <= set(received)
    for name, value in expected.items():
        want = value if cast is None else value.to(cast).float()
        assert torch.equal(received[name], want), name


def test_full_then_delta_sync_is_bitwise_the_trainers_weights(tmp_path):
    options = {"delta": True, "bucket_bytes": 4096, "full_every": 2}
    expected, stats, seen, outcome = _sync(tmp_path, options, steps_between=2, flat=True)
    for sync in range(3):
        _same(seen[sync], expected[sync])
    assert not torch.equal(expected[0]["lm_head.weight"], expected[1]["lm_head.weight"])
    first, second, third = zip(*stats)  # per rank
    assert all(s.full and s.buckets_sent == s.buckets for s in first + third)  # full_every 2
    # the frozen embedding's buckets were not written by the step: not sent again
    assert all(not s.full and 0 < s.buckets_sent < s.buckets for s in second)
    trained = sum(1 for name in expected[0] if name != "model.embed_tokens.weight")
    assert outcome[1].tensors_applied == trained and outcome[0].tensors_applied == trained + 1


def test_the_reference_llamas_fused_weights_arrive_as_transformers_tensors(tmp_path):
    """flatshard's Llama holds gate and up as one [gate; up] parameter: the receiver cuts
    the Hugging Face tensors out of it."""
    expected, _, seen, _ = _sync(tmp_path, {}, reference=True)
    assert "model.layers.0.mlp.gate_proj.weight" in expected[0]
    for sync in range(2):
        _same(seen[sync], expected[sync])


def test_a_bf16_wire_gives_the_bf16_rounding(tmp_path):
    from flatshard.planner.sync_cost import sync_figures

    expected, stats, seen, _ = _sync(tmp_path, {"wire": "bf16"}, steps_between=0)
    _same(seen[0], expected[0], cast=torch.bfloat16)
    # the bytes flatshard plan --sync-wire bf16 expects (each block aligned to 8 bytes)
    planned = sync_figures(sum(v.numel() for v in expected[0].values()),
                           SimpleNamespace(world_size=2, dp_shard=2, tp=1, sync_wire="bf16"))
    sent = sum(s[0].bytes_sent for s in stats)
    assert planned["bytes_per_receiver"] <= sent <= 1.01 * planned["bytes_per_receiver"]


def test_an_fp8_wire_rounds_each_row_to_its_scale(tmp_path):
    expected, stats, seen, _ = _sync(tmp_path, {"wire": "fp8"}, steps_between=0)
    for name, value in expected[0].items():
        rows = value.reshape(value.shape[0], -1) if value.dim() > 1 else value.reshape(1, -1)
        bound = rows.abs().amax(dim=1, keepdim=True) / 16  # e4m3: 3 mantissa bits
        error = (seen[0][name] - value).reshape(rows.shape).abs()
        assert (error <= bound + 1e-12).all(), name
    full_bytes = sum(v.numel() * 4 for v in expected[0].values())
    assert sum(s[0].bytes_sent for s in stats) < 0.35 * full_bytes


def test_tensor_parallel_trainers_send_their_slices(tmp_path):
    expected, _, seen, _ = _sync(tmp_path, {}, tp=2)
    for sync in range(2):
        _same(seen[sync], expected[sync])


def test_expert_parallel_trainers_send_their_experts(tmp_path):
    expected, _, seen, _ = _sync(tmp_path, {"names": "model"}, moe=True, ep=2)
    for sync in range(2):
        _same(seen[sync], expected[sync])


def test_tensor_parallel_receivers_each_take_their_slices(tmp_path):
    """Two receivers, as the TP ranks of an engine: each asks for its half of the rows of
    every matrix (the whole of every vector) and takes them as they arrive."""
    path = _llama_dir(tmp_path / "model")
    port = _free_port()
    taken = [{}, {}]

    def rows(index, name, shape):
        half = shape[0] // 2
        return ((index * half, 0), (half, shape[1])) if len(shape) == 2 else None

    def receive(index):
        group = flatshard.weight_sync_group(f"127.0.0.1:{port}", trainers=2, receiver=index,
                                            receivers=2, backend="gloo")  # fmt: skip
        for _ in range(2):
            flatshard.receive_weights(
                group, lambda name, value: taken[index].__setitem__(name, value.clone()),
                slices=lambda name, shape: rows(index, name, shape), apply="as_received",
            )  # fmt: skip

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    results = run_distributed(_trainer, 2, path, port, {"delta": True}, 1, receivers=2)
    for thread in threads:
        thread.join(timeout=60)
    expected = results[0][0][-1]  # after the step and the delta sync
    for index in range(2):
        assert set(taken[index]) == set(expected)
        for name, value in expected.items():
            box = rows(index, name, tuple(value.shape))
            want = value if box is None else value[index * box[1][0] : (index + 1) * box[1][0]]
            assert torch.equal(taken[index][name], want), (index, name)


def test_an_update_whose_senders_disagree_is_refused_untouched(tmp_path):
    _, _, seen, outcome = _sync(tmp_path, {}, steps_between=0, versions=[7, 8])
    assert isinstance(outcome[0], flatshard.WeightSyncError)
    assert "disagree on the version ([7, 8])" in str(outcome[0])
    assert all(not value.any() for value in seen[0].values())  # still the zeros


def test_bad_addresses_and_roles_are_one_line_errors():
    with pytest.raises(flatshard.WeightSyncError, match="host:port"):
        flatshard.weight_sync_group("localhost", trainers=2, receiver=0)
    with pytest.raises(flatshard.WeightSyncError, match="index in"):
        flatshard.weight_sync_group("localhost:1", trainers=2, receiver=3, receivers=1)
