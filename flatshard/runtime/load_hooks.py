"""Loading a state dict into a `fully_shard`-ed module: the values land in flatshard's
buffers, whatever form they come in.

`module.load_state_dict(sd)` would `copy_` each value into the parameter, or with
`assign=True` (FSDP2's way after meta-device init) put the given tensor in its place; the
module would then hold a tensor that forward, backward and the optimizer never see. So
each unit's modules get a pre-hook that takes their parameters' entries first: every
value (a full tensor, or a DTensor of any placement: flatshard's own rows, `Replicate`, or
`torch.chunk` `Shard`s) is cut to this rank's rows by its `ShardSpec` and copied into the
sharded main weights; the parameters stay flatshard's. A post-hook keeps the keys it took
out of the missing-keys report. Shape mismatches go to load_state_dict's own error list.
"""

from __future__ import annotations

import torch

from flatshard.dtensor.sharded_param import rows_in_layout
from flatshard.runtime import shard_placement
from flatshard.runtime.managed_param import ParamHome


def install(unit, module) -> None:
    paths = {id(sub): name for name, sub in module.named_modules(remove_duplicate=False)}
    taken: list[str] = []

    def keys_of(param, prefix):
        return [
            prefix + (f"{paths[id(owner)]}." if paths[id(owner)] else "") + name
            for owner, name in param.occurrences
            if id(owner) in paths  # a unit over several modules: each takes its own
        ]

    def take(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        taken.clear()
        # FSDP2's flow after meta-device init: the loaded values are the first real ones
        shard_placement.allocate(unit, unit.mesh.device)
        for param in unit.params:
            present = [key for key in keys_of(param, prefix) if key in state_dict]
            if not present:
                continue
            problem = _load(unit, param, state_dict[present[0]])
            if problem:
                errors.append(f"While loading {present[0]!r}: {problem}")
            for key in present:
                del state_dict[key]
            taken.extend(present)
        unit.mark_stale()

    def keep_out_of_missing(module, incompatible_keys):
        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if key not in taken]

    module.register_load_state_dict_pre_hook(take)
    module.register_load_state_dict_post_hook(keep_out_of_missing)


@torch.no_grad()
def _load(unit, param, value) -> str | None:
    spec = ParamHome(unit, param).spec
    if not isinstance(value, torch.Tensor):
        return f"expected a tensor, got {type(value).__name__}"
    if tuple(value.shape) != spec.global_shape:
        return f"the state dict holds shape {tuple(value.shape)}, the model {spec.global_shape}"
    param.sharded.to_local().copy_(rows_in_layout(value, spec))
    return None
