"""What every section of the device check (`scripts/gpu_check.py`) shares: the sizes, the
`Check` (device, models, data, a training loop, timing and memory), and the profiler's
view of a step."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # flatshard from the checkout (no install on the GPU machine)
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (config, micro batch, sequence length) per size, for the GPU and for the CPU dry run
SIZES = {
    "gpu": {
        "35m": (dict(vocab_size=12000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                     ffn_dim=1376, max_seq_len=2048), 8, 512),
        "activations": (dict(vocab_size=12000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                             ffn_dim=1376, max_seq_len=2048), 8, 2048),
        "1b": (dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                    ffn_dim=5632, max_seq_len=2048), 4, 2048),
        # Llama-3-8B's shapes, 4 of its 32 layers (1.9B parameters with the vocabulary)
        "8b": (dict(vocab_size=128256, dim=4096, n_layers=4, n_heads=32, n_kv_heads=8,
                    ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0), 1, 8192),
    },
    "cpu": {
        "35m": (dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                     max_seq_len=64), 2, 16),
        "activations": (dict(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                             ffn_dim=48, max_seq_len=64), 2, 32),
        "1b": (dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                    max_seq_len=64), 2, 16),
        "8b": (dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                    max_seq_len=64, rope_theta=500000.0), 1, 32),
    },
}  # fmt: skip
STEPS, WARMUP = 4, 1
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense, SXM


class Check:
    """What every section shares: the device, the sizes, the report."""

    def __init__(self, device: torch.device, sizes: dict):
        self.device, self.sizes, self.report = device, sizes, {}
        self.cuda = device.type == "cuda"
        # what compile=True compiles with: inductor on the GPU; the CPU dry run traces the
        # same graphs (dynamo, AOT autograd) without inductor's C++ code generation, which
        # the GPU never runs and which took most of the dry run's time (test_compile.py
        # covers it)
        self.compile_backend = "inductor" if self.cuda else "aot_eager"

    def model(self, size: str, seed: int = 0):
        from flatshard.models import Llama, LlamaConfig

        torch.manual_seed(seed)
        with torch.device("meta"):
            model = Llama(LlamaConfig(**self.sizes[size][0]))
        return model

    def data(self, size: str, steps: int = STEPS + WARMUP):
        cfg, batch, seq = self.sizes[size]
        generator = torch.Generator().manual_seed(1)
        shape = (batch, seq + 1)
        return [
            torch.randint(0, cfg["vocab_size"], shape, generator=generator) for _ in range(steps)
        ]

    def sharded(self, size: str, device=None, **options):
        """The `size` Llama through `flatshard.parallelize` at world 1 on `device`."""
        import flatshard

        device = device or self.device
        model = self.model(size)
        dims = flatshard.ParallelDims(1)
        if options.get("compile") is True:
            options["compile"] = self.compile_backend
        flatshard.parallelize(model, dims.build(device.type), **options)
        torch.manual_seed(0)
        flatshard.materialize(model, device)
        return model

    def fsdp2(self, size: str = "1b", ac=None, compile: bool = False):
        """The `size` Llama in bf16 under PyTorch FSDP2 (per block and the root), its blocks
        checkpointed by flatshard's AC wrapper and compiled as flatshard's are, on request."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from flatshard.api.activation_checkpointing import checkpoint_block
        from flatshard.models import Llama, LlamaConfig

        torch.manual_seed(0)
        with torch.device(self.device):
            model = Llama(LlamaConfig(**self.sizes[size][0]))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            if ac is not None:
                checkpoint_block(block, ac)
            fully_shard(block, mp_policy=policy)
            if compile:  # FSDP2's hooks are skipped by dynamo: whole block graphs
                block.compile(backend=self.compile_backend)
        fully_shard(model, mp_policy=policy)
        return model

    def train(self, model, size: str, device=None, steps: int = STEPS + WARMUP,
              optimizer=None) -> dict:  # fmt: skip
        """Losses and step times (after WARMUP) of optimizer steps (default: torch's AdamW) on
        the fixed data."""
        device = device or self.device
        optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, times = [], []
        for tokens in self.data(size, steps):
            tokens = tokens.to(device)
            self.sync()
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            self.sync()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        return {"losses": losses, "step_s": statistics.median(times[WARMUP:])}

    @contextlib.contextmanager
    def deterministic(self):
        """Bitwise-repeatable kernels (a GPU's embedding backward adds atomically, in any
        order): for the sections that compare runs bitwise."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch.use_deterministic_algorithms(True, warn_only=True)
        filling = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False  # not a cost to time
        try:
            with sdpa_kernel(SDPBackend.MATH):  # the fused attention backwards add atomically
                yield
        finally:
            torch.use_deterministic_algorithms(False)
            torch.utils.deterministic.fill_uninitialized_memory = filling

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        gc.collect()  # models of earlier runs (their reference cycles) go first
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_flops(self) -> float | None:
        """The device's dense bf16 peak (None: not a GPU of PEAK_BF16_FLOPS)."""
        if not self.cuda:
            return None
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None


def _max_rel(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))


def _profile_step(check: Check, model, size: str, rows: int = 12) -> list | None:
    """The device time of one step by kernel (copies included), largest first."""
    if not check.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    tokens = check.data(size, 1)[0].to(check.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        check.sync()
    model.zero_grad()
    events = prof.key_averages()

    def device_us(event):
        return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)

    top = sorted(events, key=device_us, reverse=True)[:rows]
    found = [{"name": e.key[:80], "device_ms": device_us(e) / 1e3, "count": e.count,
              "cpu_ms": e.cpu_time_total / 1e3} for e in top]  # fmt: skip
    step_cpu = max((e.cpu_time_total for e in events), default=0)
    found.append({"name": "largest cpu total", "cpu_ms": step_cpu / 1e3})
    return found + [{"name": "copy/compute overlap", **_copy_overlap(prof.events())}]


def _copy_overlap(events) -> dict:
    """Device milliseconds of host<->device copies, of kernels, and of copies that ran while
    a kernel ran (how much of activation offload the compute hides)."""

    def merged(spans):
        out = []
        for start, end in sorted(spans):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    copies, kernels = [], []
    for event in events:
        if str(getattr(event, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        span = (event.time_range.start, event.time_range.end)
        is_copy = "Memcpy HtoD" in event.name or "Memcpy DtoH" in event.name
        (copies if is_copy else kernels).append(span)
    copies, kernels = merged(copies), merged(kernels)
    hidden = sum(max(0, min(c[1], k[1]) - max(c[0], k[0])) for c in copies for k in kernels)
    total = sum(end - start for start, end in copies)
    return {
        "copy_ms": total / 1e3,
        "kernel_ms": sum(end - start for start, end in kernels) / 1e3,
        "copy_hidden_ms": hidden / 1e3,
        "copy_hidden_fraction": hidden / max(1, total),
    }
