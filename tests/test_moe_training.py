"""Training the MoE model with 1-D `fully_shard` (ZeRO-2/3) equals one process (fp32): losses
and final weights, with the auxiliary load-balancing loss in the loss."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import batches, full_state, rel_diff, rel_losses, shard, train

import flatshard
from flatshard.models import MoE, MoEConfig, load_balancing_loss, update_score_bias

TOLERANCE = 1e-6
STEPS = 3
# large enough that the auxiliary loss moves the router visibly within three steps
AUX_COEF = 0.1


def moe_loss(model, tokens: torch.Tensor, group=None, bias_rate=0.0) -> torch.Tensor:
    """Next-token cross-entropy plus the weighted load-balancing loss; `group`: the ranks
    that split the batch (None in one process). With `bias_rate`, the correction biases
    move after the forward (they steer only the next forward's choices, no gradient)."""
    logits, stats = model(tokens[:, :-1], return_router_stats=True)
    if bias_rate:
        update_score_bias(model, stats, bias_rate, group)
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return lm + model.config.aux_loss_coef * load_balancing_loss(stats, group)


def _compare(
    zero_stage, style="qwen3_moe", overrides=None, meta_init=False, aux_group=True, bias_rate=0.0
):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MoEConfig.tiny(style, aux_loss_coef=AUX_COEF, **(overrides or {}))
    data = batches(cfg, STEPS)

    torch.manual_seed(0)
    reference = MoE(cfg)
    ref_losses = train(reference, data, loss_fn=partial(moe_loss, bias_rate=bias_rate))

    if meta_init:
        with torch.device("meta"):
            model = MoE(cfg)
    else:
        torch.manual_seed(0)
        model = MoE(cfg)
    shard(model, zero_stage)
    if meta_init:
        torch.manual_seed(0)
        flatshard.materialize(model)
    group = dist.group.WORLD if aux_group else None
    loss_fn = partial(moe_loss, group=group, bias_rate=bias_rate)
    losses = train(model, data, rank=rank, world=world, loss_fn=loss_fn)
    # buffers are in both state dicts; report how far each moved from zero
    saved = reference.state_dict()  # (not the routers' counts since the last update)
    buffers = {n: b.abs().sum().item() for n, b in reference.named_buffers() if n in saved}
    return (
        rel_losses(losses, ref_losses),
        rel_diff(full_state(model), reference.state_dict()),
        buffers,
    )


def _check(results):
    for loss_error, weight_error, _ in results:
        assert loss_error <= TOLERANCE, results
        assert weight_error <= TOLERANCE, results


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_matches_single_process(world_size, zero_stage):
    _check(run_distributed(_compare, world_size, zero_stage))


def test_deepseek_style_meta_init_and_loop_experts():
    """Sigmoid scores with a correction bias (a buffer, moved every step by the global
    counts), a shared expert, the first layer dense, per-expert loop compute, built on the
    meta device and materialised."""
    results = run_distributed(
        _compare, 2, 3, "deepseek_v3", {"expert_compute": "loop"}, meta_init=True, bias_rate=0.05
    )
    _check(results)
    for _, _, buffers in results:
        assert list(buffers) == ["layers.1.mlp.gate.e_score_correction_bias"]
        assert buffers["layers.1.mlp.gate.e_score_correction_bias"] > 0  # it moved


def test_local_aux_loss_would_differ():
    """The comparison sees the aux loss: computed per rank (no group) it is not the global
    batch's, and sharded training no longer equals one process."""
    results = run_distributed(_compare, 2, 3, aux_group=False)
    assert all(loss > 1e-5 and weights > 1e-4 for loss, weights, _ in results), results


class _Rows:
    """A step's data as the trainer reads it: every target labelled, or no labels at all."""

    def __init__(self, tokens: torch.Tensor, labelled: bool):
        self.tokens, self.labelled = tokens, labelled

    def batch(self, first: int, count: int) -> torch.Tensor:
        return self.tokens[first : first + count]

    def labels(self, position: int, count: int):
        return self.tokens[position : position + count, 1:] if self.labelled else None

    def positions(self, first: int, count: int):
        return None


def test_labelled_micro_batches_weigh_the_balancing_loss_as_plain_ones():
    """The trainer's step over 2 micro-batches of chat data whose every target is labelled
    gives the gradients and loss of the same tokens as plain text: the load-balancing term
    weighs 1/2 per micro-batch either way (it weighed 1 with labels, twice the weight)."""
    from types import SimpleNamespace

    from flatshard.cli.train import accumulate_gradients

    cfg = MoEConfig.tiny("qwen3_moe", aux_loss_coef=AUX_COEF)
    tokens = batches(cfg, 1)[0][:2]
    train = SimpleNamespace(global_batch=2, micro_batch=1, zero_stage=3)
    results = []
    for labelled in (False, True):
        torch.manual_seed(0)
        model = MoE(cfg)
        loss, _ = accumulate_gradients(model, _Rows(tokens, labelled), 0, train, 0, 1, "cpu")
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (chat, chat_grads) = results
    assert abs(chat - plain) <= 1e-6 * plain
    assert rel_diff(chat_grads, plain_grads) <= 1e-6
