#!/usr/bin/env bash
# A lent GPU's second call (issue 65, items 2 and 3), under 8 minutes on an H200:
#  - SmolLM2-135M's architecture (its config and tokenizer, carried: first run
#    `python scripts/gpu_model_files.py` here and pass carry=[".gpu-carry"]; the weights
#    are drawn there) fine-tuned in bf16 by `flatshard train --hf` against FSDP2;
#  - `flatshard sample`'s generation against transformers.generate on that model, bf16;
#  - 4 layers of Llama-3-8B's shapes at 8192 tokens, eager and compiled, flatshard against
#    FSDP2, and the flat AdamW against torch's fused AdamW (gpu_check's scale sections).
# Everything it prints lands in $OUT as well.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out="${OUT:-.}"
model="${MODEL_FILES:-.gpu-carry/smollm2}"
status=0
python3 benchmarks/hf_finetune.py --model "$model" --random-weights --steps 8 --seq-len 2048 \
  --batch 8 --keep /tmp/hf-finetune 2>"$out/hf_finetune.log" | tee "$out/hf_finetune.txt" || status=1
python3 benchmarks/hf_sample_speed.py --model /tmp/hf-finetune/model --dtype bf16 --tokens 200 \
  2>"$out/hf_sample_speed.log" | tee "$out/hf_sample_speed.txt" || status=1
python3 scripts/gpu_check.py --out "$out" --sections scale_8b,scale_8b_compiled || status=1
exit $status
