"""What a training step costs: peak memory and bytes moved by flatshard's collectives.

Memory: on CUDA the allocator's peak; on CPU the process's peak anonymous memory (what
tensors and the allocator hold) above what it held when measuring started (the imported
libraries and the data), the figure `flatshard plan` predicts. Library code paged in when
training first runs it (file-backed pages, 5-10 MB at once, more where the kernel maps
large folios) is not training memory: the peak resident set (VmHWM) less the file-backed
and shared pages resident now, which only grow in a run.

Communication: the payload of every all-gather and reduce-scatter flatshard issues (each
bucket's padded size times its dtype's size), as `flatshard.comm.traffic` counts them.
"""

from __future__ import annotations

import torch

from flatshard import comm, compat


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field == "VmHWM":  # no procfs: ru_maxrss is the same peak (KiB on Linux)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return 0


def warm_up_runtime(device: torch.device) -> None:
    """Run one tiny step of everything training uses, so that what PyTorch loads lazily on
    first use (the first optimizer step alone imports ~70 MB of torch._dynamo) is part of
    the baseline rather than counted as training memory."""
    layer = torch.nn.Linear(8, 8, device=device)
    optimizer = torch.optim.AdamW(layer.parameters())
    x = torch.randn(1, 2, 4, 8, device=device)
    attended = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
    logits = layer(attended).flatten(0, 2)
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
    torch.nn.functional.cross_entropy(logits, target).backward()
    torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    optimizer.step()


class MemoryMeter:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.baseline = 0
        self.reset()

    def reset(self) -> None:
        """Start measuring from now."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:  # Linux: reset the peak resident set to the current one
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass
        self.baseline = _status_bytes("RssAnon") or _status_bytes("VmRSS")

    def peak(self) -> int:
        """Peak bytes since `reset` (above the baseline on CPU)."""
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        not_anonymous = _status_bytes("RssFile") + _status_bytes("RssShmem")
        return max(0, _status_bytes("VmHWM") - not_anonymous - self.baseline)

    def peak_resident(self) -> int:
        """The process's peak resident set, everything included (0 on CUDA)."""
        return 0 if self.cuda else _status_bytes("VmHWM")


def share_step(loss_sum: torch.Tensor, stop: bool, peak_bytes: int, world_size: int) -> dict:
    """One collective: every rank's loss, stop request, peak memory and EP all-to-all bytes,
    so every rank takes the same decisions and the metrics cover all ranks."""
    device = comm.group_device(None)
    mine = torch.tensor(
        [loss_sum.item(), float(bool(stop)), float(peak_bytes), float(comm.traffic.all_to_all)],
        dtype=torch.float64,
        device=device,
    )
    everyone = torch.empty(world_size * 4, dtype=torch.float64, device=device)
    compat.all_gather_single(everyone, mine)
    everyone = everyone.view(-1, 4).cpu()
    return {
        "loss": everyone[:, 0].mean().item(),
        "stop": bool(everyone[:, 1].max() > 0),
        "peak_mem_bytes": int(everyone[:, 2].max()),
        "all_to_all_bytes": round(everyone[:, 3].mean().item()),  # each sends what it routes
    }
