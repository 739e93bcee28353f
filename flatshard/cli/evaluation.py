"""Evaluation on held-out tokens: the mean next-token loss and its perplexity.

The held-out data is read in order (the first `train.eval_sequences` windows, or records of
chat data, whose prompts carry no loss); the data-parallel ranks share them in
micro-batches, the token losses are summed in float64, and one all-reduce adds every rank's
(loss sum, token count). The result is the
same mean over the same tokens at any world size and layout (ranks that hold the same
batch, TP peers, add the same sums to both). Every rank runs the same number of forwards
(a rank past the last window runs a weightless one): each forward gathers weights with the
other ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flatshard import comm
from flatshard.data.sequences import IGNORE
from flatshard.models.registry import model_inputs, position_kwargs


class Evaluation:
    """`sequences`: a SequenceOrder or RecordOrder of the held-out data, read in data order."""

    def __init__(self, sequences, max_sequences: int):
        windows = sequences.windows
        self.windows = min(windows, max_sequences) if max_sequences else windows
        self.sequences, self.seq_len = sequences, sequences.seq_len

    @staticmethod
    def due(step: int, train) -> bool:
        """Whether to evaluate after `step`: every train.eval_interval steps and after the
        last."""
        interval = train.eval_interval
        return step == train.steps or bool(interval and step % interval == 0)

    @torch.no_grad()
    def run(self, model, micro_batch: int, dp_rank: int, dp_world: int, device, cp: int = 1,
            pipe=None) -> dict:  # fmt: skip
        """{"eval_loss", "eval_perplexity", "eval_tokens"}; call on every rank (`cp`: the
        context-parallel ranks that split each window's tokens; `pipe`: the pipeline whose
        stages run the forwards, `micro_batch` rows at a time, its micro-batches')."""
        was_training = model.training
        model.eval()
        per_round = micro_batch * dp_world
        sums = torch.zeros(2, dtype=torch.float64)  # loss sum, tokens
        for first in range(0, self.windows, per_round):
            indices = [first + dp_rank * micro_batch + j for j in range(micro_batch)]
            indices = [i if i < self.windows else -1 for i in indices]  # -1: weightless
            rows = [self.sequences.row(max(i, 0)) for i in indices]
            batch = torch.from_numpy(np.stack([tokens for tokens, _ in rows])).to(device)
            targets = [batch[j, 1:].cpu() if rows[j][1] is None else torch.from_numpy(rows[j][1])
                       for j in range(len(rows))]  # fmt: skip
            targets = torch.stack(targets)
            for j, index in enumerate(indices):
                if index < 0:  # a weightless forward: the others gather with it
                    targets[j] = IGNORE
            packed = self._positions(indices, device)
            inputs, targets, positions = model_inputs(model, batch, targets.to(device), packed)
            if pipe is not None:  # every stage's rank gets the last stage's sum
                pipe.loss_fn.divisor = 1.0
                stage_inputs = {} if packed is None else {"position_ids": packed}
                sums[0] += pipe.evaluate(inputs, targets, **stage_inputs).double().cpu()
            else:
                output = model(inputs, **position_kwargs(model, positions))
                logits = getattr(output, "logits", output)  # transformers: an output object
                losses = F.cross_entropy(
                    logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                    reduction="none",
                )  # fmt: skip
                sums[0] += losses.double().sum().cpu()
            sums[1] += float((targets != IGNORE).sum())
        model.train(was_training)
        if dist.is_initialized():
            sums = sums.to(comm.group_device(None))
            dist.all_reduce(sums)
        loss = float(sums[0] / sums[1])
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_tokens": round(float(sums[1])) // _replicas(dp_world * cp),
        }

    def _positions(self, indices: list[int], device) -> torch.Tensor | None:
        """The position ids of these rows (packed conversations), None for plain positions."""
        rows = [self.sequences.row_positions(max(i, 0)) for i in indices]
        return None if rows[0] is None else torch.from_numpy(np.stack(rows)).to(device)


def _replicas(token_ranks: int) -> int:
    """How many ranks computed each token (TP peers share one data-parallel batch, and
    so do a pipeline's stages, each given its last stage's sum; CP ranks split it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return max(1, world // token_ranks)
