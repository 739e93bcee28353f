"""`flatshard.parallelize`: tensor parallelism on attention, experts split over EP ranks, FSDP
over the rest, from one `ParallelDims`.

    torchrun --nproc-per-node 4 examples/parallelize_tp_ep.py
"""

import torch
import torch.distributed as dist

import flatshard
from flatshard.models import MoE, MoEConfig
from flatshard.models.registry import training_loss

dist.init_process_group("gloo")
dims = flatshard.ParallelDims(dist.get_world_size(), tp=2, ep=2)
meshes = dims.build()
with torch.device("meta"):  # no rank ever holds the whole model
    model = MoE(MoEConfig.tiny())
flatshard.parallelize(model, meshes)
torch.manual_seed(0)
flatshard.materialize(model, torch.device("cpu"))  # the same weights as an eager build
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

# the TP ranks of a data-parallel rank share its batch
generator = torch.Generator().manual_seed(meshes.dp_rank)
for step in range(3):
    tokens = torch.randint(0, model.config.vocab_size, (4, 33), generator=generator)
    loss = training_loss(model, tokens)  # next-token loss + the load-balancing loss
    loss.backward()
    flatshard.clip_grad_norm_(model.parameters(), 1.0)  # experts and dense on two meshes
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
