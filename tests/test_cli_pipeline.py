"""`flatshard train --pp N`: the reference model's blocks in pipeline stages (each stage
sharded over its data-parallel ranks) train with the losses of the same run without a
pipeline, checkpoint at one pp and resume at another, and export the same model."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from forked_command import torchrun_forked
from safetensors.torch import load_file
from test_cli_helpers import REPO_ROOT, check_ok, flatshard, metrics, one_line_error

pytestmark = pytest.mark.slow

RUN = ["train", "--model", "tiny", "--set", "model.n_layers=4", "--seq-len", "64",
       "--global-batch", "8", "--micro-batch", "2", "--set", "run.sample_tokens=0"]  # fmt: skip
EVAL = ["--set", "data.eval=0.05", "--set", "train.eval_interval=4",
        "--set", "train.eval_sequences=6"]  # fmt: skip


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps on 2 data-parallel processes, no pipeline, evaluated at steps 4 and 8."""
    out = tmp_path_factory.mktemp("straight") / "run"
    check_ok(flatshard(*RUN, *EVAL, "--steps", "8", "--nproc", "2", "--out", out, timeout=300))
    return out


def _losses(run) -> list[float]:
    return [r["loss"] for r in metrics(run)]


def _eval_losses(run) -> list[tuple[int, float, int]]:
    return [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in metrics(run) if "eval_loss" in r]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_pipelined_training_has_the_losses_of_the_run_without(tmp_path, straight, schedule):
    """pp 2 x dp 2 on 4 processes: the same data-parallel split, the blocks in 2 stages
    (interleaved: 4, two a rank), evaluated through the stages (the schedule's forwards
    only) as the straight run is; then resumed without a pipeline from its step-4
    checkpoint, to the straight run's end, and exported as the straight run is."""
    run = tmp_path / "run"
    pipelined = ["--nproc", "4", "--pp", "2", "--pp-schedule", schedule, *EVAL]
    check_ok(flatshard(*RUN, *pipelined, "--steps", "8", "--checkpoint-interval", "4", "--out",
                       run, timeout=300))  # fmt: skip
    assert _losses(run) == pytest.approx(_losses(straight), rel=1e-5)
    ours, theirs = _eval_losses(run), _eval_losses(straight)
    assert [(s, t) for s, _, t in ours] == [(s, t) for s, _, t in theirs] == [(4, 384), (8, 384)]
    assert [loss for _, loss, _ in ours] == pytest.approx([loss for _, loss, _ in theirs], rel=1e-6)
    again = tmp_path / "again"  # the step-4 checkpoint alone, resumed
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(run / "config.toml", again)
    name = "step-00000004"
    shutil.copytree(run / "checkpoints" / name, again / "checkpoints" / name)
    check_ok(flatshard("train", "--resume", again, "--nproc", "2", "--pp", "1", timeout=300))
    resumed = [r["loss"] for r in metrics(again) if r["step"] > 4]
    assert resumed == pytest.approx(_losses(straight)[4:], rel=1e-5)
    for source, name in ((run, "pipelined"), (straight, "straight")):
        check_ok(flatshard("convert", "checkpoint-to-hf", source, tmp_path / name))
    ours = load_file(tmp_path / "pipelined" / "model.safetensors")
    theirs = load_file(tmp_path / "straight" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.allclose(ours[key], value, rtol=1e-4, atol=1e-6), key


def test_pipeline_stages_split_the_sequence_under_context_parallelism(tmp_path, straight):
    """pp 2 x cp 2 on 4 processes: each stage's tokens are its CP part of every sequence
    (placed at their positions by the stage itself); training and evaluation have the
    losses of the straight run on the same global batches."""
    run = tmp_path / "run"
    check_ok(flatshard(*RUN, *EVAL, "--nproc", "4", "--pp", "2", "--cp", "2", "--steps", "8",
                       "--out", run, timeout=300))  # fmt: skip
    assert _losses(run) == pytest.approx(_losses(straight), rel=1e-5)
    ours, theirs = _eval_losses(run), _eval_losses(straight)
    assert [(s, t) for s, _, t in ours] == [(s, t) for s, _, t in theirs]
    assert [loss for _, loss, _ in ours] == pytest.approx([loss for _, loss, _ in theirs], rel=1e-6)


def test_microbatches_and_what_a_pipeline_cannot_take(tmp_path):
    """--microbatches sets the micro-batch size; layouts and features a pipeline does not
    take yet are refused in one line that names the keys."""
    run = tmp_path / "run"
    check_ok(flatshard(*RUN, "--steps", "2", "--nproc", "2", "--pp", "2", "--microbatches",
                       "4", "--pp-schedule", "gpipe", "--out", run, timeout=300))  # fmt: skip
    assert "micro_batch = 2" in (run / "config.toml").read_text()
    refused = flatshard(*RUN, "--steps", "2", "--nproc", "4", "--pp", "3")
    assert "train.pp (3) must divide world_size (4)" in one_line_error(refused)
    refused = flatshard(*RUN, "--steps", "2", "--nproc", "2", "--pp", "2", "--microbatches", "3")
    assert "train.microbatches (3) must divide" in one_line_error(refused)
    # torch's eval cannot run a V-shaped schedule: refused before the run, not mid-way
    refused = flatshard(*RUN, "--steps", "2", "--nproc", "2", "--pp", "2", "--pp-schedule",
                        "zbv", "--eval", "0.25")  # fmt: skip
    assert "torch's V-shaped schedules cannot" in one_line_error(refused)


def test_moe_stages_train_with_the_load_balancing_loss(tmp_path):
    """An MoE model trained with its load-balancing loss (moe-tiny: weight 0.01) in two
    stages under a zero-bubble schedule (each backward's weight half apart), each sequence
    split over 2 CP ranks: every stage adds its routers' counts and probability sums to the
    totals it hands on, the last stage computes the term from all of them (the counts
    summed over the ranks holding other tokens), and its gradient flows back through the
    totals to every router. The losses of one process, which are not those without it."""
    sizes = ["--model", "moe-tiny", "--set", "model.n_layers=4", "--seq-len", "32",
             "--micro-batch", "2", "--global-batch", "8", "--steps", "4",
             "--set", "run.sample_tokens=0"]  # fmt: skip
    runs = {
        "piped": ["--nproc", 4, "--pp", 2, "--cp", 2, "--pp-schedule", "zbv"],
        "one": ["--nproc", 1],
        "without": ["--nproc", 1, "--set", "model.aux_loss_coef=0"],
    }
    losses = {}
    for name, layout in runs.items():
        check_ok(flatshard("train", *sizes, *layout, "--out", tmp_path / name, timeout=300))
        losses[name] = _losses(tmp_path / name)
    assert losses["piped"] == pytest.approx(losses["one"], rel=1e-6)
    assert all(1e-5 < w - o < 1e-2 for w, o in zip(losses["one"], losses["without"]))


def test_moe_stages_with_expert_parallelism(tmp_path):
    """An MoE model balanced by its routers' biases (no load-balancing loss) at pp 2 x ep 2
    (each stage's experts split over its own 2 ranks, dp 2; each stage's routers counting
    their own forwards, not torch's shape inference): the losses of data parallelism alone;
    its step-2 checkpoint (the biases with it) resumes in one process to the same losses;
    each stage gathers, reduces and exchanges tokens as `flatshard plan` says."""
    sizes = ["--set", "model.preset=moe-tiny", "--set", "model.aux_loss_coef=0",
             "--set", "model.bias_update_speed=0.05",
             "--set", "model.n_layers=4", "--set", "data.seq_len=32", "--set",
             "train.micro_batch=2", "--set", "train.global_batch=8", "--set",
             "run.sample_tokens=0"]  # fmt: skip
    layout = ["--set", "run.nproc=4", "--set", "train.pp=2", "--set", "train.ep=2"]
    piped, straight = tmp_path / "piped", tmp_path / "straight"
    check_ok(flatshard("train", *sizes, *layout, "--steps", 4, "--checkpoint-interval", 2,
                       "--out", piped, timeout=300))  # fmt: skip
    check_ok(flatshard("train", *sizes, "--nproc", 2, "--steps", 4, "--out", straight))
    assert _losses(piped) == pytest.approx(_losses(straight), rel=1e-5)
    again = tmp_path / "again"  # the step-2 checkpoint alone, resumed in one process
    (again / "checkpoints").mkdir(parents=True)
    shutil.copy(piped / "config.toml", again)
    name = "step-00000002"
    shutil.copytree(piped / "checkpoints" / name, again / "checkpoints" / name)
    check_ok(flatshard("train", "--resume", again, "--nproc", 1, "--pp", 1, "--ep", 1))
    resumed = [r["loss"] for r in metrics(again) if r["step"] > 2]
    assert resumed == pytest.approx(_losses(straight)[2:], rel=1e-5)
    plan = json.loads(check_ok(flatshard("plan", *sizes, *layout, "--json")).stdout)
    first = plan["pipeline"]["stages"][0]["communication"]
    record = metrics(piped)[-1]
    assert record["all_gather_bytes"] == first["all_gather"]
    assert record["reduce_scatter_bytes"] == first["reduce_scatter"]
    assert record["all_to_all_bytes"] == first["ep_all_to_all"] > 0


def _sizes(*more: str) -> list[str]:
    pairs = ["model.preset=tiny", "model.n_layers=4", "run.nproc=4", "train.pp=2", *more]
    return [arg for pair in pairs for arg in ("--set", pair)]


@pytest.mark.parametrize("zero,schedule,cp,tied", [
    (1, "gpipe", 1, False), (2, "gpipe", 1, False), (3, "gpipe", 1, False),
    (3, "interleaved-1f1b", 1, False), (3, "zbv", 1, False), (3, "1f1b", 2, True),
])  # fmt: skip
def test_pipelined_bytes_per_step_equal_the_plan(tmp_path, zero, schedule, cp, tied):
    """Each stage gathers and reduces as `flatshard plan --pp` says (rank 0's stages, whose
    bytes the run's metrics hold), from the second step on (the first learns the order);
    with two stages a rank too (torch's schedule unshards each stage's root once a step),
    and with each stage's units sharded over its CP ranks (pp 2 x cp 2), there with tied
    embeddings (the first stage's embedding a unit of its own, its weight sent on)."""
    sizes = _sizes("data.seq_len=32", "train.micro_batch=2", "train.global_batch=16",
                   f"train.zero_stage={zero}", f"train.pp_schedule={schedule}",
                   f"train.cp={cp}", f"model.tie_embeddings={str(tied).lower()}")  # fmt: skip
    run = tmp_path / "run"
    check_ok(flatshard("train", *sizes, "--steps", 2, "--out", run, "--set",
                       "run.sample_tokens=0", timeout=300))  # fmt: skip
    plan = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)
    first = plan["pipeline"]["stages"][0]["communication"]
    assert plan["setup"]["grad_accum"] == 4 * cp == plan["pipeline"]["microbatches"]
    record = metrics(run)[-1]
    assert record["all_gather_bytes"] == first["all_gather"]
    assert record["reduce_scatter_bytes"] == first["reduce_scatter"]
    saved = dcp.FileSystemReader(run / "checkpoints" / "step-00000002").read_metadata()
    entries = saved.state_dict_metadata
    assert "model.lm_head.weight" in entries  # tied or not: both names, as in one process
    weight = entries["model.embed_tokens.weight"].size.numel() * 4  # moved in fp32
    # a tied weight: gathered by the first stage, its gradient summed there
    assert first.get("tied_embedding", 0) == (2 * weight if tied else 0)
    assert record["tied_embedding_bytes"] == first.get("tied_embedding", 0)
    assert record["comm_bytes"] == first["total"]


PEAK_SCHEDULES = ["1f1b", "interleaved-1f1b", "zbv"] + [  # the other code paths of these
    pytest.param(s, marks=pytest.mark.exhaustive)
    for s in ("gpipe", "looped-bfs", "interleaved-zb", "dualpipev")
]


@pytest.mark.parametrize("schedule", PEAK_SCHEDULES)
def test_each_stages_peak_is_its_plans(tmp_path, schedule):
    """With activations dominant (4 micro-batches of 2048 tokens per data-parallel rank),
    each pipeline rank's measured peak is within 10% of its stage's plan: GPipe holds every
    micro-batch's activations, 1F1B `pp - rank` of them, the last stage the head's; the
    schedules of two stages a rank what torch's action list for the rank holds at once
    (measured, 2026-11-30: every schedule's ranks within -8% and +7%)."""
    sizes = _sizes("data.seq_len=512", "train.micro_batch=4", "train.global_batch=32",
                   "train.zero_stage=3", f"train.pp_schedule={schedule}")  # fmt: skip
    plan = json.loads(check_ok(flatshard("plan", *sizes, "--json")).stdout)
    stages = plan["pipeline"]["stages"]
    closed_forms = {"gpipe": [4, 4], "1f1b": [2, 1]}
    if schedule in closed_forms:
        assert [s["in_flight"] for s in stages] == closed_forms[schedule]
    script = os.path.join(REPO_ROOT, "tests", "pipeline_peaks.py")
    proc = torchrun_forked(script, 4, [schedule, tmp_path], cwd=REPO_ROOT, timeout=300,
                           exact_memory=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    peaks = [(tmp_path / f"peak-{rank}.txt").read_text().split() for rank in range(4)]
    for rank, measured in peaks:
        predicted = stages[int(rank)]["memory"]["total"]
        assert abs(int(measured) - predicted) <= 0.10 * predicted, (rank, measured, predicted)
