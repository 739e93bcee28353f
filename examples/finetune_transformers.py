"""Fine-tune a Hugging Face causal LM in place: each rank reads only its rows of the
checkpoint, trains, and the result is saved as transformers loads it.

    torchrun --nproc-per-node 2 examples/finetune_transformers.py MODEL_DIR OUT_DIR
"""

import sys

import torch
import torch.distributed as dist
import transformers

import flatshard
from flatshard import hf
from flatshard.models.registry import next_token_loss

model_dir, out_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
dims = flatshard.ParallelDims(dist.get_world_size())
model = hf.from_pretrained(model_dir, dims=dims)  # sharded over every rank
tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
text = "Fully sharded data parallel training keeps one shard of every weight per rank. " * 8
ids = torch.tensor(tokenizer(text)["input_ids"][:65])
batches = ids.unfold(0, 33, 16)  # overlapping windows of 33 tokens
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
for step in range(3):
    batch = batches[dist.get_rank() :: dist.get_world_size()]
    loss = next_token_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
hf.save_pretrained(model, out_dir)  # every rank writes its part; transformers reads it
# every rank past the save before the group goes: on gloo a rank that tears the group down
# while a peer still finishes the save's last collective aborted in 2 of 8 runs
dist.barrier()
dist.destroy_process_group()
