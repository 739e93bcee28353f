"""`flatshard convert`: Hugging Face model directory <-> flatshard checkpoint, for every
model flatshard.hf.from_pretrained builds (flatshard's Llama for Llama/Qwen2/Qwen3, the
transformers model for any other causal LM).

In one process the model is plain (unsharded); under torchrun it is sharded over the
ranks, so each rank reads and writes only its rows. Weights only: a checkpoint made from a
Hugging Face model has no optimizer state; the source's config.json fields (metadata
included), generation_config.json and tokenizer files (chat template included) come back on
export, so the directory is a complete model for transformers, vLLM or llama.cpp's converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from flatshard import checkpoint, hf
from flatshard.cli import runs
from flatshard.cli.errors import RunError
from flatshard.cli.hf_records import hf_records, source_tokenizer_records
from flatshard.cli.launch import init_distributed, run, under_launcher
from flatshard.cli.model import (
    build_lora_model,
    build_plain,
    build_sharded,
    build_transformers,
    lora_of_checkpoint,
)
from flatshard.cli.saved_model import is_transformers_config, saved_model_config
from flatshard.models import family_of_config
from flatshard.models.lora import merge_adapters, peft_adapter
from flatshard.models.transformers import shard_decoder_layers

HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def convert_command(args) -> int:
    worker = hf_to_checkpoint if args.direction == "hf-to-checkpoint" else checkpoint_to_hf
    if under_launcher():
        return run(worker, (args, True), 1)
    worker(args, False)
    return 0


def _say(sharded: bool, text: str) -> None:
    if not sharded or torch.distributed.get_rank() == 0:
        print(text, flush=True)


def hf_to_checkpoint(args, sharded: bool) -> None:
    if args.step < 0:
        raise RunError(f"--step must be >= 0, got {args.step}")
    if sharded:
        init_distributed()
    shard = shard_decoder_layers if sharded else None
    model = hf.from_pretrained(args.source, shard=shard)
    # what the weights do not hold (config metadata, generation settings, the tokenizer)
    # comes back on export
    kept = {**hf_records(args.source), **source_tokenizer_records(args.source)}
    handle = checkpoint.save(
        args.target, model=model, step=args.step, source=str(args.source), **kept
    )
    path = handle.wait()
    count = sum(p.numel() for p in model.parameters())  # global numel, tied ones once
    _say(sharded, f"wrote {path} ({count:,} parameters, no optimizer state)")


def checkpoint_to_hf(args, sharded: bool) -> None:
    target = Path(args.target)
    if target.is_dir() and any(target.iterdir()) and not args.overwrite:
        raise RunError(
            f"{target} is not empty; pass --overwrite to replace a previous export there (its "
            "config, generation config and weights), or pick an empty directory"
        )
    ranks = init_distributed() if sharded else None
    group = torch.distributed.group.WORLD if sharded else None
    root, step, path, cfg = saved_model_config(args.source, group)  # verified
    if not is_transformers_config(cfg) and not family_of_config(cfg).hf_export:
        raise RunError(
            f"{path} holds an MoE model; exporting it to Hugging Face is not supported yet "
            "(only Llama, Qwen2 and Qwen3 are)"
        )
    lora = lora_of_checkpoint(path)  # (base, adapters): the checkpoint holds the adapters
    if lora is not None:
        if sharded:
            raise RunError(f"{path} holds LoRA adapters: export it in one process (no torchrun)")
        model = build_lora_model(*lora, sharded=False, device="cpu")
    elif is_transformers_config(cfg):
        model = build_transformers(cfg, sharded=sharded, device=ranks.device if sharded else "cpu")
    elif sharded:
        model = build_sharded(cfg, zero_stage=3, precision="fp32", seed=0, device=ranks.device)
    else:
        model = build_plain(cfg)
    checkpoint.load(root, model=model, step=step, verify=False,  # verified above
                    trainable_only=lora is not None)  # fmt: skip
    if args.peft:
        if lora is None:
            raise RunError(f"{path} is not a LoRA run's checkpoint: --peft exports adapters")
        _write_peft(model, lora[0], path, target)
        return
    if lora is not None:
        merge_adapters(model)  # the export is the fine-tuned model, whole
    dtype = HF_DTYPES[args.dtype] if args.dtype else None
    hf.save_pretrained(
        model, args.target, dtype=dtype, max_shard_size=args.max_shard_size,
        source_config=_saved_json(path, "hf_config"),
        generation_config=_saved_json(path, "hf_generation_config"),
    )  # fmt: skip
    written = _write_tokenizer(path, target) if not sharded or ranks.is_main else []
    count = sum(p.numel() for p in model.parameters())
    with_tokenizer = f", its tokenizer ({', '.join(written)})" if written else ""
    _say(sharded, f"wrote {args.target} from {path} ({count:,} parameters{with_tokenizer})")


def _write_peft(model, base: str, path: str, target: Path) -> None:
    """A PEFT adapter directory: adapter_model.safetensors, adapter_config.json (its base:
    `base`) and the tokenizer files, for `peft.PeftModel.from_pretrained(base_model, target)`."""
    tensors, config = peft_adapter(model, base)
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    written = _write_tokenizer(path, target)
    size = sum(t.numel() for t in tensors.values())
    modules = ", ".join(config["target_modules"])
    tokenizer = ", its tokenizer" if written else ""
    print(f"wrote {target} from {path}: LoRA adapters of {base} ({size:,} parameters, rank "
          f"{config['r']} on {modules}){tokenizer}", flush=True)  # fmt: skip


def _write_tokenizer(path: str, target: Path) -> list[str]:
    """The tokenizer files the checkpoint recorded, beside the weights (their names)."""
    text = runs.saved_extra(path, "tokenizer_files")
    if text is None:
        return []
    files = json.loads(text)
    for name, data in files.items():
        (target / name).write_bytes(data.encode("latin-1"))
    return sorted(files)


def _saved_json(path: str, name: str) -> dict | None:
    text = runs.saved_extra(path, name)
    return None if text is None else json.loads(text)
