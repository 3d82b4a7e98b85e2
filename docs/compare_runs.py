"""Held-out accuracy of several runs side by side, read from their own metrics.jsonl files.

    python docs/compare_runs.py GRPO=out/grpo MIX=out/mix --title "GRPO vs MIX" --output docs/grpo_vs_mix.png

Draws greedy and sampled held-out accuracy against the training step (one colour per run) and
prints the same numbers as a table, so a README can quote exactly what the figure shows.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_evals(run_dir: str) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl that hold a held-out evaluation."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "eval/accuracy_sampled" in row]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=FOLDER, one per run")
    parser.add_argument("--title", default="held-out accuracy")
    parser.add_argument("--output", default="comparison.png")
    args = parser.parse_args()
    runs = dict(run.split("=", 1) for run in args.runs)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    print(f"{'run':<14}" + "".join(f"{'step ' + str(r['step']):>16}" for r in read_evals(next(iter(runs.values())))))
    for (label, folder), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        evals = read_evals(folder)
        steps = [row["step"] for row in evals]
        for ax, key in zip(axes, ("eval/accuracy_sampled", "eval/accuracy_greedy")):
            ax.plot(steps, [100 * row[key] for row in evals], marker="o", color=color, label=label)
        print(f"{label:<14}" + "".join(f"{100 * r['eval/accuracy_sampled']:7.1f} / {100 * r['eval/accuracy_greedy']:5.1f}"
                                       for r in evals) + "   (sampled / greedy %)")
    for ax, name in zip(axes, ("sampled (mean of 4 at T=1)", "greedy")):
        ax.set_title(f"held-out accuracy, {name}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("%")
    axes[0].legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
