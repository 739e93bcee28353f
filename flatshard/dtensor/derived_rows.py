"""Row provenance through ops that change a row shard's shape but keep its rows: a
reduction or a softmax along another dim, a matrix product, a transpose. DTensor keeps
such outputs `Shard(d)` and would later gather them by `torch.chunk` sizes, which
flatshard's rows are not (a `p.sum(dim=1).full_tensor()` hung; torch's Muon was silently
wrong). Here the output gets a spec with the same row bounds, so `full_tensor()` and
redistribution gather it by flatshard's rows.

Only for pieces of whole dim-0 rows of a tensor that is its own global tensor (no TP
block, no fused components split over TP, no finer expert rows); the decision depends on
the op and the shapes alone, so every rank makes the same one.
"""

from __future__ import annotations

import torch

from flatshard.layout import ParamInfo
from flatshard.layout.spec import ShardSpec

aten = torch.ops.aten

# reductions and ops along a dim: rows are kept when that dim is not 0
_ALONG_DIM = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim, aten.var.correction,
    aten.std.correction, aten.prod.dim_int, aten.logsumexp.default, aten.any.dim,
    aten.all.dim, aten.argmax.default, aten.argmin.default, aten._softmax.default,
    aten._log_softmax.default, aten.cumsum.default, aten.cumprod.default,
    aten.max.dim, aten.min.dim, aten.sort.default, aten.topk.default,
    aten.index_select.default, aten.slice.Tensor, aten.select.int,
}  # fmt: skip
# the dim argument's position in each schema (index_select's and topk's differ)
_DIM_POSITION = {aten.linalg_vector_norm.default: 2, aten.topk.default: 2}
# matrix products whose output rows are those of the operand at this position
_ROWS_FROM = {aten.mm.default: 0, aten.addmm.default: 1}
_TRANSPOSES = {aten.t.default, aten.transpose.int}  # of a 2-D tensor; DTensor's `.T` is permute


def _is_transpose(func, args) -> bool:
    if func is aten.permute.default:
        return [d % 2 for d in args[1]] == [1, 0]
    return func in _TRANSPOSES


def derived_spec(func, args, kwargs, out: torch.Tensor, like) -> ShardSpec | None:
    """The spec of `out` when `func` kept `like`'s rows (dim 0, or moved to dim 1 by a
    transpose), else None."""
    spec = like.spec
    info = spec.info
    if (
        info.row_dims != 1
        or info.split_by_components
        or tuple(info.global_shape) != tuple(info.shape)
        or not isinstance(out, torch.Tensor)
        or out.dim() == 0
    ):
        return None
    if info.shard_dim == 1:  # a transposed piece: its rows along dim 1
        return _from_columns(func, args, kwargs, out, like)
    if info.shard_dim != 0:
        return None
    if _is_transpose(func, args) and like.dim() == 2 and args[0] is like:
        return _spec(spec, (out.shape[0], info.shape[0]), out.dtype, shard_dim=1)
    if func in _ROWS_FROM:
        if args[_ROWS_FROM[func]] is not like or out.shape[0] != like.shape[0]:
            return None
    elif func in _ALONG_DIM:
        if not _keeps_dim_zero(func, args, kwargs, like.dim()) or out.shape[0] != like.shape[0]:
            return None
    else:
        return None
    return _spec(spec, (info.shape[0], *out.shape[1:]), out.dtype)


def _from_columns(func, args, kwargs, out, like) -> ShardSpec | None:
    """A 2-D piece with its rows along dim 1 (a transpose of one): transposed back, or an
    op along dim 0: a reduction (its rows then along the only dim left, or dim 1 with
    keepdim), or one that keeps the shape."""
    spec, rows = like.spec, like.spec.info.shape[1]
    if like.dim() != 2 or args[0] is not like:
        return None
    if _is_transpose(func, args):
        return _spec(spec, (rows, out.shape[1]), out.dtype)
    if func not in _ALONG_DIM or _dims(func, args, kwargs, 2) != [0]:
        return None
    if out.shape == like.shape:  # softmax, cumsum, sort along dim 0
        return _spec(spec, spec.info.shape, out.dtype, shard_dim=1)
    if out.dim() == 1 and out.shape[0] == like.shape[1]:
        return _spec(spec, (rows,), out.dtype)
    if out.dim() == 2 and tuple(out.shape) == (1, like.shape[1]):
        return _spec(spec, (1, rows), out.dtype, shard_dim=1)
    return None


def _dims(func, args, kwargs, ndim: int) -> list[int] | None:
    """The op's `dim` argument as a list of non-negative dims (None: all dims)."""
    position = _DIM_POSITION.get(func, 1)
    dim = args[position] if len(args) > position else (kwargs or {}).get("dim")
    if dim is None:
        return None
    return sorted(d % ndim for d in ([dim] if isinstance(dim, int) else dim))


def _keeps_dim_zero(func, args, kwargs, ndim: int) -> bool:
    """Whether the op's `dim` argument leaves dim 0 alone (a reduction over all dims, or
    over dim 0, does not)."""
    dims = _dims(func, args, kwargs, ndim)
    return bool(dims) and 0 not in dims


def _spec(spec: ShardSpec, shape: tuple[int, ...], dtype, shard_dim: int = 0) -> ShardSpec:
    info = ParamInfo(f"{spec.info.name} (derived)", tuple(shape), dtype, shard_dim=shard_dim)
    return ShardSpec(info=info, rank=spec.rank, shard_offset=0, row_bounds=spec.row_bounds)
