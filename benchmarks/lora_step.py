"""LoRA fine-tuning of a Hugging Face Llama: flatshard against FSDP2 + PEFT (and QLoRA:
flatshard against FSDP2 on the same NF4 model).

Both adapt the same `LlamaForCausalLM` (random weights saved once with save_pretrained; or
--model DIR) with rank-R adapters on every attention and MLP projection, AdamW on the
adapters alone, on the same data, inside one set of gloo worker processes:

    fsdp2-peft      transformers' from_pretrained, peft.get_peft_model, then FSDP2's
                    fully_shard of every decoder layer and the root
    flatshard-lora  what `flatshard train --hf DIR --lora R` builds: flatshard's Llama on
                    meta, the adapters added, each decoder layer and the root fully_shard-ed,
                    each rank reading only its rows of the base
    flatshard-full  the same model, every weight trained (what LoRA saves)

With --tp N the LoRA modes run at (dp, tp) = (world / N, N): flatshard-lora-tp is what
`flatshard train --hf DIR --lora R --tp N` builds (each adapter split as its base:
flatshard/models/lora_parallel.py), fsdp2-peft-tp PEFT's model with torch's Colwise/
RowwiseParallel on each projection's base as transformers' plan says and on the adapter
matrix that splits with it (a column-parallel base's B, a row-parallel base's A; the other
stays whole), then FSDP2 over the data-parallel ranks.

With --qlora the modes are QLoRA's: what `flatshard train --hf DIR --lora R --qlora`
builds (the base read whole, the adapted bases quantized to torchao's NF4, then split)
under flatshard's fully_shard (flatshard-qlora) and under FSDP2's (fsdp2-qlora: the same
model object, torchao's own all-gather protocol, as torchtune runs QLoRA), against
flatshard-lora over the full-precision base. The two QLoRA runs' losses must agree.

The flatshard adapters' A matrices are copied into PEFT's (B starts at zero in both), so
the two LoRA runs take the same steps: their losses must agree (printed as their largest
relative difference). Modes alternate step by step, the order reversed every step, so a
drift of the shared machine hits all alike. Printed per rank 0: median seconds per step,
trainable parameters, the AdamW state and gradient bytes a rank holds.

    python benchmarks/lora_step.py --world 2 --rank 16 --steps 6 [--qlora | --tp 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (_ROOT, os.path.dirname(os.path.abspath(__file__))) if p not in sys.path]

from compare import free_port, start_workers, worker_queue  # noqa: E402
from hf_parallel import random_llama_dir  # noqa: E402

from flatshard import hf  # noqa: E402
from flatshard.dtensor.sharded_param import local_data  # noqa: E402
from flatshard.models.lora import (  # noqa: E402
    DEFAULT_TARGETS,
    LoRASpec,
    add_lora,
    init_adapters,
)
from flatshard.models.qlora import quantize_bases  # noqa: E402

MODES = ("fsdp2-peft", "flatshard-lora", "flatshard-full")
TP_MODES = ("fsdp2-peft-tp", "flatshard-lora-tp")
QLORA_MODES = ("fsdp2-qlora", "flatshard-qlora", "flatshard-lora")


def flatshard_model(path: str, spec: LoRASpec | None):
    def shard(model):
        if spec is not None:
            add_lora(model, spec)
        hf.shard_decoder_layers(model)

    model = hf.from_pretrained(path, shard=shard)
    if spec is not None:
        init_adapters(model, seed=0)
    return model


def qlora_model(path: str, spec: LoRASpec, fully_shard):
    """The trainer's QLoRA model (NF4 bases, adapters drawn as init_adapters draws them),
    each decoder layer and the root split by `fully_shard` (flatshard's or FSDP2's)."""
    model = hf.from_pretrained(path, device="cpu")
    add_lora(model, spec)
    quantize_bases(model, dist.get_world_size())
    init_adapters(model, seed=0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def tp_lora_model(path: str, spec: LoRASpec, dims):
    """What `flatshard train --hf DIR --lora R --tp N` builds, adapters drawn alike."""
    from flatshard.cli.model import build_hf

    model = build_hf(path, dims=dims, zero_stage=3, precision="fp32",
                     device=torch.device("cpu"), lora=spec)  # fmt: skip
    init_adapters(model, seed=0)
    return model


def peft_model(path: str, spec: LoRASpec, ours, dims=None):
    """FSDP2 + PEFT, with the A matrices of `ours` (flatshard's) copied in; with `dims`,
    torch's TP on each projection's base and the adapter matrix that splits with it."""
    import peft
    import transformers
    from torch.distributed.fsdp import fully_shard

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0,
                             target_modules=list(spec.targets))  # fmt: skip
    model = peft.get_peft_model(model, config)
    a_matrices = _hf_a_matrices(ours)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:
                key = name.removeprefix("base_model.model.").replace(".lora_A.default.weight", "")
                param.copy_(a_matrices[key])
            elif ".lora_B." in name:
                param.zero_()
    mesh = None
    if dims is not None:
        meshes = dims.build()
        _peft_tensor_parallel(model.base_model.model.model, meshes.tp)
        mesh = meshes.fsdp
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _peft_tensor_parallel(base, tp_mesh) -> None:
    """transformers' plan on PEFT's layers: each base by its style; a column-parallel
    base's B column-parallel (A whole: its input is whole), a row-parallel base's A
    row-parallel (its output all-reduced, B whole)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for glob, kind in base.config.base_model_tp_plan.items():
        if kind == "colwise":
            plan.update({f"{glob}.base_layer": ColwiseParallel(),
                         f"{glob}.lora_B.default": ColwiseParallel()})  # fmt: skip
        elif kind == "rowwise":
            plan.update({f"{glob}.base_layer": RowwiseParallel(),
                         f"{glob}.lora_A.default": RowwiseParallel()})  # fmt: skip
    parallelize_module(base, tp_mesh, plan)


def _hf_a_matrices(ours) -> dict[str, torch.Tensor]:
    """Every A matrix of flatshard's model, whole, by the HF module it adapts."""
    from flatshard.models.lora import peft_adapter

    tensors, _ = peft_adapter(ours, "")
    prefix, suffix = "base_model.model.", ".lora_A.weight"
    return {k[len(prefix) : -len(suffix)]: v for k, v in tensors.items() if k.endswith(suffix)}


def _held_bytes(model, optimizer) -> tuple[int, int]:
    """(AdamW state bytes, gradient bytes) this rank holds."""
    state = sum(
        local_data(t).nbytes if hasattr(t, "to_local") else t.nbytes
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    grads = sum(
        (local_data(p.grad) if hasattr(p.grad, "to_local") else p.grad).nbytes
        for p in model.parameters()
        if p.grad is not None
    )
    return state, grads


def worker(rank: int, world: int, port: int, args, path: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = LoRASpec(args.rank, 2.0 * args.rank, 0.0, DEFAULT_TARGETS)
    if args.tp > 1:
        from flatshard.mesh import ParallelDims

        dims = ParallelDims(world, tp=args.tp)
        ours = tp_lora_model(path, spec, dims)
        runs = {"flatshard-lora-tp": {"model": ours},
                "fsdp2-peft-tp": {"model": peft_model(path, spec, ours, dims)}}  # fmt: skip
    elif args.qlora:
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        import flatshard

        runs = {
            "flatshard-lora": {"model": (ours := flatshard_model(path, spec))},
            "fsdp2-qlora": {"model": qlora_model(path, spec, fsdp2_fully_shard)},
            "flatshard-qlora": {"model": qlora_model(path, spec, flatshard.fully_shard)},
        }
    else:
        ours = flatshard_model(path, spec)
        runs = {"flatshard-lora": {"model": ours},
                "fsdp2-peft": {"model": peft_model(path, spec, ours)},
                "flatshard-full": {"model": flatshard_model(path, None)}}  # fmt: skip
    modes = TP_MODES if args.tp > 1 else QLORA_MODES if args.qlora else MODES
    for run in runs.values():
        trainable = [p for p in run["model"].parameters() if p.requires_grad]
        run.update(opt=torch.optim.AdamW(trainable, lr=args.lr), times=[], losses=[])
        run["trainable"] = sum(p.numel() for p in trainable)
    torch.manual_seed(1)
    vocab = ours.config.vocab_size
    # a TP group shares its batch; TP is the innermost mesh dim (flatshard/mesh.py)
    dp, dp_rank = world // args.tp, rank // args.tp
    data = torch.randint(0, vocab, (args.steps, dp * args.micro_batch, args.seq + 1))
    for step in range(args.steps):
        mine = data[step, dp_rank * args.micro_batch : (dp_rank + 1) * args.micro_batch]
        order = modes if step % 2 == 0 else modes[::-1]
        for mode in order:
            run = runs[mode]
            dist.barrier()
            started = time.perf_counter()
            output = run["model"](mine[:, :-1])
            logits = getattr(output, "logits", output)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten())
            loss.backward()
            run["opt"].step()
            if step == args.steps - 1:
                run["held"] = _held_bytes(run["model"], run["opt"])
            run["opt"].zero_grad()
            elapsed = time.perf_counter() - started
            value = torch.tensor([loss.item() / world])
            dist.all_reduce(value)
            if step >= args.warmup:
                run["times"].append(elapsed)
            run["losses"].append(value.item())
    if rank == 0:
        out.put({
            mode: dict(seconds=statistics.median(run["times"]), losses=run["losses"],
                       trainable=run["trainable"], held=run["held"])
            for mode, run in runs.items()
        })  # fmt: skip
    dist.barrier()  # on gloo a rank tearing down while its peer still sends aborted the peer
    dist.destroy_process_group()


def _size(path: str) -> int:
    """The parameters of the model in `path` (from its config, on the meta device)."""
    with torch.device("meta"):
        model = hf.adapter_for_config(hf.read_hf_config(path)).build(hf.read_hf_config(path))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Llama directory (default: random)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--qlora", action="store_true", help="QLoRA's modes (see above)")
    parser.add_argument("--tp", type=int, default=1, help="the LoRA modes under TP (above)")
    args = parser.parse_args()
    if args.tp > 1 and (args.qlora or args.world % args.tp):
        parser.error("--tp N: without --qlora, and N must divide --world")
    path = args.model or random_llama_dir(args, "lora-step-")[1]
    out = worker_queue()
    start_workers(worker, (args.world, free_port(), args, path, out), args.world)
    result = out.get()
    peer, ours = (
        ("fsdp2-peft-tp", "flatshard-lora-tp") if args.tp > 1
        else ("fsdp2-qlora", "flatshard-qlora") if args.qlora
        else ("fsdp2-peft", "flatshard-lora")
    )  # fmt: skip
    reference = result[peer]
    agree = max(abs(a - b) / abs(b) for a, b in zip(result[ours]["losses"], reference["losses"]))
    kind = "QLoRA (NF4 bases)" if args.qlora else "LoRA"
    layout = f" (dp {args.world // args.tp} x tp {args.tp})" if args.tp > 1 else ""
    print(f"{kind} rank {args.rank} (alpha {2 * args.rank}) on {', '.join(DEFAULT_TARGETS)}; "
          f"a Llama of {_size(path) / 1e6:.1f}M parameters, world {args.world}{layout} (gloo, "
          f"CPU), micro batch {args.micro_batch} x {args.seq} tokens, "
          f"{args.steps - args.warmup} timed steps (median), torch {torch.__version__}; the "
          f"losses agree to {agree:.1e} "
          f"(relative, {ours} vs {peer})\n")  # fmt: skip
    print(f"| mode | s/step | vs {peer} | trainable | AdamW state MB/rank | grads MB/rank "
          "| loss first -> last |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for mode, r in result.items():
        state, grads = (b / 1e6 for b in r["held"])
        print(f"| {mode} | {r['seconds']:.3f} | {r['seconds'] / reference['seconds']:.2f} | "
              f"{r['trainable']:,} | {state:.2f} | {grads:.2f} | "
              f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
