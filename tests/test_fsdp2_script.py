"""One FSDP2 training script, run with PyTorch's FSDP2 and with flatshard by changing only
where `fully_shard` and `register_fsdp_forward_method` come from: a list-of-modules unit
(torchtitan's `[tok_embeddings, norm, output]`), `ignored_params`, a forward method other
than `forward` and `reshard_after_forward=2` at world 4. Losses and weights must agree."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_distributed
from reference import adamw, batches, config, full_state, mean_over_ranks, rank_slice, rel_diff

from flatshard.models import Llama


class Scored(Llama):
    def score(self, tokens):  # reaches the parameters without forward
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _script(framework: str):
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    else:
        from flatshard import fully_shard, register_fsdp_forward_method
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Scored(config())
    ignored = {model.layers[0].attn_norm.weight}
    fully_shard([model.embed_tokens, model.norm, model.lm_head])
    for block in model.layers:  # hpZ: backward gathers inside pairs of ranks
        fully_shard(block, ignored_params=ignored, reshard_after_forward=2)
    fully_shard(model, reshard_after_forward=2)
    register_fsdp_forward_method(model, "score")
    optimizer = adamw(model.parameters())
    losses = []
    for tokens in batches(config(), 4):
        loss = model.score(rank_slice(tokens, rank, world))
        loss.backward()
        dist.all_reduce(model.layers[0].attn_norm.weight.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss.item(), world))
    weights = full_state(model)
    weights["layers.0.attn_norm.weight"] = model.layers[0].attn_norm.weight.detach().clone()
    return losses, weights


def test_fsdp2_script_runs_the_same_on_flatshard():
    theirs = run_distributed(_script, 4, "fsdp2")[0]
    ours = run_distributed(_script, 4, "flatshard")[0]
    assert max(abs(a - b) / b for a, b in zip(ours[0], theirs[0])) <= 1e-6
    assert rel_diff(ours[1], theirs[1]) <= 1e-6
