"""A unit: what one `fully_shard(module)` call manages.

Its buckets (storage), its parameters in their two forms (managed_param.py: the sharded
DTensors the user and the optimizer see; the unsharded views of the gathered buffers that
forward and backward use), its settings and its explicit state (states.py). Where its shards
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
from flatshard.runtime.grad_sync import GradientSync
from flatshard.runtime.managed_param import ManagedParam
from flatshard.runtime.sharded_lookup import ShardedLookup, lookup_capable
from flatshard.runtime.states import Resharding, ShardedState, TrainingState, check_move

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
        self.kept_for_backward = False  # its last forward kept it gathered for backward
        self.forward_prefetch: list[Unit] | None = None  # set by the user, else run-time order
        self.backward_prefetch: list[Unit] | None = None
        self.context = None  # the RootContext of its model, set on the first forward
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
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
        self._gather_works: list | None = None
        # parameters whose subclass gathers itself (subclass_params.py; set by build_unit)
        self.subclass = None
        self._subclass_work = None
        self._forced_stale = False
        self.forward_calls = 0  # forward calls whose inputs' gradients end its backward
        self.input_gradients_seen = 0
        self.post_backward_at_end = False  # a call had no such inputs (see hooks.py)
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

    def move_to(self, state: TrainingState) -> None:
        self.training_state = check_move(self.training_state, state)

    def _move_sharded(self, state: ShardedState) -> None:
        self.sharded_state = check_move(self.sharded_state, state)

    # --- parameters ------------------------------------------------------------------------
    def check_states_here(self) -> None:
        if self.states_away:
            raise StatesOffloadedError(
                "the model's parameters and gradients are on the host (flatshard."
                "offload_states): call flatshard.reload_states(model, optimizer) first"
            )

    def unshard(self, async_op: bool = False):
        """Start gathering the parameters (no-op while a gathered copy is up to date)."""
        self.check_states_here()
        state = self.sharded_state
        if state is ShardedState.SHARDED or (state is ShardedState.UNSHARDED and self._stale()):
            self._start_gather()
        if not async_op:
            self.wait_unshard()

    def _start_gather(self) -> None:
        if self.post_optim_event is not None:
            comm.wait_event(self.post_optim_event)
            self.post_optim_event = None
        pool = self.pool()
        kept = self.sharded_state is ShardedState.SHARDED and self.buckets
        if self.subclass is not None:
            self.subclass.rode = False
        if kept and not self._forced_stale and all(b.secondary_fresh() for b in self.buckets):
            group = self.mesh.forward_group(self.resharding.forward_group_size)
            self._gather_works = [b.start_secondary_gather(group, pool) for b in self.buckets]
        else:
            self._drop_secondaries()
            self._gather_works = [bucket.start_all_gather(pool) for bucket in self.buckets]
        if self.subclass is not None and not self.subclass.rode:
            self._subclass_work = self.subclass.gather_alone(self.mesh.shard_group)
        self._move_sharded(ShardedState.GATHERING)
        self._forced_stale = False

    def _drop_secondaries(self) -> None:
        for bucket in self.buckets:
            bucket.secondary = None

    def _stale(self) -> bool:
        # Any write to the sharded weights (optimizer step, checkpoint load, a user's
        # in-place edit of `to_local()`) bumps the version of the bucket's main buffer.
        return self._forced_stale or any(b.gathered_version_changed() for b in self.buckets)

    def wait_unshard(self) -> None:
        if self.sharded_state is not ShardedState.GATHERING:
            return
        while self.sharded_state is ShardedState.GATHERING:
            for work, bucket in zip(self._gather_works, self.buckets):
                bucket.finish_all_gather(work)
            if self._subclass_work is not None:
                self._subclass_work.wait()
            self._gather_works = self._subclass_work = None
            self._move_sharded(ShardedState.UNSHARDED)
            if self._stale():  # written while the gather was in flight: gather again
                self._start_gather()
        self.make_unsharded_params()

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
        """Free the unsharded buffers; with `keep_for_backward` (hpZ, after a forward with
        gradients) keep this rank's piece of them for a gather inside its small group."""
        self.wait_unshard()
        if self.sharded_state is ShardedState.UNSHARDED:
            self.register("sharded")  # nothing may hold on to the views of freed buffers
            size = self.resharding.forward_group_size
            for bucket in self.buckets:
                if keep_for_backward and size is not None:
                    bucket.keep_secondary(size, self.rank % size)
                bucket.free_unsharded(self.pool())
            if self.subclass is not None:
                self.subclass.free()
            self._move_sharded(ShardedState.SHARDED)
        if not keep_for_backward:
            self._drop_secondaries()

    def mark_stale(self) -> None:
        """Force the next use to gather again."""
        self._forced_stale = True

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
