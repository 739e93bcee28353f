"""A unit: what one `fully_shard(module)` call manages.

Its buckets (storage), its parameters in their two forms (managed_param.py: the sharded
DTensors the user and the optimizer see; the unsharded views of the gathered buffers that
forward and backward use), its settings and its explicit state (states.py; gathering.py moves
it between sharded and gathered). Where its shards
live (allocated from meta, moved to the host by optimizer offload) is shard_placement.py.
The hooks that drive it through a step are in hooks.py, the order and prefetch decisions in
schedule.py, its gradients in grad_sync.py, an embedding's lookup from the shards in
sharded_lookup.py.
"""

from __future__ import annotations

import itertools

import torch.nn as nn

from flatshard import comm
from flatshard.errors import StatesOffloadedError
from flatshard.layout import UnitLayout
from flatshard.policy import MixedPrecisionPolicy, OffloadPolicy
from flatshard.runtime.flat_bucket import FlatBucket
from flatshard.runtime.gathering import Gathering
from flatshard.runtime.grad_sync import GradientSync
from flatshard.runtime.managed_param import ManagedParam
from flatshard.runtime.sharded_lookup import ShardedLookup, lookup_capable
from flatshard.runtime.states import Resharding, ShardedState, StepState, TrainingState

_creation_order = itertools.count()


class Unit:
    def __init__(
        self,
        modules: list[nn.Module],
        mesh,
        layout: UnitLayout,
        buckets: list[FlatBucket],
        params: list[ManagedParam],
        resharding: Resharding,
        mp_policy: MixedPrecisionPolicy,
        first_use_of: nn.Module | None = None,
        offload: OffloadPolicy | None = None,
    ):
        self.modules = modules  # usually one; a first-use group of a root's children: more
        self.mesh = mesh  # a ShardMesh
        self.layout = layout
        self.buckets = buckets
        self.params = params
        self.resharding = resharding
        self.mp_policy = mp_policy
        self.offload = offload or OffloadPolicy()  # which pieces: runtime/offload.py
        self.created = next(_creation_order)
        # The module this unit is a first-use group of (first_use.py). A group of the model
        # root is needed again early in backward, so it stays gathered from forward to
        # backward like the root itself; a group of an inner module (a block whose experts
        # are a unit) reshards like any block.
        self.first_use_of = first_use_of
        self.forward_prefetch: list[Unit] | None = None  # set by the user, else run-time order
        self.backward_prefetch: list[Unit] | None = None
        self.context = None  # the RootContext of its model, set on the first forward
        self.gathering = Gathering(self)  # SHARDED -> GATHERING -> UNSHARDED and back
        self.step = StepState()  # where it is in a step, and what the step has seen
        self.unshard_in_backward = True  # False: its backward does not read the parameters
        self.is_last_backward = True  # accepted from FSDP2 scripts; reductions always finish
        self.post_optim_event = None  # the next forward's gathers wait for it (CUDA)
        self.grads = GradientSync(self)
        self.lookup = None
        if lookup_capable(modules, params, resharding.stage, mesh.shard_size):
            param = params[0]
            self.lookup = ShardedLookup(
                modules[0], param, buckets[param.bucket], mesh.shard_group, self.grads
            )
        # parameters whose subclass gathers itself (subclass_params.py; set by build_unit)
        self.subclass = None
        self.states_away = False  # flatshard.offload_states moved its shards to the host

    @property
    def root_part(self) -> bool:
        """Whether this is a first-use group of its model's root (before the first forward
        names the root: of any module)."""
        if self.first_use_of is None:
            return False
        if self.context is None:
            return True
        return any(self.first_use_of is module for module in self.context.root.modules)

    @property
    def group(self):
        return self.mesh.shard_group

    @property
    def rank(self) -> int:
        return self.mesh.shard_rank

    @property
    def world_size(self) -> int:
        return self.mesh.shard_size

    @property
    def training_state(self) -> TrainingState:
        return self.step.training

    @property
    def kept_for_backward(self) -> bool:
        """Whether its last forward kept it gathered for backward."""
        return self.step.kept_for_backward

    def move_to(self, state: TrainingState) -> None:
        self.step.move(state)

    # --- parameters ------------------------------------------------------------------------
    def check_states_here(self) -> None:
        if self.states_away:
            raise StatesOffloadedError(
                "the model's parameters and gradients are on the host (flatshard."
                "offload_states): call flatshard.reload_states(model, optimizer) first"
            )

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the parameters (no-op while a gathered copy is up to date)."""
        self.gathering.unshard(async_op)

    def wait_unshard(self) -> None:
        self.gathering.wait()

    def make_unsharded_params(self) -> None:
        if self.params and self.params[0].unsharded is not None:
            return
        for param in self.params:
            bucket = self.buckets[param.bucket]
            view = bucket.unsharded_view(bucket.unsharded, param.index)
            view = param.as_unsharded(view, self.mesh, bucket.specs[param.index])
            param.unsharded = nn.Parameter(view, requires_grad=param.sharded.requires_grad)

    def allocate_on_device(self) -> None:
        """Real (zeroed) shards on the mesh's device for a unit built on meta (FSDP2's
        `to_empty`; the DTensor layer asks this of a parameter assigned on meta)."""
        from flatshard.runtime import shard_placement  # it builds the unit's parameters

        shard_placement.allocate(self, self.mesh.device)

    def reshard(self, keep_for_backward: bool = False) -> None:
        """Free the unsharded buffers (gathering.py)."""
        self.gathering.reshard(keep_for_backward)

    def mark_stale(self) -> None:
        """Force the next use to gather again."""
        self.gathering.mark_stale()

    @property
    def sharded_state(self) -> ShardedState:
        return self.gathering.state

    def register(self, which: str) -> None:
        """Put the "sharded" or "unsharded" parameters on the modules."""
        for param in self.params:
            value = param.unsharded if which == "unsharded" else param.sharded
            for module, name in param.occurrences:
                module._parameters[name] = value
        if self.subclass is not None:
            self.subclass.register(which)

    def looked_up_from_shards(self) -> bool:
        """Whether this unit's last forward looked its embedding up from the shards."""
        return self.lookup is not None and self.lookup.last_counts is not None

    @property
    def trainable(self) -> list[ManagedParam]:
        """The parameters that require gradients now (freezing after fully_shard is fine)."""
        return [p for p in self.params if p.sharded.requires_grad]

    def follow_requires_grad(self) -> None:
        """Give the unsharded parameters the sharded ones' requires_grad (a user may freeze or
        unfreeze parameters between steps)."""
        for param in [*self.params, *(self.subclass.params if self.subclass else ())]:
            wanted = param.sharded.requires_grad
            if param.unsharded is not None and param.unsharded.requires_grad != wanted:
                param.unsharded.requires_grad_(wanted)

    def pool(self) -> comm.BufferPool | None:
        """Buffers freed in a forward or backward pass are kept for the next unit; outside
        them (a user's `unshard()` / `reshard()`) memory goes straight back."""
        return self.context.pool() if self.context is not None else None
