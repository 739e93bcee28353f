"""`flatshard train --hf` and `flatshard convert` on a transformers model flatshard has no
model of its own for (Mixtral: MoE experts fused in memory, per-expert on disk): the first
step's loss is transformers' own, a resumed run repeats an uninterrupted one bitwise, and
its checkpoint converts back to a directory transformers loads; `sample` reads it. Under
`--tp` (Phi-3, fused projections) and `--tp --ep` (Mixtral), a run stopped at one layout
resumes at others with the losses of plain data parallelism; so does one in pipeline stages
(`--pp`, Phi-3)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_cli_helpers import check_ok, flatshard, metrics, one_line_error

from flatshard.cli.main import main
from flatshard.data.sequences import SequenceOrder
from flatshard.data.tokens import load_tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

SEQ, BATCH, STEPS = 16, 4, 4
RUN = [
    "--seq-len", SEQ, "--micro-batch", 2, "--global-batch", BATCH, "--set",
    "train.warmup_steps=2", "--set", "run.sample_tokens=0", "--set", "run.log_interval=1",
    "--set", "data.tokenizer=bytes",  # tiny random models without a tokenizer: bytes, on purpose
]  # fmt: skip


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )  # fmt: skip  (vocab 260 holds the bundled corpus's 257 byte tokens)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return path, model


def test_fine_tune_resume_convert_sample(mixtral, tmp_path, capsys):
    path, model = mixtral
    straight, split = tmp_path / "straight", tmp_path / "split"
    first = check_ok(flatshard("train", "--hf", path, *RUN, "--steps", STEPS, "--out", straight))
    assert "MixtralForCausalLM from" in first.stdout and "2 process(es)" in first.stdout
    model_line = next(line for line in first.stdout.splitlines() if "[model]" in line)
    assert model_line.strip() == f'[model] hf="{path}"'  # not the reference model's sizes
    expected = [r["loss"] for r in metrics(straight)]
    assert len(expected) == STEPS

    # step 1 is transformers' own loss of the imported model on the first global batch
    data = load_tokens("", "auto", "text", "**/*.txt")
    batch = SequenceOrder(data.tokens, SEQ, 0).batch(0, BATCH)
    with torch.no_grad():
        logits = model.eval()(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(expected[0] - loss) <= 1e-5 * loss

    # stopped after step 2, then resumed: the same losses bitwise
    stop = ["--set", "run.stop_at_step=2"]
    check_ok(flatshard("train", "--hf", path, *RUN, "--steps", STEPS, "--out", split, *stop))
    resumed = check_ok(flatshard("train", "--resume", split))
    assert "resuming from step 2" in resumed.stdout
    assert [r["loss"] for r in metrics(split)] == expected

    # the fine-tuned checkpoint back to Hugging Face (one process), loadable by transformers
    out = tmp_path / "hf-out"
    assert main(["convert", "checkpoint-to-hf", str(split), str(out)]) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert sorted(load_file(out / "model.safetensors")) == sorted(
        load_file(path / "model.safetensors")
    )  # per-expert tensors, as transformers writes them
    with torch.no_grad():
        greedy = int(tuned.eval()(torch.tensor([[5, 6]])).logits[0, -1].argmax())
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(split), "--prompt-ids", "5,6", "--tokens", "1",
                 "--temperature", "0"]) == 0  # fmt: skip
    assert [int(i) for i in capsys.readouterr().out.split()] == [5, 6, greedy]


def test_convert_round_trip_of_a_transformers_model(mixtral, tmp_path):
    path, _ = mixtral
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert main(["convert", "hf-to-checkpoint", str(path), ckpt]) == 0
    assert main(["convert", "checkpoint-to-hf", ckpt, out]) == 0
    original, exported = (load_file(os.path.join(p, "model.safetensors")) for p in (path, out))
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    with open(os.path.join(path, "config.json")) as a, open(os.path.join(out, "config.json")) as b:
        assert json.load(a) == json.load(b)


def test_unusable_models_are_one_line_errors(mixtral, tmp_path):
    path, _ = mixtral
    small = tmp_path / "small"
    small.mkdir()
    config = json.loads((path / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    message = one_line_error(flatshard("train", "--hf", small, *RUN, "--steps", 1))
    assert "vocab_size 100" in message and "model.hf" in message
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {}}))
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.symlink(path / name, quantized / name)
    (quantized / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}})
    )
    message = one_line_error(flatshard("convert", "hf-to-checkpoint", quantized, tmp_path / "x"))
    assert "quantization_config" in message


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_plan_counts_what_train_hf_would_train(tmp_path, capsys, arch):
    """`flatshard plan --set model.hf=DIR` plans the Hugging Face model (transformers 5's
    config.json names Qwen3-MoE's experts num_local_experts), not the reference Llama."""
    sizes = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(num_key_value_heads=2, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**sizes, num_experts=4, moe_intermediate_size=32)
    else:
        config = transformers.MixtralConfig(**sizes, num_local_experts=4, intermediate_size=48)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    assert main(["plan", "--set", f"model.hf={tmp_path}", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["num_params"] == sum(p.numel() for p in model.parameters())


def test_plan_names_a_model_it_cannot_describe(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    assert main(["plan", "--set", f"model.hf={tmp_path}"]) == 2
    assert "'no_such_model', which transformers" in capsys.readouterr().err


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """A transformers-built family with fused projections on disk (qkv_proj, gate_up_proj)."""
    torch.manual_seed(1)
    config = transformers.Phi3Config(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("phi3")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def test_tensor_parallel_fine_tune_resumes_at_another_layout(phi3, tmp_path):
    """--hf --tp 2 at world 4 (dp 2), stopped, resumed in one process: the losses of an
    uninterrupted data-parallel run; the checkpoint converts back to what that run's does."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    run = [*RUN, "--steps", 3]
    check_ok(flatshard("train", "--hf", phi3, *run, "--nproc", 2, "--out", straight))
    stop = ["--set", "run.stop_at_step=2"]
    check_ok(flatshard("train", "--hf", phi3, *run, "--nproc", 4, "--tp", 2, "--out", split, *stop))
    resumed = check_ok(flatshard("train", "--resume", split, "--nproc", 1, "--tp", 1))
    assert "resuming from step 2" in resumed.stdout
    expected, losses = ([r["loss"] for r in metrics(d)] for d in (straight, split))
    assert len(losses) == 3
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, expected))

    _exports_agree(tmp_path, straight, split, phi3)


def test_a_pipelined_fine_tune_resumes_without_a_pipeline(phi3, tmp_path):
    """--hf --pp 2 --cp 2 at world 4 (each rank reading only its stage's tensors of the
    files; each stage's attention flatshard's CP attention, at its part's positions),
    stopped, resumed in one process without a pipeline: the losses of an uninterrupted
    data-parallel run; its export loads in transformers with that run's weights."""
    straight, piped = tmp_path / "straight", tmp_path / "piped"
    run = [*RUN, "--global-batch", 8, "--steps", 3]  # 2 micro-batches a data-parallel rank
    check_ok(flatshard("train", "--hf", phi3, *run, "--nproc", 2, "--out", straight))
    stop = ["--set", "run.stop_at_step=2"]
    check_ok(flatshard("train", "--hf", phi3, *run, "--nproc", 4, "--pp", 2, "--cp", 2,
                       "--out", piped, *stop))  # fmt: skip
    resumed = check_ok(flatshard("train", "--resume", piped, "--nproc", 1, "--pp", 1,
                                 "--cp", 1))  # fmt: skip
    assert "resuming from step 2" in resumed.stdout
    expected, losses = ([r["loss"] for r in metrics(d)] for d in (straight, piped))
    assert len(losses) == 3
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, expected))
    _exports_agree(tmp_path, straight, piped, phi3)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A Llama whose head is its embedding (tie_word_embeddings, as SmolLM2, Llama-3.2-1B,
    Qwen2.5-0.5B and Gemma have it): no lm_head.weight on disk."""
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tied")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def test_a_tied_model_trains_in_pipeline_stages_and_resumes_at_any_layout(tied, tmp_path):
    """Tied embeddings under --pp 2 (world 4, dp 2): the first stage owns the weight, the
    last receives it each step and sends its gradient back. Stopped at step 2, resumed in
    one process, stopped at 3, resumed in stages again (world 2, two stages a rank under a
    zero-bubble schedule): the losses of an uninterrupted data-parallel run, and the same
    export (no lm_head.weight, as the model's own)."""
    straight, piped = tmp_path / "straight", tmp_path / "piped"
    run = [*RUN, "--global-batch", 8, "--steps", 4, "--lr", "1e-2"]
    check_ok(flatshard("train", "--hf", tied, *run, "--nproc", 2, "--out", straight))
    check_ok(flatshard("train", "--hf", tied, *run, "--nproc", 4, "--pp", 2, "--out", piped,
                       "--set", "run.stop_at_step=2"))  # fmt: skip
    check_ok(flatshard("train", "--resume", piped, "--nproc", 1, "--pp", 1,
                       "--set", "run.stop_at_step=3"))  # fmt: skip
    resumed = check_ok(flatshard("train", "--resume", piped, "--nproc", 2, "--pp", 2,
                                 "--pp-schedule", "interleaved-zb"))  # fmt: skip
    assert "resuming from step 3" in resumed.stdout
    expected, losses = ([r["loss"] for r in metrics(d)] for d in (straight, piped))
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1  # lr 1e-2: it learns
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, expected))
    _exports_agree(tmp_path, straight, piped, tied)


def test_an_moe_fine_tune_with_its_balancing_loss_and_pipelined_without(mixtral, tmp_path):
    """Mixtral, its config.json asking for the load-balancing loss (output_router_logits):
    2 data-parallel processes train with the losses of one process (the routing counts
    summed over the ranks), which are not those without the loss; so do 2 pipeline stages
    with each sequence split over 2 CP ranks (each stage handing on its routers' totals,
    the last computing the term). Without it, --pp 2
    --ep 2 (each stage's experts split over its own ranks) has the losses of data
    parallelism and exports its weights."""
    path, _ = mixtral
    balanced = tmp_path / "balanced-model"
    balanced.mkdir()
    config = json.loads((path / "config.json").read_text())
    (balanced / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    os.symlink(path / "model.safetensors", balanced / "model.safetensors")
    run = [*RUN, "--global-batch", 8, "--steps", 3]  # 2 micro-batches a data-parallel rank
    losses = {}
    for name, model, nproc, more in [("balanced", balanced, 2, []), ("alone", balanced, 1, []),
                                     ("staged", balanced, 4, ["--pp", 2, "--cp", 2]),
                                     ("straight", path, 2, []),
                                     ("piped", path, 4, ["--pp", 2, "--ep", 2])]:
        check_ok(flatshard("train", "--hf", model, *run, "--nproc", nproc, *more,
                           "--out", tmp_path / name))  # fmt: skip
        losses[name] = [r["loss"] for r in metrics(tmp_path / name)]
        assert len(losses[name]) == 3
    assert losses["balanced"] == pytest.approx(losses["alone"], rel=1e-6)
    assert losses["staged"] == pytest.approx(losses["alone"], rel=1e-6)
    assert losses["piped"] == pytest.approx(losses["straight"], rel=1e-6)
    # the term weighs 0.001 x ~2 (experts' imbalance): above the runs' rounding, below 1%
    assert all(1e-5 < b - s < 1e-2 * s for b, s in zip(losses["balanced"], losses["straight"]))
    _exports_agree(tmp_path, tmp_path / "straight", tmp_path / "piped", path)


def test_routers_with_a_correction_bias_balance_by_it(mixtral, tmp_path):
    """GLM-4-MoE's routers carry DeepSeek-V3's score-correction bias, which transformers
    never moves: with model.bias_update_speed each router counts the experts its training
    forwards chose and its bias moves after every step. Two processes train as one (the
    counts summed over the ranks), as two with the experts split (--ep 2) and as two with
    the layers split by TP and the sequence between them (--tp 2 --sp: each MoE block sees
    the gathered sequence, so each TP rank counts every token); the exported biases are
    whole numbers of moves, the same in all four, and they changed the routing (the losses
    of a run without them differ). A model without such routers is refused."""
    torch.manual_seed(0)
    config = transformers.Glm4MoeConfig(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, n_shared_experts=1, max_position_embeddings=64,
    )  # fmt: skip  (two MoE layers after a dense one)
    path = tmp_path / "glm4-moe"
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    speed, steps = 0.05, 3
    run = [*RUN, "--global-batch", 8, "--steps", steps]
    losses, biases = {}, {}
    for name, nproc, more in [("two", 2, []), ("one", 1, []), ("ep", 2, ["--ep", 2]),
                              ("sp", 2, ["--tp", 2, "--sp"]), ("fixed", 2, None)]:  # fmt: skip
        balance = ["--set", f"model.bias_update_speed={0 if more is None else speed}"]
        check_ok(flatshard("train", "--hf", path, *run, "--nproc", nproc, *(more or []),
                           *balance, "--out", tmp_path / name))  # fmt: skip
        losses[name] = [r["loss"] for r in metrics(tmp_path / name)]
        assert main(["convert", "checkpoint-to-hf", str(tmp_path / name),
                     str(tmp_path / f"hf-{name}")]) == 0  # fmt: skip
        exported = load_file(tmp_path / f"hf-{name}" / "model.safetensors")
        biases[name] = {n: t for n, t in exported.items() if n.endswith("e_score_correction_bias")}
    assert len(biases["two"]) == 2  # the two MoE layers' routers
    assert losses["one"] == pytest.approx(losses["two"], rel=1e-6)
    assert losses["ep"] == pytest.approx(losses["two"], rel=1e-6)
    assert losses["sp"] == pytest.approx(losses["two"], rel=1e-6)
    for name, bias in biases["two"].items():
        moves = bias / speed  # each step: +1, -1 or 0 (an expert at the mean load) per expert
        assert torch.allclose(moves, moves.round(), atol=1e-4) and moves.abs().max() <= steps
        assert moves.abs().sum() > 0, name
        assert all(torch.allclose(biases[other][name], bias) for other in ("one", "ep", "sp"))
        assert not biases["fixed"][name].any()
    assert losses["fixed"][0] == pytest.approx(losses["two"][0], rel=1e-6)  # before any move
    assert any(abs(f - b) > 1e-6 * b for f, b in zip(losses["fixed"][1:], losses["two"][1:]))

    path, _ = mixtral
    message = one_line_error(flatshard("train", "--hf", path, *run, "--set",
                                       "model.bias_update_speed=0.001"))  # fmt: skip
    assert "no score-correction bias" in message, message


def test_a_fine_tune_trains_in_training_mode(mixtral, tmp_path):
    """A transformers model comes in eval mode (as from_pretrained leaves it); the trainer
    trains it in training mode, as transformers' Trainer does: LoRA's dropout then acts. The
    adapters start at zero, so the first step's loss is the same with and without dropout;
    once they have trained, the losses part (in eval mode they stayed equal). The masks come
    from train.seed: the same run again has the same losses (it once drew from an unseeded
    generator, different every run)."""
    path, _ = mixtral
    losses = {}
    for dropout in (0.0, 0.5, "0.5 again"):
        out = tmp_path / f"dropout-{dropout}"
        rate = str(dropout).split()[0]
        check_ok(flatshard("train", "--hf", path, *RUN, "--steps", 3, "--nproc", 1, "--lora", 4,
                           "--lr", "1e-2", "--set", f"train.lora_dropout={rate}",
                           "--out", out))  # fmt: skip
        losses[dropout] = [r["loss"] for r in metrics(out)]
    assert losses["0.5 again"] == losses[0.5]
    assert losses[0.5][0] == pytest.approx(losses[0.0][0], rel=1e-6)
    # lr 1e-2: the losses part by ~1e-3 (at the default lr by ~1e-6, too close to rounding to tell)
    assert all(abs(a - b) > 1e-4 * b for a, b in zip(losses[0.5][1:], losses[0.0][1:])), losses


def test_lora_under_tp_and_ep_trains_as_in_one_process(phi3, mixtral, tmp_path):
    """LoRA on transformers-built families split by transformers' own plans: Phi-3's fused
    qkv_proj and gate_up_proj adapted whole under --tp 2 (one B over the parts, split by
    parts as its base, added before the attention gathers the fused output), Mixtral's
    attention under --tp 2 --ep 2 (its frozen grouped experts split over EP): the losses of
    one process."""
    fused = ["--set", "train.lora_targets=qkv_proj,o_proj,gate_up_proj,down_proj"]
    for source, layout, extra in (
        (phi3, ["--nproc", 2, "--tp", 2], fused),
        (mixtral[0], ["--nproc", 4, "--tp", 2, "--ep", 2], []),
    ):
        losses = []
        for where in (["--nproc", 1], layout):
            out = tmp_path / f"{os.path.basename(source)}-{len(losses)}"
            check_ok(flatshard("train", "--hf", source, *RUN, "--steps", 3, "--lora", 4,
                               "--lr", "1e-2", *extra, *where, "--out", out))  # fmt: skip
            losses.append([r["loss"] for r in metrics(out)])
        one, split = losses
        assert len(one) == 3 and one[-1] != one[0]  # the adapters train
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(one, split)), (source, losses)


def _exports_agree(tmp_path, straight, other, source) -> None:
    """Both runs' checkpoints convert to the source model's tensors, equal to each other's,
    and `other`'s loads in transformers."""
    exports = []
    for run_dir in (straight, other):
        out = tmp_path / f"hf-{run_dir.name}"
        assert main(["convert", "checkpoint-to-hf", str(run_dir), str(out)]) == 0
        exports.append(load_file(out / "model.safetensors"))
    assert exports[0].keys() == exports[1].keys() == load_file(source / "model.safetensors").keys()
    for name, tensor in exports[0].items():
        assert torch.allclose(exports[1][name], tensor, rtol=1e-5, atol=1e-6), name
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{other.name}")


def test_a_tp_that_does_not_divide_the_heads_is_one_line(phi3):
    message = one_line_error(
        flatshard("train", "--hf", phi3, *RUN, "--steps", 1, "--nproc", 4, "--tp", 4)
    )
    assert "train.tp=4" in message and "num_key_value_heads is 2, not divisible by 4" in message


def test_expert_parallel_fine_tune_resumes_at_other_layouts(mixtral, tmp_path):
    """--hf at (tp 2, ep 2), stopped at step 2, resumed at (tp 1, ep 4) and in one process:
    both continue the losses of an uninterrupted data-parallel run."""
    path, _ = mixtral
    straight, split = tmp_path / "straight", tmp_path / "split"
    run = [*RUN, "--steps", 3]
    check_ok(flatshard("train", "--hf", path, *run, "--nproc", 2, "--out", straight))
    stop = ["--set", "run.stop_at_step=2"]
    parallel = ["--nproc", 4, "--tp", 2, "--ep", 2]
    tp_and_ep = check_ok(flatshard("train", "--hf", path, *run, *parallel, "--out", split, *stop))
    # torch's 5-line note on reducing the gradient norm dim by dim is not printed per rank
    assert "sequential all_reduce" not in tp_and_ep.stderr + tp_and_ep.stdout
    alone = tmp_path / "alone"
    shutil.copytree(split, alone)
    wide = ["--nproc", 4, "--tp", 1, "--ep", 4, "--micro-batch", 1]  # dp 4: 1 x 4 = the batch
    check_ok(flatshard("train", "--resume", split, *wide))
    check_ok(flatshard("train", "--resume", alone, "--nproc", 1, "--tp", 1, "--ep", 1))
    expected = [r["loss"] for r in metrics(straight)]
    for run_dir in (split, alone):
        losses = [r["loss"] for r in metrics(run_dir)]
        assert len(losses) == 3
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, expected)), run_dir


def test_expert_parallelism_of_a_dense_model_is_one_line(phi3):
    message = one_line_error(
        flatshard("train", "--hf", phi3, *RUN, "--steps", 1, "--nproc", 2, "--ep", 2)
    )
    assert "train.ep=2" in message and "no experts to split" in message and "ep=1" in message


def test_plan_of_a_hf_model_under_tp_and_ep(mixtral, capsys):
    """--tp/--ep on the command line re-derive dp_shard for that world (2, not the training
    config's 4); each rank holds E/ep experts, sharded over efsdp = world/ep = 2."""
    path, _ = mixtral
    args = ["--world-size", 4, "--tp", 2, "--ep", 2, "--json"]
    assert main(["plan", "--set", f"model.hf={path}", *map(str, args)]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["setup"]["dp_shard"] == 2
    experts = next(u for u in planned["units"] if u["name"].endswith("experts"))
    per_rank_experts = 4 // 2 * 3 * 48 * 32  # E/ep experts of gate, up and down (48 x 32)
    assert experts["numel"] == per_rank_experts and experts["shard"] == per_rank_experts // 2
    assert planned["communication"]["tp_all_reduce"] > 0
    assert planned["communication"]["ep_all_to_all"] > 0


def test_plan_of_a_transformers_family_under_tp(phi3, capsys):
    """A family the zoo has no formulas for (Phi-3) is planned from the transformers model:
    its decoder layers as units, TP-local as transformers' plan splits them (qkv_proj and
    gate_up_proj per part, o_proj and down_proj by input)."""
    args = ["--world-size", 4, "--tp", 2, "--json"]
    assert main(["plan", "--set", f"model.hf={phi3}", *map(str, args)]) == 0
    planned = json.loads(capsys.readouterr().out)
    layers = planned["units"][0]
    hidden, qkv, ffn = 32, (4 + 2 * 2) * 8, 48  # 4 heads + 2 x 2 kv heads of 8
    per_tp_rank = (qkv * hidden + hidden * hidden + 2 * ffn * hidden + hidden * ffn) // 2
    assert layers["count"] == 2 and layers["numel"] == per_tp_rank + 2 * hidden  # + 2 norms
    assert planned["num_params"] == sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(phi3).parameters()
    )
    assert planned["communication"]["tp_all_reduce"] > 0
