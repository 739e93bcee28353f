"""`parallelize(compile=True)`: each block compiled whole (inductor on CPU) while flatshard's
unit hooks run outside the graph. Compiled training equals eager training (fp32, five AdamW
steps) at world 2 and 4, ZeRO-2 and 3, under TP 2 and EP 2, with activation checkpointing
too; the graph breaks counted by dynamo are none, and the compiled frames as many as
FSDP2's. A whole sharded model compiles too, breaking only at its units."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import batches, config, full_state, lm_loss, rel_diff, rel_losses, train
from test_moe_training import moe_loss
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import flatshard
from flatshard import registry
from flatshard.api.activation_checkpointing import SAVED_OPS
from flatshard.models import Llama, MoE, MoEConfig

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

STEPS = 5
TOLERANCE = 1e-5
CONFIG = dict(ffn_dim=48)  # even: splits over tp 2


def _dynamo_counts() -> dict:
    return {
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _train(compile, *, tp=1, ep=1, zero_stage=3, ac=None, mp=None, whole=False, moe=False):
    """One run on this rank: (losses, full weights, dynamo's counts). A whole model's
    embedding is a unit of its own, looked up from its shards. `moe` (or ep > 1): the MoE
    model, whose experts compiled blocks leave eager (fp32 on a CPU: torch._grouped_mm
    compiles in bf16 only, the per-expert loop by data-dependent counts)."""
    moe = moe or ep > 1
    torch._dynamo.reset()  # a pooled worker: start from no compiled code, no counts
    counters.clear()
    torch.manual_seed(0)
    model = MoE(MoEConfig.tiny("mixtral")) if moe else Llama(config(**CONFIG))
    if whole:
        flatshard.fully_shard(model.embed_tokens)
        assert registry.unit_of(model.embed_tokens).lookup is not None
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=tp, ep=ep)
    flatshard.parallelize(
        model,
        dims,
        zero_stage=zero_stage,
        mp_policy=mp,
        activation_checkpointing=ac,
        compile=compile and not whole,
    )
    if whole:
        model.compile(fullgraph=False)
    meshes = dims.build()
    loss_fn = partial(moe_loss, group=meshes.dp.get_group()) if moe else None
    extra = {"loss_fn": loss_fn} if loss_fn else {}
    data = batches(model.config, STEPS)
    losses = train(model, data, rank=meshes.dp_rank, world=dims.dp, **extra)
    return [loss / tp for loss in losses], full_state(model), _dynamo_counts()


def _compiled_and_eager(**options):
    return _train(True, **options), _train(False, **options)


CASES = {
    "zero3": (2, {}),
    "zero2": (2, {"zero_stage": 2}),
    "zero1": (2, {"zero_stage": 1}),
    "world4": (4, {}),
    "tp2": (4, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "moe": (2, {"moe": True}),
    "ac-full": (2, {"ac": "full"}),
    "ac-selective": (2, {"ac": "selective"}),
}


@pytest.mark.parametrize(  # world 4: the graphs of world 2 (tp2 runs at world 4 too)
    "case", [pytest.param(c, marks=pytest.mark.exhaustive) if c == "world4" else c for c in CASES]
)
def test_compiled_blocks_train_like_eager(case):
    world, options = CASES[case]
    for compiled, eager in run_distributed(_compiled_and_eager, world, timeout=600, **options):
        losses, weights, counts = compiled
        assert counts["breaks"] == 0
        assert counts["graphs"] >= 1  # it did compile
        assert rel_losses(losses, eager[0]) <= TOLERANCE
        assert rel_diff(weights, eager[1]) <= TOLERANCE


def _lengths(compile: bool):
    """Steps at two sequence lengths: the second recompiles each block with symbolic
    lengths (dynamo's automatic dynamic shapes), which attention's causal flag must survive."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(config(**CONFIG))
    flatshard.parallelize(model, flatshard.ParallelDims(dist.get_world_size()), compile=compile)
    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(0, model.config.vocab_size, (4, n), generator=generator)
            for n in (9, 13)]  # fmt: skip
    return train(model, data, rank=dist.get_rank(), world=dist.get_world_size()), full_state(model)


def _lengths_compiled_and_eager():
    return _lengths(True), _lengths(False)


def test_compiled_blocks_take_other_sequence_lengths():
    compiled, eager = run_distributed(_lengths_compiled_and_eager, 1)[0]
    assert rel_losses(compiled[0], eager[0]) <= TOLERANCE
    assert rel_diff(compiled[1], eager[1]) <= TOLERANCE


def _bf16():
    mp = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _compiled_and_eager(mp=mp)


def test_mixed_precision_compiles_whole():
    for (losses, _, counts), (eager_losses, _, _) in run_distributed(_bf16, 2, timeout=600):
        assert counts["breaks"] == 0 and counts["graphs"] >= 1
        # inductor keeps bf16 intermediates in fp32 where eager rounds them
        assert rel_losses(losses, eager_losses) <= 2e-2


def _frames_of(which: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(config(**CONFIG))
    if which == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        for block in model.layers:
            block.compile(fullgraph=True)
    else:
        flatshard.parallelize(model, flatshard.ParallelDims(dist.get_world_size()), compile=True)
    # the training's frames: not the toolchain probe `compile=True` runs once a process
    counters.clear()
    train(model, batches(model.config, 2), rank=dist.get_rank(), world=dist.get_world_size())
    return _dynamo_counts()


def test_as_many_compiled_frames_as_fsdp2():
    ours = run_distributed(_frames_of, 2, "flatshard", timeout=600)[0]
    theirs = run_distributed(_frames_of, 2, "fsdp2", timeout=600)[0]
    assert ours == theirs
    assert ours["breaks"] == 0


def _whole_model():
    return _train(True, whole=True), _train(False)


def test_whole_model_compiles_breaking_at_units():
    for compiled, eager in run_distributed(_whole_model, 2, timeout=600):
        losses, weights, counts = compiled
        assert rel_losses(losses, eager[0]) <= TOLERANCE
        assert rel_diff(weights, eager[1]) <= TOLERANCE
        # a break where each unit's hooks run, the blocks' and the embedding's (the root's
        # run outside the graph)
        assert 0 < counts["breaks"] <= config(**CONFIG).n_layers + 1


class _OpCounter(TorchDispatchMode):
    """How many matrix products and other ops run while it is active."""

    def __init__(self):
        super().__init__()
        self.products = self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SAVED_OPS:
            self.products += 1
        elif (
            func.namespace == "aten"
            and func._schema.name.startswith("aten::")
            and "copy" not in str(func)
        ):
            self.others += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(ac):
    """Ops autograd runs in one backward, and the step's loss and weights."""
    torch.manual_seed(0)
    model = Llama(config(**CONFIG))
    flatshard.parallelize(
        model, flatshard.ParallelDims(dist.get_world_size()), activation_checkpointing=ac
    )
    tokens = batches(model.config, 1)[0][: 12 // dist.get_world_size()]
    loss = lm_loss(model, tokens)
    with _OpCounter() as counted:
        loss.backward()
    return counted.products, counted.others, loss.item(), full_state(model)


def test_activation_checkpointing_recomputes_per_mode():
    none, full, selective = (
        run_distributed(_backward_ops, 2, mode)[0] for mode in (None, "full", "selective")
    )
    assert full[0] > none[0]  # full reruns each block's matrix products
    assert selective[0] == none[0]  # selective saved them
    assert selective[1] > none[1]  # and reran the cheap ops
    assert full[2] == none[2] == selective[2]
    assert rel_diff(full[3], none[3]) == 0 and rel_diff(selective[3], none[3]) == 0


def test_an_unknown_mode_or_backend_is_one_line():
    model = Llama(config(**CONFIG))
    with pytest.raises(
        flatshard.WrappingError, match=r"activation_checkpointing='fulll' is not a mode"
    ):
        flatshard.parallelize(model, flatshard.ParallelDims(1), activation_checkpointing="fulll")
    with pytest.raises(
        flatshard.WrappingError, match=r"compile='inductr': not a torch.compile backend"
    ):
        flatshard.parallelize(model, flatshard.ParallelDims(1), compile="inductr")


def test_a_backend_that_cannot_compile_is_one_line(monkeypatch):
    import torch._inductor.config as inductor_config

    from flatshard.api import compile as compile_module

    monkeypatch.setattr(compile_module, "_WORKING", set())
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    torch._dynamo.reset()
    with pytest.raises(flatshard.WrappingError) as error:
        flatshard.parallelize(Llama(config(**CONFIG)), flatshard.ParallelDims(1), compile=True)
    assert "does not work on this machine" in str(error.value)
    assert "\n" not in str(error.value)
    torch._dynamo.reset()


def _hf_compiled_and_eager(arch: str):
    from test_hf_transformers import ARCHS, random_model
    from test_hf_transformers import train as hf_train

    results = []
    for compile in (True, False):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = random_model(ARCHS[arch]())
        flatshard.parallelize(model, flatshard.ParallelDims(dist.get_world_size()), compile=compile)
        generator = torch.Generator().manual_seed(1)
        data = [torch.randint(0, 61, (6, 9), generator=generator) for _ in range(3)]
        losses = hf_train(model, data, dist.get_rank(), dist.get_world_size())
        results.append((losses, full_state(model), _dynamo_counts()))
    return results


@pytest.mark.parametrize("arch", ["llama3", "mixtral"])
def test_transformers_blocks_compile(arch):
    """A transformers model's decoder layers compile whole; an MoE layer's grouped experts
    (data-dependent routing; transformers' CPU kernel cannot be traced) run eagerly, the
    rest of the layer compiled around them."""
    pytest.importorskip("transformers")
    for (losses, weights, counts), (eager_losses, eager_weights, _) in run_distributed(
        _hf_compiled_and_eager, 2, arch, timeout=600
    ):
        assert counts["breaks"] == 0 and counts["graphs"] >= 1
        assert rel_losses(losses, eager_losses) <= TOLERANCE
        assert rel_diff(weights, eager_weights) <= TOLERANCE


def test_the_trainer_warns_of_eager_selective_ac_on_a_gpu(capsys):
    from types import SimpleNamespace

    from flatshard.cli.model import warn_eager_selective

    for ac, compile, device in [
        ("selective", True, "cuda"), ("full", False, "cuda"), ("selective", False, "cpu"),
    ]:  # fmt: skip
        warn_eager_selective(SimpleNamespace(ac=ac, compile=compile), torch.device(device))
    assert capsys.readouterr().err == ""
    warn_eager_selective(SimpleNamespace(ac="selective", compile=False), torch.device("cuda"))
    assert "add --compile" in capsys.readouterr().err
