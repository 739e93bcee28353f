"""Local runs that restart after a failure (`flatshard train --max-restarts N`), supervised
by torch's elastic agent (the machinery behind `torchrun --max-restarts`), so a local run
and a multi-node torchrun restart the same way: when a worker dies or fails, the agent
stops the others and starts every rank again (`TORCHELASTIC_RESTART_COUNT` tells them which
attempt they are); the trainer then resumes from the newest complete checkpoint. Once the
restarts are spent the command fails with the last attempt's cause."""

from __future__ import annotations

import multiprocessing
import os
import sys
import uuid
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from flatshard.cli.errors import warn

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ATTEMPT_OFFSET = "FLATSHARD_ATTEMPT_OFFSET"  # attempts before this launch (a shrunk run's)


def attempt() -> int:
    """Which attempt this worker belongs to (0: the first): the elastic agent's restart
    count, after the attempts at larger sizes of a run that shrank."""
    return int(os.environ.get(ATTEMPT_OFFSET, "0")) + int(os.environ.get(RESTART_COUNT, "0"))


def run_elastic(worker: Callable, args: tuple, sizes: list[int], max_restarts: int, *,
                free_port: Callable[[], int], start_method: str, call: Callable,
                failure: Callable[[int], str], stopped: int) -> int:  # fmt: skip
    """Run `worker(*args)` on `sizes[0]` local ranks, restarting all of them up to
    `max_restarts` times; when the restarts are spent, go on at the next of `sizes` (a rank
    that cannot come back: the run continues on fewer, resharding its checkpoint), with as
    many restarts again. Returns the command's exit status."""
    # each attempt's rank 0 serves a fresh store: workers sharing the agent's store across
    # attempts read the dead attempt's addresses and fail to connect (pytorch#135712)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if start_method == "forkserver":  # the server imports the trainer once, for every rank
        server = multiprocessing.get_context("forkserver")
        server.set_forkserver_preload([worker.__module__, __name__])
    offset = 0
    for index, nproc in enumerate(sizes):
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
            max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method,
            shutdown_timeout=10,  # a rank stuck beside a dead peer is killed, not waited for
        )  # fmt: skip
        try:
            elastic_launch(config, _worker_main)(call, worker, args, offset)
            return 0
        except ChildFailedError as error:
            offset += max_restarts + 1
            why = failure(offset - 1)
            if index + 1 < len(sizes):
                warn(f"{nproc} processes failed {max_restarts + 1} time(s) (last: {why}); "
                     f"going on with {sizes[index + 1]} (--min-nproc {sizes[-1]}): the "
                     "checkpoint reshards, the global batch stays (more accumulation)")
                continue  # fmt: skip
            _, first = error.get_first_failure()
            code = first.exitcode if first.exitcode >= 0 else 128 - first.exitcode
            print(f"flatshard: error: the run failed and its restarts are spent "
                  f"(--max-restarts {max_restarts}): {why}", file=sys.stderr, flush=True)
            return code or 1  # fmt: skip
        except SignalException as error:
            warn(f"stopped by {error.sigval.name}; the workers saved what they could")
            return stopped
    return 1


def _worker_main(call: Callable, worker: Callable, args: tuple, offset: int) -> None:
    # passed, not inherited: a forked rank has the fork server's environment, not the agent's
    os.environ[ATTEMPT_OFFSET] = str(offset)
    os.setpgrp()  # Ctrl-C reaches the agent only; it forwards the signal to every worker once
    code = call(worker, args, error_dir=None, leave_on_error=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # the agent sees the failure (and restarts the ranks)
