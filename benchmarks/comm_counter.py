"""Counting the bytes and calls of `torch.distributed`'s Python-level collectives per step,
and the bytes each rank puts on the wire for the algorithms gloo runs."""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "ep_all_to_all",
              "cp_all_to_all")  # fmt: skip
# Bytes each rank sends per counted byte of a collective, as (N-1)/N multiples, for the
# algorithms gloo runs: ring all-gather, all-to-all and ring all-reduce (reduce-scatter +
# all-gather); gloo's reduce-scatter clones its input and all-reduces all of it.
WIRE_FACTOR = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2, "all_to_all": 1,
               "cp_all_to_all": 1}  # fmt: skip
COUNTED_NAME = {
    "all_gather": "all_gather_single",
    "reduce_scatter": "reduce_scatter_single",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all_single",
    "send": "isend",
    "ep_all_to_all": "all_to_all_single (EP)",
    "cp_all_to_all": "all_to_all_single (CP ring)",
}


def _by_group_size(comm: dict, kind: str, world: int) -> dict[int, float]:
    """A kind's counted bytes by the size of the group they went over: as counted
    (`comm["group_sizes"]`), or all over the world (an analytic count, an older result)."""
    split = (comm.get("group_sizes") or {}).get(kind)
    counted = comm.get(kind, 0)  # (a kind an older result did not count: none)
    if not split or not math.isclose(sum(split.values()), counted, rel_tol=1e-9):
        return {world: counted}
    return {int(n): b for n, b in split.items()}


def wire_bytes(comm: dict, world: int) -> float:
    """Bytes one rank sends per step: the collectives (see WIRE_FACTOR; (N-1)/N with N the
    size of the group each went over: the world, or a TP, HSDP or hpZ group), its sends,
    and expert parallelism's all-to-alls (the bytes of their input bound for other ranks,
    counted exactly: the splits are uneven)."""
    collectives = sum(
        WIRE_FACTOR[kind] * b * (n - 1) / n
        for kind in WIRE_FACTOR
        for n, b in _by_group_size(comm, kind, world).items()
    )
    return collectives + comm["send"] + comm.get("ep_offrank", 0)


def gathered_bytes(comm: dict, world: int) -> float:
    """All-gathered bytes: by `all_gather_single`, or by point-to-point sends of a shard to
    each of the N-1 peers of its group (flatshard on gloo, see flatshard/comm/collectives.py)."""
    sent = _by_group_size(comm, "send", world)
    return comm["all_gather"] + sum(b * n / (n - 1) for n, b in sent.items() if n > 1)


def reduced_bytes(comm: dict) -> float:
    """Reduce-scattered input bytes: by `reduce_scatter_single`, or by one all-to-all of the
    input and a local sum (flatshard on gloo)."""
    return comm["reduce_scatter"] + comm["all_to_all"]


class CommCounter:
    """Counts calls and bytes of the Python-level collectives while `active`.

    all-gather: bytes of the gathered (output) tensor; reduce-scatter: bytes of the input
    that is reduced; all-reduce: bytes of the tensor; all-to-all: bytes of the input (flatshard
    reduce-scatters that way on gloo); send: bytes of each `isend` (flatshard all-gathers that
    way on gloo). Nested calls (a deprecated name that forwards to its `*_single`
    replacement) count once. The `all_to_all_single` calls of expert parallelism (its
    token rows, forward and backward, in `flatshard.comm.collectives._send_rows`, and its per-expert
    counts, in `flatshard.parallel.expert_parallel._exchange_counts`) count apart, as
    `ep_all_to_all` (input bytes), with `ep_offrank` the bytes of the input bound for other
    ranks and `ep_rows` the token rows alone. DTensor's collectives (tensor parallelism's
    all-reduces) go through `torch.distributed._functional_collectives`, counted as well.
    Bytes are also
    kept by the size of the group they went over (`group_sizes`), for the bytes sent.
    """

    # name: (kind, position of the counted tensor, its keyword)
    WRAPPED = {
        "all_gather_single": ("all_gather", 0, "output_tensor"),
        "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
        "reduce_scatter_single": ("reduce_scatter", 1, "input"),
        "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
        "all_reduce": ("all_reduce", 0, "tensor"),
        "all_to_all_single": ("all_to_all", 1, "input"),
        "isend": ("send", 0, "tensor"),
    }

    def __init__(self) -> None:
        self.active = False
        self._local = threading.local()
        self.reset()

    # functional collectives (DTensor's redistributions): name: (kind, position of the
    # group among the arguments); the input is counted (all-gather: its output, N x)
    # (torch before 2.13 has only the older names, which 2.13 forwards to the new ones: the
    # first name present is wrapped, so no call counts twice)
    FUNCTIONAL = {
        ("all_reduce",): ("all_reduce", 2),
        ("all_gather_single", "all_gather_tensor"): ("all_gather", 2),
        ("reduce_scatter_single", "reduce_scatter_tensor"): ("reduce_scatter", 3),
        ("all_to_all_single",): ("cp_all_to_all", 3),
    }

    def reset(self) -> None:
        self.ep_offrank = 0
        self.ep_rows = 0
        self.bytes = dict.fromkeys(COMM_KINDS, 0)
        self.calls = dict.fromkeys(COMM_KINDS, 0)
        self.group_sizes = {kind: {} for kind in COMM_KINDS}
        # counted bytes of collectives on groups smaller than the world (hpZ's, HSDP's)
        self.narrow_bytes = 0

    def install(self) -> None:
        c10d = dist.distributed_c10d
        for name, spec in self.WRAPPED.items():
            original = getattr(c10d, name, None)  # the new names: torch 2.13 on
            if original is None:
                continue
            wrapper = self._wrap(original, *spec)
            for namespace in (dist, c10d):
                if getattr(namespace, name, None) is original:
                    setattr(namespace, name, wrapper)
        from torch.distributed import _functional_collectives as funcol

        import flatshard.comm.collectives as collectives
        import flatshard.parallel.expert_parallel as expert_parallel

        # looked up as module globals at each call
        collectives._send_rows = self._mark_ep(collectives._send_rows, rows=True)
        expert_parallel._exchange_counts = self._mark_ep(expert_parallel._exchange_counts)

        for names, (kind, position) in self.FUNCTIONAL.items():
            name = next(name for name in names if hasattr(funcol, name))
            setattr(funcol, name, self._wrap_functional(getattr(funcol, name), kind, position))

    def _count(self, kind: str, tensor: torch.Tensor, size: int, multiple: int = 1) -> None:
        counted = nbytes(tensor) * multiple
        self.bytes[kind] += counted
        self.group_sizes[kind][size] = self.group_sizes[kind].get(size, 0) + counted
        if size < dist.get_world_size():
            self.narrow_bytes += counted

    def _mark_ep(self, original, rows: bool = False):
        """`original`'s all-to-alls are expert parallelism's (`rows`: its token rows)."""
        counter = self

        def marked(*args, **kwargs):
            previous = getattr(counter._local, "ep", None)
            counter._local.ep = "rows" if rows else "counts"
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.ep = previous

        marked.__wrapped__ = original
        marked.__name__ = original.__name__
        return marked

    def _count_ep(self, tensor: torch.Tensor, args, kwargs) -> None:
        """An EP all-to-all's input bytes, and those bound for other ranks (its input
        splits, or equal pieces)."""
        group = args[4] if len(args) > 4 else kwargs.get("group")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        total = nbytes(tensor)
        splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        if splits:
            own = total * splits[rank] // max(sum(splits), 1)
        else:
            own = total // size
        self._count("ep_all_to_all", tensor, size)
        self.ep_offrank += total - own
        if self._local.ep == "rows":
            self.ep_rows += total

    def _wrap_functional(self, original, kind: str, position: int):
        counter = self

        def counted(tensor, *args, **kwargs):
            if counter.active and isinstance(tensor, torch.Tensor):
                group = args[position - 1] if len(args) >= position else kwargs.get("group")
                size = _functional_group_size(group)
                counter._count(kind, tensor, size, size if kind == "all_gather" else 1)
                counter.calls[kind] += 1
            return original(tensor, *args, **kwargs)

        counted.__wrapped__ = original
        counted.__name__ = original.__name__
        return counted

    def _wrap(self, original, kind: str, position: int, keyword: str):
        counter = self

        def counted(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if counter.active and depth == 0:
                tensor = args[position] if len(args) > position else kwargs.get(keyword)
                counted_kind = kind
                if kind == "all_to_all" and getattr(counter._local, "ep", None):
                    counted_kind = "ep_all_to_all"
                    if isinstance(tensor, torch.Tensor):
                        counter._count_ep(tensor, args, kwargs)
                elif isinstance(tensor, torch.Tensor):
                    group = kwargs.get("group")
                    counter._count(kind, tensor, dist.get_world_size(group))
                counter.calls[counted_kind] += 1
            counter._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._local.depth = depth

        counted.__wrapped__ = original
        counted.__name__ = original.__name__
        return counted


def _functional_group_size(group) -> int:
    """The number of ranks of a functional collective's group: a process group, a 1-D
    DeviceMesh, (mesh, mesh dim), a list of ranks or a group name."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, dist.ProcessGroup):
        return group.size()
    if isinstance(group, DeviceMesh):
        return group.size()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].size(group[1])
    if isinstance(group, list):
        return len(group)
    return c10d._resolve_process_group(group).size()


c10d = dist.distributed_c10d
COUNTER = CommCounter()
