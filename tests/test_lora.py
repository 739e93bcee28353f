"""LoRA in the trainer (`flatshard train --hf DIR --lora R`): a tiny random Llama with a tiny
tokenizer built in the test. The adapters start at zero (the first loss is the base model's),
train the same at world 1 and 2, are all the optimizer and the checkpoint hold, resume at
another world size as if never stopped, and export two ways that agree with each other and
with transformers + peft: the base with the adapters merged in (transformers loads it) and a
PEFT adapter directory (`peft.PeftModel` loads it on the base)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_cli_helpers import check_ok, flatshard, metrics, one_line_error, run_in_process
from tiny_tokenizer import TRAINING_TEXT, make_llama_dir

from flatshard.checkpoint import commit
from flatshard.cli import runs
from flatshard.cli.main import main
from flatshard.data import token_cache
from flatshard.data.sequences import SequenceOrder

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, SEQ = 4, 16
TRAIN = ["--steps", STEPS, "--seq-len", SEQ, "--micro-batch", 2, "--global-batch", 4,
         "--lora", 4, "--lr", "1e-2", "--set", "run.sample_tokens=0",
         "--set", "run.log_interval=1", "--set", "checkpoint.interval=0"]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(model directory, text file): a tiny random Llama with its own tokenizer."""
    path = tmp_path_factory.mktemp("base")
    make_llama_dir(path, intermediate_size=48, max_position_embeddings=64)
    text = path.parent / "text.txt"
    text.write_text("\n".join(TRAINING_TEXT * 20))
    return str(path), str(text)


@pytest.fixture(scope="module")
def runs_at(base, tmp_path_factory):
    """The same LoRA fine-tune at world 1 (this process) and 2: run directories."""
    path, text = base
    root = tmp_path_factory.mktemp("lora-runs")
    one, two = root / "one", root / "two"
    assert run_in_process("train", "--hf", path, "--data", text, *TRAIN, "--nproc", 1,
                          "--out", one) == 0  # fmt: skip
    check_ok(
        flatshard(
            "train",
            "--hf",
            path,
            "--data",
            text,
            *TRAIN,
            "--nproc",
            2,
            "--out",
            two,
            "--set",
            "run.sample_tokens=4",
        )
    )  # the closing sample: base + adapters
    assert (two / "sample.txt").read_text().strip()
    return one, two


def _base_loss(path: str, text: str, run) -> float:
    """The base model's loss on the run's first batch (transformers, the run's token file)."""
    step_dir = commit.latest_dir(runs.checkpoint_root(str(run)))
    tokens = np.load(token_cache.cache_file(text, runs.saved_extra(step_dir, "tokenizer")))
    batch = SequenceOrder(tokens, SEQ, 0).batch(0, 4)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def test_lora_trains_the_same_at_world_1_and_2_from_the_base_models_loss(base, runs_at):
    one, two = (metrics(run) for run in runs_at)
    losses = [[r["loss"] for r in records] for records in (one, two)]
    assert len(losses[0]) == STEPS
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(*losses)), losses
    assert losses[0][-1] < losses[0][0]  # it learns
    # the adapters start at zero: step 1 is the base model's own loss on the same tokens
    path, text = base
    assert abs(losses[0][0] - _base_loss(path, text, runs_at[0])) <= 1e-4 * losses[0][0]


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state(runs_at):
    step_dir = commit.latest_dir(runs.checkpoint_root(str(runs_at[1])))
    keys = [k for k in runs.stored_keys(step_dir) if k.startswith(("model.", "optim."))]
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    # 2 layers x (q, k, v, o, down + gate and up in the fused projection) x (A, B)
    assert len(weights) == 2 * 7 * 2
    moments = [k for k in keys if k.startswith("optim.state.")]
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments)


def test_a_resume_at_another_world_size_goes_on_as_if_never_stopped(base, runs_at, tmp_path):
    path, text = base
    run = tmp_path / "stopped"
    check_ok(flatshard("train", "--hf", path, "--data", text, *TRAIN, "--nproc", 2,
                       "--out", run, "--set", "run.stop_at_step=2"))  # fmt: skip
    assert run_in_process("train", "--resume", run, "--nproc", 1) == 0
    resumed = [r["loss"] for r in metrics(run)][-2:]
    straight = [r["loss"] for r in metrics(runs_at[1])][-2:]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(resumed, straight)), (resumed, straight)


def test_lora_under_tp_sp_and_cp_trains_as_in_one_process_and_resumes_without(
    base, runs_at, tmp_path
):
    """--tp 2 --sp --cp 2 at world 4: each adapter split as its base (A whole and B by rows
    for q/k/v, by parts for the fused gate_up; A by columns and B whole for o and down), the
    frozen norms staying frozen under sequence parallelism (torch's SequenceParallel makes
    them trainable again); stopped at step 2 and resumed in one process: the losses of the
    one-process run, the checkpoint the same adapters whatever the layout."""
    path, text = base
    run = tmp_path / "split"
    check_ok(flatshard("train", "--hf", path, "--data", text, *TRAIN, "--nproc", 4, "--tp", 2,
                       "--sp", "--cp", 2, "--out", run, "--set", "run.stop_at_step=2"))  # fmt: skip
    assert run_in_process("train", "--resume", run, "--nproc", 1, "--tp", 1, "--cp", 1,
                          "--set", "train.sp=false") == 0  # fmt: skip
    losses, straight = ([r["loss"] for r in metrics(d)] for d in (run, runs_at[0]))
    assert len(losses) == STEPS
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, straight)), (losses, straight)


def test_lora_in_pipeline_stages_trains_as_in_one_process(base, runs_at, tmp_path):
    """--pp 2 --tp 2 at world 4: the adapters added to the whole model before it is split
    into stages, each stage's drawn as the whole model's (a stage holds some of them), split
    over TP within it: the losses of the one-process run."""
    path, text = base
    run = tmp_path / "staged"
    check_ok(flatshard("train", "--hf", path, "--data", text, *TRAIN, "--nproc", 4, "--pp", 2,
                       "--tp", 2, "--out", run))  # fmt: skip
    losses, straight = ([r["loss"] for r in metrics(d)] for d in (run, runs_at[0]))
    assert len(losses) == STEPS
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, straight)), (losses, straight)


def test_merged_and_peft_exports_load_in_transformers_and_peft_alike(
    base, runs_at, tmp_path, capsys
):
    path, _ = base
    run = runs_at[1]
    merged, adapters = tmp_path / "merged", tmp_path / "adapters"
    assert run_in_process("convert", "checkpoint-to-hf", run, merged) == 0
    assert run_in_process("convert", "checkpoint-to-hf", run, adapters, "--peft") == 0
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"}  # fmt: skip
    saved = load_file(adapters / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight" in saved

    tokens = torch.randint(0, 200, (2, 12))
    load = lambda where: transformers.AutoModelForCausalLM.from_pretrained(where).float().eval()
    tuned, untouched = load(merged), load(path)
    with_adapters = peft.PeftModel.from_pretrained(load(path), str(adapters)).eval()
    with torch.no_grad():
        want, got = with_adapters(tokens).logits, tuned(tokens).logits
        before = untouched(tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got - before).abs().max() > 1e-3  # the adapters changed the model
    # what LoRA leaves frozen comes back bitwise
    tuned_state, base_state = tuned.state_dict(), untouched.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(tuned_state[name], base_state[name]), name

    # flatshard sample on the LoRA checkpoint (base + adapters) decodes as the merged model
    capsys.readouterr()
    assert run_in_process("sample", "--checkpoint", run, "--prompt-ids", "5,6,7",
                          "--temperature", 0, "--tokens", 6) == 0  # fmt: skip
    sampled = [int(i) for i in capsys.readouterr().out.split()]
    greedy = tuned.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)
    assert sampled == greedy[0, : len(sampled)].tolist() and len(sampled) > 3


def test_lora_settings_that_cannot_apply_are_one_line_errors(base, runs_at):
    path, text = base
    no_hf = one_line_error(flatshard("train", "--lora", 4, "--steps", 1))
    assert "set model.hf" in no_hf
    wrong = one_line_error(flatshard("train", "--hf", path, "--data", text, *TRAIN, "--nproc", 1,
                                     "--set", "train.lora_targets=wq,wk"))  # fmt: skip
    assert "no Linear of the model is named as a lora target (wq, wk)" in wrong
    other = one_line_error(flatshard("train", "--resume", runs_at[1], "--lora", 8))
    assert "train.lora_rank: run 4, given 8" in other  # its checkpoints hold rank-4 adapters


def test_the_plan_counts_gradients_and_optimizer_state_of_the_adapters_only(capsys):
    """`flatshard plan --lora 16` on Llama-3-8B at 8 ranks: AdamW's two fp32 states and the
    fp32 gradient shards of the adapters alone (r x in + out x r per projection); with
    --qlora the adapted bases' shards in NF4 bytes."""
    plans = {}
    for lora in ((), ("--lora", 16)):
        assert main(["plan", "llama3-8b", "--world-size", "8", *map(str, lora), "--json"]) == 0
        plans[bool(lora)] = json.loads(capsys.readouterr().out)["memory"]
    d, kv, ffn, r = 4096, 1024, 14336, 16
    per_layer = 2 * r * (d + d) + 2 * r * (d + kv) + 3 * r * (d + ffn)  # q, o; k, v; MLP
    adapters = 32 * per_layer
    assert plans[True]["optimizer"] == 2 * 4 * adapters // 8
    assert plans[True]["grads"] == 4 * adapters // 8
    assert plans[False]["grads"] > 100 * plans[True]["grads"]
    assert plans[True]["params"] >= plans[False]["params"]  # the base is all still there
    # --tp 2 (dp_shard 4): A whole and B halved for q, k, v, gate, up (column-parallel
    # bases); A halved and B whole for o and down (row-parallel)
    assert main(["plan", "llama3-8b", "--world-size", "8", "--lora", "16", "--tp", "2",
                 "--json"]) == 0  # fmt: skip
    split = json.loads(capsys.readouterr().out)["memory"]
    colwise = r * d + d * r // 2 + 2 * (r * d + kv * r // 2) + 2 * (r * d + ffn * r // 2)
    rowwise = (r * d // 2 + d * r) + (r * ffn // 2 + d * r)
    assert split["grads"] == 4 * 32 * (colwise + rowwise) // 4
    for degree in ("--tp", "--pp", "--cp"):
        assert main(["plan", "llama3-8b", "--lora", "16", "--qlora", degree, "2"]) == 2
        assert f"--qlora with {degree} > 1 is not supported" in capsys.readouterr().err
    # --qlora: the adapted bases in NF4, 4 bits a value + an int8 scale per 64 + an fp32
    # factor per 256 blocks + a mean, instead of 32 bits a value
    assert main(["plan", "llama3-8b", "--world-size", "8", "--lora", "16", "--qlora",
                 "--json"]) == 0  # fmt: skip
    qlora = json.loads(capsys.readouterr().out)["memory"]
    shapes = [(d, d)] * 2 + [(kv, d)] * 2 + [(2 * ffn, d), (d, ffn)]  # q o, k v, gate_up, down
    numel = 32 * sum(a * b for a, b in shapes)
    nf4 = 32 * sum(a * b // 2 + a * b // 64 + 4 * (a * b // 64 // 256) + 4 for a, b in shapes)
    expected = plans[True]["params"] - 4 * numel // 8 + nf4 // 8
    assert abs(qlora["params"] - expected) <= 1e-3 * expected  # the buckets pad a little less
    assert qlora["grads"] == plans[True]["grads"] and qlora["optimizer"] == plans[True]["optimizer"]


@pytest.fixture(scope="module")
def qlora_runs(base, tmp_path_factory):
    """The LoRA fine-tune over NF4 bases (--qlora) at world 1 (this process) and 2."""
    path, text = base
    root = tmp_path_factory.mktemp("qlora-runs")
    one, two = root / "one", root / "two"
    args = ["train", "--hf", path, "--data", text, *TRAIN, "--qlora"]
    assert run_in_process(*args, "--nproc", 1, "--out", one) == 0
    check_ok(flatshard(*args, "--nproc", 2, "--out", two, "--set", "run.sample_tokens=4"))
    assert (two / "sample.txt").read_text().strip()  # the closing sample: NF4 values + adapters
    return one, two


def test_qlora_trains_over_nf4_bases_the_same_at_world_1_and_2(base, qlora_runs, runs_at):
    """--qlora: the same losses at world 1 and 2 (the quantized base does not depend on the
    world size), starting at the NF4 base's own loss, which is near the full base's but
    not it; the checkpoint holds the adapters only."""
    from flatshard import hf
    from flatshard.models.lora import LoRASpec, add_lora, init_adapters
    from flatshard.models.qlora import quantize_bases
    from flatshard.models.registry import next_token_loss

    one, two = ([r["loss"] for r in metrics(run)] for run in qlora_runs)
    assert len(one) == STEPS and one[-1] < one[0]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)
    path, text = base
    model = hf.from_pretrained(path, device="cpu")
    add_lora(model, LoRASpec(4, 8.0))
    groups = quantize_bases(model, 1)
    init_adapters(model, 0)  # B is zero: the model is its base
    assert (
        set(type(m.weight).__name__ for m in model.modules() if hasattr(m, "lora_A"))
        == {"NF4Tensor"}
        and len(groups) == 2 * 6
    )  # 2 layers x q, k, v, o, gate_up (fused), down
    step_dir = commit.latest_dir(runs.checkpoint_root(str(qlora_runs[0])))
    tokens = np.load(token_cache.cache_file(text, runs.saved_extra(step_dir, "tokenizer")))
    with torch.no_grad():
        nf4_loss = next_token_loss(model, SequenceOrder(tokens, SEQ, 0).batch(0, 4)).item()
    full_loss = metrics(runs_at[0])[0]["loss"]  # the LoRA run's first: the full base's
    assert abs(one[0] - nf4_loss) <= 1e-5 * nf4_loss
    assert 1e-4 < abs(nf4_loss - full_loss) / full_loss < 0.05
    keys = [k for k in runs.stored_keys(step_dir) if k.startswith("model.")]
    assert len(keys) == 2 * 7 * 2 and all(".lora_" in k for k in keys)


def test_nf4_bases_that_cannot_split_are_one_line_errors(base):
    from flatshard.models.lora import LoRAError
    from flatshard.models.qlora import check_split, scale_group

    assert scale_group((4096, 4096), "w") == 256  # QLoRA's own, up to 1024-way splits
    assert scale_group((576, 576), "w") == 8  # SmolLM2's: 5,184 blocks = 2^6 x 81
    with pytest.raises(LoRAError, match="does not split over 16 ranks"):
        check_split((576, 576), 8, 16, "q_proj.weight")
    path, text = base
    lonely = one_line_error(flatshard("train", "--hf", path, "--data", text, "--qlora",
                                      "--steps", 1, "--nproc", 1))  # fmt: skip
    assert "train.qlora quantizes the bases LoRA adapts: set train.lora_rank" in lonely
    # (--pp and --cp alike: the plan test refuses all three in this process)
    split = one_line_error(flatshard("train", "--hf", path, "--data", text, *TRAIN, "--qlora",
                                     "--nproc", 2, "--tp", 2))  # fmt: skip
    assert "train.qlora with train.tp > 1" in split and "set train.tp to 1" in split, split
