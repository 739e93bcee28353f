"""A rank that fails leaves its peers waiting in a collective: every rank must say which
rank failed and why (not gloo's bare "Connection closed by peer"). Real scripts under
torchrun, as users run them: the failing process exits through the interpreter's report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    import flatshard
    from flatshard.models import Llama, LlamaConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = flatshard.parallelize(Llama(LlamaConfig.tiny()), flatshard.ParallelDims(2))
    if sys.argv[1] == "empty-batch":  # the model rejects rank 1's empty batch in forward
        tokens = torch.randint(0, 64, (3 if rank == 0 else 0, 9))
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    else:  # rank 1 fails in its loss; rank 0 waits for it in backward's reduce-scatter
        tokens = torch.randint(0, 64, (3, 9))
        logits = model(tokens[:, :-1])
        if rank == 1:
            raise ValueError("bad labels in shard 7")
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    """
)


def _torchrun(tmp_path, case):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    # the agent stops the other workers once it sees one fail: polling every 2 s (not 0.1 s)
    # leaves rank 0 the time to report on a loaded machine
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--monitor-interval",
        "2",
    ]
    run = subprocess.run(
        [*command, "--nproc_per_node", "2", str(script), case],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    return [line for line in run.stderr.splitlines() if line.startswith("[rank0]:")]


@pytest.mark.slow
def test_a_rank_failing_in_forward_is_named_by_its_peer(tmp_path):
    """Rank 1's model raises on its empty batch; rank 0, in the next unit's all-gather, raises
    PeerFailedError with rank 1's exception and where it was raised."""
    rank0 = _torchrun(tmp_path, "empty-batch")
    errors = [line for line in rank0 if "PeerFailedError: " in line]
    assert len(errors) == 1, "\n".join(rank0[-20:])
    assert "rank 1 failed: RuntimeError: cannot reshape tensor of 0 elements" in errors[0]
    assert "(at model.py:" in errors[0] and "rank 0 stopped in an all-gather" in errors[0]


@pytest.mark.slow
def test_a_rank_failing_outside_flatshard_is_named_by_its_peer(tmp_path):
    """Rank 1 raises in its own code after forward; rank 0 learns it in backward."""
    rank0 = _torchrun(tmp_path, "loss-error")
    errors = [line for line in rank0 if "PeerFailedError: " in line]
    assert len(errors) == 1, "\n".join(rank0[-20:])
    assert "rank 1 failed: ValueError: bad labels in shard 7 (at train.py:" in errors[0]
    assert "rank 0 stopped in an all-gather" in errors[0]  # backward's regather of a block
