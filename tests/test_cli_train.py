"""`flatshard train` end to end, as a user runs it: two local gloo ranks, checkpoints, exact
resume, Ctrl-C, a non-finite loss, sampling at world sizes 1 and 2, inspect, and the
planner's memory and communication figures against a measured run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_cli_helpers import TINY, check_ok, cli_env, flatshard, metrics, one_line_error

from flatshard.models import LlamaConfig

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

STEPS = 8


def test_train_resume_sample_inspect(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    check_ok(flatshard("train", *TINY, "--steps", STEPS, "--out", straight))
    expected = [r["loss"] for r in metrics(straight)]
    assert len(expected) == STEPS and expected[-1] < expected[0]

    # the same run, stopped after step 3 (with a checkpoint), then resumed
    first = check_ok(
        flatshard("train", *TINY, "--steps", STEPS, "--out", split, "--set", "run.stop_at_step=3")
    )
    assert "stopped at step 3" in first.stdout
    assert sorted(os.listdir(split / "checkpoints")) == ["latest", "step-00000003"]
    resumed = check_ok(flatshard("train", "--resume", split, "--set", "run.sample_tokens=6"))
    assert "resuming from step 3" in resumed.stdout
    # the load says what it reads before it starts, and how long it took
    loading = (
        r"loading \S+step-00000003: [0-9.]+ MiB saved by 2 process\(es\), into 2 "
        r"process\(es\)\.\.\.\nloaded step 3 in [0-9.]+ s"
    )
    assert re.search(loading, resumed.stdout), resumed.stdout
    # the closing sample says how long it took (it can be the longest part of a short run)
    assert re.search(r"6 tokens in [0-9.]+ s \([0-9,.]+ tokens/s\)", resumed.stderr)
    assert (split / "sample.txt").read_text().startswith("The ")
    assert [r["step"] for r in metrics(split)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in metrics(split)] == expected  # bitwise: same world, same order

    record = metrics(split)[-1]
    assert record["tokens"] == STEPS * 4 * 32 and record["comm_bytes"] > 0
    assert record["peak_mem_bytes"] > 0 and np.isfinite(record["grad_norm"])

    # greedy samples agree in one process (plain model) and on two ranks (sharded model)
    texts = []
    for nproc in (1, 2):
        result = check_ok(
            flatshard("sample", "--checkpoint", split, "--prompt", "The ", "--tokens", 24,
                      "--temperature", 0, "--nproc", nproc)
        )  # fmt: skip
        texts.append(result.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("The ") and len(texts[0]) > 10

    inspected = check_ok(flatshard("inspect", split)).stdout
    assert f"step: {STEPS}" in inspected and "saved by: 2 rank(s)" in inspected
    assert "embed_tokens.weight" in inspected and "(257, 64)" in inspected
    assert "size on disk:" in inspected and "exp_avg" in inspected
    info = json.loads(check_ok(flatshard("inspect", split / "checkpoints", "--json")).stdout)
    cfg = LlamaConfig(**info["model_config"])
    assert info["model_params"] == cfg.num_params() and cfg.dim == 64
    assert info["world_size"] == 2 and info["committed_steps"] == [3, STEPS]
    assert info["run_config"]["model"]["preset"] == "tiny"
    assert info["extras"]["data_position"] == STEPS * 4
    assert info["size_bytes"] > 3 * 4 * cfg.num_params()  # weights and two AdamW states


def test_ctrl_c_saves_and_resumes(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "flatshard", "train", *TINY, "--steps", 100000,
               "--out", run]  # fmt: skip
    proc = subprocess.Popen(
        list(map(str, command)), env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len(metrics(run)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err  # saved; resumable (EXIT_STOPPED)
    assert "interrupted by SIGINT" in out and "--resume" in out
    last = metrics(run)[-1]["step"]
    with open(run / "checkpoints" / "latest") as handle:
        assert handle.read().strip() == f"step-{last:08d}"
    check_ok(flatshard("train", "--resume", run, "--set", f"run.stop_at_step={last + 2}"))
    assert [r["step"] for r in metrics(run)][-3:] == [last, last + 1, last + 2]


def test_non_finite_loss_keeps_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    result = flatshard(
        "train", *TINY, "--steps", 20, "--out", run, "--lr", "1e6",
        "--set", "train.min_lr=0", "--set", "train.grad_clip=0", "--set", "train.warmup_steps=0",
        "--set", "checkpoint.interval=1",
    )  # fmt: skip
    line = one_line_error(result)
    assert "stopped without applying or saving it" in line and "last good checkpoint" in line
    failed_step = int(line.split("step ")[1].split(":")[0])
    steps = sorted(int(n.split("-")[1]) for n in os.listdir(run / "checkpoints") if n != "latest")
    assert steps[-1] == failed_step - 1 and f"step-{failed_step - 1:08d}" in line


def test_memmap_data_in_one_process(tmp_path):
    tokens = (np.arange(5000) * 7 % 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    run = tmp_path / "run"
    result = check_ok(
        flatshard("train", *TINY, "--steps", 3, "--nproc", 1, "--out", run,
                  "--data", tmp_path / "tokens.bin", "--set", "data.format=uint16")
    )  # fmt: skip
    assert "1 process(es)" in result.stdout and "vocab 1000" in result.stdout
    assert len(metrics(run)) == 3
    ids = check_ok(flatshard("sample", "--checkpoint", run, "--prompt-ids", "1,2,3", "--tokens", 5))
    assert len(ids.stdout.split()) == 8


def test_plan_matches_a_measured_run(tmp_path):
    """The planner's peak memory is within 10% of a run's measured peak memory, and
    its bytes per step equal the bytes the run's collectives moved."""
    sizes = ["--set", "model.preset=medium", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=1", "--set", "train.global_batch=2"]  # fmt: skip
    run = tmp_path / "run"
    # exact_memory: glibc returns freed buffers at once, so the resident peak is the live
    # peak rather than what the allocator kept cached
    check_ok(
        flatshard("train", *sizes, "--steps", 3, "--out", run, "--set", "run.sample_tokens=0",
                  "--set", "checkpoint.interval=0", "--set", "checkpoint.at_end=false",
                  exact_memory=True)
    )  # fmt: skip
    measured = metrics(run)[-1]
    plan = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)
    assert plan["setup"]["backend"] == "gloo" and plan["setup"]["world_size"] == 2
    assert measured["comm_bytes"] == plan["communication"]["total"]
    # 2 ranks x 32 tokens < 257 rows: the embedding is looked up from its shards
    assert measured["all_gather_bytes"] == plan["communication"]["all_gather"]
    assert measured["reduce_scatter_bytes"] == plan["communication"]["reduce_scatter"]
    predicted = plan["memory"]["total"]
    assert abs(measured["peak_mem_bytes"] - predicted) <= 0.10 * predicted, (
        measured["peak_mem_bytes"],
        predicted,
    )


def test_plan_matches_measured_peaks_per_activation_checkpointing_mode(tmp_path):
    """With activations dominant (16384 tokens on the tiny model), the planner's peak for
    --ac none, full and selective is within 10% of each run's measured peak, and the modes
    order as they should: full < selective < none. One process: with two, a loaded machine
    moves when each rank's collectives finish, and with them full AC's peak. Many tokens:
    what does not grow with them (the allocator's, the kernel's counting) stays small."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=256", "--set", "run.nproc=1",
             "--set", "train.micro_batch=64", "--set", "train.global_batch=64"]  # fmt: skip
    measured = {}
    for mode in ("none", "full", "selective"):
        run = tmp_path / mode
        check_ok(
            flatshard("train", *sizes, "--steps", 2, "--out", run, "--ac", mode,
                      "--set", "run.sample_tokens=0", "--set", "checkpoint.interval=0",
                      "--set", "checkpoint.at_end=false", exact_memory=True)
        )  # fmt: skip
        measured[mode] = metrics(run)[-1]["peak_mem_bytes"]
        plan = json.loads(check_ok(flatshard("plan", *sizes, "--ac", mode, "--json")).stdout)
        predicted = plan["memory"]["total"]
        assert abs(measured[mode] - predicted) <= 0.10 * predicted, (mode, measured, predicted)
    assert measured["full"] < measured["selective"] < measured["none"]


def test_plan_matches_measured_peaks_with_sequence_and_context_parallelism(tmp_path):
    """At 4096-token sequences (activations dominant), each rank's measured peak under TP +
    SP and under CP is within 10% of the planner's: its share of the activations (CP: plus
    the keys and values it gathers)."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=4096", "--set", "run.nproc=2",
             "--set", "train.micro_batch=4", "--set", "train.global_batch=4"]  # fmt: skip
    for layout in (["--set", "train.tp=2", "--set", "train.sp=true"], ["--set", "train.cp=2"]):
        run = tmp_path / layout[-1].replace("=", "")
        check_ok(
            flatshard("train", *sizes, *layout, "--steps", 2, "--out", run,
                      "--set", "run.sample_tokens=0", "--set", "checkpoint.interval=0",
                      "--set", "checkpoint.at_end=false", exact_memory=True)
        )  # fmt: skip
        measured = metrics(run)[-1]["peak_mem_bytes"]
        plan = json.loads(check_ok(flatshard("plan", *sizes, *layout, "--json")).stdout)
        predicted = plan["memory"]["total"]
        assert abs(measured - predicted) <= 0.10 * predicted, (layout, measured, predicted)
        assert plan["memory"]["activations"] > 0.8 * predicted  # what is being measured


@pytest.mark.parametrize(
    "stage, precision, weights, grads",
    [(1, "bf16", "none", "none"), (2, "fp32", "none", "int8"), (3, "bf16", "int8", "int8")],
)
def test_bytes_per_step_with_accumulation_match_the_plan(
    tmp_path, stage, precision, weights, grads
):
    """Also with the weights gathered (qwZ) and the gradients reduce-scattered (qgZ) in int8:
    the plan counts the quantized bytes."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=8",
             "--set", f"train.zero_stage={stage}", "--set", f"train.quantize_weights={weights}",
             "--set", f"train.quantize_grads={grads}",
             "--set", f"train.precision={precision}"]  # fmt: skip
    run = tmp_path / "run"
    check_ok(flatshard("train", *sizes, "--steps", 2, "--out", run, "--set", "run.sample_tokens=0"))
    plan = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)
    assert plan["setup"]["grad_accum"] == 2
    # ZeRO-3's first step gathers the last block once more (the forward order is learnt
    # then); the plan is the steady state
    for record in metrics(run)[1 if stage == 3 else 0 :]:
        assert record["all_gather_bytes"] == plan["communication"]["all_gather"]
        assert record["reduce_scatter_bytes"] == plan["communication"]["reduce_scatter"]


@pytest.mark.slow
def test_checkpoint_bytes_match_the_plan(tmp_path):
    """The DCP files a run's checkpoint writes hold what `flatshard plan` says it writes (its
    fp32 weights and AdamW state; within 1%: DCP frames each tensor in about a KiB, which a
    10.8M-parameter model makes small), one file per rank."""
    sizes = ["--set", "model.preset=small", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=4"]  # fmt: skip
    run = tmp_path / "run"
    check_ok(flatshard("train", *sizes, "--steps", 1, "--out", run, "--set", "run.sample_tokens=0"))
    saved = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)["checkpoint"]
    files = list((run / "checkpoints" / "step-00000001").glob("*.distcp"))
    written = sum(f.stat().st_size for f in files)
    assert len(files) == saved["writers"] == 2
    assert abs(written / saved["bytes"] - 1) < 0.01, (written, saved["bytes"])


def test_hsdp_run_bytes_match_the_plan(tmp_path):
    """`--dp-replicate 2` on 4 processes: HSDP (2 replicas x 2 shards); every byte the
    collectives move, the replica all-reduce included, is what `flatshard plan` predicts."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=8",
             "--set", "run.nproc=4", "--set", "train.dp_replicate=2"]  # fmt: skip
    run = tmp_path / "run"
    result = check_ok(
        flatshard("train", *sizes, "--steps", 2, "--out", run, "--set", "run.sample_tokens=0")
    )
    assert "4 process(es), gloo on cpu, ZeRO-3, fp32, HSDP over 2 replicas\n" in result.stdout
    plan = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)
    assert (plan["setup"]["world_size"], plan["setup"]["dp_shard"]) == (4, 2)
    # from the second step on: the first does not know yet which block runs last (ZeRO-3)
    for record in metrics(run)[1:]:
        assert record["replica_all_reduce_bytes"] == plan["communication"]["replica_all_reduce"] > 0
        assert record["comm_bytes"] == plan["communication"]["total"]


def test_hpz_run_bytes_match_the_plan(tmp_path):
    """`--hpz-group 2` on 4 processes: every gathered byte, those inside the pairs included,
    is what `flatshard plan` predicts (also with int8 weight gathers), and the run trains as
    plain ZeRO-3 does."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=8",
             "--set", "run.nproc=4"]  # fmt: skip
    hpz, plain = tmp_path / "hpz", tmp_path / "plain"
    common = ["--steps", 3, "--set", "run.sample_tokens=0"]
    check_ok(flatshard("train", *sizes, *common, "--out", hpz, "--set", "train.hpz_group=2"))
    check_ok(flatshard("train", *sizes, *common, "--out", plain))
    plan = json.loads(
        check_ok(flatshard("plan", *sizes, "--set", "train.hpz_group=2", "--json")).stdout
    )
    assert plan["communication"]["all_gather_in_hpz_groups"] > 0
    for record, baseline in zip(metrics(hpz)[1:], metrics(plain)[1:]):
        assert record["all_gather_bytes"] == plan["communication"]["all_gather"]
        assert abs(record["loss"] - baseline["loss"]) <= 1e-6 * baseline["loss"]
    # with the weights gathered in int8, inside the pairs too
    quantized = ["--set", "train.hpz_group=2", "--set", "train.quantize_weights=int8"]
    check_ok(flatshard("train", *sizes, *common, "--out", tmp_path / "q", *quantized))
    plan = json.loads(check_ok(flatshard("plan", *sizes, *quantized, "--json")).stdout)
    for record in metrics(tmp_path / "q")[1:]:
        assert record["all_gather_bytes"] == plan["communication"]["all_gather"]


def test_tensor_parallel_run_trains_like_data_parallel_and_resumes_without_tp(tmp_path):
    """`--tp 2` on 4 processes (2 data-parallel x 2 TP ranks) takes the steps a 2-process
    data-parallel run takes; its checkpoint resumes without TP, continuing those losses;
    its data-parallel bytes are what `flatshard plan --tp 2` predicts."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=8",
             "--set", "run.sample_tokens=0"]  # fmt: skip
    plain, tp = tmp_path / "plain", tmp_path / "tp"
    check_ok(flatshard("train", *sizes, "--steps", 4, "--nproc", 2, "--out", plain))
    result = check_ok(
        flatshard("train", *sizes, "--steps", 4, "--nproc", 4, "--tp", 2, "--out", tp,
                  "--set", "run.stop_at_step=2")
    )  # fmt: skip
    assert "tensor parallel over 2" in result.stdout
    assert "x 2 data-parallel rank(s)" in result.stdout
    check_ok(flatshard("train", "--resume", tp, "--nproc", 2, "--set", "train.tp=1"))
    expected = [r["loss"] for r in metrics(plain)]
    got = [r["loss"] for r in metrics(tp)]
    assert len(got) == 4
    assert max(abs(a - b) / b for a, b in zip(got, expected)) <= 1e-5, (got, expected)
    plan = json.loads(
        check_ok(flatshard("plan", *sizes, "--set", "run.nproc=4", "--set", "train.tp=2",
                           "--json")).stdout
    )  # fmt: skip
    assert (plan["setup"]["tp"], plan["setup"]["dp_shard"]) == (2, 2)
    assert plan["communication"]["tp_all_reduce"] > 0
    for record in metrics(tp)[1:2]:  # the TP steps (the first knows no backward order yet)
        assert record["all_gather_bytes"] == plan["communication"]["all_gather"]
        assert record["reduce_scatter_bytes"] == plan["communication"]["reduce_scatter"]


def test_sequence_parallel_run_trains_like_one_process_and_resumes_without_tp(tmp_path):
    """`--tp 2 --sp` on 2 processes (the norms and residual stream split by sequence) takes
    the steps one process takes; its checkpoint resumes in one process without TP,
    continuing those losses; `--sp` alone, and a sequence the TP ranks cannot split evenly,
    are one-line errors."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=4",
             "--set", "run.sample_tokens=0"]  # fmt: skip
    plain, sp = tmp_path / "plain", tmp_path / "sp"
    check_ok(flatshard("train", *sizes, "--steps", 4, "--nproc", 1, "--out", plain))
    result = check_ok(
        flatshard("train", *sizes, "--steps", 4, "--nproc", 2, "--tp", 2, "--sp", "--out", sp,
                  "--set", "run.stop_at_step=2")
    )  # fmt: skip
    assert "tensor parallel over 2 (+ sequence)" in result.stdout
    check_ok(flatshard("train", "--resume", sp, "--nproc", 1, "--set", "train.tp=1",
                       "--set", "train.sp=false"))  # fmt: skip
    expected = [r["loss"] for r in metrics(plain)]
    got = [r["loss"] for r in metrics(sp)]
    assert len(got) == 4
    assert max(abs(a - b) / b for a, b in zip(got, expected)) <= 1e-5, (got, expected)
    alone = flatshard("train", *sizes, "--steps", 1, "--nproc", 2, "--sp", "--out", tmp_path / "x")
    assert (
        "train.sp (sequence parallelism) splits the sequence over the TP ranks"
        in one_line_error(alone)
    )
    odd = flatshard("train", *sizes, "--steps", 1, "--nproc", 2, "--tp", 2, "--sp",
                    "--set", "data.seq_len=31", "--out", tmp_path / "odd")  # fmt: skip
    assert "data.seq_len (31) must be a multiple of train.tp" in one_line_error(odd)


def test_context_parallel_run_trains_like_one_process_and_resumes_without_cp(tmp_path):
    """`--cp 2 --tp 2` on 4 processes (each sequence split over a CP pair in load-balanced
    chunks, attention over the whole) takes the steps and evaluates as one process; its
    checkpoint resumes in one process, continuing those losses; a sequence length the
    chunks cannot split is a one-line error."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=4",
             "--set", "run.sample_tokens=0", "--set", "data.eval=0.05",
             "--set", "train.eval_interval=2"]  # fmt: skip
    plain, cp = tmp_path / "plain", tmp_path / "cp"
    check_ok(flatshard("train", *sizes, "--steps", 4, "--nproc", 1, "--out", plain))
    result = check_ok(
        flatshard("train", *sizes, "--steps", 4, "--nproc", 4, "--cp", 2, "--tp", 2,
                  "--out", cp, "--set", "run.stop_at_step=2")
    )  # fmt: skip
    assert "each sequence split over 2 (context parallel)" in result.stdout
    check_ok(flatshard("train", "--resume", cp, "--nproc", 1, "--set", "train.cp=1",
                       "--set", "train.tp=1"))  # fmt: skip
    expected, got = metrics(plain), metrics(cp)
    assert len(got) == 4
    for key in ("loss", "eval_loss"):
        pairs = [(r[key], e[key]) for r, e in zip(got, expected) if key in r]
        assert len(pairs) == (4 if key == "loss" else 2), (key, pairs)
        assert max(abs(a - b) / b for a, b in pairs) <= 1e-5, (key, pairs)
    odd = flatshard("train", *sizes, "--steps", 1, "--nproc", 2, "--cp", 2,
                    "--set", "data.seq_len=30", "--out", tmp_path / "odd")  # fmt: skip
    assert "data.seq_len (30) must be a multiple of 4" in one_line_error(odd)


# moe-tiny with a large aux loss weight, as `flatshard train` and `flatshard plan` take it
MOE_TINY = ["--set", "model.preset=moe-tiny", "--set", "data.seq_len=32",
            "--set", "train.micro_batch=2", "--set", "train.global_batch=8",
            "--set", "run.sample_tokens=0", "--set", "model.aux_loss_coef=0.1"]  # fmt: skip


def test_expert_parallel_run_trains_like_data_parallel_and_resumes_at_another_ep(tmp_path):
    """`--model moe-tiny --ep 2` on 4 processes (experts split over pairs, sharded over the
    other two) takes the steps a plain 4-process run takes, and its checkpoint resumes at
    `--ep 4`, continuing those losses."""
    sizes = MOE_TINY
    plain, ep = tmp_path / "plain", tmp_path / "ep"
    check_ok(flatshard("train", *sizes, "--steps", 3, "--nproc", 4, "--out", plain))
    check_ok(
        flatshard("train", *sizes, "--steps", 3, "--nproc", 4, "--ep", 2, "--out", ep,
                  "--set", "run.stop_at_step=2")
    )  # fmt: skip
    check_ok(flatshard("train", "--resume", ep, "--nproc", 4, "--set", "train.ep=4"))
    expected = [r["loss"] for r in metrics(plain)]
    got = [r["loss"] for r in metrics(ep)]
    assert len(got) == 3
    assert max(abs(a - b) / b for a, b in zip(got, expected)) <= 1e-5, (got, expected)
    plan = json.loads(
        check_ok(flatshard("plan", *sizes, "--set", "run.nproc=4", "--set", "train.ep=2",
                           "--json")).stdout
    )  # fmt: skip
    measured = metrics(ep)[1]  # an --ep 2 step after the first (which learns the order)
    communication = plan["communication"]
    assert measured["all_to_all_bytes"] == communication["ep_all_to_all"] > 0
    assert measured["all_gather_bytes"] == communication["all_gather"]
    assert measured["reduce_scatter_bytes"] == communication["reduce_scatter"]


def test_tensor_and_expert_parallel_moe_run_trains_like_data_parallel(tmp_path):
    """`--model moe-tiny --tp 2 --ep 2` on 4 processes: attention split over TP pairs,
    experts over the ranks holding different tokens; and `--tp 2 --sp` (the norms and
    residual split by sequence, each MoE layer gathering it): the losses of a plain
    2-process run."""
    sizes = MOE_TINY
    plain = tmp_path / "plain"
    check_ok(flatshard("train", *sizes, "--steps", 3, "--nproc", 2, "--out", plain))
    expected = [r["loss"] for r in metrics(plain)]
    for name, layout in (("tp-ep", ["--tp", 2, "--ep", 2]), ("tp-sp", ["--tp", 2, "--sp"])):
        check_ok(flatshard("train", *sizes, "--steps", 3, "--nproc", 4, *layout,
                           "--out", tmp_path / name))  # fmt: skip
        got = [r["loss"] for r in metrics(tmp_path / name)]
        assert max(abs(a - b) / b for a, b in zip(got, expected)) <= 1e-5, (name, got, expected)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tp", 3], "dp_replicate x tp (1 x 3) must divide world_size (4)"),
        (["--tp", 4], "n_kv_heads (2) is not"),
        (["--ep", 2, "--global-batch", 8], "train.ep > 1 needs a mixture-of-experts model"),
        (["--ep", 3, "--global-batch", 8, "--model", "moe-tiny"], "ep (3) must divide"),
        (["--tp", 2, "--ep", 4, "--model", "moe-tiny"], "train.ep (4) must divide the data"),
        (["--set", "model.bias_update_speed=0.001"], "balances a mixture-of-experts model's"),
    ],
    ids=["tp-world", "tp-heads", "ep-dense", "ep-world", "ep-with-tp", "bias-dense"],
)
def test_bad_parallel_degrees_are_one_line_errors_on_every_rank(tmp_path, args, expected):
    result = flatshard("train", *TINY, "--steps", 1, "--nproc", 4, "--out", tmp_path / "run", *args)
    assert expected in one_line_error(result)


def test_compiled_checkpointed_run_trains_like_eager_and_resumes_without(tmp_path):
    """`--ac selective --compile` takes the steps a plain run takes, says so in its header,
    and its checkpoint resumes eagerly with `--ac full`, continuing those losses; an
    unknown mode is a one-line error."""
    sizes = ["--set", "model.preset=tiny", "--set", "data.seq_len=32",
             "--set", "train.micro_batch=2", "--set", "train.global_batch=4",
             "--set", "run.sample_tokens=0"]  # fmt: skip
    plain, compiled = tmp_path / "plain", tmp_path / "compiled"
    check_ok(flatshard("train", *sizes, "--steps", 4, "--nproc", 2, "--out", plain))
    result = check_ok(
        flatshard("train", *sizes, "--steps", 4, "--nproc", 2, "--out", compiled,
                  "--ac", "selective", "--compile", "--set", "run.stop_at_step=2")
    )  # fmt: skip
    assert "selective activation checkpointing, compiled blocks" in result.stdout
    check_ok(flatshard("train", "--resume", compiled, "--nproc", 2, "--set", "train.ac=full",
                       "--set", "train.compile=false"))  # fmt: skip
    offloaded = tmp_path / "offloaded"
    result = check_ok(flatshard("train", *sizes, "--steps", 4, "--nproc", 2, "--out", offloaded,
                                "--ac", "offload"))  # fmt: skip
    assert "offload activation checkpointing" not in result.stdout
    assert "activations offloaded to the host" in result.stdout
    expected = [r["loss"] for r in metrics(plain)]
    for run in (compiled, offloaded):
        got = [r["loss"] for r in metrics(run)]
        assert len(got) == 4
        assert max(abs(a - b) / b for a, b in zip(got, expected)) <= 1e-5, (run, got, expected)
    error = one_line_error(flatshard("train", *sizes, "--steps", 1, "--ac", "fulll"))
    assert "train.ac" in error and "fulll" in error


@pytest.mark.slow
def test_flat_and_torch_adamw_train_the_same(tmp_path):
    """`--optimizer adamw` (the default: flatshard.optim.AdamW) and `torch-adamw` give the same
    losses bit for bit; `adamw-fused` (torch's fused kernel) the same to its rounding; `sgd`
    trains too."""
    losses = {}
    for name in ("adamw", "torch-adamw", "adamw-fused", "sgd"):
        extra = ["--lr", "0.3"] if name == "sgd" else []
        run = tmp_path / name
        check_ok(flatshard("train", *TINY, "--steps", 4, "--optimizer", name, *extra, "--out", run))
        losses[name] = [r["loss"] for r in metrics(run)]
        assert f'optimizer = "{name}"' in (run / "config.toml").read_text()
    assert losses["adamw"] == losses["torch-adamw"]
    assert losses["adamw-fused"] == pytest.approx(losses["adamw"], rel=1e-5)
    assert losses["sgd"][-1] < losses["sgd"][0] and losses["sgd"] != losses["adamw"]


@pytest.mark.slow
def test_muon_trains_and_resumes(tmp_path):
    """`--optimizer muon` trains; a resume continues from its Muon + AdamW state as the run
    would have gone on (the same losses); with --tp 2 (2 x 2 processes) it takes the same
    steps (the TP-global matrices; to bf16 Newton-Schulz noise)."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    check_ok(flatshard("train", *TINY, "--steps", 4, "--optimizer", "muon", "--out", whole))
    check_ok(flatshard("train", *TINY, "--steps", 2, "--optimizer", "muon", "--out", cut))
    check_ok(flatshard("train", "--resume", cut, "--steps", 4))
    expected = [r["loss"] for r in metrics(whole)]
    assert expected[-1] < expected[0]
    assert [r["loss"] for r in metrics(cut)] == expected
    tp = tmp_path / "tp"
    check_ok(flatshard("train", *TINY, "--steps", 4, "--optimizer", "muon", "--tp", 2,
                       "--nproc", 4, "--out", tp))  # fmt: skip
    got = [r["loss"] for r in metrics(tp)]
    assert max(abs(a - b) / b for a, b in zip(got, expected)) <= 1e-3, (got, expected)
    # --muon-split-fused reaches the optimizer: gate and up orthogonalised apart
    split = tmp_path / "split"
    check_ok(flatshard("train", *TINY, "--steps", 4, "--optimizer", "muon",
                       "--muon-split-fused", "--out", split))  # fmt: skip
    losses = [r["loss"] for r in metrics(split)]
    assert losses[0] == expected[0] and losses[1:] != expected[1:] and losses[-1] < losses[0]


def test_adamw_choices_leave_torch_its_kernel_defaults():
    """Only `adamw-fused` asks for the fused kernel; the other AdamWs leave `fused` and
    `foreach` unset, so torch still picks its foreach kernels where it would (on a GPU; an
    explicit fused=False turns that off)."""
    from types import SimpleNamespace

    import torch

    from flatshard.cli.train import make_optimizer

    model = torch.nn.Linear(4, 4)
    for name in ("adamw", "torch-adamw", "adamw-fused"):
        train = SimpleNamespace(optimizer=name, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1)
        defaults = make_optimizer(train, model).defaults
        assert defaults["fused"] is (True if name == "adamw-fused" else None), name
        assert defaults["foreach"] is None, name
