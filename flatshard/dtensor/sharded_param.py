"""flatshard's sharded parameters (`RowShardedParameter`, DTensors whose local tensor is a
`RowShard`) and the helpers that read their spec: this rank's rows of a value in any layout,
the spec and global rows of a parameter, the shape a checkpoint stores."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from flatshard import registry
from flatshard.compat import allow_foreach
from flatshard.dtensor.row_shard import RowShard
from flatshard.errors import UnevenShardError
from flatshard.layout import ShardSpec, describe_param, whole_param_spec


def rows_in_layout(value: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's rows (by `spec`) of a tensor shaped like the global one, whatever layout
    it comes in: a full tensor, flatshard's own rows, a Replicate DTensor, or another
    sharding (gathered: every rank loading the same values joins that collective)."""
    if not isinstance(value, DTensor):
        return spec.piece_of(value.detach())
    local = value._local_tensor
    if isinstance(local, RowShard) and local.spec.pieces == spec.pieces:
        return local.data_
    if all(isinstance(p, Replicate) for p in value.placements):
        return spec.piece_of(local)
    return spec.piece_of(value.full_tensor())


def in_row_layout(param, value):
    """An optimizer state `value` for `param` in flatshard's rows: a DTensor of another
    layout (e.g. `distribute_tensor(full, p.device_mesh, p.placements)`, which cuts
    `torch.chunk` rows) is re-cut (its full tensor gathered: every rank loads the same
    state, so every rank joins); anything else, or any state of another parameter, is
    returned as it is."""
    local = param._local_tensor if isinstance(param, DTensor) else None
    if not isinstance(local, RowShard) or not isinstance(value, DTensor):
        return value
    if isinstance(value._local_tensor, RowShard) and (
        value._local_tensor.spec.pieces == local.spec.pieces
    ):
        return value
    if tuple(value.shape) != local.spec.global_shape:
        return value  # not a state of this shape: the optimizer's own checks speak
    rows = torch.zeros_like(param.detach(), dtype=value.dtype)
    with torch.no_grad():
        rows.to_local().copy_(rows_in_layout(value, local.spec))
    return rows


_TENSOR_DATA = torch._C.TensorBase.data


class RowShardedParameter(DTensor):
    """The class of flatshard's sharded parameters. A plain DTensor's `param.data = value`
    swaps the wrapper and keeps its old local tensor: the assignment would be silently
    dropped. Here it loads `value` into this rank's rows of the flat buffers instead."""

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value) -> None:
        spec = shard_spec(self)
        if tuple(value.shape) != spec.global_shape:
            raise UnevenShardError(
                f"param.data = a tensor of shape {tuple(value.shape)}: this parameter's shape is "
                f"{spec.global_shape}; flatshard loads the values into its shards, it cannot "
                "change the shape"
            )
        target = self
        if self.is_meta and (registry.managed_of(self) is not None):
            # still on meta (FSDP2's flow): the unit gets real shards, whose new parameter
            # takes this one's place in the module and receives the values
            unit, managed = registry.managed_of(self)
            unit.allocate_on_device()
            target = managed.sharded
        with torch.no_grad():
            target.to_local().copy_(rows_in_layout(value, spec))


# torch's optimizers pick foreach/fused kernels by exact type; unlisted, AdamW loops per tensor
allow_foreach(RowShardedParameter)


def shard_spec(param: DTensor) -> ShardSpec:
    """The `ShardSpec` of this rank's piece of a flatshard DTensor (a parameter, its gradient
    or an optimizer state of it)."""
    local = param._local_tensor if isinstance(param, DTensor) else None
    if not isinstance(local, RowShard):
        raise TypeError(f"expected a flatshard-sharded DTensor, got {type(param).__name__}")
    return local.spec


def param_spec(root, fqn: str, param) -> ShardSpec:
    """What this rank holds of `root`'s parameter `fqn`: its flatshard spec, or the whole of
    a parameter flatshard does not shard."""
    if isinstance(param, DTensor):
        return shard_spec(param)
    return whole_param_spec(describe_param(root, fqn, param))


def stored_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape a checkpoint stores `tensor` as: the global one for flatshard's pieces, a
    plain-tensor optimizer state (a bare `RowShard`) included."""
    if isinstance(tensor, RowShard):
        return tensor.spec.global_shape
    return tuple(tensor.shape)


def row_range(param: DTensor) -> tuple[int, int]:
    """The global dim-0 rows `[start, end)` of a flatshard DTensor that this rank's piece
    lies in: whole rows, except for grouped experts fewer than ranks (a finer row), where
    the piece is part of one expert's rows; its exact box is
    `shard_spec(param).global_box`."""
    box = shard_spec(param).global_box
    return box.offset[0], box.offset[0] + box.shape[0]


def local_data(dtensor: DTensor) -> torch.Tensor:
    """The plain tensor behind a DTensor's local shard."""
    local = dtensor._local_tensor
    return local.data_ if isinstance(local, RowShard) else local


def make_row_sharded_dtensor(
    local: torch.Tensor,
    mesh,
    spec: ShardSpec,
    version_base: torch.Tensor | None = None,
    tp_placement=None,
    tier=None,
) -> DTensor:
    """A DTensor on `mesh` (a ShardMesh: `Shard(0)`, or the `Shard(d)` its spec splits,
    over its shard dim, replicated over HSDP's replicas, `tp_placement` over TP) whose
    local tensor is `local` (a view of `version_base`); `tier`: the disk tier its optimizer
    state goes to."""
    placements = list(mesh.placements_for(tp_placement))
    if spec.info.shard_dim:  # FSDP2's Shard(d) from shard_placement_fn
        placements[mesh.shard_mesh_dim] = Shard(spec.info.shard_dim)
    return dtensor_viewing(
        RowShard(local, spec, version_base, mesh.shard_mesh_dim, tier),
        mesh.param_mesh,
        placements,
        shape=torch.Size(spec.global_shape),
        stride=spec.global_strides,
    )


def gradient_dtensor(local: torch.Tensor, param: DTensor, tier=None) -> DTensor:
    """The DTensor `.grad` of flatshard's sharded `param` over `local` (this rank's rows of
    a reduced gradient shard, in the parameter's dtype): placed exactly as the parameter,
    so it shares the parameter's DTensorSpec instead of building one per parameter per
    step (this runs for every parameter after every synced backward)."""
    param_local = param._local_tensor
    if local.dtype != param.dtype:
        raise TypeError(f"a {local.dtype} gradient for a {param.dtype} parameter")
    row_shard = RowShard(local, param_local.spec, None, param_local.mesh_dim, tier)
    return DTensor(row_shard, param._spec, requires_grad=False)


def dtensor_viewing(local: torch.Tensor, mesh, placements, shape, stride) -> DTensor:
    """`DTensor.from_local(local, mesh, placements, run_check=False, shape=, stride=)`,
    except that `local` stays where it is. `from_local` copies a local tensor on another
    device type than the mesh's to the mesh's: an offloaded piece (host memory, a CUDA
    mesh) would become a device copy that the optimizer steps while the unit gathers
    the host buffer, which never changes. As FSDP2's CPU offload, the DTensor views the
    host memory itself (no autograd edge: `local` needs no gradient)."""
    tensor_meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    dtensor_spec = DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta)
    # a fresh tensor object sharing `local`'s memory, as from_local's
    return DTensor(local.view_as(local), dtensor_spec, requires_grad=local.requires_grad)
