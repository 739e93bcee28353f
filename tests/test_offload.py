"""Optimizer offload (`OffloadPolicy(fraction=f)`): a fraction of each rank's main weights,
gradients and optimizer state lives and is stepped on the host. The optimizer math is the
same, so training is bitwise the training without offload, at every ZeRO stage, world size
and fraction; checkpoints do not depend on where the state lived."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import (
    adamw,
    batches,
    build_model,
    config,
    full_optimizer_state,
    full_state,
    lm_loss,
    rank_slice,
    rel_diff,
    rel_losses,
    shard,
    train,
)

import flatshard
from flatshard import checkpoint
from flatshard.comm import nccl_shim
from flatshard.runtime.offload import units_below

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

STEPS = 4
FRACTIONS = (0.0, 0.3, 1.0)


def host_share(model) -> float:
    """The share of this rank's parameter elements whose shard lives in a host buffer."""
    host = total = 0
    for unit in units_below([model]):
        for param in unit.params:
            bucket = unit.buckets[param.bucket]
            numel = bucket.specs[param.index].numel
            host += numel if bucket.shard.on_host(param.index) else 0
            total += numel
    return host / total


def _train_each_fraction(disk, zero_stage, microbatches, sync_last_only, tied, precision, vocab):
    """Train with each fraction, and with everything offloaded to the disk tier in `disk`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(tie_embeddings=tied, vocab_size=vocab)
    data = batches(cfg, STEPS, batch=12 * microbatches)
    mp = flatshard.MixedPrecisionPolicy(param_dtype=precision) if precision else None
    results = {}
    for fraction in FRACTIONS + ("disk",):
        if fraction == "disk":
            policy = flatshard.OffloadPolicy(fraction=1.0, path=disk)
        else:
            policy = flatshard.OffloadPolicy(fraction=fraction)
        model = shard(build_model(cfg), zero_stage, mp, offload_policy=policy)
        losses = train(
            model, data, rank=rank, world=world, microbatches=microbatches,
            sync_last_only=sync_last_only,
        )  # fmt: skip
        looked_up = any(unit.looked_up_from_shards() for unit in units_below([model]))
        results[fraction] = (losses, full_state(model), host_share(model), looked_up)
    return results


CASES = [
    # (world, ZeRO stage, micro-batches, sync on the last only, tied, param dtype, vocab)
    (1, 3, 1, False, False, None, 61),
    (2, 3, 1, False, False, None, 61),
    (2, 2, 2, False, True, None, 61),
    (2, 1, 2, True, False, None, 61),
    (4, 3, 3, True, True, None, 61),
    (4, 2, 1, False, False, None, 61),
    (2, 3, 1, False, False, torch.bfloat16, 61),
    # more rows than tokens: the embedding is looked up from its (offloaded) shards
    (2, 3, 2, False, False, None, 257),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "w{}-zero{}-micro{}-last{}-tied{}-{}-vocab{}".format(*c)
)
def test_offload_trains_bitwise_like_no_offload(case, tmp_path):
    world, *settings = case
    zero_stage, microbatches, sync_last_only, tied, precision, vocab = settings
    for results in run_distributed(_train_each_fraction, world, str(tmp_path), *settings):
        losses, weights, share, _ = results[0.0]
        assert share == 0.0
        for fraction in FRACTIONS[1:] + ("disk",):
            offloaded_losses, offloaded_weights, offloaded_share, looked_up = results[fraction]
            assert looked_up == (vocab > 61)
            if fraction in (1.0, "disk") or not nccl_shim.active():
                assert offloaded_losses == losses, fraction
                assert all(torch.equal(offloaded_weights[k], weights[k]) for k in weights)
            else:  # NCCL's sums (the shim's native collectives) follow a bucket's chunks,
                # which a bucket per parameter moves: equal up to their rounding
                assert rel_losses(offloaded_losses, losses) <= 1e-6, fraction
                assert rel_diff(offloaded_weights, weights) <= 1e-6, fraction
            assert offloaded_share > 0.0
            assert (offloaded_share == 1.0) == (fraction in (1.0, "disk"))
    assert list(tmp_path.iterdir()) == []  # the state files went with their tensors
    if precision is None:  # and that is one process's training
        cfg = config(tie_embeddings=tied, vocab_size=vocab)
        reference = build_model(cfg)
        ref_losses = train(
            reference, batches(cfg, STEPS, batch=12 * microbatches), microbatches=microbatches
        )
        assert rel_losses(losses, ref_losses) <= 1e-6
        assert rel_diff(weights, reference.state_dict()) <= 1e-6


def _toy_with_empty_shards(fraction):
    """A head of 2 rows over 4 ranks: two ranks hold none of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    policy = flatshard.OffloadPolicy(fraction=fraction)
    flatshard.fully_shard(model[2], offload_policy=policy)
    flatshard.fully_shard(model, offload_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    rank = dist.get_rank()
    for _ in range(3):
        inputs = torch.randn(8, 6, generator=generator)[2 * rank : 2 * rank + 2]
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_state(model), host_share(model)


def test_offload_with_empty_local_shards():
    expected = run_distributed(_toy_with_empty_shards, 4, 0.0)
    for fraction in (0.5, 1.0):
        for (weights, share), (plain, _) in zip(
            run_distributed(_toy_with_empty_shards, 4, fraction), expected
        ):
            assert share > 0.0
            if fraction == 1.0 or not nccl_shim.active():  # see the test above
                assert all(torch.equal(weights[k], plain[k]) for k in plain)
            else:
                assert rel_diff(weights, plain) <= 1e-6


def _policy(offload) -> flatshard.OffloadPolicy:
    """(fraction, disk directory or None) -> the policy."""
    fraction, path = offload
    return flatshard.OffloadPolicy(fraction=fraction, path=path)


def _save(path, offload, steps=2, async_save=False):
    cfg = config()
    model = shard(build_model(cfg), offload_policy=_policy(offload))
    optimizer = adamw(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in batches(cfg, steps):
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = full_state(model), full_optimizer_state(model, optimizer)
    pending = checkpoint.save(
        path, model=model, optimizer=optimizer, step=steps, async_save=async_save
    )
    if async_save:  # the staged copy is written while training goes on
        lm_loss(model, rank_slice(batches(cfg, 1, seed=5)[0], rank, world)).backward()
        optimizer.step()
        pending.wait()
    return saved


def _load_and_train(path, offload, zero_stage):
    cfg = config()
    model = shard(build_model(cfg, seed=3), zero_stage, offload_policy=_policy(offload))
    optimizer = adamw(model.parameters())
    checkpoint.load(path, model=model, optimizer=optimizer)
    loaded = full_state(model), full_optimizer_state(model, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    for tokens in batches(cfg, 4)[2:]:  # the rest of a 4-step run
        lm_loss(model, rank_slice(tokens, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return loaded, full_state(model)


def test_checkpoint_does_not_depend_on_offload(tmp_path):
    """Saved with f = 0.3 at world 2 (asynchronously), loaded at f = 0 and 1, with the disk
    tier, at world 4 and 1 (and the reverse: from the disk tier and from f = 0): model and
    optimizer bitwise; the remaining steps equal an uninterrupted run."""
    disk = str(tmp_path / "tier")
    uninterrupted = run_distributed(_save, 2, str(tmp_path / "full"), (0.0, None), 4)[0][0]
    saved = run_distributed(_save, 2, str(tmp_path / "f03"), (0.3, None), 2, True)[0]
    plain = run_distributed(_save, 2, str(tmp_path / "f0"), (0.0, None))[0]
    paged = run_distributed(_save, 2, str(tmp_path / "disk"), (0.5, disk))[0]
    for name in saved[0]:
        assert torch.equal(saved[0][name], plain[0][name])
        assert torch.equal(paged[0][name], plain[0][name])
    # the same keys, shapes and bytes whatever the fraction or tier
    assert _files(tmp_path / "f03") == _files(tmp_path / "f0") == _files(tmp_path / "disk")
    for path, world, offload, zero_stage in (
        ("f03", 4, (0.0, None), 3),
        ("f03", 1, (1.0, None), 3),
        ("f03", 2, (1.0, disk), 2),
        ("f0", 4, (0.3, None), 1),
        ("disk", 1, (0.0, None), 3),
    ):
        (weights, optim), trained = run_distributed(
            _load_and_train, world, str(tmp_path / path), offload, zero_stage
        )[0]
        assert all(torch.equal(weights[k], saved[0][k]) for k in saved[0])
        assert optim.keys() == saved[1].keys()
        assert all(torch.equal(optim[k], saved[1][k]) for k in optim), (path, world, offload)
        assert rel_diff(trained, uninterrupted) <= 1e-6, (path, world, offload)


def _files(path) -> dict[str, tuple]:
    """Every stored tensor's key, global shape, dtype and bytes (chunks per rank follow
    the layout, which gives each parameter a bucket of its own under a fraction)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path / "step-00000002")).read_metadata()
    stored = {}
    for key, item in metadata.state_dict_metadata.items():
        if hasattr(item, "chunks"):
            data = sum(c.sizes.numel() for c in item.chunks) * item.properties.dtype.itemsize
            stored[key] = (tuple(item.size), item.properties.dtype, data)
    return stored


def _cpu_offload_policy_trains():
    from torch.distributed.fsdp import CPUOffloadPolicy

    cfg = config()
    model = shard(build_model(cfg), offload_policy=CPUOffloadPolicy())
    rank, world = dist.get_rank(), dist.get_world_size()
    return train(model, batches(cfg, 2), rank=rank, world=world), host_share(model)


def test_fsdp2_cpu_offload_policy_offloads_everything():
    cfg = config()
    reference = train(build_model(cfg), batches(cfg, 2))
    for losses, share in run_distributed(_cpu_offload_policy_trains, 2):
        assert share == 1.0
        assert rel_losses(losses, reference) <= 1e-6


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "half", True])
def test_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(flatshard.OffloadError, match=r"\[0, 1\]"):
        flatshard.OffloadPolicy(fraction=fraction)


def _unwritable_directory(path):
    try:
        flatshard.fully_shard(torch.nn.Linear(4, 4), offload_policy=_policy((1.0, path)))
    except flatshard.OffloadError as error:
        return str(error)
    return None


def test_unwritable_offload_directory_is_refused_when_sharding(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for message in run_distributed(_unwritable_directory, 2, str(blocker / "tier")):
        assert message is not None and "cannot be written" in message and str(blocker) in message


def _disk_fills_up(path):
    """The disk is full when the optimizer makes its state: one clear error, and the
    checkpoint written before it is intact."""
    import os

    cfg = config()
    model = shard(build_model(cfg), offload_policy=_policy((1.0, path)))
    optimizer = adamw(model.parameters())
    checkpoint.save(f"{path}/ckpt", model=model, step=1)  # (no optimizer state made yet)
    lm_loss(model, batches(cfg, 1)[0]).backward()
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    os.posix_fallocate = full
    try:
        optimizer.step()
    except flatshard.OffloadError as error:
        message = str(error)
    else:
        message = None
    finally:
        os.posix_fallocate = real
    fresh = shard(build_model(cfg, seed=4))
    checkpoint.load(f"{path}/ckpt", model=fresh)
    return message, rel_diff(full_state(fresh), full_state(model))


def test_full_disk_is_a_clear_error_and_the_checkpoint_is_intact(tmp_path):
    for message, diff in run_distributed(_disk_fills_up, 1, str(tmp_path)):
        assert message is not None and "is full" in message and str(tmp_path) in message
        assert diff == 0.0


def _optimizer_before_the_root():
    """Wrapping the root moves blocks' pieces (the fraction is reached over the model): an
    optimizer built on the blocks' parameters before that is caught, not silently idle."""
    cfg = config()
    model = build_model(cfg)
    policy = flatshard.OffloadPolicy(fraction=0.5)
    for layer in model.layers:
        flatshard.fully_shard(layer, offload_policy=policy)
    early = adamw(model.layers.parameters())
    flatshard.fully_shard(model, offload_policy=policy)
    lm_loss(model, batches(cfg, 1)[0]).backward()
    try:
        early.step()
    except flatshard.OptimizerOrderError as error:
        return str(error)
    return None


def test_an_optimizer_built_before_the_root_is_caught():
    for message in run_distributed(_optimizer_before_the_root, 2):
        assert message is not None and "built before" in message
