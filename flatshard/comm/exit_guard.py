"""A pause at interpreter exit for the collectives' own threads.

gloo's worker threads (and NCCL's watchdog) release each finished collective's work
themselves, and releasing the tensors of a work that Python made takes the GIL. A script
whose last collective ran moments before it ends can reach interpreter finalisation while
such a thread has not yet had the GIL: the thread is then made to exit inside a C++
destructor and the process aborts ("terminate called without an active exception",
SIGABRT, after every line of the script ran; examples/muon.py did so in about 1 run in 7 on
2 loaded cores, destroy_process_group or not, since objects that still refer to a group keep
its threads alive). At exit, before finalisation starts, the main thread gives up the GIL
for a moment so that those threads finish first.
"""

from __future__ import annotations

import atexit
import time

PAUSE_S = 0.1  # far longer than a thread waiting for the GIL needs, even on a loaded host


def pause() -> None:
    """Give up the GIL for `PAUSE_S`."""
    time.sleep(PAUSE_S)


def install() -> None:
    """Run `pause` at this process's exit (once, however often it is called)."""
    atexit.unregister(pause)
    atexit.register(pause)
