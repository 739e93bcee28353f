"""flatshard on a torch without the 2.13 collective names (`all_gather_single`,
`reduce_scatter_single`; torch 2.11 and 2.12 have only `all_gather_into_tensor` /
`reduce_scatter_tensor`): with the new names taken away, training runs through the old
ones and equals training with them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, build_model, config, full_state, lm_loss, rel_diff, shard, train

from flatshard import comm, compat
from flatshard.comm import nccl_shim
from flatshard.compat import OwnDataParallelMeshDims


def _train_without_new_names(take_away: bool):
    # (a torch before 2.13 has not got them: nothing to take away, the old names run)
    new_names = ("all_gather_single", "reduce_scatter_single")
    saved = {name: getattr(dist, name) for name in new_names if hasattr(dist, name)}
    old = {
        name: getattr(dist, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor")
    }
    calls = dict.fromkeys(old, 0)

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return old[name](*args, **kwargs)

        return call

    try:
        if take_away:
            for name in saved:
                delattr(dist, name)
            for name in old:
                setattr(dist, name, counting(name))
        model = shard(build_model(config()))
        rank, world = dist.get_rank(), dist.get_world_size()
        losses = train(model, batches(model.config, 2), rank=rank, world=world)
        return losses, full_state(model), calls
    finally:
        for name, function in {**saved, **old}.items():
            setattr(dist, name, function)


def test_training_without_the_new_collective_names():
    new = run_distributed(_train_without_new_names, 2, False)
    old = run_distributed(_train_without_new_names, 2, True)
    for (losses, weights, _), (old_losses, old_weights, calls) in zip(new, old):
        assert old_losses == losses
        assert rel_diff(old_weights, weights) == 0
        # the full-state gather goes through all-gather too; under the NCCL shim
        # (scripts/test.sh runs this file under it) so do every unit's gathers and
        # reduce-scatters, as on a GPU
        assert calls["all_gather_into_tensor"] > 0
        if nccl_shim.active():
            assert calls["reduce_scatter_tensor"] > 0


@pytest.mark.parametrize(
    "shard, replicate", [("dp", None), (("dp_a", "dp_b"), "dp_replicate"), (None, "dp")]
)
def test_own_data_parallel_mesh_dims_reads_as_fsdp2s(shard, replicate):
    # what a torch before 2.13 gets for FSDP2's class (fully_shard reads only these names)
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        pytest.skip("this torch has no DataParallelMeshDims to compare with")
    DataParallelMeshDims = fsdp.DataParallelMeshDims

    ours = OwnDataParallelMeshDims(shard=shard, replicate=replicate)
    theirs = DataParallelMeshDims(shard=shard, replicate=replicate)
    assert (ours.shard_names, ours.replicate_names) == (theirs.shard_names, theirs.replicate_names)


def test_own_data_parallel_mesh_dims_needs_a_dim():
    with pytest.raises(ValueError, match="shard or a replicate"):
        OwnDataParallelMeshDims()


def _kernels_torch_picks(monkeypatch_devices: bool):
    """What torch's optimizers and clipping choose for flatshard's tensors, as on a GPU:
    the device check is made to pass for the CPU, so only the type check can refuse."""
    import importlib

    import torch
    from torch.utils._foreach_utils import _has_foreach_support

    optimizer_module = importlib.import_module("torch.optim.optimizer")

    model = shard(build_model(config()))
    lm_loss(model, batches(model.config, 1)[0]).backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    optimizer.step()  # its states exist
    states = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
    with pytest.MonkeyPatch.context() as patch:
        for name in (
            "_get_foreach_kernels_supported_devices",
            "_get_fused_kernels_supported_devices",
        ):
            patch.setattr(optimizer_module, name, lambda: ["cpu"])
        tensors = params + grads + states
        return {
            "foreach": optimizer_module._default_to_fused_or_foreach(tensors, False),
            "fused": optimizer_module._default_to_fused_or_foreach(tensors, False, use_fused=True),
            "clip": _has_foreach_support(grads, torch.device("cpu")),
            "types": sorted({type(t).__name__ for t in tensors}),
        }


def test_torch_optimizers_step_flatshard_params_with_foreach_kernels():
    # a DTensor subclass missing from torch's exact-type lists silently got the per-tensor
    # loop: AdamW's step took 123 ms on a 1B Llama on an H200 against FSDP2's 23 ms
    picked = run_distributed(_kernels_torch_picks, 1, True)[0]
    assert "RowShardedParameter" in picked["types"]
    assert picked["foreach"] == (False, True)
    assert picked["fused"] == (True, False)
    assert picked["clip"]


def test_allow_foreach_lists_a_type_once_and_skips_a_missing_list(monkeypatch):
    import importlib

    from flatshard.compat import allow_foreach

    optimizer_module = importlib.import_module("torch.optim.optimizer")
    utils_module = importlib.import_module("torch.utils._foreach_utils")

    class Extra:
        pass

    monkeypatch.setattr(optimizer_module, "_foreach_supported_types", [])
    monkeypatch.delattr(utils_module, "_foreach_supported_types")
    allow_foreach(Extra)
    allow_foreach(Extra)
    assert optimizer_module._foreach_supported_types == [Extra]


def test_buffers_are_freed_and_refilled_where_storage_memory_cannot_move(monkeypatch):
    # a torch whose storages swap nothing: the pool keeps no memory, buffers resize instead
    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", lambda self, other: None)
    monkeypatch.setattr(compat, "storage_memory_moves", compat.storage_memory_moves.__wrapped__)
    assert not compat.storage_memory_moves()
    pool = comm.BufferPool()
    buffer = torch.ones(1000)
    comm.free_storage(buffer, pool)
    assert buffer.untyped_storage().size() == 0 and pool.empty(1000, torch.float32, "cpu").numel()
    comm.alloc_storage(buffer, pool)
    assert buffer.untyped_storage().size() == 4000
    pool.give_back(torch.empty(1000))
    assert pool._pop(4000, torch.device("cpu")) is None


def test_torch_save_without_record_crc32_writes_none_and_loads(tmp_path, monkeypatch):
    import io
    import zipfile

    serialization = torch.serialization
    if not hasattr(serialization, "set_crc32_options"):
        pytest.skip("this torch always writes the records' CRC-32")
    before = serialization.get_crc32_options()
    tensor = torch.arange(1000, dtype=torch.float32)
    with compat.torch_save_without_record_crc32():
        assert serialization.get_crc32_options() is False
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
    assert serialization.get_crc32_options() == before
    records = zipfile.ZipFile(io.BytesIO(buffer.getvalue())).infolist()
    assert any(r.file_size and r.CRC == 0 for r in records)  # no CRC computed
    assert torch.equal(torch.load(io.BytesIO(buffer.getvalue())), tensor)
    # a torch without the switch: the records keep their CRC-32, nothing fails
    monkeypatch.delattr(serialization, "set_crc32_options")
    with compat.torch_save_without_record_crc32():
        torch.save(tensor, tmp_path / "plain.pt")
    assert torch.equal(torch.load(tmp_path / "plain.pt"), tensor)


def test_fused_tail_unit_follows_the_cpu_vector_width(monkeypatch):
    from flatshard import compat

    cpu = torch.device("cpu")
    for capability, fp32, bf16 in [("AVX512", 16, 32), ("AVX2", 8, 16), ("VSX", None, None)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert compat.fused_tail_unit(cpu, torch.float32) == fp32
        assert compat.fused_tail_unit(cpu, torch.bfloat16) == bf16
    assert compat.fused_tail_unit(torch.device("cuda"), torch.float32) == 1


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv",
                                      "dualpipev"])  # fmt: skip
def test_pipeline_actions_of_torchs_multi_stage_schedules(schedule):
    """`flatshard plan` reads what a pipeline rank holds off torch's action list for it, built
    from stand-in stages: every one of the rank's (stage, micro-batch) runs a forward, then
    a whole backward or its input half before its weight half."""
    from flatshard.api.pipeline import SCHEDULES, V_SHAPED

    pp, microbatches = 4, 8
    for rank in range(pp):
        mine = [rank, 2 * pp - 1 - rank] if schedule in V_SHAPED else [rank, rank + pp]
        actions = compat.pipeline_actions(SCHEDULES[schedule], mine, pp, rank, microbatches)
        assert actions, (schedule, rank)
        for stage in mine:
            for micro in range(microbatches):
                kinds = "".join(k for k, s, m in actions if (s, m) == (stage, micro))
                assert kinds in ("FB", "FIW"), (schedule, rank, stage, micro, kinds)


def test_pipeline_steps_keep_no_outputs():
    """torch's schedules keep each micro-batch's last-stage output (the logits) to return
    them unless told not to: flatshard's steps tell them where `step` takes it."""
    from flatshard.api.pipeline import SCHEDULES

    for schedule in SCHEDULES.values():
        assert compat.pipeline_step_options(schedule.step) == {"return_outputs": False}
    assert compat.pipeline_step_options(lambda *args, target=None: None) == {}


def test_pipeline_shape_inference_is_one_flatshard_wraps():
    """flatshard's PipelineStage marks torch's shape-inference forward (MoE routers must not
    count it as training): torch names it one of these two; a rename would go unmarked."""
    from torch.distributed.pipelining import PipelineStage

    assert hasattr(PipelineStage, "_forward_metadata_inference") or hasattr(
        PipelineStage, "_shape_inference"
    )
