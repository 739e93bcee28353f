"""The runtime: what `fully_shard` leaves behind and what runs every step.

flat_bucket.py     storage of one bucket: sharded main weights, unsharded buffer, gradients
unit.py            one fully_shard call: buckets, parameters, settings, explicit state
states.py          the state enums with checked transitions; what is resharded when
hooks.py           forward/backward hooks that drive a unit through a step
schedule.py        run-time order, prefetch, what stays gathered (the model's RootContext)
gather_policy.py   what is gathered when and what a lookup costs (also for plan, benchmarks)
grad_sync.py       gradient buffers, reduce-scatter, accumulation
first_use.py       a model root's first-use groups
sharded_lookup.py  an embedding looked up from its shards
"""
