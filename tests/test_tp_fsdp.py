"""fully_shard over tensor-parallel parameters (`parallelize_llama` first, as torchtitan
does): every parameter is a DTensor on the (data-parallel..., tp) mesh, and training
equals one process, gradients tensor by tensor, losses and full weights after five AdamW
steps, for (dp_shard, tp) in (2, 2), (1, 4), (4, 1), (1, 2) and HSDP with TP, ZeRO-3 and
ZeRO-2, with accumulation and tied embeddings."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from reference import (
    batches,
    build_model,
    config,
    full_optimizer_state,
    full_state,
    lm_loss,
    rank_slice,
    rel_diff,
    rel_losses,
)
from reference import shard as shard_model
from reference import train as train_ranks
from test_gradients import backward_micro_batches, full_grads, per_tensor_errors
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import flatshard
from flatshard import checkpoint, registry
from flatshard.errors import CheckpointError
from flatshard.models.llama import parallelize_llama
from flatshard.runtime.flat_bucket import FlatBucket

pytestmark = pytest.mark.slow  # deselect with -m 'not slow' for a quick loop

CFG = dict(n_heads=8, n_kv_heads=4, dim=32, ffn_dim=48, attention_bias=True)  # tp | 4
STEPS = 5
TOLERANCE = 1e-6
GRAD_TOLERANCE = 2e-6  # per tensor


def tp_model(
    replicate: int, shard: int, tp: int, zero_stage: int = 3, seed=0, sp=False, **overrides
):
    """The reference Llama, TP over `tp` ranks, then fully_shard over (replicate, shard)."""
    dims = flatshard.ParallelDims(
        replicate * shard * tp, dp_replicate=replicate, tp=tp, sequence_parallel=sp
    )
    model = build_model(config(**{**CFG, **overrides}), seed=seed)
    plan = None  # the Llama family's (with sequence parallelism as dims ask)
    if tp == 1:  # TP over one rank: applied by hand (parallelize applies it for tp > 1)
        parallelize_llama(model, dims.build().world["tp"])
        plan = flatshard.ParallelPlan("layers")
    flatshard.parallelize(model, dims, plan=plan, zero_stage=zero_stage)
    return model, dims.build().dp_rank


def _train(layout, zero_stage, microbatches, sync_last_only, tied, sp=False):
    replicate, shard, tp = layout
    model, dp_rank = tp_model(replicate, shard, tp, zero_stage, sp=sp, tie_embeddings=tied)
    data = batches(config(**CFG), STEPS, batch=12 * microbatches)
    losses = train_ranks(
        model, data, rank=dp_rank, world=replicate * shard, microbatches=microbatches,
        sync_last_only=sync_last_only,
    )  # fmt: skip
    # train() sums over every rank (each data-parallel rank's loss tp times) unless dp is 1
    counted = tp if replicate * shard > 1 else 1
    return [loss / counted for loss in losses], full_state(model), _placements(model)


def _placements(model) -> dict[str, tuple]:
    return {name: tuple(p.placements) for name, p in model.named_parameters()}


CASES = [
    # ((dp_replicate, dp_shard, tp), ZeRO stage, micro-batches, sync on the last only, tied)
    ((1, 2, 2), 3, 1, False, False),
    ((1, 2, 2), 2, 3, True, True),
    ((1, 1, 4), 3, 3, False, True),
    ((1, 1, 4), 2, 1, False, False),
    ((1, 4, 1), 3, 1, False, True),
    ((1, 4, 1), 2, 3, False, False),
    ((1, 1, 2), 3, 1, False, False),
    ((1, 1, 2), 2, 3, True, True),
    ((2, 1, 2), 3, 3, True, False),
    ((2, 1, 2), 2, 1, False, True),
]


def _id(case) -> str:
    (replicate, shard, tp), stage, micro, last, tied = case
    return f"rep{replicate}-shard{shard}-tp{tp}-zero{stage}-micro{micro}-last{last}-tied{tied}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_tp_with_fully_shard_trains_like_one_process(case):
    layout, _, microbatches, _, tied = case
    cfg = config(**CFG, tie_embeddings=tied)
    reference = build_model(cfg)
    data = batches(cfg, STEPS, batch=12 * microbatches)
    ref_losses = train_ranks(reference, data, microbatches=microbatches)
    world = layout[0] * layout[1] * layout[2]
    dp = (Replicate(), Shard(0)) if layout[0] > 1 else (Shard(0),)
    for losses, weights, placements in run_distributed(_train, world, *case):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE
        # one mesh for every parameter; the TP split where TP put it, Replicate elsewhere
        assert placements["layers.0.attn.q_proj.weight"] == (*dp, Shard(0))
        assert placements["layers.0.attn.o_proj.weight"] == (*dp, Shard(1))
        assert placements["layers.0.mlp.gate_up_proj.weight"][-1].split_factor == 2
        assert placements["embed_tokens.weight"] == (*dp, Replicate())
        assert placements["layers.0.attn_norm.weight"] == (*dp, Replicate())


def _qk_norm_run(layout):
    """The first gradients, then five AdamW steps' losses, of a model with q/k norms."""
    replicate, shard, tp = layout
    model, dp_rank = tp_model(replicate, shard, tp, qk_norm=True)
    cfg = config(**CFG, qk_norm=True)
    tokens = batches(cfg, 1, batch=12)[0]
    backward_micro_batches(model, tokens, 1, False, dp_rank, replicate * shard)
    grads = full_grads(model)
    model.zero_grad()
    losses = train_ranks(model, batches(cfg, STEPS), rank=dp_rank, world=replicate * shard)
    counted = tp if replicate * shard > 1 else 1
    return grads, [loss / counted for loss in losses]


@pytest.mark.parametrize("layout", [(1, 2, 2), (1, 1, 4)], ids=str)
def test_q_and_k_norms_under_tp(layout):
    """Qwen3's q/k norms see each TP rank's own heads: their weights are replicated over TP
    and their gradients summed over it (HeadNormParallel). Gradients per tensor and losses
    equal one process (weights after AdamW are not compared: the norms' gradients are tiny
    and Adam scales their rounding noise to full steps)."""
    cfg = config(**CFG, qk_norm=True)
    reference = build_model(cfg)
    backward_micro_batches(reference, batches(cfg, 1, batch=12)[0], 1, False)
    expected = {name: p.grad.clone() for name, p in reference.named_parameters()}
    reference.zero_grad()
    ref_losses = train_ranks(reference, batches(cfg, STEPS))
    for grads, losses in run_distributed(_qk_norm_run, layout[1] * layout[2], layout):
        errors = per_tensor_errors(grads, expected)
        assert max(errors.values()) <= GRAD_TOLERANCE, errors
        assert rel_losses(losses, ref_losses) <= TOLERANCE


@pytest.mark.parametrize("layout", [(1, 2, 2), (1, 1, 4)], ids=str)
def test_sequence_parallel_with_vocab_parallel_embedding_and_head(layout):
    """torchtitan's plan: norms and residual split by sequence, embedding and head by
    vocabulary (odd: 61 rows, uneven TP pieces), then fully_shard; equals one process."""
    cfg = config(**CFG)
    reference = build_model(cfg)
    ref_losses = train_ranks(reference, batches(cfg, STEPS, batch=36), microbatches=3)
    world = layout[0] * layout[1] * layout[2]
    for losses, weights, placements in run_distributed(
        _train, world, layout, 2, 3, True, False, True
    ):
        assert rel_losses(losses, ref_losses) <= TOLERANCE
        assert rel_diff(weights, reference.state_dict()) <= TOLERANCE
        assert placements["embed_tokens.weight"][-1] == Shard(0)  # vocab-parallel
        assert placements["layers.0.attn_norm.weight"][-1] == Replicate()


def _first_gradients(layout, microbatches, sync_last_only):
    replicate, shard, tp = layout
    model, dp_rank = tp_model(replicate, shard, tp)
    tokens = batches(config(**CFG), 1, batch=12 * microbatches)[0]
    backward_micro_batches(model, tokens, microbatches, sync_last_only, dp_rank, replicate * shard)
    grads = full_grads(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return grads, norm.item()


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 1, 2), (1, 1, 4)], ids=str)
def test_tp_gradients_and_clip_norm_equal_one_process(layout):
    reference = build_model(config(**CFG))
    tokens = batches(config(**CFG), 1, batch=36)[0]
    backward_micro_batches(reference, tokens, 3, False)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e9).item()
    world = layout[0] * layout[1] * layout[2]
    for grads, norm in run_distributed(_first_gradients, world, layout, 3, True):
        errors = per_tensor_errors(grads, ref_grads)
        assert max(errors.values()) <= GRAD_TOLERANCE, errors
        # every element counted once over dp x tp, replicated parameters included
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm


# --- checkpoints whose meaning does not depend on the TP size ---------------------------------
SAVED_STEPS = 2


class PlainStateAdamW(torch.optim.AdamW):
    """AdamW whose moments are plain local tensors (TransformerEngine's FusedAdam keeps its
    state like this): their checkpoint chunks must come from the layout, not their numel."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    if isinstance(state.get(key), DTensor):
                        state[key] = state[key].to_local()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state and not isinstance(state[key], DTensor):
                        state[key] = DTensor.from_local(
                            state[key], p.device_mesh, p.placements, run_check=False,
                            shape=p.shape, stride=p.stride(),
                        )  # fmt: skip
        result = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = state[key].to_local()
        return result


def _optimizer(kind):
    if kind == "plain-state":
        return lambda params: PlainStateAdamW(params, lr=1e-3, weight_decay=0.1)
    return lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _moments(optimizer) -> dict:
    """Every optimizer state tensor, full, keyed by parameter position and name."""
    out = {}
    for index, p in enumerate(optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state[p].items():
            if value.dim() == 0:
                continue
            if not isinstance(value, DTensor):
                value = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride(),
                )  # fmt: skip
            out[f"{index}.{key}"] = value.full_tensor().clone()
    return out


def _save_tp(path, layout, kind, sp=False):
    replicate, shard, tp = layout
    model, dp_rank = tp_model(replicate, shard, tp, sp=sp)
    optimizer = _optimizer(kind)(model.parameters())
    data = batches(config(**CFG), SAVED_STEPS)
    train_ranks(
        model, data, rank=dp_rank, world=replicate * shard, make_optimizer=lambda _: optimizer
    )
    checkpoint.save(path, model=model, optimizer=optimizer, step=SAVED_STEPS)
    return full_state(model), _moments(optimizer)


def _resume_tp(path, layout, kind, sp=False):
    replicate, shard, tp = layout
    model, dp_rank = tp_model(replicate, shard, tp, seed=3, sp=sp and tp > 1)
    optimizer = _optimizer(kind)(model.parameters())
    checkpoint.load(path, model=model, optimizer=optimizer)
    loaded = full_state(model), _moments(optimizer)
    data = batches(config(**CFG), STEPS)[SAVED_STEPS:]
    losses = train_ranks(
        model, data, rank=dp_rank, world=replicate * shard, make_optimizer=lambda _: optimizer
    )
    counted = tp if replicate * shard > 1 else 1
    return loaded, [loss / counted for loss in losses], full_state(model)


LAYOUTS = [(1, 2, 2), (1, 1, 4), (1, 4, 1), (2, 2, 1), (2, 1, 2), (1, 1, 1)]
# Where each save is loaded in CI: every layout saved or loaded at least twice, each save
# loaded at two others (one with another TP degree); the rest of the 25 pairs is exhaustive.
SAMPLED = {
    ((1, 2, 2), "adamw"): [(1, 1, 4), (2, 2, 1)],
    ((1, 1, 4), "adamw"): [(1, 4, 1), (2, 1, 2)],
    ((1, 4, 1), "adamw"): [(2, 2, 1), (1, 1, 1)],
    ((2, 2, 1), "adamw"): [(2, 1, 2), (1, 2, 2)],
    ((1, 2, 2), "plain-state"): [(1, 1, 1), (1, 4, 1)],
}
SAVES = [
    pytest.param(saved_at, kind, loads, marks=marks, id=f"{saved_at}-{kind}{suffix}")
    for (saved_at, kind), sampled in SAMPLED.items()
    for loads, marks, suffix in (
        (sampled, (), ""),
        ([at for at in LAYOUTS if at != saved_at and at not in sampled], pytest.mark.exhaustive,
         "-rest"),
    )
]  # fmt: skip


@pytest.mark.parametrize("saved_at, kind, loads", SAVES)
def test_tp_checkpoint_loads_at_any_layout_and_resumes(tmp_path, saved_at, kind, loads):
    """Saved at (replicate, shard, tp), loaded at other layouts and in one process:
    model and optimizer bitwise, and training resumed equals uninterrupted training."""
    cfg = config(**CFG)
    reference = build_model(cfg)
    ref_losses = train_ranks(reference, batches(cfg, STEPS))
    path = str(tmp_path / "tp")
    world = saved_at[0] * saved_at[1] * saved_at[2]
    saved_weights, saved_moments = run_distributed(_save_tp, world, path, saved_at, kind)[0]
    for layout in loads:
        world = layout[0] * layout[1] * layout[2]
        (weights, moments), losses, final = run_distributed(_resume_tp, world, path, layout, kind)[
            0
        ]
        assert rel_diff(weights, saved_weights) == 0.0, layout
        assert moments.keys() == saved_moments.keys(), layout
        assert all(torch.equal(moments[k], saved_moments[k]) for k in moments), layout
        assert rel_losses(losses, ref_losses[SAVED_STEPS:]) <= TOLERANCE, layout
        assert rel_diff(final, reference.state_dict()) <= TOLERANCE, layout
    if kind == "plain-state" and loads == SAMPLED[(saved_at, kind)]:
        messages = run_distributed(_load_wider_mlp, 4, path)
        assert all("ffn_dim: checkpoint 48, model 64" in m for m in messages), messages


def test_sequence_parallel_checkpoint_resumes_at_any_layout(tmp_path):
    """Saved under TP + SP (the root's vocabulary-parallel embedding has uneven TP pieces,
    so each TP rank packs the Replicate final norm at other offsets): resumed under TP +
    SP, at dp 4 and in one process, exactly as uninterrupted training."""
    cfg = config(**CFG)
    reference = build_model(cfg)
    ref_losses = train_ranks(reference, batches(cfg, STEPS))
    path = str(tmp_path / "sp")
    saved_weights, saved_moments = run_distributed(_save_tp, 4, path, (1, 2, 2), "adamw", True)[0]
    for layout in [(1, 1, 4), (1, 4, 1), (1, 1, 1)]:
        world = layout[0] * layout[1] * layout[2]
        (weights, moments), losses, final = run_distributed(
            _resume_tp, world, path, layout, "adamw", True
        )[0]
        assert rel_diff(weights, saved_weights) == 0.0, layout
        assert all(torch.equal(moments[k], saved_moments[k]) for k in saved_moments), layout
        assert rel_losses(losses, ref_losses[SAVED_STEPS:]) <= TOLERANCE, layout
        assert rel_diff(final, reference.state_dict()) <= TOLERANCE, layout


def _load_wider_mlp(path):
    """Loading into a model whose fused gate/up has other component sizes: one clear error,
    on every rank, naming the difference."""
    model, _ = tp_model(1, 2, 2, ffn_dim=64)
    try:
        checkpoint.load(path, model=model)
    except CheckpointError as error:
        return str(error)
    return "loaded"


# --- collectives ------------------------------------------------------------------------------
def _collectives(tp):
    """One forward and backward (after a first one, which learns the order): how often each
    unit's buckets were all-gathered and reduce-scattered, over which ranks, and every
    other collective by op (torch's count, which sees all but flatshard's point-to-point
    all-gathers on gloo)."""
    shard = dist.get_world_size() // tp
    if tp > 1:
        model, dp_rank = tp_model(1, shard, tp)
    else:
        model, dp_rank = shard_model(build_model(config(**CFG))), dist.get_rank()
    data = batches(config(**CFG), 2)
    lm_loss(model, rank_slice(data[0], dp_rank, shard)).backward()
    calls = []
    gather, reduce = FlatBucket.start_all_gather, FlatBucket.start_reduce_scatter

    def counted(kind, original):
        def run(bucket, *args, **kwargs):
            calls.append((kind, id(bucket), tuple(dist.get_process_group_ranks(bucket.group))))
            return original(bucket, *args, **kwargs)

        return run

    FlatBucket.start_all_gather = counted("all-gather", gather)
    FlatBucket.start_reduce_scatter = counted("reduce-scatter", reduce)
    try:
        with CommDebugMode() as mode:
            lm_loss(model, rank_slice(data[1], dp_rank, shard)).backward()
    finally:
        FlatBucket.start_all_gather, FlatBucket.start_reduce_scatter = gather, reduce
    units = {}
    for name, module in model.named_modules():
        unit = registry.unit_of(module)
        if unit is not None and id(unit) not in units:
            units[id(unit)] = (name, unit)
    per_unit = {}
    for name, unit in units.values():
        counts = {
            (kind, sum(1 for k, b, _ in calls if k == kind and b == id(bucket)))
            for bucket in unit.buckets
            for kind in ("all-gather", "reduce-scatter")
        }
        per_unit[name] = sorted(counts)  # one count per kind: every bucket moves alike
    groups = {ranks for _, _, ranks in calls}
    dp_group = tuple(dist.get_process_group_ranks(units[next(iter(units))][1].mesh.shard_group))
    others = {str(op): count for op, count in mode.get_comm_counts().items()}
    reduce_scatters = sum(1 for kind, _, _ in calls if kind == "reduce-scatter")
    return per_unit, groups == {dp_group}, others, reduce_scatters


def test_tp_collectives_are_the_data_parallel_ones_plus_torchs_tp():
    """At (dp 2, tp 2): each unit's buckets are all-gathered and reduce-scattered exactly as
    without TP, on the data-parallel group only; the other collectives are the TP
    all-reduces (torch's: two row-parallel outputs and the q/k/v input gradients per block;
    flatshard's: the fused gate/up input gradient) and what the run without TP issues
    too (gloo's reduce-scatter all-to-alls, the lookup's token counts): nothing else."""
    per_unit, on_dp_group, others, reduce_scatters = run_distributed(_collectives, 4, 2)[0]
    expected_per_unit, _, others_without, _ = run_distributed(_collectives, 2, 1)[0]
    assert per_unit == expected_per_unit and on_dp_group
    layers = config(**CFG).n_layers
    tp_ops = {"c10d_functional.all_reduce": 5 * layers, "c10d.allreduce_": layers}
    assert {op: n for op, n in others.items() if op in tp_ops} == tp_ops, others
    rest = {op: n for op, n in others.items() if op not in tp_ops}
    assert rest.pop("c10d.alltoall_base_") == reduce_scatters  # gloo's reduce-scatter
    assert rest == {op: n for op, n in others_without.items() if op != "c10d.alltoall_base_"}


# --- checkpoints interchangeable with PyTorch FSDP2 + TP --------------------------------------
def _fsdp2_tp_model():
    """The same model under FSDP2 over (dp_shard 2, tp 2), split by torch's own styles. FSDP2
    2.13 cannot checkpoint the per-component fused gate/up (`_StridedShard` under its own
    strided dp placement: wrong full_tensor, DCP refuses overlapping chunks), so here gate/up
    is a plain ColwiseParallel: its SwiGLU pairs other rows, but its checkpoint is the same
    global `[gate; up]`, which is what interchange is about."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = flatshard.ParallelDims(4, tp=2).build().world  # (dp_shard, tp)
    model = build_model(config(**CFG), seed=5)
    plan = {name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan = {f"attn.{name}": style for name, style in plan.items()}
    plan.update({"attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    plan["mlp.gate_up_proj"] = ColwiseParallel()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model, mesh["dp_shard"].get_local_rank()


def _interchange(path, writer):
    """`writer` ("fsdp2" or "flatshard") trains two steps and saves with DCP (torch's own
    state-dict API); the other library loads it. Returns (saved, loaded) full states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    builders = {"fsdp2": _fsdp2_tp_model, "flatshard": lambda: tp_model(1, 2, 2, seed=5)}
    model, dp_rank = builders[writer]()
    optimizer = _optimizer("adamw")(model.parameters())
    data = batches(config(**CFG), SAVED_STEPS)
    train_ranks(model, data, rank=dp_rank, world=2, make_optimizer=lambda _: optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    saved = full_state(model), full_optimizer_state(model, optimizer)

    reader = builders["flatshard" if writer == "fsdp2" else "fsdp2"]
    model, _ = reader()
    optimizer = _optimizer("adamw")(model.parameters())
    train_ranks(model, data[:1], rank=dp_rank, world=2, make_optimizer=lambda _: optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return saved, (full_state(model), full_optimizer_state(model, optimizer))


@pytest.mark.parametrize("writer", ["fsdp2", "flatshard"])
def test_tp_checkpoints_interchange_with_fsdp2(tmp_path, writer):
    for saved, loaded in run_distributed(_interchange, 4, str(tmp_path / "dcp"), writer):
        assert rel_diff(loaded[0], saved[0]) == 0.0
        assert loaded[1].keys() == saved[1].keys()
        assert all(torch.equal(loaded[1][k], saved[1][k]) for k in saved[1])
