"""RL between updates: move the training state to the host while an inference engine runs,
stream the full weights into it, bring the state back.

    torchrun --nproc-per-node 2 examples/rl_offload.py
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
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(0, model.config.vocab_size, (4, 33))
F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
optimizer.step()
optimizer.zero_grad()

# the new weights, a bucket at a time, in Hugging Face names (rank 0 receives them)
received = {name: t.clone() for name, t in flatshard.full_weights(model, to_rank=0)}
moved = flatshard.offload_states(model, optimizer, pin_memory=False)  # rollouts run now
flatshard.reload_states(model, optimizer)
if dist.get_rank() == 0:
    print(f"{len(received)} tensors streamed; {moved / 2**20:.2f} MiB per rank offloaded and back")
dist.destroy_process_group()
