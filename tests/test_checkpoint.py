"""Checkpoints: exact resume across world sizes and ZeRO stages, FSDP2 interop, async save,
atomic commit under SIGKILL, constant collectives, strictness and integrity checks."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_distributed, spawn_fresh
from reference import (
    adamw,
    batches,
    build_model,
    config,
    full_optimizer_state,
    full_state,
    lm_loss,
    rank_slice,
    shard,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import flatshard
from flatshard import checkpoint
from flatshard.errors import CheckpointError

STEPS = 8


def _run_steps(model, optimizer, data, first, last):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, last):
        loss = lm_loss(model, rank_slice(data[step], rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reduced = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(reduced)
        losses.append((reduced / world).item())
    return losses


def _straight(zero_stage):
    cfg = config()
    model = shard(build_model(cfg), zero_stage)
    optimizer = adamw(model.parameters())
    losses = _run_steps(model, optimizer, batches(cfg, STEPS), 0, STEPS)
    return losses, full_state(model)


def _first_half(path, zero_stage):
    cfg = config()
    model = shard(build_model(cfg), zero_stage)
    optimizer = adamw(model.parameters())
    losses = _run_steps(model, optimizer, batches(cfg, STEPS), 0, STEPS // 2)
    checkpoint.save(
        path, model=model, optimizer=optimizer, step=STEPS // 2, data_position=STEPS // 2
    )
    return losses


def _second_half(path, zero_stage):
    cfg = config()
    model = shard(build_model(cfg, seed=123), zero_stage)  # other weights: the load must win
    optimizer = adamw(model.parameters())
    result = checkpoint.load(path, model=model, optimizer=optimizer, data_position=None)
    start = result.extra["data_position"]
    assert result.step == start == STEPS // 2
    losses = _run_steps(model, optimizer, batches(cfg, STEPS), start, STEPS)
    return losses, full_state(model), result.world_size


RESUMES = [
    # (save world, save stage, load world, load stage, bitwise)
    (2, 3, 2, 3, True),
    (2, 3, 4, 3, False),
    (4, 2, 1, 2, False),
    (3, 3, 2, 3, False),
    (2, 3, 3, 1, False),
]


@pytest.mark.parametrize("save_world,save_stage,load_world,load_stage,bitwise", RESUMES)
def test_exact_resume(tmp_path, save_world, save_stage, load_world, load_stage, bitwise):
    expected_losses, expected_weights = run_distributed(_straight, save_world, save_stage)[0]
    first = run_distributed(_first_half, save_world, str(tmp_path), save_stage)[0]
    second, weights, saved_world = spawn_fresh(_second_half, load_world, str(tmp_path), load_stage)[
        0
    ]
    assert saved_world == save_world
    losses = first + second
    if bitwise:
        assert losses == expected_losses
        assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)
    else:
        for ours, theirs in zip(losses, expected_losses):
            assert abs(ours - theirs) <= 1e-6 * abs(theirs)
        for key, value in expected_weights.items():
            assert (weights[key] - value).norm() <= 1e-6 * value.norm(), key


# --- PyTorch FSDP2 interop (plain DCP on both sides) -------------------------------------
def _fsdp2_model(cfg, seed=0):
    from torch.distributed.fsdp import fully_shard

    model = build_model(cfg, seed)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _writer(path, framework, steps):
    cfg = config()
    model = _fsdp2_model(cfg) if framework == "fsdp2" else shard(build_model(cfg))
    optimizer = adamw(model.parameters())
    _run_steps(model, optimizer, batches(cfg, 6), 0, steps)
    model_state, optim_state = get_state_dict(model, optimizer)
    if path:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    rest = _run_steps(model, optimizer, batches(cfg, 6), steps, 6)
    return rest, full_state(model)


def _reader(path, framework, steps):
    cfg = config()
    model = _fsdp2_model(cfg, 7) if framework == "fsdp2" else shard(build_model(cfg, 7))
    optimizer = adamw(model.parameters())
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    flatshard.weights_changed(model)
    rest = _run_steps(model, optimizer, batches(cfg, 6), steps, 6)
    return rest, full_state(model)


@pytest.mark.parametrize(
    "writer,reader,save_world,load_world",
    [
        ("fsdp2", "flatshard", 2, 3),
        ("flatshard", "fsdp2", 3, 2),
    ],
)
def test_interop_with_fsdp2(tmp_path, writer, reader, save_world, load_world):
    expected_losses, expected_weights = run_distributed(
        _writer, save_world, str(tmp_path), writer, 3
    )[0]
    losses, weights = run_distributed(_reader, load_world, str(tmp_path), reader, 3)[0]
    for ours, theirs in zip(losses, expected_losses):
        assert abs(ours - theirs) <= 1e-6 * abs(theirs)
    for key, value in expected_weights.items():
        assert (weights[key] - value).norm() <= 1e-6 * value.norm(), key


# --- async save ----------------------------------------------------------------------------
def _async_save(path, staging_bytes):
    from flatshard.checkpoint import rank_file

    write_wave = rank_file.write_wave
    if staging_bytes < checkpoint.DEFAULT_STAGING_BYTES:  # slow writes: the next optimizer
        # step comes before the last wave is copied

        def slow(*args):
            time.sleep(0.2)
            return write_wave(*args)

        rank_file.write_wave = slow
    try:
        return _async_saves(path, staging_bytes)
    finally:  # the pool's workers run later tests: they must write at full speed
        rank_file.write_wave = write_wave


def _async_saves(path, staging_bytes):
    cfg = config()
    model = shard(build_model(cfg))
    optimizer = adamw(model.parameters())
    data = batches(cfg, 8)
    results, peaks = [], []
    for step in (2, 4):  # the second save refills the first one's staging buffers
        _run_steps(model, optimizer, data, step - 2, step)
        at_call = {**full_state(model), **full_optimizer_state(model, optimizer)}
        handle = checkpoint.save(
            path, model=model, optimizer=optimizer, step=step, async_save=True,
            staging_bytes=staging_bytes,
        )  # fmt: skip
        _run_steps(model, optimizer, data, step, step + 1)  # training goes on during the write
        handle.wait()
        peaks.append(handle.peak_staging_bytes)
        fresh = shard(build_model(cfg, seed=9))
        fresh_optimizer = adamw(fresh.parameters())
        checkpoint.load(path, model=fresh, optimizer=fresh_optimizer, step=step)
        saved = {**full_state(fresh), **full_optimizer_state(fresh, fresh_optimizer)}
        changed = not all(torch.equal(at_call[k], full_state(model)[k]) for k in full_state(model))
        results.append((all(torch.equal(saved[k], at_call[k]) for k in at_call), changed))
    return results, handle.blocking_seconds, peaks


@pytest.mark.parametrize("staging_bytes", [None, 64 << 10])
def test_async_save_captures_state_at_call(tmp_path, staging_bytes):
    """With the whole state in one wave, and in waves of 32 KiB (about 4 of them) that the
    next optimizer step waits for."""
    bound = staging_bytes or checkpoint.DEFAULT_STAGING_BYTES
    for results, blocking, peaks in run_distributed(_async_save, 2, str(tmp_path), bound):
        assert results == [(True, True), (True, True)]
        assert all(0 < peak <= bound for peak in peaks), peaks
        print(f"async save blocking time: {blocking * 1000:.1f} ms; staged at most {peaks}")


# --- collectives per save do not grow with the model ---------------------------------------
def _count_save_collectives(path, n_layers):
    from test_collectives import CollectiveCounter

    model = shard(build_model(config(n_layers=n_layers)))
    optimizer = adamw(model.parameters())
    checkpoint.save(path, model=model, optimizer=optimizer, step=0)  # warm-up: groups exist
    with CollectiveCounter() as counter:
        counter.phase = "save"
        checkpoint.save(path, model=model, optimizer=optimizer, step=1)
    return sum(counter.calls.values())


def test_save_collectives_do_not_grow_with_parameters(tmp_path):
    small = run_distributed(_count_save_collectives, 2, str(tmp_path / "a"), 2)[0]
    large = run_distributed(_count_save_collectives, 2, str(tmp_path / "b"), 16)[0]
    assert small == large
    assert small <= 12, small


# --- strictness and integrity ----------------------------------------------------------------
class Small(torch.nn.Module):
    def __init__(self, extra_param=False, wide=False):
        super().__init__()
        self.a = torch.nn.Linear(4, 6 if not wide else 7)
        if extra_param:
            self.b = torch.nn.Linear(2, 2)


def _strict(path):
    checkpoint.save(path, model=flatshard.fully_shard(Small()), step=1)
    outcomes = {}
    for name, module in [("extra", Small(extra_param=True)), ("wide", Small(wide=True))]:
        try:
            checkpoint.load(path, model=flatshard.fully_shard(module))
            outcomes[name] = "ok"
        except CheckpointError as error:
            outcomes[name] = str(error)
    relaxed = checkpoint.load(
        path, model=flatshard.fully_shard(Small(extra_param=True)), strict=False
    )
    outcomes["skipped"] = relaxed.skipped
    big = build_model(config())
    checkpoint.save(path + "-llama", model=shard(big), step=1)
    try:
        checkpoint.load(path + "-llama", model=shard(build_model(config(n_layers=3))))
    except CheckpointError as error:
        outcomes["config"] = str(error)
    return outcomes


def test_mismatches_are_reported_together(tmp_path):
    outcomes = run_distributed(_strict, 2, str(tmp_path / "ckpt"))[0]
    assert "missing in checkpoint: ['model.b.weight', 'model.b.bias']" in outcomes["extra"]
    assert "model.a.weight: checkpoint shape (6, 4), model (7, 4)" in outcomes["wide"]
    assert "model.a.bias: checkpoint shape (6,), model (7,)" in outcomes["wide"]
    assert outcomes["skipped"] == ["model.b.weight", "model.b.bias"]
    assert "n_layers: checkpoint 2, model 3" in outcomes["config"]


def _save_small(path, step):
    model = flatshard.fully_shard(Small())
    checkpoint.save(path, model=model, step=step, keep_last=2)


def _load_small(path):
    try:
        checkpoint.load(path, model=flatshard.fully_shard(Small()))
        return "ok"
    except CheckpointError as error:
        return str(error)


def test_corruption_truncation_retention(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        run_distributed(_save_small, 2, root, step)
    assert checkpoint.commit.committed_steps(root) == [2, 3]
    assert run_distributed(_load_small, 2, root) == ["ok", "ok"]
    data = sorted(
        f for f in os.listdir(os.path.join(root, "step-00000003")) if f.endswith(".distcp")
    )
    target = os.path.join(root, "step-00000003", data[0])
    blob = bytearray(open(target, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(target, "wb").write(bytes(blob))
    for message in run_distributed(_load_small, 2, root):
        assert "fails its CRC-32 check" in message and data[0] in message
    open(target, "wb").write(bytes(blob[:-10]))
    for message in run_distributed(_load_small, 2, root):
        assert "truncated" in message


def _full_disk_on_rank_1(path):
    """Rank 1's writer hits ENOSPC while saving step 2, synchronously and asynchronously."""
    model = flatshard.fully_shard(Small())
    checkpoint.save(path, model=model, step=1)
    from flatshard.checkpoint import rank_file

    original = rank_file.write_wave

    def full_disk(file, name, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, name))

    outcomes = []
    if dist.get_rank() == 1:
        rank_file.write_wave = full_disk
    try:
        for async_save in (False, True):
            try:
                checkpoint.save(path, model=model, step=2, async_save=async_save)
                checkpoint.wait_for_pending_save()
                outcomes.append("saved")
            except CheckpointError as error:
                outcomes.append(str(error))
            outcomes.append(sorted(os.listdir(path)))
    finally:
        rank_file.write_wave = original
    checkpoint.save(path, model=model, step=2)  # with space again: nothing left in the way
    outcomes.append(sorted(os.listdir(path)))
    return outcomes


def test_full_disk_during_save_is_one_error_and_leaves_no_partial(tmp_path):
    for outcomes in run_distributed(_full_disk_on_rank_1, 2, str(tmp_path)):
        sync_error, after_sync, async_error, after_async, recovered = outcomes
        for error in (sync_error, async_error):
            assert error.startswith(
                "no space left on device while saving step 2; the last complete checkpoint "
                "step-00000001 is intact"
            ), error
            assert "rank 1" in error and "__1_0.distcp" in error
        assert after_sync == after_async == ["latest", "step-00000001"]
        assert recovered == ["latest", "step-00000001", "step-00000002"]


def _serializer_fails_on_a_full_disk(path: str) -> list:
    """torch.save's zip writer on a full disk raises a RuntimeError ("unexpected pos"), not
    an OSError: rank 1's RNG file, with the disk reported full."""
    model = flatshard.fully_shard(Small())
    checkpoint.save(path, model=model, step=1)
    original_save, original_usage = torch.save, shutil.disk_usage
    short = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"

    def short_write(obj, f, *args, **kwargs):
        if str(f).endswith("rank1.pt"):
            raise RuntimeError(short)
        return original_save(obj, f, *args, **kwargs)

    if dist.get_rank() == 1:
        torch.save = short_write
        shutil.disk_usage = lambda d: shutil._ntuple_diskusage(100 << 20, 100 << 20, 0)
    try:
        checkpoint.save(path, model=model, step=2)
        return ["saved", []]
    except CheckpointError as error:
        return [str(error), sorted(os.listdir(path))]
    finally:
        torch.save, shutil.disk_usage = original_save, original_usage


def test_a_short_write_of_the_serializer_on_a_full_disk_is_the_full_disk_error(tmp_path):
    for error, after in run_distributed(_serializer_fails_on_a_full_disk, 2, str(tmp_path)):
        assert error.startswith(
            "no space left on device while saving step 2; the last complete checkpoint "
            "step-00000001 is intact"
        ), error
        assert "rank 1" in error and "unexpected pos 704 vs 598" in error
        assert after == ["latest", "step-00000001"]


# --- SIGKILL during saves: `latest` always names a complete checkpoint ----------------------
KILL_SCRIPT = textwrap.dedent("""
    import os, socket, sys, torch, torch.distributed as dist
    sys.path[:0] = [{repo!r}]
    with socket.socket() as probe:  # a free port, never a fixed one: runs may overlap
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    import flatshard
    from flatshard import checkpoint
    layers = [torch.nn.Linear(512, 512) for _ in range(8)]
    model = flatshard.fully_shard(torch.nn.Sequential(*layers))
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(1, 1000):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        checkpoint.save(sys.argv[1], model=model, optimizer=optimizer, step=step, keep_last=2)
        print(step, flush=True)
""")


def _check_after_kill(root):
    model = flatshard.fully_shard(
        torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    )
    optimizer = torch.optim.AdamW(model.parameters())
    return checkpoint.load(root, model=model, optimizer=optimizer).step


@pytest.mark.slow
def test_sigkill_during_save_keeps_latest_loadable(tmp_path):
    script = tmp_path / "saver.py"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script.write_text(KILL_SCRIPT.format(repo=repo))
    rng = random.Random(0)
    for trial in range(4):
        root = str(tmp_path / f"run{trial}")
        process = subprocess.Popen(
            [sys.executable, str(script), root],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        process.stdout.readline()  # at least one committed checkpoint
        time.sleep(rng.uniform(0.0, 1.5))
        process.send_signal(signal.SIGKILL)
        process.wait()
        steps = checkpoint.commit.committed_steps(root)
        latest = checkpoint.commit.latest_dir(root)
        # A kill between the rename of step-N and the move of `latest` leaves latest at
        # the step before: still complete, and step-N is complete too (renamed last).
        marked = checkpoint.commit.step_of(latest) if latest else None
        assert steps and marked in steps[-2:], (steps, latest)
        loaded = run_distributed(_check_after_kill, 1, root)[0]
        assert loaded == marked


# --- consolidated full weights ----------------------------------------------------------------
def _export(path):
    cfg = config(tie_embeddings=True)
    model = shard(build_model(cfg))
    optimizer = adamw(model.parameters())
    _run_steps(model, optimizer, batches(cfg, 2), 0, 2)
    checkpoint.export_full(model, path)
    return full_state(model)


def _import(path):
    model = shard(build_model(config(tie_embeddings=True), seed=4))
    checkpoint.load_full(model, path)
    wrong = shard(build_model(config(tie_embeddings=True, dim=48, n_heads=4, n_kv_heads=2)))
    try:
        checkpoint.load_full(wrong, path)
        message = "ok"
    except CheckpointError as error:
        message = str(error)
    return full_state(model), message


def test_full_weights_export_and_sharded_import(tmp_path):
    from safetensors.torch import load_file

    path = str(tmp_path / "full.safetensors")
    expected = run_distributed(_export, 3, path)[0]
    on_disk = load_file(path)
    assert on_disk.keys() == expected.keys()
    assert all(torch.equal(on_disk[k], expected[k]) for k in expected)
    for weights, message in run_distributed(_import, 2, path):
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
        assert "embed_tokens.weight: file shape (61, 32), model (61, 48)" in message


def _export_peak(path):
    import ctypes

    from test_features import rss_kib

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # freed buffers leave RSS at once
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(32)]
    model = flatshard.fully_shard(torch.nn.Sequential(*layers))
    checkpoint.export_full(model, path + ".warmup")  # loads code paths first
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = rss_kib("VmRSS")
    checkpoint.export_full(model, path)
    return rss_kib("VmHWM") - before


def test_full_weights_export_memory_is_bounded_by_largest_tensor(tmp_path):
    model_kib, tensor_kib = 32 * 4096, 4096
    for peak in run_distributed(_export_peak, 2, str(tmp_path / "big.safetensors")):
        # a few buffers of one tensor's size (send, receive, the transport's copies): a
        # constant number of tensors, not the model (32 tensors)
        assert peak <= 6 * tensor_kib, (peak, model_kib)


# --- layouts that differ only in how the model was wrapped or in param_dtype -----------------
def _save_variant(path, wrap_blocks, param_dtype):
    cfg = config()
    model = build_model(cfg)
    policy = flatshard.MixedPrecisionPolicy(param_dtype=param_dtype)
    if wrap_blocks:
        shard(model, mp_policy=policy)
    else:
        flatshard.fully_shard(model, mp_policy=policy)  # one unit: other buckets, other cuts
    optimizer = adamw(model.parameters())
    _run_steps(model, optimizer, batches(cfg, 2), 0, 2)
    counter = Counter()
    counter.value = 41
    checkpoint.save(path, model=model, optimizer=optimizer, step=2, counter=counter)
    model_state, optim_state = get_state_dict(model, optimizer)
    return full_state(model), _full_optim(optim_state)


class Counter:
    """A Stateful object saved alongside the model."""

    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = int(state["value"])


def _full_optim(optim_state):
    return {
        (fqn, name): value.full_tensor() if hasattr(value, "full_tensor") else value
        for fqn, states in optim_state["state"].items()
        for name, value in states.items()
    }


def _load_into(path, wrap_blocks, param_dtype):
    model = build_model(config(), seed=3)
    policy = flatshard.MixedPrecisionPolicy(param_dtype=param_dtype)
    if wrap_blocks:
        shard(model, mp_policy=policy)
    else:
        flatshard.fully_shard(model, mp_policy=policy)
    optimizer = adamw(model.parameters())
    counter = Counter()
    checkpoint.load(path, model=model, optimizer=optimizer, counter=counter)
    model_state, optim_state = get_state_dict(model, optimizer)
    return full_state(model), _full_optim(optim_state), counter.value


def test_reshard_across_wrapping_and_param_dtype(tmp_path):
    path = str(tmp_path)
    weights, optim = run_distributed(_save_variant, 2, path, True, torch.bfloat16)[0]
    loaded, loaded_optim, counter = run_distributed(_load_into, 3, path, False, None)[0]
    assert counter == 41
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert loaded_optim.keys() == optim.keys()
    assert all(torch.equal(loaded_optim[k], optim[k]) for k in optim)


def _save_empty_pieces(path):
    from test_features import Odd

    torch.manual_seed(0)
    model = flatshard.fully_shard(Odd())
    empty = model.down.weight.to_local().shape[0] == 0
    checkpoint.save(path, model=model, step=1)
    return empty, {k: v.full_tensor() for k, v in model.state_dict().items()}


def _load_odd(path):
    from test_features import Odd

    model = flatshard.fully_shard(Odd())
    checkpoint.load(path, model=model)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_empty_local_shards_save_and_load(tmp_path):
    results = run_distributed(_save_empty_pieces, 4, str(tmp_path))
    assert any(empty for empty, _ in results)
    expected = results[0][1]
    loaded = run_distributed(_load_odd, 1, str(tmp_path))[0]
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
