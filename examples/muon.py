"""Muon on the hidden matrices, AdamW on the rest, over flat shards: each matrix
orthogonalised by one owner rank, exactly as in one process.

    torchrun --nproc-per-node 2 examples/muon.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard
from flatshard.models import Llama, LlamaConfig

dist.init_process_group("gloo")
torch.manual_seed(0)
model = flatshard.parallelize(
    Llama(LlamaConfig.tiny()), flatshard.ParallelDims(dist.get_world_size())
)
muon, rest = flatshard.optim.muon_param_groups(model)  # embeddings and the head: AdamW
optimizer = flatshard.optim.Muon(
    [muon, {**rest, "use_muon": False}], lr=2e-2, adjust_lr_fn="match_rms_adamw"
)
generator = torch.Generator().manual_seed(dist.get_rank())
for step in range(3):
    tokens = torch.randint(0, model.config.vocab_size, (4, 33), generator=generator)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
