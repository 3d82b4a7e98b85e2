"""Held-out accuracy of several runs side by side, read from their own metrics.jsonl files.

    python docs/compare_runs.py SFT=out/sft PPO=out/ppo GRPO=out/grpo MIX=out/mix --pipeline --after PPO=out/rm \
        --output docs/compare.png

Draws held-out accuracy (sampled, greedy) against the training step and against the wall-clock
time of the run (`time/elapsed`, evaluations included), one colour per run, and prints the same
numbers as a table, so a README can quote exactly what the figure shows. With --pipeline the
runs after the first start from its checkpoint (SFT -> RL), so their steps and clocks are drawn
from where the first run's ended; --after LABEL=FOLDER puts the run FOLDER holds on that run's clock
before it (PPO's reward model, which PPO cannot start without).
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KEYS = {"eval/accuracy_sampled": "sampled (mean of 4 at T=1)", "eval/accuracy_greedy": "greedy"}


def read_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_evals(run_dir: str) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl that hold a held-out evaluation."""
    return [row for row in read_rows(run_dir) if "eval/accuracy_sampled" in row]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=FOLDER, one per run")
    parser.add_argument("--title", default="held-out accuracy")
    parser.add_argument("--output", default="comparison.png")
    parser.add_argument("--pipeline", action="store_true", help="draw later runs from where the first one ended")
    parser.add_argument("--steps_only", action="store_true", help="only the step axis (no wall-clock column)")
    parser.add_argument("--after", nargs="*", default=[], metavar="LABEL=FOLDER",
                        help="the run LABEL starts on the clock after the run in FOLDER (e.g. PPO=out/rm)")
    args = parser.parse_args()
    runs = dict(run.split("=", 1) for run in args.runs)
    before = {label: read_rows(folder)[-1]["time/elapsed"] for label, folder in (a.split("=", 1) for a in args.after)}
    first = read_evals(next(iter(runs.values())))[-1]
    step0, clock0 = (first["step"], first.get("time/elapsed", 0.0)) if args.pipeline else (0, 0.0)

    fig, axes = plt.subplots(2, 1 if args.steps_only else 2, figsize=(6 if args.steps_only else 10, 7), sharey="row",
                             squeeze=False)
    print(f"{'run':<22}{'steps':>6}{'minutes':>9}   held-out accuracy, sampled / greedy %: first eval -> last eval")
    for i, ((label, folder), color) in enumerate(zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"])):
        evals = read_evals(folder)
        offset, clock = (step0, clock0 + before.get(label, 0.0)) if i > 0 else (0, 0.0)
        steps = [offset + row["step"] for row in evals]
        timed = [row for row in evals if "time/elapsed" in row]
        for ax_row, key in zip(axes, KEYS):
            name = f"{label} (after its reward model)" if label in before else label
            ax_row[0].plot(steps, [100 * row[key] for row in evals], marker="o", color=color, label=name)
            if not args.steps_only:
                ax_row[1].plot([(clock + row["time/elapsed"]) / 60 for row in timed], [100 * row[key] for row in timed],
                               marker="o", color=color, label=name)
        first, last = evals[0], evals[-1]
        minutes = f"{last['time/elapsed'] / 60:9.1f}" if "time/elapsed" in last else f"{'-':>9}"
        print(
            f"{label:<22}{last['step']:>6}{minutes}   "
            f"{100 * first['eval/accuracy_sampled']:.1f} / {100 * first['eval/accuracy_greedy']:.1f} "
            f"(step {first['step']})"
            f" -> {100 * last['eval/accuracy_sampled']:.1f} / {100 * last['eval/accuracy_greedy']:.1f}"
        )
    for ax_row, name in zip(axes, KEYS.values()):
        ax_row[0].set_ylabel(f"{name}, %")
        xlabels = ("training step (SFT, then RL)", "wall-clock minutes (SFT, then RL)") if args.pipeline else \
            ("training step", "wall-clock minutes of the run")
        for ax, xlabel in zip(ax_row, xlabels[: len(ax_row)]):
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
