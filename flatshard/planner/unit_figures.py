"""One `fully_shard` unit as `flatshard plan` sees it: its layout at the shard size (from
`plan_unit_layout`, the layout fully_shard uses), and whether its embedding is looked up from
its shards instead of gathered (the runtime's own policy, runtime/gather_policy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.layout import plan_unit_layout
from flatshard.planner.parallel_cost import DTYPE_BYTES
from flatshard.runtime.gather_policy import looks_up, lookup_payloads, lookup_possible
from flatshard.runtime.quantized_gather import BLOCK, packed_bytes


@dataclass(frozen=True)
class UnitFigures:
    """One unit's layout at the shard size (elements), and how many identical units."""

    name: str
    count: int
    is_root: bool
    numel: int
    padded: int  # unsharded bucket elements (all buckets)
    padded_trainable: int
    shard: int  # per-rank shard elements
    shard_trainable: int
    buckets: int
    embedding: tuple[int, int] | None  # (rows, dim) of a unit over one plain embedding
    trainable: bool
    empty_ranks: int = 0  # ranks whose shards hold none of its parameters (only padding)
    inner: bool = False  # runs inside the previous unit's forward (EP experts)
    quantized: int = 0  # bytes of one all-gather of it in 8 bits (every rank's blocks, scales)
    quantized_in_hpz_group: int = 0  # the same for hpZ's backward gather inside a group
    quantized_grads: int = 0  # bytes of one reduce-scatter of its gradients in 8 bits
    nf4: int = 0  # bytes of its QLoRA NF4 bases, whole (sharded and gathered besides buckets)

    def gathered_bytes(self, param_bytes: int) -> int:
        """Its unsharded parameters' bytes: buckets in the compute dtype and NF4 bases."""
        return self.padded * param_bytes + self.nf4

    @property
    def padding(self) -> int:
        return self.padded - self.numel


def unit_figures(unit, dp_shard: int, bucket_per_param: bool = False, hpz: int = 0) -> UnitFigures:
    layout = plan_unit_layout(unit.params, dp_shard, bucket_per_param)
    trainable = [b for b in layout.buckets if b.requires_grad]
    return UnitFigures(
        name=unit.name,
        count=unit.count,
        is_root=unit.is_root,
        numel=layout.used_size,
        padded=layout.padded_size,
        padded_trainable=sum(b.padded_size for b in trainable),
        shard=sum(b.shard_size for b in layout.buckets),
        shard_trainable=sum(b.shard_size for b in trainable),
        buckets=len(layout.buckets),
        embedding=tuple(unit.params[0].shape) if unit.embedding else None,
        trainable=bool(trainable),
        empty_ranks=layout.empty_rank_count() if layout.used_size else 0,
        inner=unit.inner,
        quantized=sum(dp_shard * packed_bytes(b.shard_size, BLOCK) for b in layout.buckets),
        quantized_in_hpz_group=sum(
            hpz * packed_bytes(b.padded_size // hpz, BLOCK) for b in layout.buckets if hpz
        ),
        quantized_grads=sum(dp_shard * packed_bytes(b.shard_size, BLOCK) for b in trainable),
        nf4=unit.nf4_bytes,
    )


def is_looked_up(unit: UnitFigures, setup) -> bool:
    """Whether the runtime looks this unit's embedding up from its shards."""
    if unit.embedding is None or not lookup_possible(setup.zero_stage, setup.dp_shard):
        return False
    tokens = setup.micro_batch * setup.seq_len // setup.cp  # this rank's (its CP part)
    return looks_up(setup.dp_shard, tokens, unit.embedding[0])


def unit_lookup_payloads(unit: UnitFigures, setup) -> tuple[int, int]:
    """(all-gathered, reduce-scattered) bytes of one micro-batch's lookup and its backward."""
    dim, itemsize = unit.embedding[1], DTYPE_BYTES[setup.param_dtype]
    tokens = setup.micro_batch * setup.seq_len // setup.cp
    return lookup_payloads(setup.dp_shard, tokens, dim, itemsize, unit.trainable)
