"""Smoke test of benchmarks/compare.py: the tiny preset runs every mode end to end and
writes a table whose flatshard losses match the single process and whose ZeRO-3 bytes match
the layout's count (fp32 and bf16). No timing assertions."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from forked_command import run_forked

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "compare.py")
MODES = [
    "single process",
    "DDP",
    "FSDP2",
    "flatshard ZeRO-3",
    "flatshard ZeRO-2",
    "flatshard ZeRO-1",
]
LOSS_COLUMN = "loss Δ vs single"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The report's header and its rows (cells) by mode name."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return _cells(lines[0]), {_cells(line)[0]: _cells(line) for line in lines[2:]}


def _script(path: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python PATH ARGS` in the repository root; forked from the test server that has
    imported torch already (tests/forked_command.py) unless it needs variables of its own."""
    if env is None:
        return run_forked([path, *args], cwd=ROOT, timeout=600)  # timeout: a hang guard
    return subprocess.run(
        [sys.executable, path, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, **env},
    )  # fmt: skip


def _run_compare(out_dir, *args: str, env: dict | None = None) -> str:
    out = out_dir / "results.md"
    proc = _script(SCRIPT, "--preset", "tiny", "--steps", "2", "--out", str(out), *args, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out.read_text(encoding="utf-8")


def _zero3_measured_over_layout(text: str) -> float:
    """ZeRO-3 bytes sent, counted at the torch.distributed calls, over the layout's count."""
    match = re.search(r"measured / layout = ([0-9.]+)", text)
    assert match, text
    return float(match.group(1))


@pytest.fixture(scope="module")
def fp32_report(tmp_path_factory) -> str:
    return _run_compare(tmp_path_factory.mktemp("fp32"))


def _row(text: str, mode: str) -> dict[str, str]:
    header, rows = _table(text)
    return dict(zip(header, rows[mode]))


def test_compare_tiny(fp32_report):
    text = fp32_report
    header, rows = _table(text)
    assert header[0] == "mode" and LOSS_COLUMN in header, header
    assert sorted(rows) == sorted(MODES), sorted(rows)
    loss_index = header.index(LOSS_COLUMN)
    for mode in MODES:
        assert len(rows[mode]) == len(header), rows[mode]
        if mode.startswith("flatshard"):
            assert float(rows[mode][loss_index]) <= 1e-5, (mode, rows[mode][loss_index])
    assert "python" in text and "--preset tiny" in text  # the exact command is recorded
    assert abs(_zero3_measured_over_layout(text) - 1) < 0.01
    zero3 = _row(text, "flatshard ZeRO-3")
    assert float(zero3["CPU s/step (all ranks)"]) > 0 and float(zero3["CPU ×DDP"]) > 0


def test_compare_tiny_bf16_bytes(tmp_path, fp32_report):
    """bf16 parameters: ZeRO-3 still sends what its layout says, gathers half the bytes of
    the fp32 run and reduces the same (fp32 gradients); here with the modes side by side."""
    text = _run_compare(
        tmp_path, "--param-dtype", "bf16", "--modes", "fsdp2,zero3", "--interleave", "steps"
    )
    assert abs(_zero3_measured_over_layout(text) - 1) < 0.01
    bf16, fp32 = _row(text, "flatshard ZeRO-3"), _row(fp32_report, "flatshard ZeRO-3")
    assert float(bf16["loss Δ vs FSDP2"]) <= 1e-5, bf16
    gathered = _kib(bf16["all-gather /step"]) / _kib(fp32["all-gather /step"])
    reduced = _kib(bf16["reduce-scatter /step"]) / _kib(fp32["reduce-scatter /step"])
    assert abs(gathered - 0.5) < 0.01 and abs(reduced - 1) < 0.01, (bf16, fp32)


def test_compare_embedding_looked_up_from_shards(tmp_path):
    """Vocab 257 > ranks x tokens per rank: ZeRO-3 looks the embedding up from its shards,
    sends what its layout and the lookups say (less than the table would cost) and trains
    as FSDP2 does."""
    text = _run_compare(
        tmp_path, "--preset", "tiny-large-vocab", "--modes", "fsdp2,zero3", "--interleave", "steps"
    )
    assert abs(_zero3_measured_over_layout(text) - 1) < 0.01
    lookup = re.search(
        r"sends (\S+ \S+) \(token ids, rows and row gradients\) instead of "
        r"its table's (\S+ \S+)\.",
        text,
    )
    assert lookup and _kib(lookup[1]) < _kib(lookup[2]), text
    assert float(_row(text, "flatshard ZeRO-3")["loss Δ vs FSDP2"]) <= 1e-5


def _kib(cell: str) -> float:
    value, unit = cell.split()[:2]
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


def test_gloo_collectives_script():
    script = os.path.join(ROOT, "benchmarks", "gloo_collectives.py")
    proc = _script(script, "--world", "2", "--elements", "4096", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timed = [line for line in proc.stdout.splitlines() if line.startswith("world 2")]
    assert len(timed) == 8 and all(" ms" in line for line in timed), proc.stdout


def test_compare_hsdp_and_hpz_modes(tmp_path):
    """World 4, 2 replicas x 2 shards: flatshard's HSDP trains as FSDP2's HSDP does, moves
    the same all-reduce bytes, and the report gives its step-paired ratio to FSDP2 HSDP;
    hpZ (reshard_after_forward=2) trains like one process and gathers some bytes on pairs."""
    modes = "single,fsdp2-hsdp,hsdp3,fsdp2-hpz,hpz3"
    text = _run_compare(tmp_path, "--world", "4", "--modes", modes, "--interleave", "steps")
    assert float(_row(text, "flatshard hpZ")["loss Δ vs single"]) <= 1e-6
    assert re.search(r"flatshard hpZ [0-9.]+ \S+ of", text), text
    ours, peer = _row(text, "flatshard HSDP ZeRO-3"), _row(text, "FSDP2 HSDP")
    assert float(ours["loss Δ vs single"]) <= 1e-6
    assert ours["all-reduce /step"] == peer["all-reduce /step"] != "0 B"
    assert re.search(r"flatshard HSDP ZeRO-3 step x FSDP2 HSDP [0-9.]+ \(CPU [0-9.]+\)", text)


def test_compare_tp_modes(tmp_path):
    """World 4, 2 data-parallel x 2 tensor-parallel (preset tiny-tp: ffn 44 splits over 2):
    FSDP2 and flatshard ZeRO-3 over the same parallelize_llama plan train like one process
    (each TP group on its data-parallel rank's slice), all-reduce the same TP activations
    (counted at DTensor's functional collectives), send per rank (N-1)/N of groups of 2, and
    the report gives flatshard's step-paired ratio to FSDP2 TP. With sequence parallelism
    (torchtitan's plan under both) and flatshard's context parallelism (cp 2) the same
    steps; SP all-reduces far less than TP (all-gathers and reduce-scatters instead)."""
    modes = "single,fsdp2,fsdp2-tp,tp3,fsdp2-sp,sp3,cp3"
    text = _run_compare(
        tmp_path, "--preset", "tiny-tp", "--world", "4", "--modes", modes, "--interleave", "steps"
    )
    ours, peer = _row(text, "flatshard TP ZeRO-3"), _row(text, "FSDP2 TP")
    for row in (ours, peer):
        assert float(row["loss Δ vs single"]) <= 1e-6, row
    assert ours["all-reduce /step"] == peer["all-reduce /step"] != "0 B"
    # FSDP2's collectives all go over groups of 2 ranks: sent = 1/2 x (ag + 2 rs + 2 ar)
    expected = (
        _kib(peer["all-gather /step"])
        + 2 * _kib(peer["reduce-scatter /step"])
        + 2 * _kib(peer["all-reduce /step"])
    ) / 2
    assert abs(_kib(peer["sent /step"]) / expected - 1) < 0.02, (peer, expected)
    assert re.search(r"flatshard TP ZeRO-3 vs FSDP2 TP: step x [0-9.]+ \(CPU [0-9.]+\)", text)
    sp, sp_peer = _row(text, "flatshard TP+SP ZeRO-3"), _row(text, "FSDP2 TP+SP")
    for row in (sp, sp_peer, _row(text, "flatshard CP ZeRO-3")):
        assert float(row["loss Δ vs single"]) <= 1e-6, row
    assert sp["all-reduce /step"] == sp_peer["all-reduce /step"]
    assert _kib(sp["all-reduce /step"]) < _kib(ours["all-reduce /step"]) / 4
    assert re.search(r"flatshard TP\+SP ZeRO-3 vs FSDP2 TP\+SP: step x [0-9.]+", text)
    assert re.search(r"flatshard CP ZeRO-3 vs FSDP2: step x [0-9.]+", text)
    # torch's ring passes the key and value gradients with functional all-to-alls: counted
    ring = re.search(r"passes ([0-9.]+) (B|KiB|MiB) of key and value gradients", text)
    assert ring and float(ring.group(1)) > 0, text
    assert re.search(r"all_to_all_single \(CP ring\) [1-9]", text)


def test_compare_moe_modes(tmp_path):
    """World 4, MoE preset tiny-moe (4 experts, top-2, aux loss in the loss): FSDP2 and
    flatshard ZeRO-3 without EP and flatshard ZeRO-3 with EP 2 (experts over efsdp 2) train
    like one process; only EP moves tokens by all-to-all, counted as flatshard counts its
    token rows, and the report gives its step-paired ratio to FSDP2 (no EP)."""
    modes = "single,fsdp2-moe,moe3,ep3"
    text = _run_compare(
        tmp_path, "--preset", "tiny-moe", "--world", "4", "--modes", modes,
        "--interleave", "steps", "--rounds", "1",
    )  # fmt: skip
    for mode in ("FSDP2 (no EP)", "flatshard ZeRO-3 (no EP)", "flatshard EP ZeRO-3"):
        row = _row(text, mode)
        assert float(row["loss Δ vs single"]) <= 1e-6, row
        assert (row["EP all-to-all /step"] == "0 B") == (mode != "flatshard EP ZeRO-3"), row
    rows = re.search(r"token rows (\S+ \S+) .*?all_to_all counts (\S+ \S+)\)", text)
    assert rows and rows[1] == rows[2] and _kib(rows[1]) > 0, text
    assert re.search(
        r"flatshard EP ZeRO-3 vs FSDP2 \(no EP\): step x [0-9.]+ \(CPU [0-9.]+\)", text
    )


def test_compare_offload_modes(tmp_path):
    """Optimizer offload (world 2, modes side by side, one round): FSDP2 + CPUOffloadPolicy
    and flatshard ZeRO-3 with OffloadPolicy 0.5, 1 and 1 on the disk tier train bitwise as
    ZeRO-3 does; the report gives the offloaded bytes per rank (the disk tier: AdamW's state
    of the whole shard in its files, the host tier none) and the step-paired ratios to FSDP2
    + CPUOffloadPolicy; the disk tier's temporary directories are removed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    modes = "fsdp2-cpuoff,zero3,off50,off100,offdisk"
    text = _run_compare(
        tmp_path, "--modes", modes, "--interleave", "steps", "--rounds", "1",
        env={"TMPDIR": str(tmp)},
    )  # fmt: skip
    losses = re.search(r"Losses against flatshard ZeRO-3 \(every step, every round\): (.*)\.", text)
    assert losses and losses[1].count("bitwise equal") == 4, text
    pattern = (
        r"(flatshard ZeRO-3 offload [^;]*?) host [^;]*?, disk (\S+ \S+) / \S+ \S+ "
        r"\(AdamW state of the whole shard: (\S+ \S+) /"
    )
    held = {name: (disk, state) for name, disk, state in re.findall(pattern, text)}
    assert sorted(held) == [
        "flatshard ZeRO-3 offload 0.5",
        "flatshard ZeRO-3 offload 1",
        "flatshard ZeRO-3 offload 1 (disk)",
    ], text
    disk, state = held["flatshard ZeRO-3 offload 1 (disk)"]
    assert disk == state and _kib(disk) > 0, held
    assert held["flatshard ZeRO-3 offload 1"][0] == "0 B", held
    assert re.search(
        r"flatshard ZeRO-3 offload 1 \(disk\) ×FSDP2 \+ CPUOffloadPolicy [0-9.]+ \(CPU [0-9.]+\)",
        text,
    ), text
    assert not list(tmp.glob("flatshard-bench-offload-*")), list(tmp.iterdir())


def test_state_movement_script():
    """The RL state-movement benchmark runs its four comparisons end to end (tiny preset)."""
    script = os.path.join(ROOT, "benchmarks", "state_movement.py")
    proc = _script(script, "--preset", "tiny", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [_cells(line) for line in proc.stdout.splitlines() if line.startswith("| ")]
    compared = [row for row in rows[1:] if row[0] in ("offload", "reload", "full weights")]
    assert len(compared) == 4 and all(float(row[-1]) > 0 for row in compared), proc.stdout


def test_weight_sync_script():
    """The weight-sync benchmark runs its three ways and its two deltas end to end (tiny)."""
    script = os.path.join(ROOT, "benchmarks", "weight_sync.py")
    proc = _script(script, "--preset", "tiny", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [_cells(line) for line in proc.stdout.splitlines() if line.startswith("| ")]
    timed = [row for row in rows if row[0].startswith(("sync_weights", "full_"))]
    assert len(timed) == 4 and all(float(row[1]) > 0 for row in timed), proc.stdout
    deltas = {row[0]: row for row in rows if row[0] in ("full fine-tuning", "LoRA r16")}
    assert "100.0% of the model" in deltas["full fine-tuning"][1], proc.stdout
    assert float(deltas["LoRA r16"][1].split("(")[1].split("%")[0]) < 100, proc.stdout


def test_sample_speed_script():
    """The sampling benchmark runs both ways and they choose the same tokens."""
    script = os.path.join(ROOT, "benchmarks", "sample_speed.py")
    proc = _script(script, "--tokens", "4", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "same tokens: True" in proc.stdout and "| KV cache |" in proc.stdout


def test_host_profile_script():
    """benchmarks/host_profile.py times every hook phase it names, add_reduced included."""
    script = os.path.join(ROOT, "benchmarks", "host_profile.py")
    proc = _script(script, "--preset", "tiny", "--steps", "2", "--warmup", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line[:24].strip(): line[24:].split() for line in proc.stdout.splitlines()[2:]}
    for phase in ("pre_forward", "post_backward", "add_reduced", "optimizer.step"):
        assert float(rows[phase][0]) > 0 and float(rows[phase][2]) >= 1, proc.stdout


def test_hf_parallel_script():
    """benchmarks/hf_parallel.py at its smallest: flatshard's transformers Llama under TP
    trains as FSDP2 + torch TP does, and reads a fraction of the checkpoint FSDP2 reads."""
    pytest.importorskip("transformers")
    script = os.path.join(ROOT, "benchmarks", "hf_parallel.py")
    tiny = ["--world", "2", "--tp", "2", "--steps", "2", "--layers", "1", "--hidden", "64"]
    proc = _script(script, *tiny, "--vocab", "256", "--seq", "16", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    agree = re.search(r"losses agree to (\S+) \(relative\)", proc.stdout)
    assert agree and float(agree.group(1)) <= 1e-5, proc.stdout
    _, rows = _table(proc.stdout)
    read = {mode: float(rows[mode][-1]) for mode in ("fsdp2-tp", "flatshard")}
    assert read["flatshard"] < read["fsdp2-tp"], proc.stdout


def test_compare_compile_and_ac_modes(tmp_path):
    """Compiled blocks and activation checkpointing (world 2, side by side, one round):
    flatshard's compiled blocks train as eager ZeRO-3 does (fp32), and its checkpointed and
    offloaded modes bitwise; the report gives compiled flatshard's step ratios to compiled FSDP2 and
    to eager flatshard."""
    modes = "fsdp2,zero3,fsdp2-compile,compile3,acfull3,acsel3,acoff3"
    text = _run_compare(tmp_path, "--modes", modes, "--interleave", "steps", "--rounds", "1")
    assert re.search(
        r"flatshard ZeRO-3 compiled blocks ×FSDP2 compiled blocks [0-9.]+ \(CPU [0-9.]+\), "
        r"×flatshard ZeRO-3 [0-9.]+",
        text,
    ), text
    rows = re.search(
        r"Against eager flatshard ZeRO-3 \(losses every step, every round\): (.*)\.", text
    )
    assert rows, text
    found = dict(
        re.findall(r"(flatshard ZeRO-3 [^;]*?|FSDP2 compiled blocks) max rel ([0-9.e+-]+)", rows[1])
    )
    assert float(found["flatshard ZeRO-3 compiled blocks"]) <= 1e-5, found
    assert float(found["flatshard ZeRO-3 full AC"]) == 0, found
    assert float(found["flatshard ZeRO-3 selective AC"]) == 0, found
    assert float(found["flatshard ZeRO-3 activation offload"]) == 0, found


def test_compare_flat_optimizer_modes(tmp_path):
    """flatshard.optim.AdamW (zero3f, zero1f; zero3ff fused) beside torch's AdamW on
    flatshard and FSDP2 (fsdp2-fused): the report has their rows and the same losses as
    FSDP2's (the flat step is torch's math)."""
    modes = "fsdp2,zero3,zero3f,zero1f,fsdp2-fused,zero3ff"
    text = _run_compare(tmp_path, "--modes", modes, "--interleave", "steps", "--rounds", "1")
    for name in (
        "flatshard ZeRO-3 + flat AdamW",
        "flatshard ZeRO-1 + flat AdamW",
        "FSDP2 + fused AdamW",
        "flatshard ZeRO-3 + flat fused AdamW",
    ):
        assert float(_row(text, name)["loss Δ vs FSDP2"]) <= 1e-6, text


def test_compare_muon_modes(tmp_path):
    """Muon beside AdamW: FSDP2 + torch's Muon and flatshard ZeRO-3 + flatshard.optim.Muon
    train alike (the same distance from FSDP2 + AdamW's losses, to bf16 Newton-Schulz
    noise)."""
    text = _run_compare(
        tmp_path, "--modes", "fsdp2,fsdp2-muon,zero3m", "--interleave", "steps", "--rounds", "1"
    )
    theirs = float(_row(text, "FSDP2 + torch Muon")["loss Δ vs FSDP2"])
    ours = _row(text, "flatshard ZeRO-3 + Muon")
    assert theirs > 0 and abs(float(ours["loss Δ vs FSDP2"]) - theirs) <= 1e-4, text


def test_compare_quantized_gather_modes(tmp_path):
    """ZeRO-3 with int8 and fp8 weight gathers and int8 gradient reduce-scatters beside plain
    ZeRO-3: rows in the report, losses near FSDP2's (only what moves is rounded)."""
    text = _run_compare(
        tmp_path,
        "--modes",
        "fsdp2,zero3,zero3q8,zero3qf8,zero3qg8",
        "--interleave",
        "steps",
        "--rounds",
        "1",
    )
    names = ("int8 weight gathers", "fp8 weight gathers", "int8 gradient reduce-scatters")
    for name in (f"flatshard ZeRO-3, {kind}" for kind in names):
        assert 0 < float(_row(text, name)["loss Δ vs FSDP2"]) <= 1e-2, text


def _tiny_chat_model(path) -> str:
    """A tiny Llama directory with a tiny tokenizer and chat template."""
    import torch
    import transformers
    from tiny_tokenizer import make_tokenizer_dir

    tokenizer = make_tokenizer_dir(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_hf_sample_and_tokenize_scripts(tmp_path):
    """The generation benchmark compares flatshard's tokens with transformers' on the same
    model; the tokenising one writes, then reuses, the token file with the same ids."""
    model = _tiny_chat_model(tmp_path / "model")
    runs = {
        "hf_sample_speed.py": ["--tokens", "4", "--repeats", "1"],
        "tokenize_speed.py": ["--mb", "0.2"],
    }
    for name, args in runs.items():
        proc = _script(os.path.join(ROOT, "benchmarks", name), "--model", model, *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        if name == "hf_sample_speed.py":
            assert "same tokens: 4 of 4" in proc.stdout and "| flatshard |" in proc.stdout
        else:
            assert "same ids: True; reused: True" in proc.stdout


def test_hf_finetune_script(tmp_path):
    """`flatshard train --hf` and the FSDP2 run of its settings (two processes each) train
    alike: in fp32 every step's loss agrees to rounding."""
    model = _tiny_chat_model(tmp_path / "model")
    proc = _script(os.path.join(ROOT, "benchmarks", "hf_finetune.py"), "--model", model,
                   "--steps", "3", "--seq-len", "32", "--batch", "2", "--nproc", "2",
                   "--precision", "fp32")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| flatshard |" in proc.stdout and "| fsdp2 |" in proc.stdout, proc.stdout
    difference = re.search(r"largest relative difference ([0-9.e+-]+)", proc.stdout)
    assert float(difference.group(1)) <= 1e-6, proc.stdout


@pytest.mark.parametrize("mode", ["lora", "qlora", "tp"])
def test_lora_step_script(mode):
    """benchmarks/lora_step.py at its smallest: flatshard's LoRA and FSDP2 + PEFT, given the
    same adapters, take the same steps; the adapters' state is a fraction of the full one.
    --qlora: flatshard and FSDP2 on the same NF4 model take the same steps, which differ
    from the full-precision base's. --tp 2: so do flatshard's and PEFT's split adapters."""
    pytest.importorskip("peft")
    tiny = ["--world", "2", "--steps", "3", "--hidden", "64", "--layers", "2", "--vocab", "256"]
    tiny += {"lora": [], "qlora": ["--qlora"], "tp": ["--tp", "2"]}[mode]
    proc = _script(os.path.join(ROOT, "benchmarks", "lora_step.py"), *tiny, "--seq", "16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    agree = re.search(r"the losses agree to (\S+) \(relative", proc.stdout)
    assert agree and float(agree.group(1)) <= 1e-5, proc.stdout
    _, rows = _table(proc.stdout)
    if mode == "tp":
        assert rows["flatshard-lora-tp"][3] == rows["fsdp2-peft-tp"][3], proc.stdout
        return
    if mode == "qlora":
        assert rows["flatshard-qlora"][3] == rows["fsdp2-qlora"][3] == rows["flatshard-lora"][3]
        assert rows["flatshard-qlora"][6] != rows["flatshard-lora"][6], proc.stdout  # NF4
        return
    state = {mode: float(rows[mode][4]) for mode in ("flatshard-lora", "flatshard-full")}
    assert rows["flatshard-lora"][3] == rows["fsdp2-peft"][3]  # the same trainable count
    assert 0 < state["flatshard-lora"] < state["flatshard-full"] / 2, proc.stdout


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_script(tied):
    """benchmarks/pipeline.py at its smallest: flatshard's pipeline stages train as FSDP2's
    under the same torch schedule (their losses agree), beside the run without a pipeline;
    with --tied, as that tied run (FSDP2's stages train the model untied)."""
    script = os.path.join(ROOT, "benchmarks", "pipeline.py")
    proc = _script(script, "--size", "tiny", "--steps", "2", "--seq", "16", *["--tied"] * tied)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("and no pipeline's losses" in proc.stdout) is tied, proc.stdout
    agree = re.search(r"losses agree to (\S+) \(relative\)", proc.stdout)
    assert agree and float(agree.group(1)) <= 1e-5, proc.stdout
    _, rows = _table(proc.stdout)
    assert set(rows) == {"fsdp2", "flatshard", "no pipeline"}, proc.stdout
