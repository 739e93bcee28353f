"""The behaviours PyTorch's FSDP2 unit tests check, each run with FSDP2 and with flatshard
(only the import differs, tests/fsdp2_behaviours.py) at world 2 (4 where said); results
must agree: fp32 losses and full weights to 1e-6, bf16 to bf16 rounding, structure
exactly. Not ported (with why) is listed in NOT_PORTED; docs/development.md gives the count."""

from __future__ import annotations

import pytest
from distributed import run_distributed
from fsdp2_behaviours import BEHAVIOURS, REFERENCES, WORLD, close, run

# FSDP2 test files whose behaviours cannot run here, or do not apply, and why.
NOT_PORTED = {
    "test_fully_shard_compile.py, test_fully_shard_training_compile.py":
        "torch.compile of FSDP2 internals (FSDP2-specific tracing)",
    "test_fully_shard_memory.py, test_fully_shard_overlap.py, test_fully_shard_stream_utils.py,"
    " test_fully_shard_copy_engine.py": "CUDA memory stats, streams and timing",
    "test_fully_shard_grad_scaler.py": "CUDA AMP GradScaler (fp16 on GPU)",
    "test_fully_shard_extensions.py": "fsdp_pre/post_all_gather subclasses: run against "
        "FSDP2 in test_subclass_gather.py (frozen) and test_subclass_trainable.py",
    "test_fully_shard_2d.py": "tensor parallelism (flatshard's TP issue)",
    "test_fully_shard_logging.py, test_fully_shard_debug.py": "FSDP2's own log records",
    "test_fully_shard_block_shard.py, test_fully_shard_chunk_cat.py, test_fully_shard_fuse.py":
        "FSDP2's internal sharding and copy kernels",
}  # fmt: skip


@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_behaves_as_fsdp2(name):
    world = WORLD.get(name, 2)
    peer = "one process" if name in REFERENCES else "fsdp2"
    theirs = run_distributed(run, world, name, peer)[0]
    ours = run_distributed(run, world, name, "flatshard")[0]
    tolerance = 2**-7 if theirs.get("bf16") else 1e-6
    close(ours, theirs, tolerance, name)


def test_the_count_in_the_docs():
    import pathlib

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "development.md"
    assert f"{len(BEHAVIOURS)} behaviours of FSDP2's unit tests" in page.read_text()
