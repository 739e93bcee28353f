"""Each rank's measured peak memory for two steps of a pipelined reference Llama, as
`tests/test_cli_pipeline.py` compares it with `flatshard plan --pp`: run as
`torchrun --nproc-per-node 4 tests/pipeline_peaks.py SCHEDULE DIR` with
MALLOC_MMAP_THRESHOLD_=65536 (glibc returns freed blocks at once: the live peak is
measured; the test forks its ranks with that threshold set: forked_command.torchrun_forked).
Each rank writes `<pipeline rank> <bytes>` to DIR/peak-<rank>.txt, the second step's (the
first also learns shapes and the gather order), above what the rank holds before it; a file
each, as the ranks' printed lines interleave."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import flatshard
from flatshard.cli.meters import MemoryMeter, warm_up_runtime
from flatshard.cli.run_model import build_pipeline
from flatshard.models import LlamaConfig

# the sizes of test_cli_pipeline's plan: 4 micro-batches of 4 x 512 tokens per dp rank
CONFIG = dict(vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=172)
ROWS, SEQ, MICROBATCHES = 16, 512, 4


def main(schedule: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dims = flatshard.ParallelDims(dist.get_world_size(), pp=2)
    warm_up_runtime(device)
    pipe = build_pipeline(LlamaConfig(max_seq_len=SEQ, **CONFIG), zero_stage=3,
                          precision="fp32", seed=0, device=device, dims=dims,
                          schedule=schedule, microbatches=MICROBATCHES)  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.model.parameters())
    meter = MemoryMeter(device)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        tokens = torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ + 1), generator=generator)
        for stage in pipe.stages:  # what torch keeps of the last step till the next begins
            stage.clear_runtime_states()  # (the last stage's outputs, the inputs' gradients)
        meter.reset()
        pipe.loss_fn.divisor = float(ROWS * SEQ)
        pipe.step(tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = meter.peak()
    with open(os.path.join(out, f"peak-{dist.get_rank()}.txt"), "w") as handle:
        handle.write(f"{dims.build().pp_rank} {peak}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
