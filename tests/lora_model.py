"""The tiny models of the tensor-subclass tests: blocks of a norm and two linears (plain, or
a frozen base plus trainable LoRA adapters) and a head, their training loop (losses, the
trainable weights in full, the bytes all-gathered per step) and a counter of all-gathers."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard.comm import collectives


class LoRALinear(nn.Module):
    """A frozen (quantized) base linear plus a trainable low-rank update."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, linear):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = linear(dim, hidden)
        self.down = linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int, classes: int, linear):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden, linear) for _ in range(blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def qlora_model(dim: int, hidden: int, blocks: int, classes: int, quantize) -> Model:
    """Seeded LoRA blocks whose bases are `quantize(weight)`, frozen."""
    torch.manual_seed(0)
    model = Model(dim, hidden, blocks, classes, LoRALinear)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            weight = quantize(module.base.weight.detach())
            module.base.weight = nn.Parameter(weight, requires_grad=False)
    return model


def base_weights(module: nn.Module) -> list:
    return [m.base.weight for m in module.modules() if isinstance(m, LoRALinear)]


def batch(step: int, rank: int, world: int, size: int, dim: int, classes: int):
    """This rank's share of step `step`'s batch (the same batch at every world size)."""
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size, dim, generator=generator)
    y = torch.randint(0, classes, (size,), generator=generator)
    rows = slice(rank * size // world, (rank + 1) * size // world)
    return x[rows], y[rows]


def train(model: Model, rank: int, world: int, steps: int, size: int):
    """AdamW on the trainable parameters: (mean losses, full trainable weights, bytes
    all-gathered in each step)."""
    dim, classes = model.head.in_features, model.head.out_features
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=1e-2)
    losses, gathered = [], []
    for step in range(steps):
        x, y = batch(step, rank, world, size, dim, classes)
        before = collectives.traffic.all_gather
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        gathered.append(collectives.traffic.all_gather - before)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
        for n, p in trainable.items()
    }
    return losses, weights, gathered


@contextlib.contextmanager
def all_gather_sizes():
    """The bytes of every all-gather flatshard issues inside the block, in order."""
    sizes = []
    original = collectives.Collectives.all_gather

    def counted(self, output, shard, pieces=None):
        sizes.append(output.numel() * output.element_size())
        return original(self, output, shard, pieces)

    collectives.Collectives.all_gather = counted
    try:
        yield sizes
    finally:
        collectives.Collectives.all_gather = original
