"""Tests of the distributed test harness itself (tests/distributed.py)."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from distributed import (
    DistributedError,
    DistributedTimeout,
    run_distributed,
    spawn_fresh,
    world_sizes,
)

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

# Task functions live at module level: workers import this module to unpickle them.


def _whoami():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "rank_sum": t.item(),
        "env": (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])),
        "threads": torch.get_num_threads(),
    }


def _pid():
    return os.getpid()


def _leak_global_state():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    return torch.get_default_dtype()


def _global_state():
    return torch.get_default_dtype(), torch.rand(3)


def _double(t, *, scale):
    return t * scale + dist.get_rank()


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return "fine"


def _raise_everywhere():
    raise KeyError(f"no luck on rank {dist.get_rank()}")


def _hang_on_rank0():
    if dist.get_rank() == 0:
        while True:  # never reaches the barrier
            time.sleep(1)
    dist.barrier()  # rank 1 waits here for rank 0 forever


def _exit_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()  # rank 0 is left waiting for the dead rank


def _sections(message):
    """Split a failure message into {rank: text of that rank's section}."""
    parts = re.split(r"^----- rank (\d+) ", message, flags=re.MULTILINE)
    return {int(rank): text for rank, text in zip(parts[1::2], parts[2::2], strict=True)}


@world_sizes
def test_results_come_back_in_rank_order(world_size):
    results = run_distributed(_whoami, world_size)
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size
        assert r["backend"] == "gloo"
        assert r["rank_sum"] == sum(range(world_size))
        assert r["env"] == (rank, world_size)
        assert r["threads"] == 1


def test_args_kwargs_and_tensors_round_trip():
    x = torch.arange(4.0)
    results = run_distributed(_double, 2, x, scale=2.0)
    torch.testing.assert_close(results[0], x * 2)
    torch.testing.assert_close(results[1], x * 2 + 1)
    torch.testing.assert_close(x, torch.arange(4.0))  # the caller's tensor is untouched


def test_global_state_is_reset_between_tasks():
    assert run_distributed(_leak_global_state, 2) == [torch.float64] * 2
    torch.manual_seed(0)
    expected = torch.rand(3, dtype=torch.float32)
    for dtype, sample in run_distributed(_global_state, 2):
        assert dtype == torch.float32
        torch.testing.assert_close(sample, expected)


def _seconds(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def test_pool_is_reused_and_fast():
    first = run_distributed(_pid, 2)
    warm = []
    for _ in range(3):
        elapsed, again = _seconds(run_distributed, _pid, 2)
        assert again == first  # same processes, in the same rank order
        warm.append(elapsed)
    assert len(set(first)) == 2 and os.getpid() not in first
    # No absolute bound (a loaded machine slows everything): a warm call, a message over a
    # pipe, must be far cheaper than starting 2 ranks (spawn, import torch, join gloo),
    # measured here on the same machine under the same load. Typically ~1000x.
    cold, fresh = _seconds(spawn_fresh, _pid, 2)
    assert not set(fresh) & set(first)
    print(f"2-rank pool: warm call {min(warm) * 1000:.1f} ms, cold start {cold * 1000:.0f} ms")
    assert min(warm) * 20 < cold, (warm, cold)


def test_exception_on_one_rank_reports_its_traceback():
    # World size 4 reuses the pool of the rank-order test: a failure discards its pool.
    with pytest.raises(DistributedError) as info:
        run_distributed(_raise_on_rank1, 4)
    message = str(info.value)
    assert "failed on rank 1" in message
    sections = _sections(message)
    assert sorted(sections) == [0, 1, 2, 3]
    for rank in (0, 2, 3):
        assert "finished normally" in sections[rank]
    assert "ValueError: rank one is unhappy" in sections[1]
    assert "_raise_on_rank1" in sections[1]  # the full traceback, not just the message


def test_hang_times_out_with_every_rank_stack_then_pool_is_replaced():
    before = run_distributed(_pid, 2)
    timeout = 5
    start = time.perf_counter()
    with pytest.raises(DistributedTimeout) as info:
        run_distributed(_hang_on_rank0, 2, timeout=timeout)
    elapsed = time.perf_counter() - start
    # Not before the timeout, and bounded by it rather than by the 120 s default (the stack
    # dump and the kill add well under a second on an idle machine; 10x leaves room for load).
    assert timeout <= elapsed < 10 * timeout, elapsed
    message = str(info.value)
    print(message)
    assert f"timed out after {timeout} s" in message
    sections = _sections(message)
    assert sorted(sections) == [0, 1]
    for rank in (0, 1):
        assert "its Python stack" in sections[rank]
        assert "in _hang_on_rank0" in sections[rank]  # faulthandler's frame line

    # The hung pool was killed and a fresh one serves the next call.
    after = run_distributed(_pid, 2)
    assert not set(before) & set(after)
    assert run_distributed(_whoami, 2)[1]["rank_sum"] == 1.0


def test_dead_worker_fails_fast_with_exit_code():
    timeout = 60
    start = time.perf_counter()
    with pytest.raises(DistributedError) as info:
        run_distributed(_exit_on_rank1, 3, timeout=timeout)  # W=3: reuses an existing pool
    elapsed = time.perf_counter() - start
    # Noticed through the process sentinel, not by running out the timeout: reported as a
    # failure, not a timeout, well before the deadline (typically within GRACE_S, 3 s).
    assert not isinstance(info.value, DistributedTimeout)
    assert elapsed < timeout / 2, elapsed
    sections = _sections(str(info.value))
    assert "died with exit code 3" in sections[1]
    assert "finished normally" not in sections[0]  # rank 0 was stuck waiting for rank 1


def test_spawn_fresh_uses_new_processes():
    pooled = run_distributed(_pid, 2)
    fresh = spawn_fresh(_pid, 2)
    assert len(set(fresh)) == 2
    assert not set(fresh) & set(pooled)
    assert run_distributed(_pid, 2) == pooled  # the pool was left alone


def test_spawn_fresh_reports_errors():
    with pytest.raises(DistributedError, match="KeyError: 'no luck on rank 0'"):
        spawn_fresh(_raise_everywhere, 1)
