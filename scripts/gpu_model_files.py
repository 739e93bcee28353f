"""Copy SmolLM2-135M-Instruct's config and tokenizer (no weights: a lent GPU machine takes at
most 64 MiB of files) to a folder the device call carries; `scripts/gpu_real_model.sh`
draws the weights there.

    python scripts/gpu_model_files.py [.gpu-carry/smollm2]
"""

from __future__ import annotations

import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

from hf_finetune import WEIGHTS  # noqa: E402
from real_model import model_dir_or_exit  # noqa: E402


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".gpu-carry", "smollm2")
    source = model_dir_or_exit("")
    os.makedirs(target, exist_ok=True)
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(WEIGHTS) and name != "complete":
            shutil.copy(path, target)  # "complete": real_model.py's cache marker
    print(f"{target}: {', '.join(sorted(os.listdir(target)))}")


if __name__ == "__main__":
    main()
