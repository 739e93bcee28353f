"""A decoder split into pipeline stages: each stage a copy of the model holding its share
of the blocks (under their indices in the whole model, so names and checkpoints stay the
whole model's), the embedding on the first stage, the final norm and the head on the last.
Where those parts live is the model's plan's (`ParallelPlan.stages`: `StageParts`)."""

from __future__ import annotations

import copy
import types

from torch import nn

from flatshard.api.parallel_plan import StageParts, plan_for
from flatshard.api.pipeline_tie import drop_head_weight, untie_across_stages
from flatshard.errors import WrappingError


class StageBlocks(nn.ModuleList):
    """A stage's blocks under their indices in the whole model ("layers.5"); iterated and
    indexed by position, as any ModuleList."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, index):
        held = list(self._modules.values())
        return nn.ModuleList(held[index]) if isinstance(index, slice) else held[index]

    @property
    def indices(self) -> list[int]:
        """Each block's index in the whole model."""
        return [int(key) for key in self._modules]


def assign_blocks(blocks: int, num_stages: int) -> list[range]:
    """Each stage's blocks (by position): as even as they go, the earlier stages taking
    the extra ones."""
    per, extra = divmod(blocks, num_stages)
    starts = [s * per + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


def stage_modules(model: nn.Module, num_stages: int, stage: int) -> nn.Module:
    """Stage `stage` of `num_stages` of a decoder (its plan says where the embedding, the
    blocks, the norm and the head are: flatshard's reference models, transformers' causal
    LMs): a copy holding its share of the blocks under their whole-model indices, the
    embedding on the first stage, norm and head on the last. Blocks are split as evenly as
    they go, the earlier stages taking the extra ones."""
    return stages_part(model, num_stages, [stage])


def stages_part(model: nn.Module, num_stages: int, mine: list[int], untie: bool = False
                ) -> nn.Module:  # fmt: skip
    """A copy of `model` with the blocks (and ends) of the stages `mine`, one module.
    untie: an embedding and head sharing one weight are split too (the first stage's part
    owns it, the last's head holds none: `flatshard.pipeline` moves it each step);
    otherwise such a model is refused."""
    parts = _parts_of(model)
    blocks = _blocks(model, parts)
    if not 1 <= num_stages <= len(blocks) or not all(0 <= s < num_stages for s in mine):
        raise WrappingError(
            f"cannot make stages {mine} of {num_stages} from {len(blocks)} blocks: the "
            "stages must number between 1 and the blocks, and each be one of them"
        )
    tie = None
    if num_stages > 1 and ties_ends(model):
        if not untie:
            raise WrappingError(
                "the embedding and the output head share one weight, but pipeline stages "
                "put them on the first and the last stage: split it with flatshard.pipeline "
                "(which moves the weight between them each step), or untie them "
                "(tie_embeddings=False)"
            )
        tie = untie_across_stages(model, parts.embed, parts.head, mine, num_stages - 1)
    ranges = assign_blocks(len(blocks), num_stages)
    # one copy of what the pieces share (a transformers model's config, which its layers
    # read their attention implementation from): one memo for every copy
    memo: dict = {}
    held = {blocks[p][0]: copy.deepcopy(blocks[p][1], memo) for s in mine for p in ranges[s]}
    ends = {parts.embed: 0 in mine, parts.norm: num_stages - 1 in mine}
    ends[parts.head] = num_stages - 1 in mine
    kept = {path: copy.deepcopy(_get(model, path), memo) for path, keep in ends.items() if keep}
    stage = _assemble(model, parts, held, kept, memo)
    if tie is not None:  # the first stage owns the weight; the last receives it each step
        stage.tied_across_stages = tie
        if tie.last:
            drop_head_weight(_get(stage, parts.head))
    return stage


def ties_ends(model: nn.Module) -> bool:
    """Whether the model's embedding and output head share one weight (as its plan's
    `StageParts` names them)."""
    parts = _parts_of(model)
    embed, head = _get(model, parts.embed), _get(model, parts.head)
    return embed is not None and head is not None and embed.weight is head.weight


def stage_view(part: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """One stage of a rank's part: a module of its own holding the part's very blocks (and
    ends), so sharding the stage shards the part."""
    parts = _parts_of(part)
    held = {i: b for i, b in _blocks(part, parts) if i in blocks}
    ends = {parts.embed: first, parts.norm: last, parts.head: last}
    kept = {p: _get(part, p) for p, keep in ends.items() if keep}
    config = getattr(part, "config", None)  # the one its blocks read, not a copy
    return _assemble(part, parts, held, kept, {} if config is None else {id(config): config})


def _parts_of(model: nn.Module) -> StageParts:
    parts = plan_for(model).stages
    missing = [p for p in (parts.embed, parts.blocks, parts.norm, parts.head) if not _has(model, p)]
    if missing:
        raise WrappingError(
            f"{type(model).__name__} has no {', '.join(missing)}: give its plan the parts' "
            "names (flatshard.ParallelPlan(stages=StageParts(...))), or split it into stages "
            "yourself and wrap each in flatshard.PipelineStage"
        )
    return parts


def _blocks(model: nn.Module, parts: StageParts) -> list[tuple[int, nn.Module]]:
    blocks = _get(model, parts.blocks)
    if isinstance(blocks, StageBlocks):
        return list(zip(blocks.indices, blocks))
    return list(enumerate(blocks))


def _assemble(model: nn.Module, parts: StageParts, blocks: dict, ends: dict, memo: dict
              ) -> nn.Module:  # fmt: skip
    """A copy of `model` without its blocks and ends, given `blocks` and `ends` (the parts
    it keeps; the others stand in as the plan says), its forward the plan's. `memo`: the
    copies made so far (`copy.deepcopy`'s), which it shares."""
    names = (parts.embed, parts.blocks, parts.norm, parts.head)
    kept = {name: _get(model, name) for name in names}
    own_forward = model.__dict__.pop("forward", None)  # a stage's: each copy gets its own
    try:
        for name in names:
            _set(model, name, None)
        stage = copy.deepcopy(model, memo)
    finally:
        for name, module in kept.items():
            _set(model, name, module)
        if own_forward is not None:
            model.forward = own_forward
    _set(stage, parts.blocks, StageBlocks(blocks))
    for name in (parts.embed, parts.norm, parts.head):
        _set(stage, name, ends[name] if name in ends else parts.missing(name))
    stage.pipeline_stage = True  # parallelize takes it under pp > 1
    if parts.forward is not None:  # bound: a copy of the stage calls it with itself
        stage.forward = types.MethodType(_StageForward(parts.forward, parts.embed in ends), stage)
    return stage


class _StageForward:
    """A stage's forward as its plan gives it: `forward(stage, x, first)`."""

    def __init__(self, forward, first: bool):
        self.forward, self.first = forward, first

    def __call__(self, stage: nn.Module, x, *carried, **kwargs):
        """`carried`: what the stage before handed on beside its hidden states."""
        return self.forward(stage, x, self.first, *carried, **kwargs)


def _get(model: nn.Module, path: str):
    for name in path.split("."):
        model = getattr(model, name, None)
    return model


def _has(model: nn.Module, path: str) -> bool:
    owner, _, name = path.rpartition(".")
    holder = _get(model, owner) if owner else model
    return holder is not None and hasattr(holder, name)


def _set(model: nn.Module, path: str, value) -> None:
    owner, _, name = path.rpartition(".")
    setattr(_get(model, owner) if owner else model, name, value)
