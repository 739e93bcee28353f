"""The communication settings of a `fully_shard`-ed module (FSDP2's `FSDPModule` setters
for gradient division, hooks, custom collectives and buffers, and flatshard's
`set_comm_policy`): a base class of `FlatShardModule`, which provides `_units` and
`_own_units`."""

from __future__ import annotations

from flatshard.errors import WrappingError
from flatshard.policy import CommPolicy
from flatshard.runtime import custom_comms
from flatshard.runtime.quantized_gather import QuantizedWeightGather
from flatshard.runtime.quantized_scatter import QuantizedGradientScatter


class CommSettings:
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by `factor` instead of the data-parallel world size."""
        if factor <= 0:
            raise WrappingError(f"gradient divide factor must be positive, got {factor}")
        for unit in self._units(recurse=True):
            unit.grads.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of `set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """`hook(reduced)` runs on each of this unit's reduced gradient shards (in the
        reduce dtype, before they are added to the parameters' gradients): the
        reduce-scatter's output, or under HSDP the all-reduce's over the replicas, as in
        FSDP2 (torchft sums over its own replicas here). Not recursive, but a root's
        first-use groups (the parameters FSDP2's root group holds) take it too. `stream`
        is accepted without HSDP; the hook runs on the current stream."""
        units = self._own_units()
        if stream is not None and units[0].mesh.replicate_group is not None:
            raise ValueError("stream cannot be set when using native HSDP")
        for unit in units:
            unit.grads.all_reduce_hook = hook

    def set_comm_policy(self, policy: CommPolicy, *, recurse: bool = True) -> None:
        """Gather this module's weights and reduce its gradients as `policy` says
        (`CommPolicy(quantize_weights="int8", quantize_grads="int8")`: ZeRO++'s qwZ and
        qgZ); `CommPolicy()` restores the compute and reduce dtypes."""
        gather = scatter = None
        if policy.quantize_weights is not None:
            gather = QuantizedWeightGather(policy.quantize_weights, policy.block_size)
        if policy.quantize_grads is not None:
            scatter = QuantizedGradientScatter(
                policy.quantize_grads, policy.block_size, policy.error_feedback
            )
        for unit in self._units(recurse):
            for bucket in unit.buckets:
                bucket.transport.gather = gather
                bucket.transport.scatter = scatter

    def set_custom_all_gather(self, comm) -> None:
        """FSDP2's: this module's all-gathers run `comm` (an `AllGather`: it allocates the
        gathered buffer and gathers into it; flatshard copies it out at wait(), as FSDP2
        does). Not recursive; a root's first-use groups take it too."""
        for unit in self._own_units():
            for bucket in unit.buckets:
                bucket.transport.gather = custom_comms.all_gather_hook(comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """FSDP2's: this module's gradient reduce-scatters run `comm` (a `ReduceScatter`:
        it allocates its input and output; the gradient is copied in and the reduced shard
        out, as FSDP2 does). Not recursive; a root's first-use groups take it too."""
        for unit in self._own_units():
            for bucket in unit.buckets:
                bucket.transport.scatter = custom_comms.reduce_scatter_hook(comm)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse=True):
        """Accepted: flatshard always reduce-scatters a unit's whole buckets (a parameter a
        rank did not use contributes zeros), so ranks that use different parameters never
        mismatch their collectives: FSDP2's True, whatever the value."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse=True):
        """Accepted (checked as FSDP2 checks it): flatshard's reduce-scatters read from a
        buffer pool that backward reuses, so there is no cap to set; results never depend
        on it."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse=True) -> None:
        """Accepted: a choice of FSDP2's NCCL streams and communicators; flatshard keeps its
        collectives on the shard group. Results never depend on it."""

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted: where FSDP2 allocates its staging buffers (NCCL); flatshard uses its
        own buffer pool. Results never depend on it."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted: FSDP2's symmetric-memory all-gather (NCCL); results never depend on it."""
