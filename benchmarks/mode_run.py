"""One mode built and trained step by step on this rank, and what it measures: phase times,
collective bytes, losses, the state it holds, its peak memory, flatshard's layout counts.

`compare.py` drives several of these: one after another (each mode built, trained and freed
in turn, so its peak memory is its own) or side by side (every mode built, then one step of
each in turn, so a drift of a shared machine within seconds hits all modes alike).
"""

from __future__ import annotations

import ctypes
import gc
import resource
import time

import torch
import torch.distributed as dist
from bench_modes import (
    DTYPES,
    FLATSHARD_STAGES,
    OFFLOAD_DIRS,
    OFFLOAD_FRACTIONS,
    LlamaConfig,
    build_mode,
    data_slice,
    make_optimizer,
    remove_offload_dirs,
)
from comm_counter import COUNTER, nbytes

from flatshard import comm as flatshard_comm
from flatshard import registry
from flatshard.runtime.gather_policy import LOOKUP_PLAN_BYTES, all_gathers_per_step, lookup_payloads
from flatshard.runtime.offload import offloaded_bytes

# --- memory ----------------------------------------------------------------------------


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def release_free_memory() -> None:
    """Collect garbage and hand freed malloc memory back to the OS, so the resident set at
    the start of a mode is what is really alive (glibc keeps freed heap pages otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


# --- what a model holds ------------------------------------------------------------------


def _local_nbytes(tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    return nbytes(to_local() if to_local is not None else tensor)


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes this rank holds of the optimizer's parameters, their gradients and its state."""
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}.values()
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for param in params:
        out["params"] += _local_nbytes(param)
        if param.grad is not None:
            out["grads"] += _local_nbytes(param.grad)
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor):
                out["optimizer"] += _local_nbytes(value)
    return out


def trainable_shard_elements(optimizer) -> int:
    """Elements of this rank's shards of the optimizer's parameters (DTensors: local)."""
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}.values()
    total = 0
    for param in params:
        to_local = getattr(param, "to_local", None)
        total += (to_local() if to_local is not None else param).numel()
    return total


def _units(model) -> list:
    """flatshard's units, once each (a first-use group spans several modules)."""
    return registry.units_below(model)


def padding_info(model) -> dict | None:
    units = _units(model)
    if not units:
        return None
    padding = sum(u.layout.padding for u in units)
    used = sum(u.layout.used_size for u in units)
    return {"padding": padding, "used": used, "units": len(units)}


def zero3_wire_bytes(model, world: int) -> dict:
    """What one ZeRO-3 step sends per rank, from the layout: (N-1)/N x (every bucket
    gathered in forward, again in backward unless its unit stays gathered through backward
    (the model root's parts, as FSDP2 keeps its root, and the last block), every trainable
    bucket reduced); an
    embedding looked up from its shards (flatshard/runtime/sharded_lookup.py) sends its tokens' ids,
    rows and row gradients instead of its table. Also the textbook count: every bucket
    gathered twice and reduced once (in fp32: 3 x padded parameter bytes x (N-1)/N)."""
    share = (world - 1) / world
    analytic = textbook = kept = table = lookups = 0.0
    for unit in _units(model):
        # an embedding looked up from its shards would, gathered, stay as a root part
        stays = unit.kept_for_backward or unit.root_part
        gathered = sum(b.layout.padded_size * b.param_dtype.itemsize for b in unit.buckets)
        reduced = sum(
            b.layout.padded_size * b.reduce_dtype.itemsize
            for b in unit.buckets
            if b.layout.requires_grad
        )
        textbook += share * (2 * gathered + reduced)
        kept += share * gathered if stays else 0
        cost = share * (all_gathers_per_step(3, stays, microbatches=1) * gathered + reduced)
        if unit.looked_up_from_shards():
            table += cost
            lookups += _lookup_bytes(unit.lookup, share)
        else:
            analytic += cost
    return {
        "analytic": analytic + lookups,
        "textbook": textbook,
        "kept": kept,
        "table": table,
        "lookups": lookups,
    }


def _lookup_bytes(lookup, share: float) -> float:
    """Sent per rank by one lookup from the shards and its backward: its plan to every
    peer, then (N-1)/N of its collectives' payloads
    (flatshard/runtime/sharded_lookup.py)."""
    counts = lookup.last_counts
    gathered, rows = lookup_payloads(
        len(counts),
        max(counts),
        lookup.module.embedding_dim,
        lookup.bucket.param_dtype.itemsize,
        lookup.param.sharded.requires_grad,
    )
    return LOOKUP_PLAN_BYTES * (len(counts) - 1) + share * (gathered + rows)


def resident_unsharded_bytes(model) -> int:
    """Bytes of flatshard's unsharded parameter and gradient buffers still allocated
    between steps (after `zero_grad`): ZeRO-1/2 keep some, ZeRO-3 none."""
    total = 0
    for unit in _units(model):
        for bucket in unit.buckets:
            for buffer in (bucket.unsharded, bucket.grads.unsharded):
                if isinstance(buffer, torch.Tensor):
                    total += buffer.untyped_storage().nbytes()
    return total


# --- a mode, step by step ----------------------------------------------------------------


class ModeRun:
    """Builds `mode` on this rank (the single process only on rank 0: elsewhere `idle`).

    `own_memory`: nothing else was built beside it, so the peak resident set since the
    build is this mode's own.
    """

    def __init__(self, mode: str, cfg: LlamaConfig, opts: dict, own_memory: bool):
        self.mode = mode
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.idle = mode == "single" and self.rank != 0
        self.own_memory = own_memory
        self.losses: list[float] = []
        self.phases: list[tuple[float, float, float]] = []
        self.cpu_seconds: list[float] = []  # the process's CPU time (all threads) per step
        self.page_faults: list[int] = []  # minor page faults per step (fresh memory touched)
        self.comm: list[dict] = []
        self.sizes: dict | None = None
        self.offloaded: dict | None = None
        self.offload_dirs: list[str] = []
        dist.barrier()  # the previous mode has finished on every rank
        if self.idle:
            return
        if own_memory:
            release_free_memory()
            self.peak_reset = reset_peak_rss()
            self.rss_start = proc_status_kib("VmRSS")
        t_build = time.perf_counter()
        dirs_before = len(OFFLOAD_DIRS)
        self.model, self.forward_loss, self.backward = build_mode(
            mode, cfg, DTYPES[opts["param_dtype"]]
        )
        self.offload_dirs = OFFLOAD_DIRS[dirs_before:]
        self.optimizer = make_optimizer(mode, self.model)
        self.build_s = time.perf_counter() - t_build
        # which part of each global batch this rank trains on (TP: its data-parallel rank's)
        self.data_rank, self.data_world = data_slice(mode)

    def step(self, tokens: torch.Tensor, timed: bool, last: bool) -> None:
        """One training step on the global batch `tokens` (this rank's slice of it, but for
        the single process; in the TP modes its data-parallel rank's slice, the same on every
        rank of a TP group). Every rank of a distributed mode calls it together."""
        if self.idle:
            return
        if self.mode != "single":
            per_rank = tokens.shape[0] // self.data_world
            tokens = tokens[self.data_rank * per_rank : (self.data_rank + 1) * per_rank]
            dist.barrier()  # every rank starts the step together
        COUNTER.reset()
        COUNTER.active = timed
        ep_rows0 = flatshard_comm.traffic.all_to_all
        cpu0 = time.process_time()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = self.forward_loss(tokens)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        if last:
            self.sizes = state_bytes(self.optimizer)  # after the step, before grads go
            if self.mode in OFFLOAD_FRACTIONS:
                host, disk = offloaded_bytes(self.model, self.optimizer)
                self.offloaded = {
                    "host": host,
                    "disk": disk,
                    # AdamW's exp_avg + exp_avg_sq (fp32) of every element this rank holds
                    "adamw_state": 8 * trainable_shard_elements(self.optimizer),
                }
        t4 = time.perf_counter()
        self.optimizer.zero_grad()
        t5 = time.perf_counter()
        cpu = time.process_time() - cpu0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        COUNTER.active = False
        ep_rows = flatshard_comm.traffic.all_to_all - ep_rows0
        self.losses.append(loss.item())
        if timed:
            self.phases.append((t1 - t0, t2 - t1, (t3 - t2) + (t5 - t4)))
            self.cpu_seconds.append(cpu)
            self.page_faults.append(faults)
            self.comm.append(
                dict(COUNTER.bytes)
                | {
                    "calls": dict(COUNTER.calls),
                    "narrow": COUNTER.narrow_bytes,
                    # expert parallelism: bytes bound for other ranks, the token rows
                    # counted here and as flatshard counts them (comm.traffic.all_to_all)
                    "ep_offrank": COUNTER.ep_offrank,
                    "ep_rows": COUNTER.ep_rows,
                    "ep_traffic": ep_rows,
                    "group_sizes": {k: dict(v) for k, v in COUNTER.group_sizes.items()},
                }
            )

    def finish(self) -> dict:
        """Frees the model and returns what was measured (losses: the global mean). Every
        rank calls it for every mode, in the same order."""
        if self.idle:
            return {"idle": True}
        model = self.model
        peak_kib = proc_status_kib("VmHWM")
        result = {
            "idle": False,
            "losses": self.losses,
            "phases": self.phases,
            "cpu_seconds": self.cpu_seconds,
            "page_faults": self.page_faults,
            "comm": self.comm,
            "state": self.sizes,
            "peak_rss_kib": peak_kib if self.own_memory else None,
            "rss_start_kib": self.rss_start if self.own_memory else None,
            "peak_reset": self.peak_reset if self.own_memory else True,
            "build_s": self.build_s,
            "padding": padding_info(model) if self.mode in FLATSHARD_STAGES else None,
            "zero3_wire": zero3_wire_bytes(model, self.world) if self.mode == "zero3" else None,
            "resident": resident_unsharded_bytes(model) if self.mode in FLATSHARD_STAGES else None,
            "offloaded": self.offloaded,
        }
        if self.mode == "ddp":
            result["ddp_param_bytes"] = sum(
                p.numel() * 4 if p.dtype.is_floating_point else nbytes(p)
                for p in model.parameters()
                if p.requires_grad
            )
            # After the run (and after reading the peak RSS): DDP uses one bucket for its
            # first step, then rebuilds buckets in backward order. Private API.
            try:
                buckets = model.reducer._get_zeros_like_grad_buckets()
                result["ddp_bucket_sizes"] = [nbytes(b.buffer()) for b in buckets]
            except (AttributeError, RuntimeError):
                result["ddp_bucket_sizes"] = None
        del self.model, self.optimizer, self.forward_loss, self.backward, model
        remove_offload_dirs(self.offload_dirs)  # the disk tier's (its files: unlinked)
        if self.mode != "single":
            # Global mean loss of every step (outside the counted window). TP ranks of a
            # group hold the same loss (replicated logits), so the mean over every rank is
            # the mean over the data-parallel ranks.
            total = torch.tensor(result["losses"], dtype=torch.float64)
            dist.all_reduce(total)
            result["losses"] = (total / self.world).tolist()
        return result
