"""Pipeline stages on paper (`flatshard plan --pp N`): which blocks each rank's stages
hold (as `flatshard.pipeline` splits them: api/pipeline.py's `assign_blocks`), how many
micro-batches' activations a stage holds at once under each schedule, the bubble, and the
activations and their gradients sent between stages. Each rank's memory and data-parallel
bytes are then those of a flatshard run of its stages' units (estimate.py).

What a rank holds at once under the schedules of two stages a rank is read off torch's own
action list for it (`compat.pipeline_actions`): a forward's activations live until its
backward, or under the zero-bubble schedules until the backward's weight half, and from
the input half to the weight half also the gradients of the matrix products' outputs that
the weight half starts from (torch's `stage_backward_input` keeps them); each tensor sent
to another rank lives until the step ends (torch's runtime waits for its sends then), and
a running backward adds its own gradients. Checked against measured peaks of every
schedule (`tests/test_cli_pipeline.py`, benchmarks/RESULTS.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flatshard import compat
from flatshard.api.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from flatshard.api.pipeline import V_SHAPED
from flatshard.api.pipeline_split import assign_blocks
from flatshard.errors import ConfigError
from flatshard.planner.activations import FP32
from flatshard.planner.model_spec import ModelSpec, UnitSpec

SCHEDULES = tuple(PIPELINE_SCHEDULES)
_V_SHAPED = V_SHAPED  # rank r runs stages r and 2 pp - 1 - r
_INTERLEAVED = tuple(s for s in SCHEDULES if s not in ("gpipe", "1f1b"))  # two stages a rank


@dataclass(frozen=True)
class RankPart:
    """Pipeline rank `rank`'s stages: each as a model of its own (`stages`), all of them
    together (`whole`: its memory), the micro-batches of activations they hold at once
    (`in_flight`, of the rank's whole activations) and the bytes sent to other stages."""

    rank: int
    stages: tuple[ModelSpec, ...]
    whole: ModelSpec
    in_flight: float
    sent: int
    # bytes held at the peak besides the in-flight activations: the loss's backward on the
    # last stage; with two stages a rank, all else the walk of torch's action list finds
    transient: int
    tied: TiedCost | None = None  # a tied embedding's share (api/pipeline_tie.py)


@dataclass(frozen=True)
class TiedCost:
    """What a tied embedding costs a pipeline rank a step, in bytes: held through the step
    (the last stage: the weight it receives, a micro-batch's gradient and their fp32 sum),
    held at its end (the first stage: the gradient received), the first stage's all-gather
    of the weight and all-reduce of the gradient (fp32, as the payloads `flatshard plan`
    counts), their bytes on the wire, and what goes to the other end."""

    held: int
    held_at_end: int
    collectives: int
    wire: int
    sent: int


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in _INTERLEAVED else 1


def check_pipeline_setup(setup) -> None:
    if setup.pp_schedule not in SCHEDULES:
        raise ConfigError(f"--pp-schedule {setup.pp_schedule}: use one of {', '.join(SCHEDULES)}")
    if setup.world_size % setup.pp:
        raise ConfigError(f"--pp {setup.pp} must divide --world-size {setup.world_size}")
    if setup.hpz_group:
        raise ConfigError("--pp with --hpz-group is not planned yet: use one of the two")


def bubble_fraction(setup) -> float:
    """The share of a step each rank waits: (pp - 1) of the micro-batch slots, which the
    interleaved schedules make `v` times shorter (v stages a rank); the zero-bubble ones
    fill it with weight gradients as their papers count it: interleaved-zb to a third,
    the V-shaped ones to none once there are 2 pp micro-batches."""
    pp, m, schedule = setup.pp, setup.grad_accum, setup.pp_schedule
    if schedule in _V_SHAPED and m >= 2 * pp:
        return 0.0
    v = 2 if schedule in ("interleaved-1f1b", "interleaved-zb", *_V_SHAPED) else 1
    bubble = (pp - 1) / (v * m + pp - 1)
    return bubble / 3 if schedule == "interleaved-zb" else bubble


def rank_parts(spec: ModelSpec, setup, hidden: int, activation_bytes: int) -> list[RankPart]:
    """Every pipeline rank's part of `spec` under `setup` (grad_accum: the micro-batches)."""
    tied = tied_embedding(spec)
    v = stages_per_rank(setup.pp_schedule)
    stages = setup.pp * v
    if spec.n_layers < stages:
        raise ConfigError(
            f"--pp {setup.pp} with {setup.pp_schedule} makes {stages} stages of "
            f"{spec.n_layers} blocks: use fewer stages"
        )
    whole_tied = tied.numel * FP32 if tied is not None else 0  # moved in fp32
    blocks = assign_blocks(spec.n_layers, stages)
    # what a stage sends on: its activations for this rank's tokens (its CP part)
    boundary = setup.micro_batch * setup.seq_len // setup.cp * hidden * activation_bytes
    parts = []
    for rank in range(setup.pp):
        mine = [rank, stages - 1 - rank] if setup.pp_schedule in _V_SHAPED else range(
            rank, stages, setup.pp
        )
        specs = tuple(_stage(spec, blocks[s], s == 0, s == stages - 1) for s in mine)
        held = [b for s in mine for b in blocks[s]]
        together = _stage(spec, held, 0 in mine, stages - 1 in mine)
        sends = sum((s < stages - 1) + (s > 0) for s in mine)  # forward out, gradient back
        tokens = setup.micro_batch * setup.seq_len // setup.cp
        in_flight = _in_flight(setup, rank)
        transient = tokens * spec.activations(activation_bytes, setup.kv_grouped).head_transient
        transient = transient if stages - 1 in mine else 0
        held = None
        if len(mine) > 1:
            held = _held_at_peak(setup, rank, list(mine), specs, together, spec, hidden,
                                 activation_bytes)  # fmt: skip
        if held is not None:
            in_flight, transient = held[0], tokens * held[1]
        first, last = 0 in mine, stages - 1 in mine
        cost = None
        if whole_tied and (first or last):
            cost = _tied_cost(whole_tied, tied.numel * activation_bytes, first, last, setup,
                              tied.requires_grad)  # fmt: skip
        parts.append(RankPart(rank, specs, together, in_flight,
                              sends * setup.grad_accum * boundary, transient, cost))  # fmt: skip
    return parts


def _held_at_peak(setup, rank: int, mine: list[int], specs, together: ModelSpec,
                  whole_spec: ModelSpec, hidden: int, a: int):  # fmt: skip
    """Walking torch's action list for pipeline rank `rank` (stages `mine`, their `specs`):
    at the moment it holds the most, (the activations held, in micro-batches of the rank's
    whole `together`; the bytes per token of everything else then: the gradients kept for
    weight halves, the tensors sent so far (torch's runtime waits for its sends at the end
    of the step, so each lives till then) and the running backward's own gradients); a
    tuple (float, int). None where torch's list is not to be had."""
    actions = compat.pipeline_actions(PIPELINE_SCHEDULES[setup.pp_schedule], mine, setup.pp,
                                      rank, setup.grad_accum)  # fmt: skip
    if not actions:
        return None
    stages = setup.pp * len(mine)
    per_token = lambda s: s.activations(a, setup.kv_grouped).on_rank(setup.tp, setup.sp)  # noqa: E731
    whole = per_token(whole_spec)
    boundary = hidden * a // (setup.tp if setup.sp else 1)
    saved, kept, running = {}, {}, {}
    for index, spec in zip(mine, specs):
        stage = per_token(spec)
        saved[index] = stage.per_token("none")
        # the weight half starts from the gradients of the matrix products' outputs: about
        # what selective AC keeps of a block (those outputs)
        kept[index] = sum(n * layer.kept for n, layer in stage.layers)
        # while a backward runs: a block's activation gradients (as per_token's), freed as
        # it goes; the input half frees nothing (the weight half needs the graph), so it
        # holds what it keeps, and on the last stage the loss's gradients too
        largest = max((layer.all for _, layer in stage.layers), default=0)
        last = whole.head_transient if index == stages - 1 else 0
        running[index] = {"B": largest * 3 // 8, "I": kept[index] + largest * 3 // 8 + last}
    sends_forward = {i for i in mine if i < stages - 1 and i + 1 not in mine}
    sends_back = {i for i in mine if i > 0 and i - 1 not in mine}
    held: dict[tuple[int, int], list[int]] = {}
    sent, peak = 0, (0, 0)

    def now(extra: int = 0) -> tuple[int, int]:
        return (sum(h[0] for h in held.values()),
                sum(h[1] for h in held.values()) + sent + extra)  # fmt: skip

    for kind, stage, micro in actions:
        moments = []
        if kind in ("B", "I"):  # while it runs: its gradients besides what is held
            moments.append(now(running[stage][kind]))
            sent += boundary * (stage in sends_back)
        if kind == "F":
            held[(stage, micro)] = [saved[stage], 0]
        elif kind == "I" and (stage, micro) in held:
            held[(stage, micro)][1] = kept[stage]
        elif held.pop((stage, micro), None) is not None:  # a whole backward, a weight half
            sent += boundary * (stage in sends_forward)  # its output, till the sends end
        moments.append(now())
        peak = max([peak, *moments], key=sum)
    return peak[0] / per_token(together).per_token("none"), peak[1]


def _in_flight(setup, rank: int) -> float:
    """Micro-batches of the rank's activations held at once, at the peak (the closed forms;
    with two stages a rank only where torch's action list is not to be had): GPipe runs every
    forward first; 1F1B starts `pp - rank` of them before its first backward; interleaved
    1F1B holds `2 (pp - rank - 1) + pp + 1` chunks of a stage (half the rank's blocks);
    looped BFS every micro-batch of both stages."""
    m, pp = setup.grad_accum, setup.pp
    if setup.pp_schedule in ("gpipe", "looped-bfs"):
        return float(m)
    if setup.pp_schedule == "1f1b":
        return float(min(m, pp - rank))
    if setup.pp_schedule in _V_SHAPED:  # a V: 1F1B's memory, every rank alike
        return float(min(m, pp))
    return min(2 * m, 2 * (pp - rank - 1) + pp + 1) / 2


def _stage(spec: ModelSpec, blocks, first: bool, last: bool) -> ModelSpec:
    """`spec` cut to `blocks` (the embedding when `first`, the norm and head when `last`)."""
    held = _layer_counts(spec, blocks)

    def activations(a: int, grouped_kv: bool = False):
        # per micro-batch in flight: its blocks', and the head's (the logits and what the
        # loss saved) on the last stage, the stage's output on the others (the schedule
        # keeps it until its backward); the loss's backward adds `transient` once
        whole = spec.activations(a, grouped_kv)
        layers = tuple((n, saved) for n, (_, saved) in zip(held, whole.layers) if n)
        head, head_norm = (whole.head - whole.head_transient, whole.head_norm) if last else (
            whole.block_input, 0
        )
        return replace(whole, layers=layers, head=head, head_norm=head_norm, head_transient=0)

    units = _stage_units(spec, blocks, first, last)
    return replace(spec, units=units, n_layers=len(list(blocks)), activations=activations)


def _layer_counts(spec: ModelSpec, blocks) -> list[int]:
    """How many of `blocks` fall in each run of same-shaped layers (spec.units' order)."""
    counts, start = [], 0
    chosen = set(blocks)
    for unit in spec.units:
        if unit.is_root or unit.inner:
            continue
        counts.append(sum(1 for i in range(start, start + unit.count) if i in chosen))
        start += unit.count
    return counts


def _tied_cost(whole: int, compute: int, first: bool, last: bool, setup,
               trainable: bool = True) -> TiedCost:  # fmt: skip
    """`whole`: the weight in fp32; `compute`: in the compute dtype. The first stage
    gathers it over its shard group (dp_shard x cp) and, `trainable`, sums the gradient over
    that group, then over the replicas (HSDP; a frozen weight, LoRA's, has none to send
    back); a rank holding both ends (a V's first) sends nothing."""
    shards, replicas = setup.dp_shard * setup.cp, setup.dp_replicate
    collectives = wire = 0
    if first:
        collectives = whole if shards > 1 else 0  # the gather
        wire = (shards - 1) * whole // shards
        if trainable:  # an all-reduce per group
            collectives += whole * ((shards > 1) + (replicas > 1))
            wire += 2 * (shards - 1) * whole // shards + 2 * (replicas - 1) * whole // replicas
    held = (2 * compute + whole if trainable else compute) if last else 0
    sends = (first and not last) or (last and not first and trainable)  # weight; gradient
    return TiedCost(held, whole * trainable if first else 0, collectives, wire, whole * sends)


def tied_embedding(spec: ModelSpec):
    """The embedding's ParamInfo where a root unit holds it as the head too (tied: no
    `lm_head.weight` anywhere), else None."""
    names = {p.name: p for u in spec.units for p in u.params}
    embed = names.get("embed_tokens.weight")
    tied = embed is not None and "lm_head.weight" not in names
    held_by_root = any(u.is_root and not u.embedding and embed in u.params for u in spec.units)
    return embed if tied and held_by_root else None


def _stage_units(spec: ModelSpec, blocks, first: bool, last: bool) -> tuple[UnitSpec, ...]:
    """The units of `blocks` (and the ends): a run of layers cut to those it holds, the
    experts unit after it (expert parallelism, ep_local) cut alike. A root holding a tied
    embedding is split: the embedding (a unit of its own) on the first stage, the rest on
    the last (which receives the weight each step: `RankPart.tied`)."""
    chosen, units, start, held = sorted(set(blocks)), [], 0, []
    tied = tied_embedding(spec)
    for unit in spec.units:
        if unit.is_root and tied is not None and tied in unit.params:
            rest = tuple(p for p in unit.params if p is not tied)
            if first:
                units.append(UnitSpec("embed_tokens", (tied,), is_root=True, embedding=True))
            if last and rest:
                units.append(replace(unit, params=rest))
        elif unit.is_root:
            if first if unit.embedding else last:
                units.append(unit)
        elif unit.inner:  # the experts of the layers just before
            if held:
                units.append(replace(unit, name=f"{units[-1].name} experts", count=len(held)))
        else:
            held = [i for i in chosen if start <= i < start + unit.count]
            start += unit.count
            if held:
                name = f"layers.{held[0]}-{held[-1]}" if len(held) > 1 else f"layers.{held[0]}"
                units.append(replace(unit, name=name, count=len(held)))
    return tuple(units)
