"""`flatshard plan` on zoo models, checked against figures computed by hand from the models'
public configs (the measured-run check is in test_cli_train.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from flatshard.cli.main import main
from flatshard.models import LlamaConfig, MoEConfig
from flatshard.optim.matrix_owners import newton_schulz_flops
from flatshard.planner import estimate, zoo
from flatshard.planner.activations import Activations, Saved
from flatshard.planner.estimate import Setup

BF16, FP32 = 2, 4


def plan(capsys, *args) -> dict:
    assert main(["plan", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama3_8b_on_64_ranks(capsys):
    result = plan(capsys, "llama3-8b", "--world-size", 64)
    V, d, L, f = 128256, 4096, 32, 14336
    # a block: q, k, v, o, [gate; up], down, two norms; it cuts into 64 equal whole-row shards
    block = d * d + 2 * (8 * 128) * d + d * d + 2 * f * d + d * f + 2 * d
    assert block == 218_112_000 and block % 64 == 0
    # the root's first-use groups: the embedding (V rows of d) and [final norm (d), output
    # layer (V rows)]: whole rows of d elements per rank, each padded to a multiple of 64 rows
    embed_rows, head_rows = math.ceil(V / 64) * 64, math.ceil((V + 1) / 64) * 64
    root = (embed_rows + head_rows) * d
    assert result["num_params"] == L * block + 2 * V * d + d == 8_030_261_248
    shard = L * block // 64 + root // 64
    memory, comm = result["memory"], result["communication"]
    assert memory["params"] == memory["grads"] == FP32 * shard == 501_907_456
    assert memory["optimizer"] == 2 * FP32 * shard  # AdamW: exp_avg and exp_avg_sq
    assert memory["largest_unsharded_unit"] == BF16 * head_rows * d  # larger than a block
    # bf16 all-gathers: every unit in forward, the blocks but the last again in backward
    # (the last block's backward comes right after the root's, which stays); fp32 reductions
    assert comm["all_gather"] == BF16 * ((2 * L - 1) * block + root) == 29_583_982_592
    assert comm["reduce_scatter"] == FP32 * (L * block + root) == 32_122_077_184
    padding = root - (2 * V * d + d)
    assert result["padding_fraction"] == pytest.approx(padding / result["num_params"])
    # activations kept for backward, per token, bf16 except the fp32 parts:
    # per block: 2 RMSNorms (fp32 input + bf16 output), SDPA's q, out and o_proj's input
    # (3 x 32 heads x 128) with k and v as the 8 KV heads (CUDA's flash kernel reads them
    # grouped in bf16), fp32 logsumexp (32 heads), SwiGLU 4 x ffn;
    # head: final norm, bf16 logits, and while the loss's backward runs the fp32
    # log-softmax, its gradient and the logits' gradient
    attention = BF16 * (3 * 32 + 2 * 8) * 128 + FP32 * 32
    per_block = 2 * (FP32 + BF16) * d + attention + BF16 * 4 * f
    head = (FP32 + BF16) * d + BF16 * V + 3 * FP32 * V
    assert memory["activations"] == 4096 * (L * per_block + head) == 32_705_085_440
    # at the start of backward: weights + AdamW + activations + the root's parts gathered
    # with their gradient buffers, two blocks gathered, two blocks' bf16 gradients, one fp32
    # copy reducing
    working = BF16 * 2 * root + BF16 * 4 * block + FP32 * block
    expected = FP32 * shard * 3 + memory["activations"] + working
    assert memory["total"] == expected == 41_031_892_992
    # full activation checkpointing: every block's input (bf16), then the head's backward
    # (on Llama-3's vocabulary it outweighs one block recomputed with its gradients);
    # selective: what each block keeps (q, k, v, SDPA's output and logsumexp, o_proj's and
    # down_proj's outputs, [gate; up]), then the head's backward again
    assert head > per_block + per_block * 3 // 8
    full = plan(capsys, "llama3-8b", "--ac", "full")["memory"]["activations"]
    assert full == 4096 * (L * BF16 * d + head)
    kept = BF16 * (2 * 32 + 2 * 8) * 128 + FP32 * 32 + BF16 * 2 * d + BF16 * 2 * f
    selective = plan(capsys, "llama3-8b", "--ac", "selective")["memory"]["activations"]
    assert selective == 4096 * (L * (BF16 * d + kept) + head)
    assert full < selective < memory["activations"]
    # offload: the head with the last block (kept on the device)
    offload = plan(capsys, "llama3-8b", "--ac", "offload")["memory"]["activations"]
    assert offload == 4096 * (head + per_block) < full


def test_keys_and_values_are_kept_grouped_only_where_cudas_kernel_reads_them_so(capsys):
    """bf16 on NCCL: SDPA keeps the 8 KV heads' keys and values (the flash kernel reads
    them grouped); on gloo, and under packed documents' mask, they are repeated to the 32
    query heads, as the kernels there keep them; context parallelism counts its own (a
    ring's keys: as projected)."""
    tokens, L = 4096, 32
    cuda, cpu = (plan(capsys, "llama3-8b", "--backend", b)["memory"] for b in ("nccl", "gloo"))
    repeats = tokens * L * BF16 * 2 * (32 - 8) * 128  # k and v, the 24 heads' copies
    assert cpu["activations"] - cuda["activations"] == repeats
    packed = plan(capsys, "llama3-8b", "--pack")["memory"]  # masked: no flash, repeated
    assert packed["activations"] == cpu["activations"]
    cp = [plan(capsys, "llama3-8b", "--cp", 2, "--backend", b) for b in ("nccl", "gloo")]
    assert cp[0]["memory"]["activations"] == cp[1]["memory"]["activations"]


def test_what_fits_per_activation_mode(capsys):
    """Each --ac mode's device peak (the plan of that mode's total), and which fit."""
    peaks = plan(capsys, "llama3-8b", "--seq-len", 8192)["device_peak_by_ac"]
    for mode in ("none", "full", "selective", "offload"):
        assert (
            peaks[mode]
            == plan(capsys, "llama3-8b", "--seq-len", 8192, "--ac", mode)["memory"]["device"]
        )
    assert peaks["offload"] < peaks["full"] < peaks["selective"] < peaks["none"]
    budget = (peaks["selective"] + peaks["none"]) / 2 / 2**30
    assert main(["plan", "llama3-8b", "--seq-len", "8192", "--device-memory", f"{budget}"]) == 0
    text = capsys.readouterr().out
    assert f"fits in {budget:g} GiB: full, selective, offload" in text
    assert main(["plan", "llama3-8b", "--seq-len", "8192", "--device-memory", "1"]) == 0
    assert "fits in 1 GiB: none of them: shard over more ranks" in capsys.readouterr().out


def test_llama3_8b_with_tensor_parallelism(capsys):
    """--tp 4 on 64 ranks: each block's q/k/v/o, [gate; up] and down are split 4 ways before
    FSDP shards them over 16 ranks (norms, embedding and head stay whole); the TP
    all-reduces are each block's two row-parallel outputs and four column-parallel input
    gradients, bf16, per token."""
    result = plan(capsys, "llama3-8b", "--world-size", 64, "--tp", 4)
    V, d, L, f = 128256, 4096, 32, 14336
    block = (d * d + 2 * (8 * 128) * d + d * d + 2 * f * d + d * f) // 4 + 2 * d
    units = {unit["name"]: unit for unit in result["units"]}
    assert units["layers.0-31"]["numel"] == block
    assert result["setup"]["dp_shard"] == 16 and result["setup"]["tp"] == 4
    assert units["embed_tokens"]["numel"] == V * d  # replicated over TP
    tokens = 4096
    assert result["communication"]["tp_all_reduce"] == 6 * L * tokens * d * BF16
    assert result["communication"]["tp_wire_per_rank"] == 2 * 3 * 6 * L * tokens * d * BF16 // 4


def test_llama3_8b_with_sequence_parallelism(capsys):
    """--tp 4 --sp: the embedding and head split by vocabulary too; per block the attention's
    and MLP's inputs all-gathered and outputs reduce-scattered in forward and backward, but
    the MLP input's gradient all-reduced (as torch's plan runs: the benchmark's counters
    show it), and the embedding's output, the head's input, the logits; the
    norms, residual stream and block inputs a quarter per rank, the heads' and hidden
    units' a quarter already under TP alone."""
    V, d, L, tokens = 128256, 4096, 32, 4096
    one, tp, sp = (
        plan(capsys, "llama3-8b", "--world-size", 64, *extra)
        for extra in ([], ["--tp", 4], ["--tp", 4, "--sp"])
    )
    units = {unit["name"]: unit for unit in sp["units"]}
    assert units["embed_tokens"]["numel"] == V // 4 * d
    comm = sp["communication"]
    activation = tokens * d * BF16
    assert comm["tp_all_reduce"] == L * activation  # 6 per block without SP
    assert comm["tp_reduce_scatter"] == (3 * L + 2) * activation
    assert comm["tp_all_gather"] == (4 * L + 2) * activation + tokens * V * BF16
    wire = 3 * (comm["tp_all_gather"] + comm["tp_reduce_scatter"]) // 4
    assert comm["tp_wire_per_rank"] == wire + 2 * 3 * comm["tp_all_reduce"] // 4
    act = [result["memory"]["activations"] for result in (one, tp, sp)]
    # per token and block without AC: norms 2 x (fp32 + bf16) x d and the projection
    # outputs (none kept without AC) split only by SP; attention and SwiGLU by TP
    split_by_tp = BF16 * (3 * 32 + 2 * 8) * 128 + FP32 * 32 + BF16 * 4 * 14336  # (see above)
    assert act[0] - act[1] == tokens * L * (split_by_tp - split_by_tp // 4)
    norms = 2 * (FP32 + BF16) * d  # and the final norm's, in the head
    assert act[1] - act[2] == tokens * (L * (norms - norms // 4) + (FP32 + BF16) * d * 3 // 4)
    assert main(["plan", "llama3-8b", "--world-size", "64", "--tp", "4", "--sp"]) == 0
    assert "tp 4 + SP" in capsys.readouterr().out
    assert main(["plan", "llama3-8b", "--sp"]) == 2
    assert "--sp splits the sequence over the TP ranks" in capsys.readouterr().err


def test_context_parallelism_and_a_128k_token_plan_that_fits_80_gb(capsys):
    """--cp splits each sequence: activations per rank for its share of the tokens. torch's
    ring (bf16 on NCCL: flash attention) saves each block's own keys and values as
    projected and holds the whole sequence's KV heads plus fp32 gradient sums in the last
    block's backward; per block it all-gathers the keys and values in forward and backward
    and passes their fp32 gradients around the ring. The all-gather variant (fp32 on NCCL)
    saves the rest of the sequence's keys and values, repeated to the query heads, in
    every block, and reduce-scatters their gradients. 128k tokens fit 80 GB per rank:
    llama3-8b on 64 ranks at cp 8, llama3-70b on 64 at tp 8 + SP, cp 8 (full AC)."""
    L, T, q_rows, kv_rows = 32, 8192, 32 * 128, 8 * 128
    one, two = (plan(capsys, "llama3-8b", "--seq-len", T, "--cp", cp) for cp in (1, 2))
    local = T // 2
    # (keys and values as projected: so cp 1 keeps them in bf16, flash reading them grouped)
    ring = 2 * T * kv_rows * BF16 + local * (q_rows + 2 * kv_rows) * FP32
    assert two["memory"]["activations"] == one["memory"]["activations"] // 2 + ring
    kv_bytes = L * T * 2 * kv_rows
    assert two["communication"]["cp_all_gather"] == 2 * kv_bytes * BF16
    assert two["communication"]["cp_all_to_all"] == kv_bytes * FP32
    assert two["communication"]["cp_reduce_scatter"] == 0
    fp32 = ["--seq-len", T, "--param-dtype", "fp32"]
    one, two = (plan(capsys, "llama3-8b", *fp32, "--cp", cp) for cp in (1, 2))
    others = 2 * L * (T // 2) * q_rows * FP32
    assert two["memory"]["activations"] == one["memory"]["activations"] // 2 + others
    assert two["communication"]["cp_reduce_scatter"] == kv_bytes * FP32
    assert two["communication"]["cp_all_gather"] == kv_bytes * FP32
    assert main(["plan", "llama3-8b", "--cp", "3"]) == 2
    assert "--cp 3 must divide" in capsys.readouterr().err
    long = ["--seq-len", 131072, "--world-size", 64, "--ac", "full"]
    eight = plan(capsys, "llama3-8b", *long, "--cp", 8)
    seventy = plan(capsys, "llama3-70b", *long, "--tp", 8, "--sp", "--cp", 8)
    assert plan(capsys, "llama3-8b", *long)["memory"]["device"] > 80 * 2**30  # without CP
    assert max(eight["memory"]["device"], seventy["memory"]["device"]) < 80 * 2**30
    recomputed = eight["communication"]
    assert recomputed["cp_all_gather"] == 3 * kv_bytes * 16 * BF16  # 131072 = 16 x 8192


def test_qwen3_30b_a3b_on_8_ranks(capsys):
    result = plan(capsys, "qwen3-30b-a3b", "--world-size", 8, "--zero-stage", 2)
    V, d, L = 151936, 2048, 48
    attention = 32 * 128 * d + 2 * 4 * 128 * d + d * 32 * 128 + 2 * 128  # q, k, v, o, q/k norms
    experts = 128 * d + 128 * (2 * 768) * d + 128 * d * 768  # router, grouped gate|up, down
    block = attention + experts + 2 * d
    assert block == 623_120_640 and block % 8 == 0
    # Hugging Face root: `model` keeps embedding + final norm (V + 1 rows of d), `lm_head` is a
    # first-use group of its own (V rows); each padded to a multiple of 8 rows
    root = (math.ceil((V + 1) / 8) * 8 + math.ceil(V / 8) * 8) * d
    assert result["num_params"] == L * block + 2 * V * d + d == 30_532_122_624
    shard = L * block // 8 + root // 8
    memory, comm = result["memory"], result["communication"]
    assert memory["params"] == FP32 * shard == 15_266_068_480
    assert memory["optimizer"] == 2 * memory["grads"] == 2 * FP32 * shard
    assert memory["largest_unsharded_unit"] == BF16 * block  # a block outweighs the root here
    # ZeRO-2: each unit is gathered once per step (kept from forward to backward)
    assert comm["all_gather"] == BF16 * (L * block + root)
    assert comm["reduce_scatter"] == FP32 * (L * block + root)
    assert comm["wire_per_rank"] == 7 * (comm["all_gather"] + comm["reduce_scatter"]) // 8
    [blocks, root_unit, head_unit] = result["units"]
    assert (blocks["count"], blocks["padded"]) == (L, block)
    assert root_unit["padded"] + head_unit["padded"] == root


def test_zoo_totals_and_text_output(capsys):
    published = {
        "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "qwen3-30b-a3b": 30.5e9,
        "qwen3-235b-a22b": 235e9, "deepseek-v3": 671e9,
    }  # fmt: skip
    for name, params in published.items():
        assert plan(capsys, name)["num_params"] == pytest.approx(params, rel=0.005), name
    hsdp = plan(capsys, "qwen3-235b-a22b", "--world-size", 64, "--dp-shard", 32)
    flat = plan(capsys, "qwen3-235b-a22b", "--world-size", 32)
    assert hsdp["memory"]["params"] == flat["memory"]["params"]
    assert hsdp["communication"]["replica_all_reduce"] == flat["memory"]["grads"]
    assert main(["plan", "deepseek-v3", "--world-size", "64"]) == 0
    text = capsys.readouterr().out
    for part in ("layers.3-60 (MoE) (x58)", "total (peak estimate)", "padding:", "all-gather"):
        assert part in text


def test_plan_of_a_hugging_face_config(tmp_path, capsys):
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000,
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = plan(capsys, tmp_path, "--world-size", 2, "--param-dtype", "fp32")
    expected = LlamaConfig(
        vocab_size=1000, dim=64, ffn_dim=96, n_layers=3, n_heads=4, n_kv_heads=2,
        head_dim=32, tie_embeddings=True, qk_norm=True,
    )  # fmt: skip
    assert result["num_params"] == expected.num_params()
    # in pipeline stages the tied weight is the first stage's, gathered there and its
    # gradient summed over its 2 data-parallel ranks (in fp32); under ZBV too (rank 0 holds
    # both ends)
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    for schedule in ("1f1b", "zbv"):
        piped = plan(capsys, deeper, "--world-size", 4, "--pp", 2, "--param-dtype", "fp32",
                     "--pp-schedule", schedule)  # fmt: skip
        first, last = (stage["communication"] for stage in piped["pipeline"]["stages"])
        assert first["tied_embedding"] == 2 * 1000 * 64 * 4 and "tied_embedding" not in last
    # frozen under LoRA: gathered and sent on, no gradient summed nor sent back; HSDP's
    # replicas sum a trained one's once more
    layout = ("--pp", 2, "--param-dtype", "fp32")
    lora = plan(capsys, deeper, "--world-size", 4, *layout, "--lora", 4)["pipeline"]["stages"]
    assert lora[0]["communication"]["tied_embedding"] == 1000 * 64 * 4
    assert lora[1]["communication"]["pipeline_send"] < lora[0]["communication"]["pipeline_send"]
    hsdp = plan(capsys, deeper, "--world-size", 8, *layout, "--dp-shard", 2)["pipeline"]
    assert hsdp["stages"][0]["communication"]["tied_embedding"] == 3 * 1000 * 64 * 4
    assert main(["plan", "gpt-5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert main(["plan", "llama3-8b", "--world-size", "6", "--dp-shard", "4"]) == 2
    error = capsys.readouterr().err
    assert "--world-size 6, --dp-shard 4" in error  # the flags that set the degrees
    assert "dp_shard x tp (4 x 1) must divide world_size (6)" in error


def test_embedding_looked_up_from_its_shards():
    """The reference Llama's embedding is a unit of its own: while the ranks' tokens are
    fewer than its rows, ZeRO-2/3 look it up from the shards (sharded_lookup.py) instead of
    gathering and reducing the table (the measured run is in test_cli_train.py)."""
    V, d = 1000, 64
    config = LlamaConfig(vocab_size=V, dim=d, n_layers=2, n_heads=4, ffn_dim=96)
    spec = zoo.from_llama_config(config, "llama")
    setup = Setup(
        world_size=4, dp_shard=4, zero_stage=3, param_dtype="fp32", reduce_dtype="fp32",
        micro_batch=2, seq_len=100, grad_accum=1, backend="gloo",
    )  # fmt: skip
    looked = estimate.plan(spec, setup).communication
    # 4 x 250 tokens = 1000 rows: gathering costs no more, so the table is gathered
    gathered = estimate.plan(spec, replace(setup, seq_len=125)).communication
    positions = 4 * 200  # every rank's tokens, as every rank sees them
    rows = FP32 * positions * d  # every rank's tokens looked up, reduce-scattered
    # the table (1000 rows cut into 4 x 250) gathered once (the root's parts stay gathered)
    # and reduced once, against the token ids (int64) and output gradients gathered and the
    # looked-up rows reduced
    table = FP32 * V * d
    assert gathered["all_gather"] - looked["all_gather"] == table - positions * 8 - rows
    assert gathered["reduce_scatter"] - looked["reduce_scatter"] == table - rows
    for stage in (1, 2):  # ZeRO-1 keeps unsharded gradients: it always gathers
        at_stage = replace(setup, zero_stage=stage)
        looked = estimate.plan(spec, at_stage).communication
        gathered = estimate.plan(spec, replace(at_stage, seq_len=125)).communication
        saved = table - rows if stage == 2 else 0
        assert gathered["reduce_scatter"] - looked["reduce_scatter"] == saved


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--world-size", "100000000"], "--world-size 100000000: more ranks than any machine"),
        (["--world-size", "0"], "--world-size 0: it must be >= 1"),
        (["--dp-shard", "0"], "--dp-shard 0: it must be >= 1 (leave it out to shard over all"),
        (["--world-size", "8", "--dp-shard", "3"], "dp_shard x tp (3 x 1) must divide"),
        (["--hpz-group", "-2"], "--hpz-group -2: it must be >= 0"),
        (["--device-memory", "0"], "--device-memory 0: it must be > 0 (GiB)"),
        # only the flags the user gave are named, a default world is said to be one
        (["--tp", "3"], "--tp 3 does not divide --world-size 8 (the default): pick"),
        (["--world-size", "4", "--tp", "2", "--ep", "3"], "--world-size 4, --tp 2, --ep 3: ep"),
    ],
)
def test_impossible_values_are_one_line_errors(capsys, args, expected):
    assert main(["plan", "llama3-8b", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flatshard: error: ") and expected in err, err


def test_ranks_that_would_hold_nothing_are_warned_about(capsys):
    # 64 ranks, the default training model: its embedding's 257 rows leave 12 ranks empty
    result = plan(capsys, "--world-size", 64)
    empty = {unit["name"]: unit["empty_ranks"] for unit in result["units"]}
    assert empty == {"layers.0-5": 0, "embed_tokens": 12, "norm+lm_head": 12}, empty
    assert main(["plan", "--world-size", "64"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("flatshard: warning: at dp_shard 64 some ranks would hold none")
    assert "embed_tokens: 12 of 64 ranks, norm+lm_head: 12 of 64 ranks" in err, err
    assert main(["plan", "--world-size", "2"]) == 0
    assert capsys.readouterr().err == ""


def test_plan_of_the_reference_moe(capsys):
    """A training config's MoE model is the reference MoE on the meta device, every parameter
    counted; dense and MoE layers are units of their own."""
    result = plan(capsys, "--set", "model.preset=moe-tiny", "--world-size", 2)
    expected = MoEConfig.tiny(
        "mixtral", vocab_size=257, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=64, expert_ffn_dim=64
    )
    assert result["num_params"] == expected.num_params() == 156608
    assert [u["name"] for u in result["units"]][0] == "layers.0-1"

    deepseek_style = MoEConfig.tiny("deepseek_v3", n_layers=3)
    spec = zoo.from_llama_config(deepseek_style, "moe")
    layers = [(u.name, u.count) for u in spec.units if not u.is_root]
    assert layers == [("layers.0-0", 1), ("layers.1-2", 2)]
    assert spec.num_params == deepseek_style.num_params()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_zoo_moe_shapes_match_the_reference_moe(model_type):
    """The zoo describes Qwen3-MoE and Mixtral by hand; the reference MoE built from the
    same sizes has the same parameter shapes (attention named `attn`, not `self_attn`)."""
    hf = dict(
        model_type=model_type, vocab_size=100, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    if model_type == "qwen3_moe":
        hf.update(num_experts=4, moe_intermediate_size=48)
    else:
        hf.update(num_local_experts=4, intermediate_size=48)
    qk_norm = model_type == "qwen3_moe"
    cfg = MoEConfig.tiny(
        vocab_size=100, n_experts=4, expert_ffn_dim=48, head_dim=8, qk_norm=qk_norm
    )
    ours = zoo.from_llama_config(cfg, "reference")
    theirs = zoo.from_hf_config(hf, model_type)

    def layer_shapes(spec):
        layer = next(u for u in spec.units if not u.is_root)
        return sorted((p.name.replace("self_attn.", "attn."), p.shape) for p in layer.params)

    renames = {"input_layernorm.": "attn_norm.", "post_attention_layernorm.": "mlp_norm."}
    expected = []
    for name, shape in layer_shapes(theirs):
        for old, new in renames.items():
            name = name.replace(old, new)
        expected.append((name, shape))
    assert layer_shapes(ours) == sorted(expected)
    assert ours.num_params == theirs.num_params == cfg.num_params()


def test_qwen3_30b_a3b_with_expert_parallelism(capsys):
    """--ep 8 on 64 ranks: each MoE block's 128 experts split 8 ways into a unit of their
    own sharded over the 8 expert-data-parallel ranks; each token's 8 expert copies go out
    and back in forward and backward (bf16)."""
    E, d, ffn, L, top_k = 128, 2048, 768, 48, 8
    plain = plan(capsys, "qwen3-30b-a3b", "--world-size", 64)
    result = plan(capsys, "qwen3-30b-a3b", "--world-size", 64, "--ep", 8)
    assert result["num_params"] == plain["num_params"]
    units = {unit["name"]: unit for unit in result["units"]}
    experts = units["layers.0-47 experts"]
    assert experts["numel"] == (E // 8) * 3 * ffn * d
    assert experts["shard"] == experts["numel"] // 8  # over efsdp = 64 / 8
    assert units["layers.0-47"]["numel"] + 8 * experts["numel"] == plain["units"][0]["numel"]
    tokens = 4096
    assert result["communication"]["ep_all_to_all"] == 4 * L * tokens * top_k * d * BF16
    # the same bytes of optimizer state per rank: the experts are still split over 64 ranks
    assert (
        abs(result["memory"]["optimizer"] - plain["memory"]["optimizer"])
        <= 1e-3 * plain["memory"]["optimizer"]
    )


def test_activation_peak_is_the_larger_of_the_head_and_a_block_moment():
    """Each mode's peak: the head's backward on top of what is saved, or, once it is done, a
    block's backward (its activations recomputed where checkpointed, with 3/8 of them again
    as gradients): the block moment wins where the vocabulary is small."""
    layer = Saved(all=800, kept=300)
    small_head = Activations(((2, layer),), block_input=10, head=100)
    assert small_head.per_token("none") == 2 * 800 + 100
    assert small_head.per_token("full") == 2 * 10 + 800 + 300
    assert small_head.per_token("selective") == 2 * 10 + 2 * 300 + 500 + 300
    assert small_head.per_token("offload") == 800 + 800 + 300
    large_head = Activations(((2, layer),), block_input=10, head=5000)
    assert large_head.per_token("full") == 2 * 10 + 5000
    assert large_head.per_token("selective") == 2 * 10 + 2 * 300 + 5000
    assert large_head.per_token("offload") == 5000 + 800


def test_optimizer_state_per_optimizer(capsys):
    """SGD keeps one fp32 state per trained element (its momentum), AdamW two: half the
    bytes; the flat and torch AdamW the same."""
    states = {
        name: plan(capsys, "llama3-8b", "--world-size", 8, "--optimizer", name)["memory"][
            "optimizer"
        ]
        for name in ("adamw", "adamw-fused", "torch-adamw", "sgd")
    }
    assert states["adamw"] == states["adamw-fused"] == states["torch-adamw"]
    assert states["adamw"] == 2 * states["sgd"] > 0


def test_muon_plan(capsys, tmp_path):
    """`--optimizer muon`: one fp32 state on the hidden matrices (q, k, v, o, [gate; up],
    down of every block), AdamW's two on the embeddings, head and norms; the Newton-Schulz
    work of the owners the optimizer chooses within 10% of the mean at 8 and 16 ranks; the
    exchange's bytes, under TP too."""
    d, f, L, kv = 4096, 14336, 32, 8 * 128
    matrices = L * (2 * d * d + 2 * kv * d + 3 * f * d)
    for world in (8, 16):
        result = plan(capsys, "llama3-8b", "--world-size", world, "--optimizer", "muon")
        adamw = plan(capsys, "llama3-8b", "--world-size", world)
        muon, n = result["muon"], result["num_params"]
        assert muon["matrices"] == 6 * L and muon["share"] == pytest.approx(matrices / n)
        states = adamw["memory"]["optimizer"] * (2 - muon["share"]) / 2
        assert result["memory"]["optimizer"] == pytest.approx(states, rel=1e-6)
        assert muon["ns_flops_max"] <= 1.1 * muon["ns_flops_mean"]
        exchanged = 4 * matrices * (world - 1) // world // world
        assert muon["exchange_bytes"] == pytest.approx(exchanged, rel=1e-6)
        if world == 8:
            muon_at_8 = muon
    assert main(["plan", "llama3-8b", "--world-size", "8", "--optimizer", "muon"]) == 0
    assert "Newton-Schulz per step" in capsys.readouterr().out
    # TP 2 at 16 ranks: the same TP-global matrices and work per rank; the owners' rows of
    # their TP blocks (bf16) and the blocks joined (fp32)
    tp = plan(capsys, "llama3-8b", "--world-size", 16, "--tp", 2, "--optimizer", "muon")["muon"]
    assert tp["matrices"] == 6 * L and tp["ns_flops_max"] == muon_at_8["ns_flops_max"]
    exchanged = 4 * matrices // 2 * 7 // 8 // 8 + 4 * matrices // 2 // 8
    assert tp["exchange_bytes"] == pytest.approx(exchanged, rel=1e-6)
    # --muon-split-fused: gate and up two (f, d) matrices; the same bytes move
    split = plan(capsys, "llama3-8b", "--world-size", 8, "--optimizer", "muon",
                 "--muon-split-fused")["muon"]  # fmt: skip
    assert split["matrices"] == 7 * L and split["exchange_bytes"] == muon_at_8["exchange_bytes"]
    shapes = [(d, d)] * 2 + [(kv, d)] * 2 + [(f, d)] * 2 + [(d, f)]
    work = L * sum(newton_schulz_flops(shape, 5) for shape in shapes)
    assert split["ns_flops_mean"] * 8 == pytest.approx(work, rel=1e-9)


def test_checkpoint_size_files_and_save_time(capsys):
    """A save writes the fp32 weights and both AdamW states once; HSDP's second replica
    writes nothing, so 16 ranks at dp_shard 8 write 8 files (and the metadata), each an
    eighth; the time is one rank's bytes over --write-gbps."""
    result = plan(capsys, "llama3-8b", "--world-size", 16, "--dp-shard", 8, "--write-gbps", 2)
    saved, n = result["checkpoint"], result["num_params"]
    assert saved["bytes"] == 3 * FP32 * n and saved["files"] == 9 and saved["writers"] == 8
    assert saved["bytes_per_writer"] == -(-saved["bytes"] // 8)
    assert saved["save_seconds"] == saved["bytes_per_writer"] / 2e9
    sgd = plan(capsys, "llama3-8b", "--world-size", 8, "--optimizer", "sgd")["checkpoint"]
    assert sgd["bytes"] == 2 * FP32 * n and sgd["files"] == 9


def test_quantized_gradients_plan(capsys):
    """`--quantize-grads int8` (qgZ): each reduce-scatter moves 8-bit blocks and a scale per
    256 elements (about 0.26x fp32), and error feedback keeps every unit's whole gradient
    in fp32 on each rank (the cost the plan names)."""
    plain = plan(capsys, "llama3-8b", "--world-size", 8)
    ours = plan(capsys, "llama3-8b", "--world-size", 8, "--quantize-grads", "int8")
    ratio = ours["communication"]["reduce_scatter"] / plain["communication"]["reduce_scatter"]
    # (256 + 4) / 256 / 4 = 0.254, and each bucket's shard rounded up to whole blocks
    assert (256 + 4) / 256 / 4 <= ratio <= 0.27
    assert plain["memory"]["error_feedback"] == 0
    feedback = ours["memory"]["error_feedback"]
    assert feedback == pytest.approx(4 * ours["num_params"], rel=1e-3)
    assert ours["memory"]["total"] == plain["memory"]["total"] + feedback
