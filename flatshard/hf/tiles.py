"""Where the elements of one tensor come from in another: tiles, and a stand-in tensor that
tracks them through transformers' own checkpoint conversions.

transformers 5 stores some parameters differently on disk and in memory (per-expert MoE
weights on disk, one fused `(E, 2I, H)` tensor in memory) and describes the difference as
data: `WeightConverter`s whose operations stack, concatenate, chunk, split, squeeze and
transpose tensors. `Tiled` is a stand-in that answers those torch calls with no data: it
only records, for each block of the result, which block of which source tensor it is.
Running transformers' conversion on stand-ins therefore gives the exact mapping between
disk and memory, by transformers' own rules, without reading or allocating a weight; each
rank then reads just the rows it holds (`Tile.clip`). An operation that is not a pure
rearrangement of blocks (a reshape that interleaves, arithmetic) is refused by name.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch

from flatshard.hf.errors import HFCheckpointError
from flatshard.layout import Box
from flatshard.layout.spec import contiguous_strides


@dataclass(frozen=True)
class Tile:
    """The block `box` of tensor `origin` lies at `offset` of this tensor.

    dims: for each dim of this tensor, the origin dim it runs along, or None for a dim of
        size 1 the origin lacks. Origin dims not named have extent 1 in `box`.
    """

    origin: str
    box: Box
    offset: tuple[int, ...]
    dims: tuple[int | None, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's shape in this tensor's dims."""
        return tuple(1 if d is None else self.box.shape[d] for d in self.dims)

    @property
    def numel(self) -> int:
        n = 1
        for size in self.box.shape:
            n *= size
        return n

    def narrow(self, dim: int, start: int, stop: int) -> Tile | None:
        """This tile cut to `[start, stop)` along `dim` (coordinates unchanged), or None."""
        low = max(self.offset[dim], start)
        high = min(self.offset[dim] + self.shape[dim], stop)
        if high <= low:
            return None
        offset = list(self.offset)
        offset[dim] = low
        box = self.box
        origin_dim = self.dims[dim]
        if origin_dim is not None:
            skip = low - self.offset[dim]
            box_offset, box_shape = list(box.offset), list(box.shape)
            box_offset[origin_dim] += skip
            box_shape[origin_dim] = high - low
            box = Box(tuple(box_offset), tuple(box_shape))
        return replace(self, box=box, offset=tuple(offset))

    def clip(self, box: Box) -> Tile | None:
        """This tile cut to `box` of this tensor (e.g. the rows a rank holds), or None."""
        tile = self
        for dim, (start, size) in enumerate(zip(box.offset, box.shape)):
            tile = tile.narrow(dim, start, start + size)
            if tile is None:
                return None
        return tile

    def take(self, block: torch.Tensor) -> torch.Tensor:
        """`block` (the origin's `box`, in origin dims) arranged as this tile's block."""
        kept = [d for d in self.dims if d is not None]
        ordered = sorted(kept)
        block = block.reshape([self.box.shape[d] for d in ordered])  # drop size-1 dims
        block = block.permute([ordered.index(d) for d in kept])
        return block.reshape(self.shape)

    def inverse(self, name: str) -> Tile:
        """The same block seen from the origin: where it lies in this tensor (`name`)."""
        dims = [None] * len(self.box.shape)
        for dim, origin_dim in enumerate(self.dims):
            if origin_dim is not None:
                dims[origin_dim] = dim
        return Tile(name, Box(self.offset, self.shape), self.box.offset, tuple(dims))


@dataclass(frozen=True)
class Storage:
    """What the real tensor made by the same operations would be a view of: storage `key`
    of `numel` elements, at `offset` with `strides`. huggingface_hub's splitter puts the
    tensors that share a storage into one file and counts the whole storage's size once."""

    key: object
    numel: int
    offset: int
    strides: tuple[int, ...]

    @classmethod
    def new(cls, key, shape) -> Storage:
        return cls(key, math.prod(shape), 0, contiguous_strides(tuple(shape)))


_fresh = itertools.count()  # keys of storages that operations allocate


class Tiled:
    """A tensor of `shape` made of `tiles` (blocks of other tensors); no data.

    Supports what transformers' conversion operations call: torch.stack / cat / chunk /
    transpose, and the methods squeeze, contiguous, size and shape. `storage` follows torch:
    chunk, squeeze and transpose give views, cat, stack and contiguous() of a view that is
    not contiguous give new storage.
    """

    def __init__(self, shape, tiles, storage: Storage | None = None):
        self.shape = torch.Size(shape)
        self.tiles = tuple(tiles)
        self.storage = storage or Storage.new(("new", next(_fresh)), self.shape)

    @classmethod
    def leaf(cls, name: str, shape) -> Tiled:
        shape = tuple(shape)
        zeros = (0,) * len(shape)
        tiles = [Tile(name, Box(zeros, shape), zeros, tuple(range(len(shape))))]
        return cls(shape, tiles, Storage.new(("tensor", name), shape))

    def __repr__(self) -> str:
        return f"Tiled({tuple(self.shape)}, {len(self.tiles)} tiles)"

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def is_contiguous(self) -> bool:
        expected = contiguous_strides(tuple(self.shape))
        return all(n == 1 or s == e for n, s, e in zip(self.shape, self.storage.strides, expected))

    def contiguous(self) -> Tiled:
        return self if self.is_contiguous() else Tiled(self.shape, self.tiles)

    def squeeze(self, dim: int | None = None) -> Tiled:
        drop = [
            d for d, n in enumerate(self.shape) if n == 1 and (dim is None or d == dim % self.dim())
        ]
        keep = [d for d in range(self.dim()) if d not in drop]
        tiles = [
            replace(t, offset=tuple(t.offset[d] for d in keep), dims=tuple(t.dims[d] for d in keep))
            for t in self.tiles
        ]
        strides = tuple(self.storage.strides[d] for d in keep)
        return Tiled([self.shape[d] for d in keep], tiles, replace(self.storage, strides=strides))

    def narrow(self, dim: int, start: int, length: int) -> Tiled:
        tiles = []
        for tile in self.tiles:
            cut = tile.narrow(dim, start, start + length)
            if cut is not None:
                offset = list(cut.offset)
                offset[dim] -= start
                tiles.append(replace(cut, offset=tuple(offset)))
        shape = list(self.shape)
        shape[dim] = length
        offset = self.storage.offset + start * self.storage.strides[dim]
        return Tiled(shape, tiles, replace(self.storage, offset=offset))

    def transpose(self, dim0: int, dim1: int) -> Tiled:
        order = list(range(self.dim()))
        order[dim0], order[dim1] = order[dim1], order[dim0]
        tiles = [
            replace(
                t, offset=tuple(t.offset[d] for d in order), dims=tuple(t.dims[d] for d in order)
            )
            for t in self.tiles
        ]
        strides = tuple(self.storage.strides[d] for d in order)
        return Tiled([self.shape[d] for d in order], tiles, replace(self.storage, strides=strides))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        handler = _HANDLERS.get(func)
        if handler is None:
            raise HFCheckpointError(
                f"a transformers checkpoint conversion calls {getattr(func, '__name__', func)}, "
                "which is not a rearrangement of blocks (stack, cat, chunk, squeeze, transpose); "
                "flatshard cannot read such a tensor row by row"
            )
        return handler(*args, **kwargs)


def _stack(tensors, dim: int = 0) -> Tiled:
    first = tensors[0]
    dim = dim % (first.dim() + 1)
    if any(t.shape != first.shape for t in tensors):
        raise HFCheckpointError(
            f"cannot stack tensors of shapes {[tuple(t.shape) for t in tensors]}"
        )
    tiles = [
        replace(
            tile,
            offset=(*tile.offset[:dim], i, *tile.offset[dim:]),
            dims=(*tile.dims[:dim], None, *tile.dims[dim:]),
        )
        for i, t in enumerate(tensors)
        for tile in t.tiles
    ]
    shape = list(first.shape)
    shape.insert(dim, len(tensors))
    return Tiled(shape, tiles)


def _cat(tensors, dim: int = 0) -> Tiled:
    dim = dim % tensors[0].dim()
    tiles, start = [], 0
    for t in tensors:
        for tile in t.tiles:
            offset = list(tile.offset)
            offset[dim] += start
            tiles.append(replace(tile, offset=tuple(offset)))
        start += t.shape[dim]
    shape = list(tensors[0].shape)
    shape[dim] = start
    return Tiled(shape, tiles)


def _chunk(tensor: Tiled, chunks: int, dim: int = 0) -> tuple[Tiled, ...]:
    dim = dim % tensor.dim()
    length = tensor.shape[dim]
    step = -(-length // chunks)  # torch.chunk: ceil-sized chunks, the last may be shorter
    return tuple(
        tensor.narrow(dim, start, min(step, length - start)) for start in range(0, length, step)
    )


def _transpose(tensor: Tiled, dim0: int, dim1: int) -> Tiled:
    return tensor.transpose(dim0 % tensor.dim(), dim1 % tensor.dim())


_HANDLERS = {
    torch.stack: _stack,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.chunk: _chunk,
    torch.transpose: _transpose,
    torch.Tensor.contiguous: Tiled.contiguous,
    torch.Tensor.squeeze: Tiled.squeeze,
}
