"""DTensor integration: flatshard's uneven `Shard(0)` pieces as ordinary DTensors.

row_shard.py        the local tensor of every flatshard DTensor (carries its ShardSpec;
                    answers DCP's chunk questions; routes redistribution)
full_state_dict.py  loading full state dicts into row pieces
optimizer_check.py  an optimizer built before fully_shard is caught
patches.py          every change to PyTorch's behaviour, installed once
"""
