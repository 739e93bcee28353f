"""What real FSDP2 clients do, written as functions that run with either library: `lib` is
"fsdp2" or "flatshard" and picks where `fully_shard` comes from; everything else is the
same code. The flows are those of the official FSDP2 example (meta-device init,
`to_empty` + `reset_parameters`, mixed precision, explicit prefetching, resuming from
full state dicts), torchtitan's FSDP application (units found by `isinstance(m,
FSDPModule)`, gradient division turned off, a summed loss) and Lightning's checkpoints
(optimizer state loaded by position), plus the FSDP2 behaviours those clients lean on.
Each returns plain values that tests/test_fsdp2_dropin.py compares. Helpers only."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp2_behaviours import (
    DIM,
    Block,
    api,
    full_weights,
    global_mean,
    inputs,
    mine,
    net,
    plain_loss,
    shard_net,
    train,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import flatshard

VOCAB, SEQ = 64, 8


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    @property
    def wqkv(self):
        return self.wq, self.wk, self.wv

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in self.wqkv)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))

    def reset_parameters(self):
        for module in (self.attention_norm, self.ffn_norm, self.attention, self.w1, self.w2):
            module.reset_parameters()


class Transformer(nn.Module):
    """The shape of the FSDP2 example's toy model: embeddings, layers, norm, output head;
    each module initialises itself in `reset_parameters()`."""

    def __init__(self, vocab=VOCAB, dim=16, heads=4, layers=3):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(SEQ, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):
        for module in (self.tok_embeddings, self.pos_embeddings, self.norm, self.output):
            module.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()


def shard_transformer(model, lib, **kwargs):
    return shard_net(model, lib, blocks="layers", **kwargs)


def example_steps(model, steps=3, prefetch=False, optimizer=None) -> dict:
    """The example's loop: random tokens drawn on every rank after init, `loss.sum()`,
    clipping, Adam."""
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        if prefetch:
            model.unshard()
        tokens = torch.randint(0, VOCAB, (2, SEQ))
        loss = model(tokens).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss))
    return {"losses": losses, "weights": full_weights(model), "optimizer": optimizer}


def _prefetch(model, forward=2, backward=2):
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + forward])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - backward) : i][::-1])


def example_fresh_run(lib, mixed_precision=False, prefetch=False) -> dict:
    """Meta init, fully_shard, FSDPModule checks, to_empty, reset_parameters, train."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    kwargs = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    shard_transformer(model, lib, **kwargs)
    assert isinstance(model, Transformer) and isinstance(model, FSDPModule)
    if prefetch:
        _prefetch(model)
    model.to_empty(device="cpu")
    model.reset_parameters()
    gathered = []  # the example's inspect_mixed_precision: on a block, and on the root's group
    for module, params in ((model.layers[0], lambda: model.layers[0].parameters()),
                           (model, lambda: (model.output.weight, model.norm.weight))):  # fmt: skip
        module.unshard()
        gathered.append(sorted({(isinstance(p, DTensor), str(p.dtype)) for p in params()}))
        module.reshard()
    gathered.append(sorted({isinstance(p, DTensor) for p in model.parameters()}))
    result = example_steps(model, prefetch=prefetch)
    result["gathered_dtypes"] = gathered
    result.pop("optimizer")
    # the ranks' generators after init and training: where a same-seed batch comes from
    result["rng"] = torch.rand(4)
    result["bf16"] = mixed_precision
    return result


def _full_optimizer_state(model, optimizer) -> dict:
    """The example's own gather of optimizer state: `full_tensor()` of each DTensor."""
    state = optimizer.state_dict()
    full = {
        pid: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()}
        for pid, s in state["state"].items()
    }
    return {"param_groups": state["param_groups"], "state": full}


def example_resume(lib, dcp_api: bool) -> dict:
    """A run saves full model and optimizer state; a new process group's model, still on
    meta, loads them as the example does (DCP's state-dict API with broadcast from rank 0,
    or `distribute_tensor` by the parameters' own placements) and trains on."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(0)
    first = shard_transformer(Transformer(), lib)
    run = example_steps(first, steps=2)
    full_model = run["weights"]
    full_optim = _full_optimizer_state(first, run["optimizer"])
    with torch.device("meta"):
        model = Transformer()
    shard_transformer(model, lib)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    if dcp_api:
        sent = full_model if dist.get_rank() == 0 else {}
        set_model_state_dict(model, sent, options=options)
    else:
        sharded = {}
        for name, param in model.state_dict().items():
            value = distribute_tensor(full_model[name], param.device_mesh, param.placements)
            sharded[name] = nn.Parameter(value)
        model.load_state_dict(sharded, strict=False, assign=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if dcp_api:
        full = get_optimizer_state_dict(
            first, run["optimizer"], options=StateDictOptions(full_state_dict=True)
        )
        sent = full if dist.get_rank() == 0 else {}
        set_optimizer_state_dict(model, optimizer, sent, options=options)
    else:
        _init_optim_state(optimizer)
        state = optimizer.state_dict()
        for pid, param_state in state["state"].items():
            for key, value in full_optim["state"][pid].items():
                if isinstance(param_state[key], DTensor):
                    mesh, placements = param_state[key].device_mesh, param_state[key].placements
                    param_state[key] = distribute_tensor(value, mesh, placements)
                else:
                    param_state[key] = value
        optimizer.load_state_dict(state)
    result = example_steps(model, steps=2, optimizer=optimizer)
    result.pop("optimizer")
    return result


def torchtitan_sum_loss(lib) -> dict:
    """torchtitan with EP (or a summed loss): every FSDP unit, found by isinstance, divides
    by 1, the loss is summed over the global batch and scaled by its token count."""
    model = net()
    fully_shard, _ = api(lib)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    norms = []

    def loss(model, x, i):
        out = model(x).pow(2).sum() / (x.numel() * dist.get_world_size())
        out.backward(retain_graph=True)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor().item())
        model.zero_grad()
        return out * dist.get_world_size()  # the global mean, as the losses are compared

    result = train(model, loss, optim=torch.optim.SGD)
    return {**result, "norms": norms}


def optimizer_state_by_position(lib) -> dict:
    """Lightning's single-file checkpoint: `optimizer.state_dict()` saved; a new model is
    sharded and moved with `.to()`, and its optimizer loads that state by parameter
    position (a LayerNorm's weight and bias have one shape: swapped, nothing would say)."""
    fully_shard, _ = api(lib)

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model.to("cpu")

    model = build(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = train(model, plain_loss, steps=2, optimizer=optimizer)
    again = build(1)
    set_model_state_dict(again, first["weights"], options=StateDictOptions(full_state_dict=True))
    names = [name for name, _ in again.named_parameters()]
    optimizer_again = torch.optim.Adam(again.parameters(), lr=1e-2)
    optimizer_again.load_state_dict(optimizer.state_dict())
    result = train(again, plain_loss, steps=2, optimizer=optimizer_again)
    return {**result, "names": names, "first": first["losses"]}


def full_state_into_meta_model(lib) -> dict:
    """FSDP2's documented loading flow: `set_model_state_dict(full, full_state_dict=True)`
    into a model still on the meta device (no `to_empty`)."""
    weights = full_weights(net(seed=3))
    with torch.device("meta"):
        model = net()
    shard_net(model, lib)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    return train(model, plain_loss)


def converted_to_float64(lib) -> dict:
    """`model.to(torch.float64)` after fully_shard: FSDP2 converts the shards and trains on
    in float64."""
    model = shard_net(net(), lib)
    model.to(torch.float64)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})

    def loss(model, x, i):
        return model(x.double()).pow(2).mean()

    return {**train(model, loss), "dtypes": dtypes}


def unsharded_between_forward_and_backward(lib) -> dict:
    """With `reshard_after_forward=False` the unsharded parameters stay registered from
    forward to backward (plain tensors): a loss may read a weight outside forward."""
    from torch.distributed.tensor import DTensor

    model = shard_net(net(), lib, reshard_after_forward=False)
    kinds = []
    kind = lambda: sorted({isinstance(p, DTensor) for p in model.parameters()})  # DTensor?

    def loss(model, x, i):
        out = model(x).pow(2).mean()
        kinds.append(kind())
        return out + 1e-2 * model.out.weight.pow(2).sum()  # the head, read again

    result = train(model, loss)
    return {**result, "between": kinds[0], "after_step": kind()}


def reduce_dtype_unset(lib) -> dict:
    """`MixedPrecisionPolicy(param_dtype=bf16)` with no reduce dtype: gradients reduce in
    bf16 (the compute dtype), also after accumulating without sync."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = shard_net(net(), lib, mp_policy=policy)

    def loss(model, x, i):
        first, second = x.chunk(2)
        model.set_requires_gradient_sync(False)
        (model(first).pow(2).mean() / 2).backward()
        model.set_requires_gradient_sync(True)
        return model(second).pow(2).mean() / 2

    return {**train(model, loss), "bf16": True}


def all_reduce_hook(lib) -> dict:
    """`set_all_reduce_hook` on every unit sees each reduced gradient (here it halves it,
    as a replica average of two identical replicas would)."""
    model = shard_net(net(), lib)
    seen = []

    def hook(reduced):
        seen.append(str(reduced.dtype))
        reduced.mul_(0.5)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
    result = train(model, plain_loss, optim=torch.optim.SGD)
    return {**result, "hooked": bool(seen), "dtypes": sorted(set(seen))}


class FailingBlock(Block):
    fail = False

    def forward(self, x):
        if FailingBlock.fail:
            raise ValueError("a failing forward")
        return super().forward(x)


def reset_after_failure(lib) -> dict:
    """A forward that raises in the middle of the model, `reset_iter_state()` on the root,
    and training goes on as if the failed iteration never happened."""
    model = net()
    model.blocks[1].__class__ = FailingBlock
    shard_net(model, lib)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    FailingBlock.fail = True
    try:
        model(mine(inputs(1)[0])).sum().backward()
    except ValueError:
        model.reset_iter_state()
    finally:
        FailingBlock.fail = False
    return train(model, plain_loss, optimizer=optimizer)


def spmd_mesh_dims(lib) -> dict:
    """torch 2.13's `fully_shard(mesh=whole_mesh, dp_mesh_dims=...)` with the parameters
    DTensors replicated on the mesh, against the plain mesh's run."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    fully_shard, _ = api(lib)
    DataParallelMeshDims = flatshard.DataParallelMeshDims  # FSDP2's, or ours before torch 2.13
    world = flatshard.ParallelDims(dist.get_world_size(), dp_replicate=2).build().world
    mesh = world["dp_replicate", "dp_shard"]
    dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    model = net()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            value = distribute_tensor(param.detach(), mesh, [Replicate(), Replicate()])
            module._parameters[name] = nn.Parameter(value)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    placements = sorted({str(p.placements) for p in model.parameters()})
    return {**train(model, plain_loss), "placements": placements}


DROPIN = {
    fn.__name__: fn
    for fn in (
        torchtitan_sum_loss, optimizer_state_by_position, full_state_into_meta_model,
        converted_to_float64, unsharded_between_forward_and_backward, reduce_dtype_unset,
        all_reduce_hook, reset_after_failure, spmd_mesh_dims,
    )
}  # fmt: skip
EXAMPLE = {
    "fresh": lambda lib: example_fresh_run(lib),
    "fresh_bf16_prefetch": lambda lib: example_fresh_run(lib, True, True),
    "resume_dcp_api": lambda lib: example_resume(lib, dcp_api=True),
    "resume_distribute_tensor": lambda lib: example_resume(lib, dcp_api=False),
}


def run(name: str, lib: str):
    if name in EXAMPLE:
        return EXAMPLE[name](lib)
    return DROPIN[name](lib)
