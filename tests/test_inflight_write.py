"""A write to the sharded weights while their all-gather is in flight (an optimizer step,
a load or a user edit after `unshard(async_op=True)`) must reach the next forward: the
gathered copy reflects the weights as of the gather's start, so it is gathered again."""

from __future__ import annotations

import torch
from distributed import run_distributed
from reference import build_model, config, full_state, shard

from flatshard.models import Llama

TOKENS = torch.arange(2 * 8).remainder(61).view(2, 8)


def _forward_after_inflight_write(write: str, zero_stage: int, wait: bool):
    model = shard(build_model(config()), zero_stage=zero_stage)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(TOKENS).sum().backward()  # gradients for the optimizer step, a warm run
    handles = [layer.unshard(async_op=True) for layer in model.layers]
    handles.append(model.unshard(async_op=True))
    if write == "optimizer":
        optimizer.step()
    else:  # a user's in-place edit of the sharded parameters
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.5)
    if wait:
        for handle in handles:
            handle.wait()
    # else: forward itself waits for the gathers in flight (FSDP2's overlap pattern)
    with torch.no_grad():
        ours = model(TOKENS)
    reference = Llama(config())  # the weights as they are now, in one process
    reference.load_state_dict(full_state(model))
    with torch.no_grad():
        expected = reference(TOKENS)
    return ((ours - expected).norm() / expected.norm()).item()


def test_write_while_gather_in_flight_reaches_forward():
    for write in ("optimizer", "edit"):
        for zero_stage in (1, 3):
            for wait in (True, False):
                case = (write, zero_stage, wait)
                errors = run_distributed(_forward_after_inflight_write, 2, *case)
                assert max(errors) < 1e-6, (case, errors)
