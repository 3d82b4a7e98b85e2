"""The GRPO family side by side: each variant is grpo.py with one or two options changed, run on the
default task from the same SFT checkpoint and seed, then drawn in one figure and one table.

    python sft.py && python benchmarks/grpo_variants.py          # ~25 min on 2 CPU cores
    python benchmarks/grpo_variants.py --only dapo dr_grpo       # a subset
    python benchmarks/grpo_variants.py --draw_only               # redraw from out/variants/

Writes docs/grpo_variants.json (each run's evaluations and means: grpo.md's table is read from it) and
docs/grpo_variants.png.

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


LABELS = {"grpo": "grpo (default)", "grpo_seed1": "grpo, seed 1", "dapo": "dapo", "dr_grpo": "Dr. GRPO",
          "batch_std": "batch std", "grpo_2it": "grpo, 2 updates per batch",
          "clip_higher_2it": "clip-higher, 2 updates", "gspo_2it": "GSPO, 2 updates"}


def summary(folder: str) -> dict:
    """What the page quotes of a run: its held-out evaluations, its clock at the end, and the means over its steps
    of the share of groups with no spread, the clipped share of tokens and the completion length."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [row for row in rows if "frac_reward_zero_std" in row]
    return {"evals": [{"step": row["step"], "sampled": 100 * row["eval/accuracy_sampled"],
                       "greedy": 100 * row["eval/accuracy_greedy"]} for row in rows if "eval/accuracy_sampled" in row],
            "minutes": rows[-1]["time/elapsed"] / 60,
            **{key: sum(row[key] for row in steps) / len(steps)
               for key in ("frac_reward_zero_std", "clip_fraction", "completion_length")}}


def table(results: dict) -> str:
    """docs/grpo.md's table: held-out sampled accuracy at each evaluation, greedy at the end, minutes, flat groups."""
    lines = ["| variant | options | sampled accuracy | greedy | minutes | frac_reward_zero_std |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, run in results.items():
        *before, last = [f"{round(e['sampled'], 2):g}" for e in run["evals"]]
        lines.append(f"| {LABELS[name]} | {' '.join(f'`{o}`' for o in [' '.join(VARIANTS[name][0])] if o)} | "
                     f"{' -> '.join(before)} -> **{last}** | {run['evals'][-1]['greedy']:.1f} | {run['minutes']:.1f} | "
                     f"{run['frac_reward_zero_std']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="out/sft", help="the SFT checkpoint every variant starts from")
    parser.add_argument("--output_dir", default="out/variants", help="one folder per variant goes here")
    parser.add_argument("--only", nargs="*", default=list(VARIANTS), help=f"a subset of: {', '.join(VARIANTS)}")
    parser.add_argument("--draw_only", action="store_true", help="do not train: draw the runs already there")
    parser.add_argument("--figure", default="docs/grpo_variants.png")
    parser.add_argument("--summary", default="docs/grpo_variants.json",
                        help="where each run's summary goes (the table in docs/grpo.md is read from it)")
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
    results = {name: summary(os.path.join(ROOT, args.output_dir, name)) for name in args.only}
    if args.summary:
        with open(os.path.join(ROOT, args.summary), "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))
    subprocess.run([sys.executable, "docs/compare_runs.py",
                    *(f"{n}={os.path.join(args.output_dir, n)}" for n in args.only),
                    "--title", "GRPO variants from the same out/sft and seed (2-core CPU)", "--output", args.figure],
                   cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
