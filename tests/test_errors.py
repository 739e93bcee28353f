"""Bad input gets a clear error on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import run_distributed
from reference import batches, build_model, config, lm_loss, rank_slice
from torch.distributed.device_mesh import DeviceMesh

import flatshard


def _outcome(fn):
    try:
        fn()
        return "ok", ""
    except flatshard.FlatShardError as error:
        return type(error).__name__, str(error)


def _wrap_twice():
    model = build_model(config())
    flatshard.fully_shard(model)
    return _outcome(lambda: flatshard.fully_shard(model))


def test_wrapping_twice():
    for kind, message in run_distributed(_wrap_twice, 2):
        assert kind == "WrappingError" and "already fully_shard-ed" in message


def _mesh_without_last_rank():
    mesh = DeviceMesh("cpu", [0, 1])  # world 3: rank 2 is not in it
    outcome = _outcome(lambda: flatshard.fully_shard(nn.Linear(4, 4), mesh=mesh))
    dist.barrier()  # ranks 0 and 1 went on without waiting for rank 2
    return outcome


def test_mesh_that_does_not_contain_this_rank():
    results = run_distributed(_mesh_without_last_rank, 3, timeout=60)
    assert results[0] == results[1] == ("ok", "")
    kind, message = results[2]
    assert kind == "MeshError" and "rank 2 is not in the device mesh" in message


def _device_problem_on_one_rank():
    # A check only rank 1 fails: every rank of the mesh raises, none waits alone.
    module = nn.Linear(4, 4)
    if dist.get_rank() == 1:
        module.bias = nn.Parameter(torch.zeros(4, dtype=torch.long), requires_grad=False)
    return _outcome(lambda: flatshard.fully_shard(module))


def test_check_failing_on_one_rank_raises_on_all():
    for kind, message in run_distributed(_device_problem_on_one_rank, 2, timeout=60):
        assert kind == "WrappingError" and message.startswith("rank 1: parameter 'bias'")


def _integer_parameter():
    module = nn.Linear(4, 4)
    module.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    return _outcome(lambda: flatshard.fully_shard(module))


def test_non_floating_parameter():
    for kind, message in run_distributed(_integer_parameter, 2):
        assert kind == "WrappingError" and "'steps'" in message and "torch.int64" in message


def _optimizer_before_wrapping():
    cfg = config()
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    flatshard.fully_shard(model)
    lm_loss(
        model, rank_slice(batches(cfg, 1)[0], dist.get_rank(), dist.get_world_size())
    ).backward()
    return _outcome(optimizer.step)


def test_optimizer_built_before_wrapping():
    for kind, message in run_distributed(_optimizer_before_wrapping, 2):
        assert kind == "OptimizerOrderError" and "Build the optimizer after fully_shard" in message


def _tied_across_units():
    model = build_model(config(tie_embeddings=True))
    flatshard.fully_shard(model.embed_tokens)
    return _outcome(lambda: flatshard.fully_shard(model))


def test_tied_weights_split_across_units():
    for kind, message in run_distributed(_tied_across_units, 2):
        assert kind == "WrappingError" and "'lm_head.weight'" in message and "one unit" in message


def _conflicting_stage():
    return _outcome(
        lambda: flatshard.fully_shard(nn.Linear(4, 4), zero_stage=3, reshard_after_forward=False)
    )


def test_conflicting_zero_stage():
    for kind, message in run_distributed(_conflicting_stage, 1):
        assert kind == "WrappingError" and "zero_stage=3 conflicts" in message


def _ranks_left_empty():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = flatshard.fully_shard(nn.Linear(3, 2, bias=False))  # 2 rows over 4 ranks
        value = module.weight.full_tensor()
    return [str(w.message) for w in caught], tuple(value.shape), module.weight.to_local().shape[0]


def test_world_larger_than_rows_warns_and_still_shards():
    results = run_distributed(_ranks_left_empty, 4)
    assert [rows for _, _, rows in results] == [1, 1, 0, 0]
    for messages, shape, _ in results:
        assert shape == (2, 3)
        assert any("ranks [2, 3] hold none" in m for m in messages), messages


def test_no_process_group():
    with pytest.raises(flatshard.MeshError, match="init_process_group"):
        flatshard.fully_shard(nn.Linear(2, 2))


def test_parallel_dims_validate_once_with_clear_messages():
    from flatshard.errors import MeshError
    from flatshard.mesh import ParallelDims

    dims = ParallelDims(16, dp_replicate=2, tp=2, ep=4)
    assert (dims.dp_shard, dims.efsdp, dims.dp) == (4, 4, 8)
    assert (dims.dense_grad_divide_factor, dims.expert_grad_divide_factor) == (8, 16)
    with pytest.raises(MeshError, match=r"dp_replicate x tp \(3 x 1\) must divide world_size"):
        ParallelDims(8, dp_replicate=3)
    with pytest.raises(MeshError, match=r"ep \(3\) must divide the data-parallel ranks"):
        ParallelDims(8, ep=3)
    with pytest.raises(MeshError, match=r"ep \(4\) must divide the data-parallel ranks"):
        ParallelDims(8, tp=4, ep=4)  # TP ranks hold the same tokens
    with pytest.raises(MeshError, match="2 x 2 x 1 = 4 ranks, but world_size is 8"):
        ParallelDims(8, dp_replicate=2, dp_shard=2)
    with pytest.raises(MeshError, match="tp must be an int >= 1"):
        ParallelDims(8, tp=0)


def _model_differs_on_rank_1():
    # One parameter's shape, then one parameter's presence, differs on rank 1: without the
    # check, the first collective would mix buffers of different sizes (a C++ abort).
    rank = dist.get_rank()
    shapes = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5 if rank == 1 else 4))
    names = nn.Linear(4, 4, bias=rank != 1)
    return [_outcome(lambda m=m: flatshard.fully_shard(m)) for m in (shapes, names)]


def test_ranks_that_build_different_models_raise_naming_the_parameter():
    for shapes, names in run_distributed(_model_differs_on_rank_1, 2, timeout=60):
        kind, message = shapes
        assert kind == "WrappingError", shapes
        assert "parameter '1.weight' is (4, 4) float32 on rank 0 but (5, 4) float32 on rank 1" in (
            message
        )
        kind, message = names
        assert kind == "WrappingError" and "'bias' (4,) float32 on rank 0 but missing" in message
