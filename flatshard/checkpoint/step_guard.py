"""Holds every optimizer's next `step()` until an asynchronous save has copied the sharded
state it writes: the copies are made in bounded waves while training goes on (forward and
backward leave the weights and the optimizer state as they are), and the first thing
that would change them waits for the last wave."""

from __future__ import annotations

import threading

from torch.optim.optimizer import register_optimizer_step_pre_hook


class StepGuard:
    def __init__(self):
        self._staged = threading.Event()
        self._hook = register_optimizer_step_pre_hook(self._wait)

    def _wait(self, optimizer, args, kwargs) -> None:
        self._staged.wait()

    def release(self) -> None:
        """The state is copied (or the save failed): steps may run again."""
        if not self._staged.is_set():
            self._staged.set()
            self._hook.remove()

    def wait(self) -> None:
        self._staged.wait()
