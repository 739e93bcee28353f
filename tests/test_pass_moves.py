"""A model's pass moves as a step runs it, checked as a unit's states are: a move the
runtime never makes is an internal error at once, not a hang or a wrong gradient later."""

import pytest

from flatshard.runtime.schedule import RootContext
from flatshard.runtime.states import Pass


def test_a_step_moves_idle_forward_idle_backward_idle():
    context = RootContext(units=[], root=None)
    seen = [context.running]
    for move in (context.start_forward, context.end_forward, context.start_backward,
                 context.end_backward):  # fmt: skip
        move()
        seen.append(context.running)
    assert seen == [Pass.IDLE, Pass.FORWARD, Pass.IDLE, Pass.BACKWARD, Pass.IDLE]


def test_a_forward_inside_a_backward_is_refused_and_a_reset_ends_any_pass():
    context = RootContext(units=[], root=None)
    context.start_backward()
    with pytest.raises(RuntimeError, match="internal error: moved from Pass.BACKWARD"):
        context.start_forward()
    with pytest.raises(RuntimeError, match="internal error"):
        context.start_backward()
    context.reset()  # reset_iteration after a backward that raised
    context.start_forward()  # a forward that raised is begun again by the next
    context.start_forward()
    assert context.running is Pass.FORWARD
