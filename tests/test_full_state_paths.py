"""Full (unsharded) state dicts into every composition, entry by entry: a model trained one
AdamW step in one process gives the full model and optimizer state; each composition
(EP 2, EP 4 with efsdp 1, TP 2, TP 2 x EP 2, HSDP 2 x 2, two experts over four ranks
(finer rows), optimizer offload of half the state, the disk tier under EP) loads it into
a fresh model with `set_model_state_dict` / `set_optimizer_state_dict(full_state_dict=
True)` (and the model alone with `load_state_dict`), and every entry read back is the one
loaded. The same compositions write the one-process model's Hugging Face directory and
full-weights file bitwise (`hf.save_pretrained`, `checkpoint.export_full`) and read the
one-process files back entry by entry (`hf.from_pretrained`, `checkpoint.load_full`). And
by values: loading full tensors whose values are their elements' indices, every element is
read by one rank of each copy.

Each rank must take its own piece of each full tensor: its expert rows under EP, its TP
block, its layout rows (a piece taken from the wrong coordinates put expert 0's rows on
every EP rank, and no other test saw it).
"""

from __future__ import annotations

import copy
import shutil
import tempfile

import pytest
import torch
from distributed import run_distributed
from safetensors.torch import load_file
from test_hf import assert_bit_exact, read_all
from test_moe_training import moe_loss
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import flatshard
from flatshard import checkpoint, hf
from flatshard.models import Llama, LlamaConfig, MoE, MoEConfig

FULL = StateDictOptions(full_state_dict=True)
CASES = {  # name: (world, model, ParallelDims keywords, parallelize keywords)
    "ep2": (2, "moe", dict(ep=2), {}),
    "tp2": (2, "llama", dict(tp=2), {}),
    "offload-half": (2, "llama", {}, dict(offload_policy=flatshard.OffloadPolicy(0.5))),
    "disk-tier": (2, "moe", dict(ep=2), dict(offload_policy="disk")),
    "ep4-efsdp1": (4, "moe", dict(ep=4), {}),
    "tp2-ep2": (4, "moe", dict(tp=2, ep=2), {}),
    "hsdp2x2": (4, "llama", dict(dp_replicate=2), {}),
    "finer-expert-rows": (4, "moe-2-experts", {}, {}),
}


def build_case_model(kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "llama":
        return Llama(LlamaConfig.tiny(ffn_dim=48))  # even rows: splits over tp 2
    return MoE(MoEConfig.tiny(n_experts=2 if kind == "moe-2-experts" else 4))


_DISK_TIERS: list[str] = []  # this worker's disk-tier folder of the last case


def _composition(dims_keywords: dict, keywords: dict):
    """(ParallelDims, parallelize keywords) of a case on this rank: the disk tier gets a
    folder of its own per rank for the optimizer state's files."""
    import torch.distributed as dist

    dims = flatshard.ParallelDims(dist.get_world_size(), **dims_keywords)
    if keywords.get("offload_policy") == "disk":
        # the previous case's folder goes (its model with it): pooled workers end by
        # SIGKILL, so at most the last one per worker stays behind in the temp directory
        while _DISK_TIERS:
            shutil.rmtree(_DISK_TIERS.pop(), ignore_errors=True)
        folder = tempfile.mkdtemp(prefix=f"disk-tier-{dist.get_rank()}-")
        _DISK_TIERS.append(folder)
        keywords = dict(offload_policy=flatshard.OffloadPolicy(1.0, path=folder))
    return dims, keywords


def case_loss(model, tokens):
    if isinstance(model, MoE):
        return moe_loss(model, tokens)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


@pytest.fixture(scope="module")
def full_states():
    """kind -> (full model state, full optimizer state) after one AdamW step, one process."""
    out = {}
    for kind in ("llama", "moe", "moe-2-experts"):
        model = build_case_model(kind, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        tokens = torch.randint(0, model.config.vocab_size, (4, 9), generator=torch.Generator())
        case_loss(model, tokens).backward()
        optimizer.step()
        out[kind] = (
            get_model_state_dict(model, options=FULL),
            get_optimizer_state_dict(model, optimizer, options=FULL),
        )
    return out


def _differences(ours: dict, theirs: dict, where: str) -> list[str]:
    if ours.keys() != theirs.keys():
        return [f"{where}: keys {sorted(set(ours) ^ set(theirs))}"]
    return [f"{where}: {key}" for key, value in theirs.items() if not torch.equal(ours[key], value)]


def _load(kind: str, dims_keywords: dict, keywords: dict, model_state, optim_state):
    """Every entry that reads back other than loaded, as 'path: key' (none: all exact)."""

    dims, keywords = _composition(dims_keywords, keywords)
    model = flatshard.parallelize(build_case_model(kind, seed=5), dims, **keywords)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # torch puts the loaded (sharded) values into the dicts it is given: give it copies
    set_model_state_dict(model, copy.deepcopy(model_state), options=FULL)
    set_optimizer_state_dict(model, optimizer, copy.deepcopy(optim_state), options=FULL)
    wrong = _differences(get_model_state_dict(model, options=FULL), model_state, "model")
    ours = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
    for key, states in optim_state["state"].items():
        wrong += _differences(ours[key], states, f"optimizer {key}")

    again = flatshard.parallelize(build_case_model(kind, seed=6), dims, **keywords)
    again.load_state_dict(copy.deepcopy(model_state))  # full tensors into the shards
    wrong += _differences(get_model_state_dict(again, options=FULL), model_state, "load_state_dict")
    return wrong


@pytest.mark.parametrize("case", list(CASES))
def test_a_full_state_loads_exactly_into(full_states, case):
    world, kind, dims_keywords, keywords = CASES[case]
    model_state, optim_state = full_states["moe" if kind == "moe" else kind]
    results = run_distributed(_load, world, kind, dims_keywords, keywords, model_state, optim_state)
    for rank, wrong in enumerate(results):
        assert wrong == [], f"rank {rank}: {wrong[:8]}"


# --------------------------------------------------------------------------------------------
# DCP chunks, checked by us: every rank's chunks tile each global tensor evenly
# --------------------------------------------------------------------------------------------


def _chunk_lists(kind: str, dims_keywords: dict, keywords: dict) -> dict:
    """{state key: (global shape, this rank's chunks as (offsets, sizes))}, for every sharded
    weight and optimizer state after one AdamW step."""
    from torch.distributed.tensor import DTensor

    dims, keywords = _composition(dims_keywords, keywords)
    model = flatshard.parallelize(build_case_model(kind, seed=5), dims, **keywords)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    case_loss(model, torch.arange(36).reshape(4, 9) % model.config.vocab_size).backward()
    optimizer.step()
    names = {param: name for name, param in model.named_parameters()}
    tensors = dict(model.state_dict())
    for param, state in optimizer.state.items():
        tensors.update({f"{names[param]}/{k}": v for k, v in state.items() if v.dim()})
    out = {}
    for key, value in tensors.items():
        local = value._local_tensor if isinstance(value, DTensor) else value
        if hasattr(local, "__create_chunk_list__"):
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in local.__create_chunk_list__()]
            out[key] = (tuple(local.spec.global_shape), chunks)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_chunks_of_all_ranks_tile_each_tensor_evenly(case):
    """Without DCP's own save-time overlap check: the chunks all ranks declare cover every
    element of each global tensor the same number of times (once per copy: replicas,
    TP ranks of a replicated tensor), with no gap and no overlap within a copy."""
    world, kind, dims_keywords, keywords = CASES[case]
    per_rank = run_distributed(_chunk_lists, world, kind, dims_keywords, keywords)
    assert per_rank[0] and all(r.keys() == per_rank[0].keys() for r in per_rank)
    for key, (shape, _) in per_rank[0].items():
        covered = torch.zeros(shape, dtype=torch.int32)
        for rank_chunks in per_rank:
            for offsets, sizes in rank_chunks[key][1]:
                covered[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] += 1
        assert covered.min() == covered.max() >= 1, (key, covered.unique().tolist())


# --------------------------------------------------------------------------------------------
# The same compositions through the Hugging Face and full-weights files, both ways
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process_files(full_states, tmp_path_factory):
    """kind -> (HF directory, full-weights file) written from the one-process model."""
    out = {}
    for kind, (model_state, _) in full_states.items():
        folder = tmp_path_factory.mktemp(f"one-process-{kind}")
        model = build_case_model(kind, seed=5)
        model.load_state_dict(model_state)
        hf.save_pretrained(model, folder / "hf")
        checkpoint.export_full(model, str(folder / "full.safetensors"))
        out[kind] = (str(folder / "hf"), str(folder / "full.safetensors"))
    return out


def _through_files(kind, dims_keywords, keywords, model_state, hf_dir, full_file, out):
    """Writes this composition's HF directory and full-weights file to `out` (from a model
    given the full state); returns the entries that read back wrong after loading the
    one-process files into fresh models (the model's full state from the full-weights file;
    the HF tensors from the HF directory, which may build transformers' model)."""
    import functools

    dims, keywords = _composition(dims_keywords, keywords)
    model = flatshard.parallelize(build_case_model(kind, seed=5), dims, **keywords)
    set_model_state_dict(model, copy.deepcopy(model_state), options=FULL)
    hf.save_pretrained(model, f"{out}/hf")
    checkpoint.export_full(model, f"{out}/full.safetensors")

    fresh = flatshard.parallelize(build_case_model(kind, seed=6), dims, **keywords)
    checkpoint.load_full(fresh, full_file)
    wrong = _differences(get_model_state_dict(fresh, options=FULL), model_state, "load_full")
    shard = functools.partial(flatshard.parallelize, dims=dims, **keywords)
    loaded = hf.from_pretrained(hf_dir, shard=shard)
    saved = read_all(hf_dir)
    wrong += _differences(dict(flatshard.full_weights(loaded)), saved, "from_pretrained")
    return wrong


@pytest.mark.parametrize("case", list(CASES))
def test_hf_and_full_weights_files_as_one_process(one_process_files, full_states, case, tmp_path):
    """save_pretrained / export_full of each composition write the one-process files
    bitwise; from_pretrained / load_full of the one-process files read back every entry."""
    world, kind, dims_keywords, keywords = CASES[case]
    hf_dir, full_file = one_process_files[kind]
    args = (kind, dims_keywords, keywords, full_states[kind][0], hf_dir, full_file, str(tmp_path))
    for rank, wrong in enumerate(run_distributed(_through_files, world, *args)):
        assert wrong == [], f"rank {rank}: {wrong[:8]}"
    assert_bit_exact(tmp_path / "hf", hf_dir)
    written, expected = load_file(tmp_path / "full.safetensors"), load_file(full_file)
    assert _differences(written, expected, "export_full") == []


# --------------------------------------------------------------------------------------------
# Which rank reads which element: full tensors whose values are their elements' indices
# --------------------------------------------------------------------------------------------


def _indexed(state: dict) -> dict:
    """Each tensor's values replaced by its elements' indices, unique over the whole state
    (exact in float32: the tiny models have far fewer than 2**24 elements)."""
    out, base = {}, 0
    for key, value in state.items():
        out[key] = torch.arange(base, base + value.numel(), dtype=value.dtype).view(value.shape)
        base += value.numel()
    assert base < 2**24
    return out


@pytest.fixture(scope="module")
def indexed_files(full_states, tmp_path_factory):
    """kind -> (indexed full model state, HF directory of it written by one process)."""
    out = {}
    for kind, (model_state, _) in full_states.items():
        folder = tmp_path_factory.mktemp(f"indexed-{kind}")
        model = build_case_model(kind, seed=5)
        state = _indexed(model_state)
        model.load_state_dict(state)
        hf.save_pretrained(model, folder)
        out[kind] = (state, str(folder))
    return out


def _elements_held(kind, dims_keywords, keywords, state, hf_dir):
    """This rank's local values (element indices) after loading the indexed full state
    (set_model_state_dict) and the indexed HF directory (from_pretrained)."""
    import functools

    from torch.distributed.tensor import DTensor

    dims, keywords = _composition(dims_keywords, keywords)

    def held(model):
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        return torch.cat([t.detach().reshape(-1).cpu() for t in local]).long()

    model = flatshard.parallelize(build_case_model(kind, seed=5), dims, **keywords)
    set_model_state_dict(model, copy.deepcopy(state), options=FULL)
    shard = functools.partial(flatshard.parallelize, dims=dims, **keywords)
    return held(model), held(hf.from_pretrained(hf_dir, shard=shard))


@pytest.mark.parametrize("case", list(CASES))
def test_every_element_is_read_by_one_rank_of_each_copy(indexed_files, case):
    """The full-state and Hugging Face slicing paths, checked by the values they read: over
    all ranks, every element of a tensor is held the same number of times (once per copy:
    replicas, TP ranks of a replicated tensor), none missing, none twice within a copy."""
    world, kind, dims_keywords, keywords = CASES[case]
    state, hf_dir = indexed_files[kind]
    per_rank = run_distributed(_elements_held, world, kind, dims_keywords, keywords, state, hf_dir)
    total = sum(value.numel() for value in state.values())
    for path, tensors in (("full state", state), ("hf", read_all(hf_dir))):
        held = torch.cat([ranks[path == "hf"] for ranks in per_rank])
        counts = torch.bincount(held, minlength=total)
        for name, value in tensors.items():
            times = counts[value.reshape(-1).long()]
            assert times.min() == times.max() >= 1, (path, name, times.unique().tolist())
