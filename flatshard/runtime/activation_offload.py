"""Activation offload: a block's saved activations live on the host between its forward and
its backward, and come back one unit ahead of it.

`parallelize(activation_checkpointing="offload")` binds an `ActivationOffload` to each
block but the last; the block's unit hooks (hooks.py) start it in pre-forward and stop it
in post-forward, so it composes with compiled blocks.

In forward, every activation autograd saves inside the block (not its parameters, which
backward gathers again; not DTensors) is copied to (pinned) host memory as it is saved,
and the device copy is dropped. In backward, when the unit before it in the backward
order starts its backward (pre-backward, where the runtime also prefetches that unit's
all-gather), the copies back start, so they overlap that unit's backward; whatever was not
fetched ahead comes back when autograd asks for it. The copies themselves are device code
(comm/devices.py); on the CPU they are plain copies, so the path runs and is tested there.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from flatshard import comm, registry


class _OnHost:
    """One saved activation on the host, and its copy back once started."""

    __slots__ = ("host", "like", "device", "fetched", "event")

    def __init__(self, tensor: torch.Tensor):
        self.host = comm.activation_to_host(tensor)
        self.like = (tensor.shape, tensor.stride())  # restored on the way back
        self.device = tensor.device
        self.fetched = self.event = None

    def fetch(self) -> None:
        if self.fetched is None:
            self.fetched, self.event = comm.activation_to_device(self.host, self.like, self.device)

    def take(self) -> torch.Tensor:
        # the device copy stays here for every op that saved this tensor; it is freed with
        # this object, once autograd has run them all
        self.fetch()
        return comm.use_on_current_stream(self.fetched, self.event)


class ActivationOffload:
    """The saved activations of one block. The unit's forward hooks `start` and `stop` it
    (outside any compiled region, where autograd's saved-tensor hooks cannot be entered)."""

    def __init__(self):
        self.waiting: list[_OnHost] = []  # on the host, not yet fetched
        self._active = None
        # this forward's activations by what they view, so that one saved by several ops
        # (the input of q, k and v) moves once; the device tensors are held until `stop`,
        # so their memory is not reused for another tensor that would match
        self._this_forward: dict[tuple, tuple[torch.Tensor, _OnHost]] = {}
        # since creation (tests, benchmarks): bytes moved to the host, activations saved
        # there, and of those, how many were fetched back ahead of their unpacking
        self.moved_bytes = self.saved = self.fetched_ahead = 0

    def start(self) -> None:
        """From now on, activations autograd saves go to the host (until `stop`)."""
        self._active = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._active.__enter__()

    def stop(self) -> None:
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._active = None
        self._this_forward.clear()

    def _pack(self, tensor: torch.Tensor):
        if (
            isinstance(tensor, DTensor)
            or (tensor.is_leaf and tensor.requires_grad)
            or 0 in tensor.stride()
        ):
            # a parameter (gathered again for backward), a TP DTensor, or an expanded
            # view (its elements overlap: no copy can keep its strides)
            return tensor
        key = (
            tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape,
            tensor.stride(), tensor.dtype, tensor._version,
        )  # fmt: skip
        if key in self._this_forward:
            return self._this_forward[key][1]
        on_host = _OnHost(tensor)
        self._this_forward[key] = (tensor, on_host)
        self.waiting.append(on_host)
        self.moved_bytes += tensor.numel() * tensor.element_size()
        self.saved += 1
        return on_host

    def _unpack(self, packed):
        if not isinstance(packed, _OnHost):
            return packed
        if packed in self.waiting:  # not fetched ahead: comes back now
            self.waiting.remove(packed)
        return packed.take()

    def prefetch(self) -> None:
        """Start bringing every activation still on the host back to the device."""
        for on_host in self.waiting:
            on_host.fetch()
        self.fetched_ahead += len(self.waiting)
        self.waiting.clear()


def offloads_of(unit) -> list[ActivationOffload]:
    found = (registry.activation_offload_of(module) for module in unit.modules)
    return [offload for offload in found if offload is not None]


def prefetch_activations(unit) -> None:
    """Start the copies back of `unit`'s offloaded activations, if it has any."""
    for offload in offloads_of(unit):
        offload.prefetch()
