"""Long sequences: context parallelism (each sequence split over CP ranks, attention over the
whole) with tensor and sequence parallelism.

    torchrun --nproc-per-node 4 examples/long_context.py
"""

import torch
import torch.distributed as dist

import flatshard
from flatshard.models import Llama, LlamaConfig
from flatshard.models.registry import next_token_loss

dist.init_process_group("gloo")
dims = flatshard.ParallelDims(dist.get_world_size(), cp=2, tp=2, sequence_parallel=True)
meshes = dims.build()
torch.manual_seed(0)
model = flatshard.parallelize(Llama(LlamaConfig.tiny(ffn_dim=48, max_seq_len=512)), meshes)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
generator = torch.Generator().manual_seed(meshes.dp_rank)  # CP and TP ranks share a batch
for step in range(3):
    tokens = torch.randint(0, model.config.vocab_size, (2, 257), generator=generator)
    loss = next_token_loss(model, tokens)  # this rank's part of each sequence, its positions
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f} (this rank's 128 of 256 tokens)")
dist.destroy_process_group()
