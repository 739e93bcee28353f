"""Which `torch.compile` backend `parallelize(compile=...)` uses, checked once up front: a
torch whose backend cannot compile (inductor on CPU needs a C++ compiler) is one clear
error at build time, not a traceback from inside the first forward."""

from __future__ import annotations

import torch
from torch import nn

from flatshard.errors import WrappingError
from flatshard.registry import unit_of

_WORKING: set[str] = set()


def compile_backend(compile: bool | str) -> str | None:
    """The backend name of `compile` (True: inductor), after a one-op trial compile; None
    when not compiling."""
    if compile is False or compile is None:
        return None
    backend = "inductor" if compile is True else compile
    if not isinstance(backend, str) or backend not in torch._dynamo.list_backends(None):
        raise WrappingError(
            f"compile={compile!r}: not a torch.compile backend; use True (inductor) or one "
            f"of {', '.join(torch._dynamo.list_backends(None))}"
        )
    if backend not in _WORKING:
        try:
            torch.compile(_add_one, backend=backend, fullgraph=True)(torch.zeros(2))
        except Exception as error:  # any failure of the toolchain: say which, in one line
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise WrappingError(
                f"compile={compile!r}: torch.compile with backend {backend!r} does not work "
                f"on this machine ({type(error).__name__}: {first_line}); install what it "
                "needs (inductor on CPU: a C++ compiler) or train without compile"
            ) from error
        _WORKING.add(backend)
    return backend


def _add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def compile_block(block: nn.Module, backend: str, eager: set[nn.Module] = frozenset()) -> int:
    """Compile `block` (after `fully_shard`) whole, as one graph: its unit hooks run outside
    it. A block holding units of its own (its experts under EP) or modules that must run
    eagerly (`eager`: the plan's `uncompiled`) is compiled region by region around them,
    each region one graph, as torchtitan does for MoE blocks: a unit's hooks inside a graph
    would break it. Returns the number of compiled regions."""
    own = unit_of(block)

    def stays_eager(module: nn.Module) -> bool:
        return module in eager or (unit_of(module) is not None and unit_of(module) is not own)

    def compile_regions(module: nn.Module) -> int:
        if not any(stays_eager(sub) for sub in module.modules()):
            module.compile(backend=backend, fullgraph=True)
            return 1
        return sum(compile_regions(child) for child in module.children() if not stays_eager(child))

    return compile_regions(block)
