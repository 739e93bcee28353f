"""A unit's state, explicit: where its parameters are and where it is in a step.

Enums with checked transitions (in the spirit of FSDP2's `ShardedState` and
`TrainingState`) instead of flags that can disagree: a transition the runtime never
makes is a bug in flatshard, reported at once rather than as a hang or a wrong gradient
later. `StepState` is all a unit's step has seen (its training state among it), reset in
one place. `Resharding` is what a unit frees when, from which the ZeRO stage follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto


class ShardedState(Enum):
    SHARDED = auto()  # only the shards are allocated
    GATHERING = auto()  # all-gathers issued, not yet waited on
    UNSHARDED = auto()  # the unsharded buffers hold the gathered parameters


class Pass(Enum):
    """Which pass a model (its root and every unit below) is running."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


class TrainingState(Enum):
    IDLE = auto()  # between steps, or in forward/backward outside this unit
    FORWARD = auto()  # between this unit's pre- and post-forward
    PRE_BACKWARD = auto()  # its backward started: gathered, gradient buffers prepared
    POST_BACKWARD = auto()  # its gradients reduced (or held); waits for the end of backward


_SHARDED_MOVES = {
    ShardedState.SHARDED: {ShardedState.GATHERING},
    ShardedState.GATHERING: {ShardedState.UNSHARDED},
    # a re-gather of a stale copy starts from the unsharded state
    ShardedState.UNSHARDED: {ShardedState.SHARDED, ShardedState.GATHERING},
}
_TRAINING_MOVES = {
    # a forward may be re-entered (a module calling itself) or left by an exception
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.PRE_BACKWARD,
                         TrainingState.POST_BACKWARD, TrainingState.IDLE},
    TrainingState.FORWARD: {TrainingState.IDLE, TrainingState.FORWARD},
    TrainingState.PRE_BACKWARD: {TrainingState.POST_BACKWARD, TrainingState.IDLE},
    TrainingState.POST_BACKWARD: {TrainingState.IDLE},
}  # fmt: skip
_PASS_MOVES = {
    # a forward that raised is begun again by the next one (reset_iteration ends any pass);
    # a root method that calls its own forward (register_fsdp_forward_method) ends twice
    Pass.IDLE: {Pass.FORWARD, Pass.BACKWARD, Pass.IDLE},
    Pass.FORWARD: {Pass.IDLE, Pass.FORWARD},
    Pass.BACKWARD: {Pass.IDLE},
}
_MOVES = {ShardedState: _SHARDED_MOVES, TrainingState: _TRAINING_MOVES, Pass: _PASS_MOVES}


def check_move(old: Enum, new: Enum) -> Enum:
    """`new`, if a unit (or its model's pass) may go there from `old`; else an internal
    error."""
    if new not in _MOVES[type(old)][old]:
        raise RuntimeError(f"flatshard internal error: moved from {old} to {new}")
    return new


@dataclass
class StepState:
    """What a unit's current step has seen, from its first forward to the end of backward
    (or an iteration that raised: `reset`)."""

    training: TrainingState = TrainingState.IDLE
    # forward calls whose inputs' gradients mark the end of its backward, and how many of
    # those gradients arrived: the last one runs its post-backward
    forward_calls: int = 0
    input_gradients_seen: int = 0
    # a call had no such inputs (token ids into an embedding): its gradients are complete
    # only at the end of the whole backward
    post_backward_at_end: bool = False
    kept_for_backward: bool = False  # its last forward kept it gathered for backward

    def move(self, new: TrainingState) -> None:
        self.training = check_move(self.training, new)

    def marked_forward(self) -> None:
        """A forward call whose inputs' gradients will mark the end of its backward."""
        self.forward_calls += 1

    def input_gradients_arrived(self) -> bool:
        """One call's input gradients arrived; True when they all have and nothing waits
        for the end of backward (then its post-backward runs now)."""
        self.input_gradients_seen += 1
        return self.input_gradients_seen == self.forward_calls and not self.post_backward_at_end

    def finish(self) -> None:
        """Its backward is over: idle, ready for the next step's forwards
        (`kept_for_backward` still tells what its last forward did)."""
        self.move(TrainingState.IDLE)
        self.forward_calls = self.input_gradients_seen = 0
        self.post_backward_at_end = False

    def reset(self) -> None:
        """An iteration that raised: as `finish`, and nothing kept."""
        self.finish()
        self.kept_for_backward = False


@dataclass
class Resharding:
    """What a unit frees when. ZeRO-3 frees its unsharded parameters after forward and
    backward; ZeRO-2 after backward only; ZeRO-1 keeps parameters and its unsharded
    gradient buffers between steps (only main weights and optimizer state are sharded).
    FSDP2's `set_reshard_after_forward` / `_backward` change the first two; the stage is
    read off them, so the two can never disagree."""

    after_forward: bool
    after_backward: bool
    keep_grad_buffers: bool
    # hpZ: after forward, stay sharded over this many consecutive ranks (each keeps 1/n of
    # the gathered buckets), so backward gathers inside that small group; None: all ranks
    forward_group_size: int | None = None

    @classmethod
    def for_stage(cls, stage: int) -> Resharding:
        return cls(
            after_forward=stage == 3, after_backward=stage != 1, keep_grad_buffers=stage == 1
        )

    @property
    def stage(self) -> int:
        return 3 if self.after_forward else 2 if self.after_backward else 1
