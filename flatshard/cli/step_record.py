"""What a training run records of each step (metrics.jsonl, the progress line, TensorBoard),
and where its random draws come from."""

from __future__ import annotations

import torch

from flatshard import comm


def step_record(trainer, shared: dict, lr: float, labelled: int | None, step_s: float,
                elapsed_s: float, offloaded: tuple[int, int]) -> dict:  # fmt: skip
    """The record of the step `trainer` just took: `shared` (what every rank agreed on: the
    loss, gradient norm, peak memory, all-to-all bytes, whether to stop), the step's lr,
    its labelled targets (None: all), its and the run's seconds, and this rank's optimizer
    bytes offloaded (host, disk). Takes the step's collective bytes from the counters."""
    train = trainer.config.train
    moved = comm.traffic.take()
    tokens = train.global_batch * trainer.config.data.seq_len
    return {
        "step": trainer.step,
        "loss": shared["loss"],
        "lr": lr,
        "grad_norm": shared["grad_norm"],
        "tokens": trainer.step * tokens,
        **({} if labelled is None else {"loss_tokens": labelled}),
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "elapsed_s": elapsed_s,
        "peak_mem_bytes": shared["peak_mem_bytes"],
        "peak_rss_bytes": trainer.memory.peak_resident(),
        "all_gather_bytes": moved.all_gather,
        "reduce_scatter_bytes": moved.reduce_scatter,
        "replica_all_reduce_bytes": moved.all_reduce,
        # pipeline stages' tied embedding (the first stage's: `flatshard plan`'s alike)
        "tied_embedding_bytes": moved.tied_embedding,
        # expert parallelism: the mean over ranks (each sends what its router chose)
        "all_to_all_bytes": shared["all_to_all_bytes"],
        "comm_bytes": moved.all_gather + moved.reduce_scatter + moved.all_reduce
        + moved.tied_embedding,
        # optimizer offload (this rank's): weights, gradients and state off the device
        "offload_host_bytes": offloaded[0],
        "offload_disk_bytes": offloaded[1],
        "stop": shared["stop"],
    }


def seed_random_draws(seed: int, dims, device: torch.device) -> None:
    """The run's random draws (dropout) from its seed: one stream per rank holding other
    tokens (the TP ranks of a group, which hold the same ones, drop the same features); a
    resume then restores the checkpoint's RNG state."""
    token_rank = dims.build(device.type).token_ranks.get_local_rank()
    torch.manual_seed(seed + 1 + token_rank)
