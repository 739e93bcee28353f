"""Checkpoints in host memory over several hosts (`save/load(host_local=True)`): each host's
directory is its own, each rank's files also go to a rank on the next host (a ring), and a
restart after a host is lost with its memory loads, from the hosts left, exactly what was
saved; two neighbouring hosts lost leave nothing to load from memory. Hosts are emulated
as one directory each, ranks 4 (two hosts of two ranks, or four of one)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch.distributed as dist
from reference import adamw, batches, build_model, config, full_state, shard
from test_checkpoint import _run_steps

from flatshard import checkpoint
from flatshard.checkpoint import host_memory
from flatshard.checkpoint.state import checkpoint_group

pytestmark = pytest.mark.slow


def _save_lose_and_load(base, per_host, lost):
    rank = dist.get_rank()
    host = rank // per_host
    memory = os.path.join(base, f"host{host}")
    cfg = config()
    data = batches(cfg, 8)
    model = shard(build_model(cfg), 3)
    optimizer = adamw(model.parameters())
    losses = _run_steps(model, optimizer, data, 0, 4)
    for step in (4, 6):  # keep_last=1: the second replaces the first on every host
        checkpoint.save(memory, model=model, optimizer=optimizer, step=step, async_save=True,
                        keep_last=1, host_local=True, data_position=step)  # fmt: skip
        checkpoint.wait_for_pending_save()
        if step == 4:
            losses += _run_steps(model, optimizer, data, 4, 6)
    held = sorted(os.listdir(os.path.join(memory, "step-00000006")))
    steps_kept = sorted(n for n in os.listdir(memory) if n.startswith("step-"))
    losses += _run_steps(model, optimizer, data, 6, 8)
    expected = full_state(model)
    dist.barrier()
    if host in lost and rank % per_host == 0:  # the host is gone, its memory with it
        shutil.rmtree(memory)
    dist.barrier()
    step = host_memory.recoverable_step(memory, checkpoint_group())
    if step is None:
        return held, steps_kept, None, None
    fresh = shard(build_model(cfg, seed=123), 3)
    optimizer = adamw(fresh.parameters())
    result = checkpoint.load(memory, model=fresh, optimizer=optimizer, step=step,
                             host_local=True, data_position=None)  # fmt: skip
    again = _run_steps(fresh, optimizer, data, result.extra["data_position"], 8)
    weights = full_state(fresh)
    same = again == losses[6:] and all(weights[k].equal(v) for k, v in expected.items())
    return held, steps_kept, step, same


@pytest.mark.parametrize(
    "per_host,lost,recoverable",
    [(2, [1], True), (1, [1, 3], True), (1, [1, 2], False)],
    ids=["two-hosts-one-lost", "four-hosts-two-apart-lost", "four-hosts-neighbours-lost"],
)
def test_a_lost_hosts_part_comes_back_from_its_ring_neighbour(tmp_path, per_host, lost,
                                                              recoverable):  # fmt: skip
    from distributed import run_distributed

    results = run_distributed(_save_lose_and_load, 4, str(tmp_path), per_host, lost)
    hosts = 4 // per_host
    for rank, (held, steps_kept, step, same) in enumerate(results):
        host = rank // per_host
        before = (host - 1) % hosts  # the host whose files this one keeps a copy of
        ranks = [r for r in range(4) if r // per_host in (host, before)]
        data = {n for n in held if n.startswith("__")}
        assert data == {f"__{r}_0.distcp" for r in ranks}, (rank, held)
        assert {".metadata", "flatshard.json", "rng"} <= set(held)
        assert steps_kept == ["step-00000006"]
        assert step == (6 if recoverable else None)
        assert same is (True if recoverable else None)
    copies = {n for host in range(hosts) if host not in lost
              for n in os.listdir(tmp_path / f"host{host}" / "step-00000006" / "rng")}  # fmt: skip
    assert copies == {f"rank{r}.pt" for r in range(4)} or not recoverable
