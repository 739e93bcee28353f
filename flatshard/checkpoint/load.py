"""`load`: verify a committed checkpoint, check it against the model, then load it (DCP
reshards to this run's world size, ZeRO stage and bucket layout)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_state_dict,
)

from flatshard.api.fsdp_module import weights_changed
from flatshard.checkpoint import commit, host_memory, manifest
from flatshard.checkpoint.save import wait_for_pending_save
from flatshard.checkpoint.state import (
    app_state,
    checkpoint_group,
    rank_and_world,
    restore_stateful,
    set_rng_state,
    tied_aliases,
)
from flatshard.dtensor import plain_state
from flatshard.dtensor.sharded_param import stored_shape
from flatshard.errors import CheckpointError


@dataclass
class LoadResult:
    """What `checkpoint.load` loaded: the step, its directory, the saving run's world size,
    the keys skipped (non-strict), whether the RNG states were restored, and the extras."""

    step: int
    path: str
    world_size: int  # of the run that saved it
    skipped: list[str] = field(default_factory=list)  # non-strict: what was not loaded
    rng_restored: bool = False
    extra: dict = field(default_factory=dict)  # loaded values of the extra names asked for


def load(
    directory: str,
    *,
    model,
    optimizer=None,
    step: int | None = None,
    strict: bool = True,
    verify: bool = True,
    trainable_only: bool = False,
    host_local: bool = False,
    **extra,
) -> LoadResult:
    """Load `step` (default: `latest`) from `directory` into `model`/`optimizer` (call on every
    rank). Pass the same extra names as to `save`, with `Stateful` objects or placeholders.

    strict: missing or unexpected keys and shape/dtype mismatches raise one error naming them
        all; with strict=False they are skipped and listed in the result.
    verify: check every file's size and CRC-32 first (each rank checks a share of them).
    trainable_only: load only the trainable parameters (a checkpoint saved with it).
    host_local: a checkpoint saved with `host_local=True` (`step` given): each rank first
        gets the files it reads from the hosts that hold them.
    """
    wait_for_pending_save()
    group = checkpoint_group()
    rank, world = rank_and_world(group)
    if host_local:
        path = host_memory.bring_shared(directory, step, group, rank)
    else:
        path = _resolve(directory, step)
    saved = manifest.read(path)
    if verify and not host_local:  # a host-local one: each rank checks what it reads
        manifest.check_intact(path, saved, group)
    differences = manifest.config_differences(
        saved.get("model_config"), manifest.model_config(model)
    )
    if differences:
        raise CheckpointError(
            f"{path} was saved from a model with a different config: " + "; ".join(differences)
        )

    state = app_state(model, optimizer, extra, trainable_only)
    if host_local:
        read = host_memory.files_read(path, state, rank)
        host_memory.bring_read(path, read, group, rank)
        if verify:
            manifest.check_intact(path, saved, group, names=read)
    reader = dcp.FileSystemReader(path)
    # a pipeline stage holds some of the model: what the others hold is not unexpected
    others = _held_by_any_rank(state, group) if getattr(model, "pipeline_stage", False) else set()
    skipped = _mismatches(state, reader.read_metadata(), strict, path, others)
    # each rank plans its own reads from the metadata: no plan crosses the network
    with warnings.catch_warnings():  # no_dist's "assuming ... a single process": not so
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    for alias in tied_aliases(model):  # loaded through the name it stands for
        state["model"].pop(alias, None)
    # trainable_only: the frozen parameters are not in the state, not missing from it
    options = StateDictOptions(strict=not skipped and not trainable_only,
                               ignore_frozen_params=trainable_only)  # fmt: skip
    if optimizer is not None:
        # the loaded values are in the optimizer's own tensors: plain ones stay plain
        plain_state.unwrap(state["optim"])
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
    else:
        set_model_state_dict(model, state["model"], options=options)
    weights_changed(model)

    rng_path = os.path.join(path, "rng", f"rank{rank}.pt")
    if os.path.exists(rng_path):
        set_rng_state(torch.load(rng_path, weights_only=False))
    loaded_extra = restore_stateful(extra, state.get("extra", {}))
    return LoadResult(
        saved["step"], path, saved["world_size"], skipped, os.path.exists(rng_path), loaded_extra
    )


def _resolve(directory: str, step: int | None) -> str:
    if step is None:
        path, warning = commit.resolve_latest(directory)
        if path is None:
            raise CheckpointError(
                f"no committed checkpoint in {directory} (no 'latest' marker, no complete step)"
            )
        if warning:
            warnings.warn(warning, stacklevel=3)
        return path
    path = os.path.join(directory, commit.step_dir_name(step))
    if not os.path.isdir(path):
        raise CheckpointError(
            f"no checkpoint of step {step} in {directory}; committed steps: "
            f"{commit.committed_steps(directory)}"
        )
    return path


def _held_by_any_rank(state: dict, group) -> set[str]:
    """Every rank's state keys (one all-gather)."""
    mine = set(flatten_state_dict(state)[0])
    if group is None:
        return mine
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return set().union(*everyone)


def _mismatches(state: dict, metadata, strict: bool, path: str, others=frozenset()) -> list[str]:
    """Compare what we load with what the checkpoint holds; drop or raise on mismatches.
    `others`: keys other ranks load (a pipeline's other stages)."""
    flat, _ = flatten_state_dict(state)
    stored = metadata.state_dict_metadata
    sections = tuple(f"{key}." for key in state if key != "extra")
    sections += tuple(f"extra.{name}" for name in state.get("extra", {}))
    missing = [key for key in flat if key not in stored]
    unexpected = [
        key for key in stored if key.startswith(sections) and key not in flat and key not in others
    ]
    wrong = []
    for key, value in flat.items():
        info = stored.get(key)
        if isinstance(value, torch.Tensor) and isinstance(info, TensorStorageMetadata):
            shape = stored_shape(value)
            if shape != tuple(info.size):
                wrong.append(f"{key}: checkpoint shape {tuple(info.size)}, model {shape}")
            elif value.dtype != info.properties.dtype:
                wrong.append(
                    f"{key}: checkpoint dtype {info.properties.dtype}, model {value.dtype}"
                )
    if not (missing or unexpected or wrong):
        return []
    report = []
    if missing:
        report.append(f"missing in checkpoint: {missing}")
    if unexpected:
        report.append(f"unexpected in checkpoint: {unexpected}")
    if wrong:
        report.append(f"mismatched: {wrong}")
    if strict:
        raise CheckpointError(
            f"{path} does not match the model/optimizer: "
            + "; ".join(report)
            + ". Pass strict=False to load the rest."
        )
    _drop(state, set(missing) | {w.split(":")[0] for w in wrong})
    return missing + unexpected + wrong


def _drop(state: dict, keys: set[str], prefix: str = "") -> None:
    for key in list(state):
        name = f"{prefix}{key}"
        if name in keys:
            del state[key]
        elif isinstance(state[key], dict):
            _drop(state[key], keys, name + ".")
