"""The public API's layer: `fully_shard` (sharding.py) and the module class it gives
(fsdp_module.py) with its communication settings (comm_settings.py), `parallelize` over a
parallel plan (parallelize.py, parallel_plan.py) with activation checkpointing and compile,
`materialize` after meta-device init, and moving a model's states off the device and back
(state_movement.py). The package face (`flatshard/__init__.py`) hands these names on."""
