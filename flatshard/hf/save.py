"""`save_pretrained`: write a model as a Hugging Face checkpoint, from any world size.

The HF tensors are written in the order transformers writes them (the adapter's
`save_order`) into the files its save_pretrained would cut; each is cut from its parameter
(gate_up_proj -> gate_proj, up_proj; a fused expert tensor -> one tensor per expert),
which every rank gathers (`full_tensor()`, in the same order) when its first tensor comes
and drops after its last: a rank holds the parameters of the tensors being written (one,
or for a MoE layer its experts' two), streamed by rank 0 into safetensors files whose
headers were planned up front. A write failure on rank 0 does not leave the other ranks
waiting in a collective: rank 0 stops writing, keeps gathering, and all ranks raise together.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flatshard.checkpoint.safetensors_stream import StreamingSafetensorsWriter, tensor_bytes
from flatshard.comm import agreement
from flatshard.hf.adapter import StateDictAdapter, adapter_for
from flatshard.hf.checkpoint import INDEX_FILE, SINGLE_FILE
from flatshard.hf.errors import HFCheckpointError
from flatshard.hf.names import NameRule, TensorMapping
from flatshard.hf.stream import gathered, hf_order

_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# a source config's fields the export's own replace (the weights' dtype, where it came from)
_NOT_KEPT = {"dtype", "torch_dtype", "_name_or_path", "name_or_path", "transformers_version"}


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    adapter: StateDictAdapter | None = None,
    rules: tuple[NameRule, ...] | None = None,
    extra_config: dict | None = None,
    source_config: dict | None = None,
    generation_config: dict | None = None,
) -> None:
    """Write `config.json` and the weights of `model` (sharded or plain) to `path`.

    Call on every rank. dtype: cast the saved tensors (default: each parameter's dtype).
    extra_config: fields that do not change the model (token ids, ...) to add to config.json.
    source_config: the config.json the model was imported from: every field of it the
    export does not write itself is kept (token ids, tokenizer and rope settings, ...).
    generation_config: the generation_config.json to write (default: the model's own, or,
    as transformers derives it, the config's token ids). Returns once the files are
    complete, on every rank.
    """
    path = Path(path)
    adapter = adapter or adapter_for(model)
    if rules is not None:
        adapter = adapter.with_rules(rules)
    config = adapter.export_config(model, dtype, dict(extra_config or {}))  # same on all ranks
    if source_config:
        kept = {k: v for k, v in source_config.items() if k not in config and k not in _NOT_KEPT}
        config = {**kept, **config}
    files = {"config.json": config, **adapter.export_files(model)}
    if generation_config is not None:
        files["generation_config.json"] = generation_config
    elif "generation_config.json" not in files and _token_ids(config):
        files["generation_config.json"] = _token_ids(config)
    mappings, unmapped = adapter.plan(model)
    if unmapped:
        raise HFCheckpointError(
            f"no Hugging Face name for parameter(s) {unmapped}; add a NameRule for them"
        )
    params = adapter.tensors(model)
    names = [m.hf_name for m in mappings]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise HFCheckpointError(
            f"Hugging Face tensor(s) {twice[:5]} are assembled from several parameters or "
            "blocks; flatshard's export writes each from one block of one parameter"
        )
    out_dtype = {m.hf_name: dtype or params[m.param_name].dtype for m in mappings}
    shards = _plan_shards(adapter.save_order(mappings), out_dtype, _parse_size(max_shard_size))
    group = dist.group.WORLD if dist.is_initialized() else None
    writer = (
        _ShardWriter(path, shards, out_dtype, sum(p.numel() for p in model.parameters()))
        if group is None or dist.get_rank() == 0
        else None
    )

    ordered = [m for shard in shards for m in shard]  # the order the files are written in
    order, _ = hf_order(model, adapter, ordered)
    with torch.no_grad():  # one parameter held at a time (or, for a MoE layer, its experts')
        for name, piece in gathered(order, params, max_bytes=0):
            if writer is not None:
                writer.write(name, piece.to(out_dtype[name]))
            del piece  # not held while the next parameter is gathered
    problem = writer.finish(files) if writer is not None else None
    agreement.agree(problem, group, HFCheckpointError)  # also the barrier: files exist after it


def _token_ids(config: dict) -> dict:
    """The generation config transformers derives from a config.json (its token ids), so
    generation stops at the model's end token."""
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return {name: config[name] for name in names if config.get(name) is not None}


def _parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or "5GB" / "500MB" / "2GiB" (decimal and binary units as HF)."""
    if isinstance(size, int) and size > 0:
        return size
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in units or int(match.group(1)) <= 0:
        raise HFCheckpointError(
            f"max_shard_size {size!r} is not a size; use a positive int (bytes) or e.g. '5GB'"
        )
    return int(match.group(1)) * units[match.group(2).upper()]


def _plan_shards(mappings, out_dtype, max_bytes: int) -> list[list[TensorMapping]]:
    """Files as transformers' save_pretrained (huggingface_hub's splitter) cuts them: the
    tensors, in the adapter's save order, fill a file until the next would pass max_bytes; a tensor
    bigger than that gets a file of its own, numbered where it comes, while the file being
    filled stays open. Tensors that share a storage (views of one fused tensor) count its
    size once, at the first of them, and all go to that one's file."""
    shards: list[list[TensorMapping]] = []
    current: list[TensorMapping] = []
    used = 0
    groups: dict[object, tuple[list[TensorMapping], list[TensorMapping]]] = {}
    for mapping in mappings:
        key, numel = mapping.storage or (("tensor", mapping.hf_name), math.prod(mapping.shape))
        if key in groups:
            groups[key][1].append(mapping)  # placed with the first of its storage, below
            continue
        size = numel * out_dtype[mapping.hf_name].itemsize
        if size > max_bytes:
            shards.append([mapping])
            groups[key] = (shards[-1], [])
            continue
        if used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(mapping)
        used += size
        groups[key] = (current, [])
    if current or not shards:
        shards.append(current)
    for shard, later in groups.values():
        shard.extend(later)
    return shards


class _ShardWriter:
    """Rank 0's side: shard files in stream order; remembers the first failure."""

    def __init__(self, path: Path, shards, out_dtype, total_parameters: int):
        self.path = path
        self.total_parameters = total_parameters  # the index says it, as transformers
        self.shards = shards
        self.out_dtype = out_dtype
        n = len(shards)
        self.names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.index = -1
        self.left_in_shard = 0
        self.current: StreamingSafetensorsWriter | None = None
        self.problem: str | None = None
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.problem = f"cannot create {path}: {e}"

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.problem:
            return  # keep the caller gathering with the other ranks; report at finish
        try:
            if self.left_in_shard == 0:
                self._open_next()
            self.current.write(name, tensor)
            self.left_in_shard -= 1
            if self.left_in_shard == 0:
                self.current.close()
                self.current = None
        except Exception as e:  # any failure: raising here would strand the other ranks
            self.problem = f"writing {self.path}: {e!r}"
            if self.current is not None:
                self.current.abort()

    def _open_next(self) -> None:
        self.index += 1
        shard = self.shards[self.index]
        entries = [(m.hf_name, m.shape, self.out_dtype[m.hf_name]) for m in shard]
        self.current = StreamingSafetensorsWriter(self.path / self.names[self.index], entries)
        self.left_in_shard = len(shard)

    def finish(self, files: dict[str, dict]) -> str | None:
        if self.problem:
            return self.problem
        try:
            self._remove_stale(files)
            if len(self.shards) > 1:
                _write_json(self.path / INDEX_FILE, self._index())
            for name, content in files.items():
                _write_json(self.path / name, content)
        except Exception as e:
            return f"writing {self.path}: {e!r}"
        return None

    def _index(self) -> dict:
        weight_map = {
            m.hf_name: file for file, shard in zip(self.names, self.shards) for m in shard
        }
        total = sum(
            tensor_bytes(m.shape, self.out_dtype[m.hf_name]) for s in self.shards for m in s
        )
        metadata = {"total_parameters": self.total_parameters, "total_size": total}
        return {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}

    def _remove_stale(self, files: dict) -> None:
        # A weights file from an earlier save would shadow or mix with this one on load, and
        # its generation config would outlive the config it came with.
        earlier = (SINGLE_FILE, INDEX_FILE, "generation_config.json")
        for file in self.path.iterdir():
            stale = file.name in earlier or _SHARD_FILE.fullmatch(file.name)
            if stale and file.name not in self.names and file.name not in files:
                file.unlink()


def _write_json(file: Path, data: dict) -> None:
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, file)
