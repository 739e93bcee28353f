"""What the layout knows about one parameter: its shape, dtype, trainability, where it sits
in its global (TP/EP-global) tensor, and the components a fused parameter is made of.

A component is a slab `[start, stop)` along one dim of the parameter (SwiGLU's gate and up
rows of `gate_up_proj`, q/k/v of a fused QKV, gate and up of grouped experts along dim 1).
Checkpoints store each component as its own tensor, of `global_shape`, in which this
parameter's slab starts at `global_offset`; so a checkpoint's meaning never depends on how
the parameter was fused or split. Pure data: no tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flatshard.errors import LayoutError


@dataclass(frozen=True)
class Component:
    """A named slab `[start, stop)` along `dim` of a parameter; in the checkpoint, the
    tensor `name` of `global_shape`, where the slab starts at `global_offset`.

    fused_start: where the component's tensor starts along `dim` in the parameter's global
        (fused) tensor; by default `start` (the parameter is its whole global tensor). A
        parameter split per component over TP ranks (`[gate_r; up_r]`) has its slabs at
        `rank * size` of each component's tensor, which starts at `k * size`.
    """

    name: str
    dim: int
    start: int
    stop: int
    global_shape: tuple[int, ...] = ()
    global_offset: tuple[int, ...] = ()
    fused_start: int | None = None

    @property
    def size(self) -> int:
        return self.stop - self.start

    def select(self, tensor):
        """This component's slab of a tensor shaped like the (local) parameter."""
        return tensor.narrow(self.dim, self.start, self.size)

    def select_global(self, tensor):
        """This component's whole tensor out of the parameter's global (fused) tensor."""
        return tensor.narrow(self.dim, self.fused_start, self.global_shape[self.dim])


@dataclass(frozen=True)
class ParamInfo:
    """What the layout needs to know about one parameter.

    shape: the parameter as this rank's module holds it (after TP/EP, before FSDP).
    global_shape / global_offset: the tensor a checkpoint stores and where this parameter
        sits in it (default: the parameter itself at offset 0).
    components: the slabs a fused parameter is made of (default: none).
    split_by_components: the parameter holds a part of every component (TP's `[gate_r;
        up_r]`), so it is not one block of its global tensor: each component piece is
        placed by its component (`Component.fused_start`) and `global_offset` is unused.
    row_dims: how many leading dims index a row (the unit of sharding): 1, a dim-0 row
        (the default); 2, the "finer row" of grouped experts `(E, R, C)` fewer than ranks,
        one dim-1 slice of `C` elements, so ranks split an expert's `R` rows. The planner
        chooses it (packing.py, `finer_row`).
    shard_dim: the dim ranks split (FSDP2's `Shard(d)` from `shard_placement_fn`; 0 by
        default). For d > 0 a row is one slice along d and the flat buffers keep the
        parameter with dim d moved first (`stored_shape`), so every rank's piece is still
        contiguous there; views move it back (a strided view of the parameter's shape).
    """

    name: str
    shape: tuple[int, ...]
    dtype: object
    requires_grad: bool = True
    components: tuple[Component, ...] = ()
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    split_by_components: bool = False
    row_dims: int = 1
    shard_dim: int = 0

    def __post_init__(self) -> None:
        # Accept torch.Size / lists, but store plain tuples so equality and hashing are exact.
        shape = _ints(self.name, "shape", self.shape)
        if any(d < 0 for d in shape):
            raise LayoutError(f"parameter {self.name!r}: shape {shape} has a negative dim")
        object.__setattr__(self, "shape", shape)
        global_shape = (
            shape
            if self.global_shape is None
            else _ints(self.name, "global_shape", self.global_shape)
        )
        offset = (
            (0,) * len(shape)
            if self.global_offset is None
            else _ints(self.name, "global_offset", self.global_offset)
        )
        if (
            len(global_shape) != len(shape)
            or len(offset) != len(shape)
            or any(o < 0 or o + s > g for o, s, g in zip(offset, shape, global_shape))
        ):
            raise LayoutError(
                f"parameter {self.name!r}: shape {shape} at offset {offset} does not fit in "
                f"its global shape {global_shape}"
            )
        if self.row_dims not in (1, 2) or self.row_dims > max(1, len(shape)):
            raise LayoutError(
                f"parameter {self.name!r} of shape {shape}: row_dims {self.row_dims} is not 1, "
                "or 2 for a parameter of at least 2 dims"
            )
        if self.shard_dim and not (
            0 < self.shard_dim < len(shape)
            and self.row_dims == 1
            and not self.components
            and global_shape == shape
        ):
            raise LayoutError(
                f"parameter {self.name!r} of shape {shape}: sharding along dim "
                f"{self.shard_dim} needs a dim of the parameter, no fused components and no "
                "tensor parallelism (shard such parameters by rows: Shard(0))"
            )
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "global_offset", offset)
        object.__setattr__(self, "components", self._checked_components())

    def _checked_components(self) -> tuple[Component, ...]:
        out = []
        for c in self.components:
            if not (0 <= c.dim < len(self.shape) and 0 <= c.start <= c.stop <= self.shape[c.dim]):
                raise LayoutError(
                    f"parameter {self.name!r}: component {c.name!r} ({c.start}:{c.stop} along "
                    f"dim {c.dim}) is outside its shape {self.shape}"
                )
            slab = tuple(c.size if d == c.dim else n for d, n in enumerate(self.shape))
            global_shape = c.global_shape or slab
            offset = c.global_offset or (0,) * len(slab)
            if len(global_shape) != len(slab) or any(
                o + s > g for o, s, g in zip(offset, slab, global_shape)
            ):
                raise LayoutError(
                    f"parameter {self.name!r}: component {c.name!r} of shape {slab} at "
                    f"{offset} does not fit in its global shape {global_shape}"
                )
            fused_start = c.start if c.fused_start is None else c.fused_start
            out.append(Component(c.name, c.dim, c.start, c.stop, global_shape, offset, fused_start))
        if self.split_by_components and not out:
            raise LayoutError(f"parameter {self.name!r} is split by components but has none")
        return tuple(out)

    def component(self, name: str) -> Component:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(f"parameter {self.name!r} has no component {name!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The parameter as the flat buffers hold it: `shape` with `shard_dim` moved first."""
        d = self.shard_dim
        return (self.shape[d], *self.shape[:d], *self.shape[d + 1 :]) if d else self.shape

    @property
    def row_size(self) -> int:
        """Elements per row (a dim-0 row, with `row_dims` 2 a dim-1 slice, with `shard_dim` d
        a slice along d); 1 for 0-d and 1-d params, 0 if another dim is 0."""
        return math.prod(self.stored_shape[self.row_dims :])

    @property
    def rows(self) -> int:
        """Rows of the parameter: the product of its `row_dims` leading (stored) dims."""
        return math.prod(self.stored_shape[: self.row_dims]) if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row, as stored."""
        return self.stored_shape[self.row_dims :]


def _ints(name: str, what: str, values) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in values)
    except TypeError as err:
        raise LayoutError(
            f"parameter {name!r}: {what} {values!r} is not a sequence of ints"
        ) from err


def stacked_components(dim: int, sizes: Sequence[tuple[str, int]]) -> tuple[Component, ...]:
    """Components stacked back to back along `dim`, in order: e.g. `[gate; up]`."""
    out, start = [], 0
    for name, size in sizes:
        out.append(Component(name, dim, start, start + int(size)))
        start += int(size)
    return tuple(out)


def declared_components(module, attr: str, shape: Sequence[int]) -> tuple[Component, ...]:
    """The components a module declares for its parameter `attr` (none if it declares none).

    Declaration, on the module that owns the parameter: `fused_components = {attr:
    ((name, size), ...)}`, stacked along dim 0, or `{attr: {"dim": d, "parts": ((name,
    size), ...)}}` along another dim (e.g. gate and up of grouped experts along dim 1).
    """
    declared = (getattr(module, "fused_components", None) or {}).get(attr)
    if not declared:
        return ()
    dim, parts = (
        (declared["dim"], declared["parts"]) if isinstance(declared, dict) else (0, declared)
    )
    components = stacked_components(dim, parts)
    if dim >= len(shape) or components[-1].stop != shape[dim]:
        raise LayoutError(
            f"{type(module).__name__}.{attr} of shape {tuple(shape)} declares fused components "
            f"{[name for name, _ in parts]} of {components[-1].stop} along dim {dim}"
        )
    return components


def describe_param(root, fqn: str, param) -> ParamInfo:
    """The `ParamInfo` of `root`'s plain parameter `fqn`, with the components its module
    declares."""
    module_name, _, attr = fqn.rpartition(".")
    module = root.get_submodule(module_name)
    shape = tuple(param.shape)
    components = declared_components(module, attr, shape)
    return ParamInfo(fqn, shape, param.dtype, param.requires_grad, components)
