"""A test mode in which CPU collectives behave like asynchronous NCCL ones.

Our machines have no GPU, yet NCCL's hazards are the ones that corrupt a first GPU run: a
collective reads its input and writes its output at some time after it is issued, so
writing the input, or reading, writing or freeing the output before `wait()` is a race
that gloo's eager CPU collectives never show. With the shim on (`FLATSHARD_NCCL_SHIM=1`,
or `set_active(True)`), flatshard takes its NCCL code paths on CPU tensors (the native
`all_gather_single` / `reduce_scatter_single`, no CPU buffer pool), and each collective:

- runs at once on a snapshot of its input, into a private buffer;
- leaves its output poisoned (NaN, or a sentinel for integers) until `wait()`, so a read
  before the wait shows in the numbers (a training-parity test fails);
- at `wait()`: an input written since the issue makes the result poisoned too (NCCL may
  have read it torn: only code that discards such a result, as a unit re-gathers weights
  written during their gather, still computes right); an input freed, or the output
  written or freed, raises `HazardError`; otherwise it delivers the result.
"""

from __future__ import annotations

import os

import torch

from flatshard.errors import FlatShardError

_active = os.environ.get("FLATSHARD_NCCL_SHIM") == "1"
torn_results = 0  # results poisoned because an input was written while in flight


class HazardError(FlatShardError):
    """A collective's buffer was used between its issue and its wait."""


def active() -> bool:
    return _active


def set_active(on: bool) -> None:
    global _active
    _active = on


def _poison(output: torch.Tensor) -> None:
    if output.is_floating_point():
        output.fill_(float("nan"))
    else:
        output.fill_(torch.iinfo(output.dtype).min)


class NcclLikeWork:
    """An issued collective: `run(result, *snapshots)` computed it on the inputs as they
    were at issue; `output` holds poison until `wait()`."""

    def __init__(self, what: str, output: torch.Tensor, inputs: list[torch.Tensor], run):
        self.what, self.output = what, output
        self.inputs = [(t, t._version, t.detach().clone(), _nbytes(t)) for t in inputs]
        self.result = torch.empty_like(output)
        run(self.result, *(snapshot for _, _, snapshot, _ in self.inputs))
        _poison(output)
        self.output_state = (output._version, _nbytes(output))
        self.done = False

    def wait(self) -> bool:
        if self.done:
            return True
        global torn_results
        problems, torn = [], False
        for i, (tensor, version, snapshot, nbytes) in enumerate(self.inputs):
            if _nbytes(tensor) != nbytes:
                problems.append(f"input {i} was freed or resized")
            elif tensor._version != version or not _same(tensor, snapshot):
                torn = True
        if _nbytes(self.output) != self.output_state[1]:
            problems.append("the output was freed or resized")
        elif self.output._version != self.output_state[0]:
            problems.append("the output was written")
        self.inputs = []
        if problems:
            raise HazardError(
                f"{self.what}: {'; '.join(problems)} between the collective's issue and its "
                "wait (on NCCL a race: the collective reads and writes them asynchronously)"
            )
        if torn:
            torn_results += 1
            _poison(self.result)
        self.output.copy_(self.result)
        self.done = True
        return True


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (
        a.is_floating_point()
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(), b.nan_to_num())
    )
