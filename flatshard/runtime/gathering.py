"""A unit's parameters between sharded and gathered: SHARDED -> GATHERING -> UNSHARDED and
back (states.py checks every move).

A gather starts every bucket's all-gather (hpZ: from the secondary copy a forward kept,
inside the small group), or the subclass parameters' own; waiting finishes them and
gathers again if the sharded weights were written meanwhile (an optimizer step, a load, a
user's in-place edit: the main buffers' versions say so). Resharding frees the unsharded
buffers into the step's pool.
"""

from __future__ import annotations

from flatshard import comm
from flatshard.runtime.states import ShardedState, check_move


class Gathering:
    def __init__(self, unit):
        self.unit = unit
        self.state = ShardedState.SHARDED
        self._works: list | None = None
        self._subclass_work = None
        # a load or a re-layout wrote the weights other than through their versions: the
        # next use gathers again, from the shards (not hpZ's kept pieces)
        self.stale = False

    def _move(self, state: ShardedState) -> None:
        self.state = check_move(self.state, state)

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering (no-op while a gathered copy is up to date)."""
        self.unit.check_states_here()
        if self.state is ShardedState.SHARDED or (
            self.state is ShardedState.UNSHARDED and self._stale()
        ):
            self._start()
        if not async_op:
            self.wait()

    def _start(self) -> None:
        unit = self.unit
        if unit.post_optim_event is not None:
            comm.wait_event(unit.post_optim_event)
            unit.post_optim_event = None
        pool = unit.pool()
        buckets = unit.buckets
        kept = self.state is ShardedState.SHARDED and buckets
        if unit.subclass is not None:
            unit.subclass.in_bucket_gather = False
        if kept and not self.stale and all(b.secondary_fresh() for b in buckets):
            group = unit.mesh.forward_group(unit.resharding.forward_group_size)
            self._works = [b.start_secondary_gather(group, pool) for b in buckets]
        else:
            self.drop_secondaries()
            self._works = [bucket.start_all_gather(pool) for bucket in buckets]
        if unit.subclass is not None and not unit.subclass.in_bucket_gather:
            self._subclass_work = unit.subclass.gather_alone(unit.mesh.shard_group)
        self._move(ShardedState.GATHERING)
        self.stale = False

    def drop_secondaries(self) -> None:
        for bucket in self.unit.buckets:
            bucket.secondary = None

    def _stale(self) -> bool:
        # Any write to the sharded weights (optimizer step, checkpoint load, a user's
        # in-place edit of `to_local()`) bumps the version of the bucket's main buffer.
        return self.stale or any(b.gathered_version_changed() for b in self.unit.buckets)

    def wait(self) -> None:
        if self.state is not ShardedState.GATHERING:
            return
        while self.state is ShardedState.GATHERING:
            for work, bucket in zip(self._works, self.unit.buckets):
                bucket.finish_all_gather(work)
            if self._subclass_work is not None:
                self._subclass_work.wait()
            self._works = self._subclass_work = None
            self._move(ShardedState.UNSHARDED)
            if self._stale():  # written while the gather was in flight: gather again
                self._start()
        self.unit.make_unsharded_params()

    def reshard(self, keep_for_backward: bool = False) -> None:
        """Free the unsharded buffers; with `keep_for_backward` (hpZ, after a forward with
        gradients) keep this rank's piece of them for a gather inside its small group."""
        self.wait()
        unit = self.unit
        if self.state is ShardedState.UNSHARDED:
            unit.register("sharded")  # nothing may hold on to the views of freed buffers
            size = unit.resharding.forward_group_size
            for bucket in unit.buckets:
                if keep_for_backward and size is not None:
                    bucket.keep_secondary(size, unit.rank % size)
                bucket.free_unsharded(unit.pool())
            if unit.subclass is not None:
                unit.subclass.free()
            self._move(ShardedState.SHARDED)
        if not keep_for_backward:
            self.drop_secondaries()

    def mark_stale(self) -> None:
        """Force the next use to gather again."""
        self.stale = True
