"""The GRPO family side by side: each variant is grpo.py with one or two options changed, run on the
default task from the same SFT checkpoint and seed, then drawn in one figure and one table.

    python sft.py && python benchmarks/grpo_variants.py          # ~25 min on 2 CPU cores
    python benchmarks/grpo_variants.py --only dapo dr_grpo       # a subset
    python benchmarks/grpo_variants.py --draw_only               # redraw from out/variants/

With one update per rollout batch (--num_iterations 1, the default) the ratio pi / pi_old is 1 at
every token, so nothing is ever clipped: the clip-range variants (DAPO's clip-higher, GSPO's
sequence-level ratio) can only differ with more updates per batch, so they run with
--num_iterations 2 next to plain GRPO with --num_iterations 2. Two seeds of the default say how
far apart two draws of the same recipe land.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name: (grpo.py options, what they change)
    "grpo": ([], "the default: per-sequence mean, group std"),
    "grpo_seed1": (["--seed", "1"], "the default, another seed"),
    "dapo": (["--loss_type", "dapo"], "one token mean over the step"),
    "dr_grpo": (["--loss_type", "dr_grpo", "--scale_rewards", "none"], "constant denominator, no std"),
    "batch_std": (["--scale_rewards", "batch"], "the batch's reward std instead of the group's"),
    "grpo_2it": (["--num_iterations", "2"], "two updates per rollout batch"),
    "clip_higher_2it": (["--num_iterations", "2", "--epsilon_high", "0.28"], "DAPO's upper clip 0.28"),
    "gspo_2it": (["--num_iterations", "2", "--importance_sampling_level", "sequence", "--epsilon", "3e-4",
                  "--epsilon_high", "4e-4"], "one ratio per completion (GSPO)"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="out/sft", help="the SFT checkpoint every variant starts from")
    parser.add_argument("--output_dir", default="out/variants", help="one folder per variant goes here")
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), help=f"a subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--draw_only", action="store_true", help="do not train: draw the runs already there")
    parser.add_argument("--figure", default="docs/grpo_variants.png")
    args = parser.parse_args()
    for name in args.only:
        if name not in VARIANTS:
            sys.exit(f"error: no variant {name!r} (there are: {', '.join(VARIANTS)})")
        folder = os.path.join(args.output_dir, name)
        if not args.draw_only:
            print(f"{name}: python grpo.py {' '.join(VARIANTS[name][0])}", flush=True)
            subprocess.run([sys.executable, "grpo.py", "--model", args.model, "--output_dir", folder,
                            "--overwrite_output_dir", "true", *VARIANTS[name][0]], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
    print("\n| variant | options | what it changes | held-out sampled | greedy | minutes | frac_reward_zero_std |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.only:
        with open(os.path.join(ROOT, args.output_dir, name, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        evals = [row for row in rows if "eval/accuracy_sampled" in row]
        steps = [row for row in rows if "frac_reward_zero_std" in row]
        zero_std = sum(row["frac_reward_zero_std"] for row in steps) / len(steps)
        sampled = " -> ".join(f"{100 * row['eval/accuracy_sampled']:.1f}" for row in evals)
        print(
            f"| {name} | `{' '.join(VARIANTS[name][0]) or '(none)'}` | {VARIANTS[name][1]} | {sampled} | "
            f"{100 * evals[-1]['eval/accuracy_greedy']:.1f} | {evals[-1]['time/elapsed'] / 60:.1f} | {zero_std:.2f} |"
        )
    subprocess.run([sys.executable, "docs/compare_runs.py",
                    *(f"{n}={os.path.join(args.output_dir, n)}" for n in args.only),
                    "--title", "GRPO variants from the same out/sft and seed (2-core CPU)", "--output", args.figure],
                   cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
