"""`flatshard plan` on paper: per-rank memory, padding and communication of a model on a mesh,
from its shapes alone (nothing is allocated). `model_spec.py` describes a model as units of
parameters, `zoo.py` / `zoo_transformers.py` build one from a name or a config.json,
`activations.py` counts what a token leaves for backward, `unit_figures.py` lays each unit
out as fully_shard would, `estimate.py` adds up the memory and `communication.py` the bytes a
step moves (with `parallel_cost.py` for TP/EP, `offload_split.py`, `checkpoint_cost.py`,
`muon_cost.py`). The command line only parses and prints
(`cli/plan.py`)."""
