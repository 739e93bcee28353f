"""FSDP2 drop-in: real clients' flows and the FSDP2 behaviours they rely on, run with
PyTorch's FSDP2 and with flatshard (only the import differs: tests/fsdp2_dropin.py) at
world 2 (4 where said). fp32 losses and weights agree to 1e-6, bf16 to bf16 rounding,
structure exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from distributed import run_distributed
from fsdp2_behaviours import close
from fsdp2_dropin import DROPIN, EXAMPLE, run

import flatshard
from flatshard.api.fsdp_module import FlatShardModule
from flatshard.errors import WrappingError

WORLD = {"spmd_mesh_dims": 4}


def _compare(name: str, world: int = 2, peer_name: str | None = None):
    theirs = run_distributed(run, world, peer_name or name, "fsdp2")[0]
    ours = run_distributed(run, world, name, "flatshard")
    for result in ours:  # every rank returns the gathered (global) values
        close(result, theirs, 2**-7 if theirs.get("bf16") else 1e-6, name)


@pytest.mark.parametrize("name", [n for n in DROPIN if n != "spmd_mesh_dims"])
def test_client_behaviour_as_fsdp2(name):
    if name == "reset_after_failure" and not hasattr(torch_fsdp.FSDPModule, "reset_iter_state"):
        pytest.skip("this torch's FSDP2 has no reset_iter_state to compare with")
    _compare(name, WORLD.get(name, 2))


@pytest.mark.parametrize("name", list(EXAMPLE))
def test_fsdp2_example_flow(name):
    _compare(name)


def test_dp_mesh_dims_trains_as_fsdp2_hsdp():
    """The whole (replicate, shard) mesh with dp_mesh_dims and replicated DTensor
    parameters trains as FSDP2's HSDP on the same mesh's dims."""
    from fsdp2_behaviours import run as run_behaviour

    theirs = run_distributed(run_behaviour, 4, "hsdp", "fsdp2")[0]
    for ours in run_distributed(run, 4, "spmd_mesh_dims", "flatshard"):
        assert ours.pop("placements") == ["(Replicate(), Shard(dim=0))"]
        close(ours, theirs, 1e-6, "spmd_mesh_dims")


def test_every_fsdp2_name_imports_from_flatshard():
    fsdp2_names = [
        "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "fully_shard",
        "MixedPrecisionPolicy", "OffloadPolicy", "register_fsdp_forward_method",
        "UnshardHandle", "share_comm_ctx",
    ]  # fmt: skip
    # (a torch before 2.13 lacks DataParallelMeshDims and share_comm_ctx: flatshard has them)
    new_in_2_13 = {"DataParallelMeshDims", "share_comm_ctx"}
    assert set(fsdp2_names) - new_in_2_13 <= set(torch_fsdp.__all__)
    for name in fsdp2_names:
        assert hasattr(flatshard, name), name
    assert issubclass(FlatShardModule, torch_fsdp.FSDPModule)


def test_every_fsdpmodule_method_is_flatshards():
    """None of FSDP2's methods is inherited: each would reach FSDP2's own state."""
    inherited = [
        name
        for name, value in vars(torch_fsdp.FSDPModule).items()
        if callable(value) and name != "__new__" and getattr(FlatShardModule, name) is value
    ]
    assert inherited == []


def _subclass_parameter():
    from torch.testing._internal.two_tensor import TwoTensor

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].weight = torch.nn.Parameter(TwoTensor(torch.ones(4, 4), torch.ones(4, 4)))
    try:
        flatshard.fully_shard(model)
    except WrappingError as error:
        return str(error)
    return None


def test_tensor_subclass_parameter_is_refused_by_name():
    for message in run_distributed(_subclass_parameter, 2):
        assert message is not None and "'0.weight'" in message and "TwoTensor" in message
        assert "rank 1" not in message  # one line, the same on every rank


def _rng_after_uneven_init(lib):
    from fsdp2_dropin import Transformer, shard_transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(vocab=61, dim=20)  # 61 rows: uneven torch.chunk pieces
    shard_transformer(model, lib)
    model.to_empty(device="cpu")
    model.reset_parameters()
    return torch.rand(4)


def test_random_init_leaves_every_rank_where_fsdp2s_first_rank_is():
    """With uneven chunks FSDP2's ranks end in different generator states; flatshard's all
    end where FSDP2's first rank does (with even chunks, test_fsdp2_example_flow: where
    all of FSDP2's do)."""
    theirs = run_distributed(_rng_after_uneven_init, 3, "fsdp2")
    assert not torch.equal(theirs[0], theirs[2])  # FSDP2 itself: ranks differ
    for ours in run_distributed(_rng_after_uneven_init, 3, "flatshard"):
        assert torch.equal(ours, theirs[0])


def _unshard_then_forward_from_shards():
    from reference import build_model, config, full_state, shard

    model = shard(build_model(config()))
    weights = full_state(model)
    model.embed_tokens.unshard()  # registers the gathered table ...
    with torch.no_grad():  # ... which this forward looks up from its shards, freeing it
        model(torch.arange(16).remainder(61).view(2, 8))
    registered = sorted({type(p).__name__ for p in model.parameters()})
    return registered, all(torch.equal(v, weights[k]) for k, v in full_state(model).items())


def test_freed_buffers_are_never_left_registered():
    """Whatever frees a unit's gathered buffers registers its sharded parameters again (an
    explicit `unshard()` followed by a forward that looks the embedding up from its shards
    would otherwise leave views of freed memory on the module)."""
    for registered, same in run_distributed(_unshard_then_forward_from_shards, 2):
        assert registered == ["RowShardedParameter"] and same
