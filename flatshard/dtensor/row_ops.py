"""What the row-shard dispatch (row_shard.py) needs to know about an aten op, worked out once
per op: whether it keeps its input's rows, writes into arguments, draws random numbers,
aliases, makes optimizer state or is a collective."""

from __future__ import annotations

import torch

from flatshard.dtensor.disk_tier import STATE_FACTORIES

# Ops whose output has the rows of their row-shard input (besides pointwise and foreach).
ROW_KEEPING = {
    "detach",
    "alias",
    "clone",
    "_to_copy",
    "copy_",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "zero_",
    "fill_",
    "contiguous",
}
RANDOM_FILLS = {
    "uniform_", "normal_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
    "rand_like", "randn_like", "randint_like",
}  # fmt: skip
VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
ALIASES = {"detach", "alias"}


class OpInfo:
    """What the dispatch needs to know about an op, computed once per op."""

    def __init__(self, func):
        name = func.name().split("::")[1].split(".")[0]
        self.collective = func.namespace in ("_c10d_functional", "c10d", "_dtensor")
        self.foreach = name.startswith("_foreach_")
        self.by_piece = self.foreach or name.startswith("_fused_")  # lists of pieces
        self.makes_state = name in STATE_FACTORIES
        self.seeded = torch.Tag.nondeterministic_seeded in func.tags
        # random ops that only take the input's shape (fill it, or make one like it)
        self.fills = name in RANDOM_FILLS or func is torch.ops.aten.bernoulli_.float
        self.view = func in VIEWS
        self.aliases = self.view or name in ALIASES
        self.keeps_rows = torch.Tag.pointwise in func.tags or self.foreach or name in ROW_KEEPING
        self.written = [
            (position, argument.name)
            for position, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]


_OPS: dict = {}


def op_info(func) -> OpInfo:
    info = _OPS.get(func)
    if info is None:
        info = _OPS[func] = OpInfo(func)
    return info
