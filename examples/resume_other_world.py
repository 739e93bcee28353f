"""A checkpoint saved at one world size resumes at another: DCP files resharded on load.

torchrun --nproc-per-node 2 examples/resume_other_world.py save CKPT_DIR
torchrun --nproc-per-node 1 examples/resume_other_world.py load CKPT_DIR
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard
from flatshard import checkpoint
from flatshard.models import Llama, LlamaConfig

action, path = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = flatshard.parallelize(
    Llama(LlamaConfig.tiny()), flatshard.ParallelDims(dist.get_world_size())
)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(
    0, model.config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1)
)


def loss_of(batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


if action == "save":
    for _ in range(2):
        loss_of(tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint.save(path, model=model, optimizer=optimizer, step=2)
else:  # weights and AdamW state, resharded to this world size
    loaded = checkpoint.load(path, model=model, optimizer=optimizer)
    print(f"resumed at step {loaded.step} of a run on {loaded.world_size} rank(s)")
with torch.no_grad():
    loss = loss_of(tokens).item()
if dist.get_rank() == 0:
    print(f"loss after 2 steps: {loss:.6f}")
dist.destroy_process_group()
