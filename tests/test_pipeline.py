"""Pipeline parallelism with torch's own schedules over flatshard-sharded stages
(`flatshard.PipelineStage`, `flatshard.stage_modules`): the reference Llama split into
stages, each `fully_shard`-ed over its data-parallel ranks, trained 5 AdamW steps at world
4, ends with the losses and weights of one process training the whole model on the whole
batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import adamw, batches, build_model, config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import schedules

import flatshard
from flatshard.errors import WrappingError

pytestmark = pytest.mark.slow

STEPS, BATCH = 5, 8


def _loss(logits, target):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _pipelined(schedule: str, pp: int, stages_per_rank: int, zero_stage: int, microbatches: int):
    """(per step: the whole batch's loss, the reference's; the largest weight difference)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), world // pp
    cfg = config(n_layers=max(4, pp * stages_per_rank))
    whole = build_model(cfg)
    reference = copy.deepcopy(whole)
    reference_optimizer = adamw(reference.parameters())
    num_stages = pp * stages_per_rank
    stages, modules = [], []
    for index in range(pp_rank, num_stages, pp):  # interleaved: stage i on rank i % pp
        part = flatshard.stage_modules(whole, num_stages, index)
        for block in part.layers.values():
            flatshard.fully_shard(block, mesh=mesh["dp"], zero_stage=zero_stage)
        flatshard.fully_shard(part, mesh=mesh["dp"], zero_stage=zero_stage)
        modules.append(part)
        stages.append(flatshard.PipelineStage(part, index, num_stages, torch.device("cpu"),
                                              group=mesh["pp"].get_group()))  # fmt: skip
    optimizer = adamw([p for m in modules for p in m.parameters()])
    kind = getattr(schedules, schedule)
    multi = issubclass(kind, schedules.PipelineScheduleMulti)
    runner = kind(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=_loss)
    holds_last = any(s.is_last for s in stages)
    losses = []
    for tokens in batches(cfg, STEPS, batch=BATCH):
        expected = _loss(reference(tokens[:, :-1]), tokens[:, 1:])
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        mine = tokens.chunk(dp)[dp_rank]
        first = any(s.is_first for s in stages)
        kwargs = {"target": mine[:, 1:], "losses": []} if holds_last else {}
        runner.step(*([mine[:, :-1]] if first else []), **kwargs)
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.stack(kwargs["losses"]).mean() if holds_last else torch.zeros(())
        total = torch.stack([mean.detach().double(), torch.tensor(float(holds_last)).double()])
        dist.all_reduce(total)  # the last stage's ranks hold the losses
        losses.append(((total[0] / total[1]).item(), expected.item()))
    options = StateDictOptions(full_state_dict=True)
    ours = {k: v for m in modules for k, v in get_model_state_dict(m, options=options).items()}
    theirs = reference.state_dict()
    worst = max(((v - theirs[k]).norm() / theirs[k].norm()).item() for k, v in ours.items())
    held = torch.tensor([len(ours)])
    dist.all_reduce(held)  # every parameter is on some stage: dp copies of each
    assert held.item() == dp * len(theirs), (held.item(), dp, len(theirs))
    return losses, worst


CASES = [  # schedule, pp, stages per rank, ZeRO stage, micro-batches
    ("ScheduleGPipe", 2, 1, 3, 4),
    ("Schedule1F1B", 2, 1, 3, 4),
    ("Schedule1F1B", 2, 1, 2, 2),
    ("ScheduleGPipe", 2, 1, 1, 2),
    ("ScheduleInterleaved1F1B", 2, 2, 3, 4),
    ("ScheduleInterleaved1F1B", 4, 2, 3, 4),
]


@pytest.mark.parametrize("schedule,pp,per_rank,zero,microbatches", CASES,
                         ids=[f"{c[0][8:]}-pp{c[1]}x{c[2]}-zero{c[3]}" for c in CASES])  # fmt: skip
def test_a_pipelined_run_equals_one_process(schedule, pp, per_rank, zero, microbatches):
    results = run_distributed(_pipelined, 4, schedule, pp, per_rank, zero, microbatches)
    for losses, worst in results:
        for ours, expected in losses:
            assert abs(ours - expected) <= 1e-5 * abs(expected), losses
        assert worst <= 1e-5, worst


def test_stage_modules_split_the_blocks_and_keep_their_names():
    cfg = config(n_layers=5)
    model = build_model(cfg)
    parts = [flatshard.stage_modules(model, 3, s) for s in range(3)]
    assert [list(p.layers) for p in parts] == [["0", "1"], ["2", "3"], ["4"]]
    assert parts[0].embed_tokens is not None and parts[1].embed_tokens is None
    assert parts[2].lm_head is not None and parts[0].lm_head is None and parts[0].norm is None
    names = [n for p in parts for n in p.state_dict()]
    assert sorted(names) == sorted(model.state_dict())  # the whole model's names, once each
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    hidden = tokens
    for part in parts:
        hidden = part(hidden)
    assert torch.equal(hidden, model(tokens))
    with pytest.raises(WrappingError, match="untie them"):
        flatshard.stage_modules(build_model(config(tie_embeddings=True)), 2, 0)
    with pytest.raises(WrappingError, match="between 1 and the blocks"):
        flatshard.stage_modules(model, 6, 0)
