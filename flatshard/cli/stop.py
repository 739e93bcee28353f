"""SIGINT / SIGTERM during training: remember the request; the trainer agrees on it across
ranks once per step (inside the loss all-reduce), saves a checkpoint and exits cleanly."""

from __future__ import annotations

import signal


class StopRequest:
    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def install(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        # Repeated signals (a launcher forwarding the terminal's Ctrl-C) change nothing:
        # the save must finish. A supervisor or torchrun escalates to SIGKILL if needed.
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
