"""The 2026 syllabus side by side: RM + PPO, offline and online DPO, GRPO, RLOO and REINFORCE++ on the toy task.

Every method starts from the same SFT checkpoint and evaluates on the same held-out problems, once per seed;
PPO and the reward-model judge read the same reward model. Then one figure (held-out sampled accuracy
against the step and against the run's clock, the mean over seeds with its range, and offline DPO's
log-probs of the chosen and rejected answers) and one markdown table (mean and range over the seeds):

    python sft.py && python reward_model.py              # out/sft, out/rm
    python benchmarks/syllabus.py --seeds 0 1 2          # out/syllabus/<method>/<seed>, docs/syllabus.png
    python benchmarks/syllabus.py --seeds 0 --methods grpo rloo --max_steps 40   # a quick look

A run already finished in its folder is read, not repeated (delete the folder to rerun it).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {  # label: (script, arguments beyond --model / --seed / --output_dir)
    "grpo": ("grpo.py", []),
    "rloo": ("grpo.py", ["--advantage_estimator", "rloo"]),
    "reinforce_pp": ("grpo.py", ["--advantage_estimator", "reinforce_pp"]),
    "dpo_offline": ("dpo.py", []),
    "dpo_online_rule": ("dpo.py", ["--online", "true", "--judge", "rule"]),
    "dpo_online_rm": ("dpo.py", ["--online", "true", "--judge", "{rm}"]),
    "rm_ppo": ("ppo.py", ["--reward_model", "{rm}"]),
}


def run(method: str, seed: int, args) -> str:
    """Train one method at one seed (unless its folder holds a finished run); returns the folder."""
    script, extra = METHODS[method]
    out = os.path.join(args.out, method, str(seed))
    if os.path.isfile(os.path.join(out, "eval.json")):
        return out
    command = [sys.executable, script, "--model", args.sft, "--seed", str(seed), "--output_dir", out,
               "--overwrite_output_dir", "true", *[a.format(rm=args.rm) for a in extra]]
    if args.max_steps:
        command += ["--max_steps", str(args.max_steps), "--eval_steps", str(max(1, args.max_steps // 3))]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return out


def read_rows(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def evaluations(folder: str) -> list[dict]:
    return [row for row in read_rows(folder) if "eval/accuracy_sampled" in row]


def spread(values: list[float]) -> str:
    """mean, and the range over seeds."""
    mean = statistics.fmean(values)
    return f"{mean:.1f} ({min(values):.1f} to {max(values):.1f})" if len(values) > 1 else f"{mean:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--sft", default="out/sft", help="the SFT checkpoint every method starts from")
    parser.add_argument("--rm", default="out/rm", help="the reward model of PPO and of the online-DPO judge")
    parser.add_argument("--max_steps", type=int, default=0, help="0: each script's default")
    parser.add_argument("--out", default="out/syllabus")
    parser.add_argument("--figure", default="docs/syllabus.png")
    args = parser.parse_args()
    for path, hint in ((args.sft, "python sft.py"), (args.rm, "python reward_model.py")):
        if not os.path.isdir(os.path.join(ROOT, path)):
            sys.exit(f"error: {path} does not exist: run `{hint}` first")

    folders = {m: [run(m, seed, args) for seed in args.seeds] for m in args.methods}
    fig, (by_step, by_time, logps) = plt.subplots(1, 3, figsize=(16, 4.5))
    print("| method | steps | minutes | held-out sampled at step 0 | at the end | gain (points) | greedy at the end |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, runs in folders.items():
        evals = [evaluations(os.path.join(ROOT, f)) for f in runs]
        steps = [row["step"] for row in evals[0]]
        curves = [[100 * row["eval/accuracy_sampled"] for row in e] for e in evals]
        mean = [statistics.fmean(c[i] for c in curves) for i in range(len(steps))]
        line, = by_step.plot(steps, mean, marker="o", label=method)
        by_step.fill_between(steps, [min(c[i] for c in curves) for i in range(len(steps))],
                             [max(c[i] for c in curves) for i in range(len(steps))], alpha=0.15,
                             color=line.get_color())
        minutes = [statistics.fmean(row.get("time/elapsed", 0) for row in (e[i] for e in evals)) / 60
                   for i in range(len(steps))]
        by_time.plot(minutes, mean, marker="o", color=line.get_color(), label=method)
        start, end = [c[0] for c in curves], [c[-1] for c in curves]
        greedy = [100 * e[-1]["eval/accuracy_greedy"] for e in evals]
        print(f"| {method} | {steps[-1]} | {minutes[-1]:.1f} | {spread(start)} | {spread(end)} | "
              f"{spread([b - a for a, b in zip(start, end)])} | {spread(greedy)} |")
        if method == "dpo_offline":  # the policy's log-ratio to pi_ref (TRL's rewards/* over beta), seeds' mean
            rows = [[row for row in read_rows(os.path.join(ROOT, f)) if "rewards/chosen" in row] for f in runs]
            with open(os.path.join(ROOT, runs[0], "run.json")) as f:
                beta = json.load(f)["settings"]["beta"]
            for key in ("chosen", "rejected"):
                logps.plot([row["step"] for row in rows[0]],
                           [statistics.fmean(r[i][f"rewards/{key}"] for r in rows) / beta for i in range(len(rows[0]))],
                           label=f"{key}: mean log pi - log pi_ref")
                logps.axhline(statistics.fmean(row[f"logps/{key}"] for r in rows for row in r), ls=":", lw=1,
                              color=logps.lines[-1].get_color(), label=f"{key}: mean summed log pi (a level)")
    by_step.set(xlabel="step", ylabel="held-out sampled accuracy, % (mean; band: range over seeds)")
    by_time.set(xlabel="minutes (time/elapsed, evaluations included)", ylabel="held-out sampled accuracy, %")
    logps.set(xlabel="step", ylabel="nats", title="offline DPO: the chosen and the rejected answers")
    for ax in (by_step, by_time, logps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"from {args.sft}, seeds {', '.join(map(str, args.seeds))}")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, args.figure), dpi=110)
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
