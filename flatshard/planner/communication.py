"""The bytes a step moves per rank under flatshard (all-gathers, reduce-scatters, HSDP's
all-reduce over the replicas, what goes on the wire), for `flatshard plan`: from each unit's
figures (unit_figures.py) and what the runtime gathers when (runtime/gather_policy.py)."""

from __future__ import annotations

from flatshard.planner.parallel_cost import DTYPE_BYTES
from flatshard.planner.unit_figures import UnitFigures, is_looked_up, unit_lookup_payloads
from flatshard.runtime.gather_policy import (
    all_gathers_per_step,
    reduce_scatters_per_step,
    stays_gathered,
)


def forward_order(units) -> list[UnitFigures]:
    """The units in the order their forwards gather them: each repeated unit `count` times,
    with the units inside it (`inner`: a block's first-use group and its experts under EP)
    right after each of its runs."""
    chains = []
    for unit in units:
        if unit.inner and chains:
            chains[-1].append(unit)
        else:
            chains.append([unit])
    return [unit for chain in chains for _ in range(chain[0].count) for unit in chain]


def step_communication(units: tuple[UnitFigures, ...], setup, empty_root=False) -> dict[str, int]:
    """`empty_root`: the model's root is a unit without parameters of its own (a pipeline
    stage holding blocks only), which counts among its units."""
    pb, rb = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce_dtype]
    accumulation = setup.grad_accum
    looked_up = [u for u in units if is_looked_up(u, setup)]
    lookups = [unit_lookup_payloads(u, setup) for u in looked_up]
    gathered_units = [u for u in units if u not in looked_up]
    # the forward order the runtime sees: blocks, then the root's parts (where the
    # embedding runs does not change which units stay gathered: gather_policy.py)
    order = forward_order(gathered_units)
    root_parts = [u.is_root for u in order]
    in_model = sum(u.count for u in units) + int(empty_root)
    stays = [stays_gathered(i, root_parts, in_model) for i in range(len(order))]
    quantized = setup.quantize_weights != "none"
    all_gather = sum(
        (u.quantized + u.nf4 if quantized else u.gathered_bytes(pb))
        * all_gathers_per_step(setup.zero_stage, kept, accumulation, setup.pp > 1)
        for u, kept in zip(order, stays)
    )
    # hpZ: the backward gathers of the units that resharded after forward, inside groups
    hpz = setup.hpz_group if setup.zero_stage == 3 else 0
    regathered = [u for u, kept in zip(order, stays) if not kept]
    if quantized:  # hpZ's backward gathers pack the group's pieces, not the shards
        in_groups = accumulation * sum(u.quantized_in_hpz_group for u in regathered)
        all_gather -= accumulation * sum(u.quantized for u in regathered) if hpz else 0
        all_gather += in_groups if hpz else 0
    else:
        in_groups = pb * accumulation * sum(u.padded for u in regathered)
    in_groups = in_groups if hpz else 0
    reductions = reduce_scatters_per_step(setup.zero_stage, accumulation, setup.pp > 1)
    per_unit = [
        u.quantized_grads if setup.quantize_grads != "none" else u.padded_trainable * rb
        for u in gathered_units
    ]
    reduce_scatter = reductions * sum(b * u.count for b, u in zip(per_unit, gathered_units))
    all_gather += accumulation * sum(gather for gather, _ in lookups)
    reduce_scatter += accumulation * sum(rows for _, rows in lookups)
    replicas = setup.dp_replicate
    all_reduce = reductions * sum(u.shard_trainable * u.count for u in units) * rb
    all_reduce = all_reduce if replicas > 1 else 0
    shards = setup.dp_shard
    wire = (shards - 1) * (all_gather - in_groups + reduce_scatter) // shards
    wire += (hpz - 1) * in_groups // hpz if hpz else 0
    wire += 2 * (replicas - 1) * all_reduce // replicas
    return {
        "all_gather": all_gather,
        "all_gather_in_hpz_groups": in_groups,
        "reduce_scatter": reduce_scatter,
        "replica_all_reduce": all_reduce,
        "total": all_gather + reduce_scatter + all_reduce,
        "wire_per_rank": wire,
    }
