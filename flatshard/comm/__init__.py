"""The comm layer: the only code that knows gloo from NCCL and CPU from CUDA.

- `devices.py`: devices and host copies (streams, events, pinned memory), the CPU buffer pool.
- `collectives.py`: all-gather, reduce-scatter, all-reduce and all-to-all of flat buffers,
  as an implementation chosen once per process group (torch's for NCCL, point-to-point and
  all-to-all ones on gloo, the hazard shim's), and the payload counters (`traffic`). On
  CUDA, NCCL runs them on its own stream and `Work.wait()` makes the current stream wait;
  on CPU, gloo runs them on its own threads and `wait()` blocks the caller.
- `nccl_shim.py`: CPU collectives that behave like asynchronous NCCL (tests).
- `peer_failure.py`: which rank failed first, and why, for the others' errors.
- `agreement.py`: checks that can differ per rank, agreed before any collective.
- `exit_guard.py`: a pause at exit so that the collectives' threads finish first.

Callers take the first two from here (`from flatshard import comm; comm.for_group(...)`).
"""

from flatshard.comm.collectives import (
    Collectives,
    all_gather,
    all_reduce,
    all_to_all,
    for_group,
    reduce_scatter,
    traffic,
)
from flatshard.comm.devices import (
    BufferPool,
    activation_to_device,
    activation_to_host,
    alloc_storage,
    compute_device,
    default_generator,
    free_storage,
    group_device,
    host_copies_done,
    host_zeros,
    release_device_memory,
    storage_from_host,
    storage_to_host,
    thread_device_setter,
    to_device,
    to_host,
    to_host_now,
    use_on_current_stream,
    wait_event,
)

__all__ = [
    "BufferPool",
    "Collectives",
    "activation_to_device",
    "activation_to_host",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "alloc_storage",
    "compute_device",
    "default_generator",
    "for_group",
    "free_storage",
    "group_device",
    "host_copies_done",
    "host_zeros",
    "reduce_scatter",
    "release_device_memory",
    "storage_from_host",
    "storage_to_host",
    "thread_device_setter",
    "to_device",
    "to_host",
    "to_host_now",
    "traffic",
    "use_on_current_stream",
    "wait_event",
]
