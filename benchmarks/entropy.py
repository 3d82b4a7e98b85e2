"""The policy's entropy over a GRPO run, and what clip-higher and a higher temperature do to it, on three seeds.

Entropy, -sum_v p(v) log p(v) of the policy at each completion token (grpo.py logs its token mean as
`entropy`), falls as RL makes the policy surer of its answers; collapsed, every sample of a group is the
same and the group teaches nothing. Two remedies of 2025 (Cui et al. 2025, "The Entropy Mechanism of RL
for Reasoning LMs"; DAPO, Yu et al. 2025): clip-higher, a larger upper clip bound (`--epsilon_high 0.28`)
so that rare tokens whose advantage is positive may grow further; and sampling at a higher temperature.
Clip-higher acts only where the clip does, from a batch's second update on, so every run here makes
four updates per batch (`--num_iterations 4`); each run changes one thing against `base`:

    base              grpo.py --num_iterations 4 (syllabus.py's grpo_4_iterations, entropy logged)
    clip_higher       base with --epsilon_high 0.28
    temperature_1.2   base with --temperature 1.2 (its entropy is measured at the temperature it samples at)

Each from benchmarks/syllabus.py's SFT model of the seed, 40 steps, evaluated at steps 0, 20 and 40
(held-out accuracy is always sampled at temperature 1).

    python benchmarks/entropy.py                 # the runs (a finished run is read, not repeated), the figure
    python benchmarks/entropy.py --report        # docs/entropy.png and the table from docs/entropy.json
"""
import argparse
import importlib.util
import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"base": ["--num_iterations", "4"],
        "clip_higher": ["--num_iterations", "4", "--epsilon_high", "0.28"],
        "temperature_1.2": ["--num_iterations", "4", "--temperature", "1.2"]}
COLORS = {"base": "tab:blue", "clip_higher": "tab:orange", "temperature_1.2": "tab:red"}


def syllabus():
    spec = importlib.util.spec_from_file_location("syllabus", os.path.join(ROOT, "benchmarks", "syllabus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(arm: str, seed: int, args) -> dict:
    """One arm at one seed, from the seed's SFT model; its entropy, clip fraction and accuracy per step."""
    bench, sft = syllabus(), f"{args.runs}/sft/{seed}"
    if not os.path.isfile(os.path.join(ROOT, sft, "eval.json")):
        raise SystemExit(f"error: no SFT model at {sft}: run `python benchmarks/syllabus.py --methods grpo` first")
    folder = bench.train(f"{args.out}/{arm}/{seed}", ["grpo.py", "--model", sft, "--seed", str(seed),
                                                      "--max_steps", "40", "--eval_steps", "20", *ARMS[arm]])
    rows = bench.read_rows(folder)
    train = [row for row in rows if row["step"] > 0]
    return {"seed": seed, "cost": bench.read_cost(folder),
            "steps": [row["step"] for row in train], "entropy": [row["entropy"] for row in train],
            "clip_fraction": statistics.fmean(row["clip_fraction"] for row in train),
            "evals": [{"step": row["step"], "sampled": 100 * row["eval/accuracy_sampled"]}
                      for row in rows if "eval/accuracy_sampled" in row]}


def figure(results: dict, path: str):
    fig, (left, hot, right) = plt.subplots(1, 3, figsize=(15, 4))
    for arm, runs in results.items():
        steps = runs[0]["steps"]
        columns = list(zip(*[run["entropy"] for run in runs]))
        ax = hot if arm.startswith("temperature") else left  # measured at its own temperature: another scale
        ax.plot(steps, [statistics.fmean(c) for c in columns], color=COLORS[arm], label=arm)
        ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=COLORS[arm], alpha=0.2,
                        linewidth=0)
        evals = list(zip(*[[e["sampled"] - run["evals"][0]["sampled"] for e in run["evals"]] for run in runs]))
        right.plot([e["step"] for e in runs[0]["evals"]], [statistics.fmean(c) for c in evals], color=COLORS[arm],
                   marker="o", label=arm)
    left.set(xlabel="step", ylabel="entropy (nats per completion token)", title="the policy's entropy, at T = 1")
    hot.set(xlabel="step", ylabel="entropy (nats per completion token)",
            title="at T = 1.2, the temperature it samples at")
    right.set(xlabel="step", ylabel="gain (points): held-out sampled accuracy\nminus at step 0",
              title="what it learned")
    for ax in (left, hot, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("GRPO with 4 updates per batch, from the SFT model of each seed (0, 1, 2): mean (line), range (band)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    def cell(values, fmt="{:.3f}"):
        return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))} to {fmt.format(max(values))})"

    lines = ["| arm | entropy, step 1 | entropy, mean of steps 31-40 | its change | clip fraction | gain (points) | "
             "minutes on one core |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm, runs in results.items():
        first, last = [run["entropy"][0] for run in runs], [statistics.fmean(run["entropy"][-10:]) for run in runs]
        lines.append(f"| {arm} | {cell(first)} | {cell(last)} | {cell([b - a for a, b in zip(first, last)])} | "
                     f"{cell([100 * run['clip_fraction'] for run in runs], '{:.2f}')}% | "
                     f"{cell([run['evals'][-1]['sampled'] - run['evals'][0]['sampled'] for run in runs], '{:.1f}')} | "
                     f"{statistics.fmean(run['cost']['cpu_minutes'] for run in runs):.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", default="out/syllabus", help="benchmarks/syllabus.py's runs: the SFT models")
    parser.add_argument("--out", default="out/entropy")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--docs", default="docs")
    parser.add_argument("--report", action="store_true", help="train nothing: figure and table from the json")
    args = parser.parse_args()
    path = os.path.join(ROOT, args.docs, "entropy.json")
    if args.report:
        with open(path) as f:
            results = json.load(f)
    else:
        results = {arm: [run(arm, seed, args) for seed in args.seeds] for arm in args.arms}
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    figure(results, os.path.join(ROOT, args.docs, "entropy.png"))
    print(table(results))


if __name__ == "__main__":
    main()
