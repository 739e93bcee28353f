"""`flatshard.parallelize` and `ParallelDims`: the docs' snippet (HSDP x TP x EP with
offload on the reference MoE, world 4) and a model of the user's own with its own TP plan
(dp 2 x tp 2) train like one process; the meshes hold the ranks the docs say; a plan that
cannot apply says why."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import batches, full_state, rel_diff, rel_losses, train
from test_moe_training import moe_loss
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import flatshard
from flatshard.models import MoE, MoEConfig

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

STEPS = 4
TOLERANCE = 1e-6
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "parallelize.md"


def readme_snippet() -> str:
    """The parallelize guide's python block that calls parallelize on the reference MoE."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    return next(b for b in blocks if "flatshard.parallelize(model, dims" in b)


def _run_readme_snippet():
    scope: dict = {}
    exec(readme_snippet(), scope)  # noqa: S102  (our own docs)
    model, optimizer = scope["model"], scope["optimizer"]
    data_rank, data_ranks = scope["data_rank"], scope["data_ranks"]
    group = scope["dims"].build().dp.get_group()
    losses = train(
        model,
        batches(model.config, STEPS),
        rank=data_rank,
        world=data_ranks,
        make_optimizer=lambda params: optimizer,
        loss_fn=partial(moe_loss, group=group),
    )
    tp = scope["dims"].tp
    return [loss / tp for loss in losses], full_state(model)  # train() summed the tp copies


def test_readme_snippet_trains_like_one_process():
    torch.manual_seed(0)
    reference = MoE(MoEConfig.tiny("mixtral"))
    data = batches(reference.config, STEPS)
    snippet_adamw = partial(torch.optim.AdamW, lr=1e-3)  # the snippet's optimizer
    ref_losses = train(reference, data, loss_fn=moe_loss, make_optimizer=snippet_adamw)
    for losses, weights in run_distributed(_run_readme_snippet, 4):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE


class _Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Regressor(nn.Module):
    """Not one of flatshard's models: its blocks are `blocks`, not `layers`."""

    def __init__(self, dim: int = 8, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))
        self.out = nn.Linear(dim, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


USER_PLAN = flatshard.ParallelPlan(
    blocks="blocks",
    tensor_parallel={"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()},
)


def _regression_data(steps: int):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(8, 7, generator=generator) for _ in range(steps)]


def _mse(model, rows):
    return F.mse_loss(model(rows[:, :5]), rows[:, 5:])


def _train_user_model():
    torch.manual_seed(0)
    model = _Regressor()
    dims = flatshard.ParallelDims(dist.get_world_size(), tp=2)
    flatshard.parallelize(model, dims, plan=USER_PLAN)
    meshes = dims.build()
    tp_split = [name for name, p in model.named_parameters() if len(p.placements) == 2]
    losses = train(model, _regression_data(STEPS), rank=meshes.dp_rank, world=dims.dp, loss_fn=_mse)
    return [loss / dims.tp for loss in losses], full_state(model), tp_split


def test_user_model_with_its_own_tp_plan_trains_like_one_process():
    torch.manual_seed(0)
    reference = _Regressor()
    ref_losses = train(reference, _regression_data(STEPS), loss_fn=_mse)
    for losses, weights, tp_split in run_distributed(_train_user_model, 4):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE
        # every parameter lives on the (dp_shard, tp) mesh: TP did split the blocks
        assert len(tp_split) == sum(1 for _ in reference.parameters())


def _mesh_ranks():
    dims = flatshard.ParallelDims(4, dp_replicate=2, tp=2, ep=2)
    meshes = dims.build()
    return {
        "world": meshes.world.mesh.tolist(),
        "names": meshes.world.mesh_dim_names,
        "experts": meshes.experts.mesh.tolist(),
        "fsdp": meshes.fsdp.mesh.tolist(),
        "dp": (meshes.dp_rank, meshes.dp.size()),
        "same": dims.build() is meshes,
    }


def test_meshes_hold_the_documented_ranks():
    results = run_distributed(_mesh_ranks, 4)
    for rank, found in enumerate(results):
        assert found["names"] == ("dp_replicate", "dp_shard", "tp")
        assert found["world"] == [[[0, 1]], [[2, 3]]]  # (dp_replicate 2, dp_shard 1, tp 2)
        # an EP group: the two data-parallel ranks at one TP index; efsdp: the rest
        assert found["experts"] == [[0, 2], [1, 3]]
        assert found["dp"] == (rank // 2, 2)  # TP ranks read the same data
        assert found["same"]


def _plan_errors():
    found = []
    for dims, model, plan in (
        (flatshard.ParallelDims(2, tp=2), _Regressor(), flatshard.ParallelPlan("blocks")),
        (flatshard.ParallelDims(2, ep=2), _Regressor(), USER_PLAN),
        (flatshard.ParallelDims(2), nn.Linear(2, 2), None),
    ):
        try:
            flatshard.parallelize(model, dims, plan=plan)
            found.append("no error")
        except flatshard.MeshError as error:
            found.append(str(error))
    return found


def test_a_plan_that_cannot_apply_says_why():
    no_tp, no_experts, no_blocks = run_distributed(_plan_errors, 2)[0]
    assert "tp=2, but _Regressor has no tensor-parallel plan" in no_tp
    assert "ep=2, but _Regressor has no experts" in no_experts
    assert "Linear has no ModuleList 'layers'" in no_blocks
