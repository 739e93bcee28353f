"""A plain training loop with `fully_shard`, as with PyTorch FSDP2: each block, then the root.

torchrun --nproc-per-node 2 examples/train_fully_shard.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard
from flatshard.models import Llama, LlamaConfig

dist.init_process_group("gloo")  # "nccl" on GPUs
torch.manual_seed(0)  # the same weights on every rank before sharding
model = Llama(LlamaConfig.tiny())
# bf16 compute and gathers, fp32 gradient reduction and fp32 main weights
policy = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.layers:  # bottom-up, as with FSDP2
    flatshard.fully_shard(block, mp_policy=policy)
flatshard.fully_shard(model, mp_policy=policy)
# after wrapping; any torch.optim optimizer works, flatshard's steps the flat shards
optimizer = flatshard.optim.AdamW(model.parameters(), lr=3e-3)

generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batch
for step in range(5):
    tokens = torch.randint(0, model.config.vocab_size, (4, 33), generator=generator)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()  # gradients reduce-scattered into each rank's shard
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
