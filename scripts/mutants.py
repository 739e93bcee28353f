"""Mutation smoke test: plant small, named bugs one at a time and see which test kills each.

Each mutant is one textual change to the library (the kind of slip a real change makes: a
dropped alignment, a missing divide factor, a wrong chunk offset, ...). For every mutant
this copies the checkout's tracked files to a scratch directory, applies the change there,
runs the tests that should catch it, and reports the first failing test (killed) or
SURVIVED. The checkout itself is never touched. Not part of CI (it runs the suite's most
telling tests once per mutant: a few minutes in all):

    python scripts/mutants.py              # every mutant
    python scripts/mutants.py crc lookup   # the named ones
    python scripts/mutants.py --full      # each against the whole suite (slow)

Exit status: 0 when every mutant was killed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # the suite's tests expected to kill it


MUTANTS = (
    Mutant(
        "subclass-rows",
        "a tensor subclass's gathered inputs take every rank's rows from rank 0",
        "flatshard/runtime/subclass_params.py",
        "copy_(wire[:, offset : offset + nbytes])",
        "copy_(wire[:1, offset : offset + nbytes])",
        ("tests/test_subclass_gather.py",),
    ),
    Mutant(
        "alignment",
        "the layout no longer moves a parameter so that shard cuts fall on row edges",
        "flatshard/layout/packing.py",
        "        if info.numel > 0 and _crosses_cut(cursor, info.numel, shard_size, world_size):",
        "        if False:",
        ("tests/test_layout.py", "tests/test_layout_padding.py"),
    ),
    Mutant(
        "divide-factor",
        "the gloo reduce-scatter sums where it should average (gradients x world)",
        "flatshard/comm/collectives.py",
        "            self.output.div_(self.world)",
        "            pass",
        ("tests/test_gradients.py",),
    ),
    Mutant(
        "chunk-offsets",
        "DCP chunks of a rank's rows are written at offset 0",
        "flatshard/dtensor/row_shard.py",
        "offsets=torch.Size(box.offset)",
        "offsets=torch.Size((0,) * len(box.offset))",
        ("tests/test_checkpoint.py",),
    ),
    Mutant(
        "crc",
        "the checkpoint CRC is not chained across read blocks",
        "flatshard/checkpoint/manifest.py",
        "            crc = zlib.crc32(block, crc)",
        "            crc = zlib.crc32(block)",
        ("tests/test_checkpoint_integrity.py",),
    ),
    Mutant(
        "component-split",
        "the fused gate/up weight declares its components in the wrong order",
        "flatshard/models/llama/model.py",
        '(("gate_proj.weight", ffn_dim), ("up_proj.weight", ffn_dim))',
        '(("up_proj.weight", ffn_dim), ("gate_proj.weight", ffn_dim))',
        ("tests/test_hf.py",),
    ),
    Mutant(
        "lookup-backward",
        "the embedding lookup's backward adds other ranks' rows' gradients into its row 0",
        "flatshard/runtime/sharded_lookup.py",
        "grads.masked_fill_(~held.unsqueeze(1), 0).to(flat.dtype)",
        "grads.to(flat.dtype)",
        ("tests/test_gradients.py",),
    ),
    Mutant(
        "lookup-divide",
        "the embedding lookup's backward forgets the gradient divide factor",
        "flatshard/runtime/sharded_lookup.py",
        "            rows.div_(self.grads.divide_factor)",
        "            pass",
        ("tests/test_gradients.py",),
    ),
    Mutant(
        "data-position",
        "the trainer reads each rank's micro-batch one sequence late",
        "flatshard/cli/train.py",
        "dp_rank * train.micro_batch\n",
        "dp_rank * train.micro_batch + 1\n",
        ("tests/test_cli_reference.py",),
    ),
    Mutant(
        "accumulation",
        "held (unsynced) low-precision gradients drop every micro-batch after the first",
        "flatshard/runtime/bucket_grads.py",
        "            self.unsynced.add_(self.unsharded)",
        "            pass",
        ("tests/test_mixed_precision.py",),
    ),
    Mutant(
        "inflight-write",
        "a write to the weights during their all-gather is not gathered again",
        "flatshard/runtime/gathering.py",
        "            if self._stale():  # written while the gather was in flight: gather again",
        "            if False:",
        ("tests/test_inflight_write.py",),
    ),
    Mutant(
        "gather-version",
        "a gathered copy is stamped with the weights' version after its wait, not at its start",
        "flatshard/runtime/flat_bucket.py",
        "        self._main_version = self._gathering_version",
        "        self._main_version = self.shard.version()",
        ("tests/test_inflight_write.py",),
    ),
    Mutant(
        "write-after-issue",
        "a gradient buffer is written while its reduce-scatter is in flight (a race on NCCL)",
        "flatshard/runtime/grad_sync.py",
        "                started += 1\n",
        "                started += 1\n                keep_alive.mul_(1.0)\n",
        ("tests/test_nccl_shim.py",),
    ),
    Mutant(
        "use-before-wait",
        "forward runs on parameters whose all-gather it did not wait for",
        "flatshard/runtime/hooks.py",
        '    unit.unshard()\n    unit.register("unsharded")\n    if not context.in_backward:',
        "    unit.unshard(async_op=True)\n    unit.make_unsharded_params()\n"
        '    unit.register("unsharded")\n    if not context.in_backward:',
        ("tests/test_nccl_shim.py",),
    ),
    Mutant(
        "tp-fused-split",
        "tensor parallelism splits the fused [gate; up] weight by plain row blocks",
        "flatshard/models/llama/parallel.py",
        "        return FusedColwiseParallel(components=2)",
        "        return ColwiseParallel()",
        ("tests/test_tensor_parallel.py",),
    ),
    Mutant(
        "tp-component-offset",
        "a TP-split fused weight's components are placed at the start of the global tensor",
        "flatshard/layout/tensor_parallel.py",
        "Component(c.name, dim, start, start + part, slab_shape, slab_offset, c.start)",
        "Component(c.name, dim, start, start + part, slab_shape, slab_offset, 0)",
        ("tests/test_tp_fsdp.py::test_tp_checkpoint_loads_at_any_layout_and_resumes",),
    ),
    Mutant(
        "ep-divide",
        "expert gradients averaged over the expert-data-parallel ranks only (FSDP2 + EP's bug)",
        "flatshard/mesh.py",
        "        experts = self.inner_size if self.expert_parallel else 1\n",
        "        experts = 1\n",
        ("tests/test_expert_parallel.py::test_expert_gradients_equal_one_process_per_tensor",),
    ),
    Mutant(
        "ep-arrival-order",
        "expert outputs are sent back in expert order, not in the order the rows arrived",
        "flatshard/parallel/expert_parallel.py",
        "out = torch.empty_like(out).index_copy(0, by_expert, out)",
        "out = out",
        ("tests/test_expert_parallel.py::test_expert_gradients_equal_one_process_per_tensor",),
    ),
    Mutant(
        "load-layout",
        "load_state_dict takes a torch.chunk DTensor's local piece as this rank's rows",
        "flatshard/dtensor/sharded_param.py",
        "    return spec.piece_of(value.full_tensor())",
        "    return local",
        ("tests/test_load_state_dict.py",),
    ),
    Mutant(
        "full-weights-local-box",
        "a full-weights file is read at each piece's local coordinates, not its global ones",
        "flatshard/checkpoint/full_weights.py",
        "value.to_local()[local.slices].copy_(piece[box.slices])",
        "value.to_local()[local.slices].copy_(piece[local.slices])",
        ("tests/test_full_state_paths.py::test_hf_and_full_weights_files_as_one_process",),
    ),
    Mutant(
        "hf-piece-local",
        "a Hugging Face tensor is read at this rank's local coordinates, not its stored ones",
        "flatshard/hf/load.py",
        "        data = f.get_slice(mapping.hf_name)[stored.slices]",
        "        data = f.get_slice(mapping.hf_name)[into.slices]",
        ("tests/test_full_state_paths.py::test_hf_and_full_weights_files_as_one_process",),
    ),
    Mutant(
        "full-state-piece",
        "a full state dict is cut by the local parameter's rows, not by this rank's piece of "
        "the global tensor (expert 0's rows on every EP rank)",
        "flatshard/dtensor/full_state_dict.py",
        "    local.to_local().copy_(shard_spec(local).piece_of(full).to(local.device))",
        "    local.to_local().copy_(shard_spec(local).rows_of(full).to(local.device))",
        ("tests/test_full_state_paths.py",),
    ),
    Mutant(
        "chunk-offset-rank",
        "a DCP chunk's row offset is taken from the rank index, not the layout's row bounds",
        "flatshard/dtensor/row_shard.py",
        "offsets=torch.Size(box.offset)",
        "offsets=torch.Size((self.spec.rank * box.shape[0], *box.offset[1:]) if box.offset "
        "else box.offset)",
        ("tests/test_full_state_paths.py::test_dcp_chunks_of_all_ranks_tile_each_tensor_evenly",),
    ),
    Mutant(
        "tp-component-local-start",
        "a TP rank's share of a fused component is placed at its local start in the component",
        "flatshard/layout/tensor_parallel.py",
        "slab_offset = tuple(rank * part if d == dim else 0 for d in range(len(global_shape)))",
        "slab_offset = tuple(start - c.start if d == dim else 0 for d in range(len(global_shape)))",
        ("tests/test_full_state_paths.py::test_dcp_chunks_of_all_ranks_tile_each_tensor_evenly",),
    ),
    Mutant(
        "unsynced-zeroed",
        "under set_requires_gradient_sync(False) each micro-batch zeroes the gradients the "
        "earlier ones held (only the last reaches the sync)",
        "flatshard/runtime/grad_sync.py",
        "                self._holds_unsynced, unit.context.buffers, bucket.shard.main.device",
        "                False, unit.context.buffers, bucket.shard.main.device",
        ("tests/test_training.py::test_gradient_accumulation",),
    ),
    Mutant(
        "eval-padding",
        "the weightless forwards of ranks past the last held-out window count as data",
        "flatshard/cli/evaluation.py",
        "                    targets[j] = IGNORE",
        "                    pass",
        ("tests/test_evaluation.py",),
    ),
    Mutant(
        "cli-accumulation",
        "the trainer no longer divides each micro-batch's loss by the accumulation steps",
        "flatshard/cli/train.py",
        "loss = training_loss(model, batch) / accumulation",
        "loss = training_loss(model, batch)",
        ("tests/test_cli_reference.py",),
    ),
)


def scratch_copy() -> str:
    """The checkout's tracked files (as they are now) in a new temporary directory."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    root = tempfile.mkdtemp(prefix="flatshard-mutants-")
    for name in (f.decode() for f in files if f):
        target = os.path.join(root, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), target)
    return root


def run_mutant(root: str, mutant: Mutant, full: bool) -> tuple[str, float]:
    """('killed by TEST' | 'SURVIVED' | 'NOT APPLIED: ...' | 'ERROR: ...', seconds). Only
    a failing test kills: a mutant that breaks the import or collection is an error."""
    path = os.path.join(root, mutant.file)
    with open(path) as handle:
        original = handle.read()
    if original.count(mutant.old) != 1:
        return f"NOT APPLIED: the text to change occurs {original.count(mutant.old)} times", 0.0
    with open(path, "w") as handle:
        handle.write(original.replace(mutant.old, mutant.new))
    started = time.perf_counter()
    try:
        tests = ["tests"] if full else list(mutant.tests)
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=root, capture_output=True, text=True, timeout=3600,
            env={**os.environ, "PYTHONPATH": root},
        )  # fmt: skip
    finally:
        with open(path, "w") as handle:
            handle.write(original)
    seconds = time.perf_counter() - started
    failed = re.search(r"^FAILED (\S+)", result.stdout, re.MULTILINE)
    if result.returncode == 0:
        return "SURVIVED", seconds
    if result.returncode == 1 and failed:  # tests ran and one failed
        return f"killed by {failed.group(1)}", seconds
    tail = (result.stdout + result.stderr).strip().splitlines()[-1:]
    return f"ERROR: pytest exit {result.returncode} {tail}", seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--full", action="store_true", help="run the whole suite per mutant")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.names] if args.names else list(MUTANTS)
    root = scratch_copy()
    survived = 0
    try:
        for mutant in chosen:
            verdict, seconds = run_mutant(root, mutant, args.full)
            survived += not verdict.startswith("killed")
            print(f"{mutant.name:<16} {verdict}  ({seconds:.0f} s)\n{'':<16} {mutant.what}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{len(chosen) - survived} of {len(chosen)} mutants killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
