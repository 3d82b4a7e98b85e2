#!/usr/bin/env bash
# The classic chain (SFT -> reward model -> PPO) at its defaults, once per seed: how far apart seeds land.
# About 12 minutes per seed on 2 CPU cores; each seed's runs go to out/seeds/<seed>/.
#
#     bash benchmarks/seeds.sh 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
for seed in "${seeds[@]}"; do
    out=out/seeds/$seed
    python sft.py --seed "$seed" --output_dir "$out/sft" --overwrite_output_dir true
    python reward_model.py --seed "$seed" --model "$out/sft" --output_dir "$out/rm" --overwrite_output_dir true
    python ppo.py --seed "$seed" --model "$out/sft" --reward_model "$out/rm" --output_dir "$out/ppo" --overwrite_output_dir true
    python -c "import json; e = [json.loads(l) for l in open('$out/ppo/metrics.jsonl') if 'eval/accuracy_sampled' in l]; \
print('seed $seed: PPO held-out sampled', ' -> '.join(f\"{100 * r['eval/accuracy_sampled']:.1f}\" for r in e), \
f\"(+{100 * (e[-1]['eval/accuracy_sampled'] - e[0]['eval/accuracy_sampled']):.1f} points)\")"
done
