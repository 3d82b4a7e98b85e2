"""Held-out accuracy of several runs side by side, read from their own metrics.jsonl files.

    python docs/compare_runs.py SFT=out/sft PPO=out/ppo GRPO=out/grpo MIX=out/mix --pipeline --after PPO=out/rm \
        --output docs/compare.png

Draws held-out accuracy (sampled, greedy) against the training step and against the wall-clock
time of the run (`time/elapsed`, evaluations included), one colour per run, and prints the same
numbers as a table, so a README can quote exactly what the figure shows. With --pipeline the
runs after the first start from its checkpoint (SFT -> RL), so their steps and clocks are drawn
from where the first run's ended; --after LABEL=FOLDER puts the run FOLDER holds on that run's clock
before it (PPO's reward model, which PPO cannot start without). With --gains (a pipeline whose
first run is SFT) the figure has two panels instead: SFT's held-out accuracy against its step, and
each later run's gain, its held-out sampled accuracy minus its own step-0 evaluation, against its step.
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
    parser.add_argument("--gains", action="store_true",
                        help="two panels: the first run's accuracy, then each later run's gain over its step 0")
    args = parser.parse_args()
    runs = dict(run.split("=", 1) for run in args.runs)
    if args.gains:
        return draw_gains(runs, args.title, args.output)
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


def draw_gains(runs: dict, title: str, output: str):
    """The first run (SFT) on its own panel, sampled and greedy accuracy against its step; the later
    runs (RL from its checkpoint) on a second, each one's gain in held-out sampled accuracy over its
    own step-0 evaluation, in points, against its step. Prints the numbers it draws."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    (first_label, first_folder), *later = runs.items()
    evals = read_evals(first_folder)
    for key, style in (("eval/accuracy_sampled", "-"), ("eval/accuracy_greedy", "--")):
        left.plot([row["step"] for row in evals], [100 * row[key] for row in evals], style, marker="o",
                  color=colors[0], label=f"{KEYS[key]}")
    left.set(title=f"{first_label}: held-out accuracy", xlabel=f"{first_label} step", ylabel="accuracy, %")
    print(f"{first_label}: " + ", ".join(f"step {row['step']} {100 * row['eval/accuracy_sampled']:.1f} / "
                                         f"{100 * row['eval/accuracy_greedy']:.1f}" for row in evals))
    for (label, folder), color in zip(later, colors[1:]):
        evals = read_evals(folder)
        start = evals[0]
        gains = [100 * (row["eval/accuracy_sampled"] - start["eval/accuracy_sampled"]) for row in evals]
        right.plot([row["step"] for row in evals], gains, marker="o", color=color,
                   label=f"{label}: {100 * start['eval/accuracy_sampled']:.1f}% -> "
                         f"{100 * evals[-1]['eval/accuracy_sampled']:.1f}%")
        print(f"{label}: sampled {100 * start['eval/accuracy_sampled']:.1f} -> "
              f"{100 * evals[-1]['eval/accuracy_sampled']:.1f} (gain {gains[-1]:+.1f}), greedy "
              f"{100 * start['eval/accuracy_greedy']:.1f} -> {100 * evals[-1]['eval/accuracy_greedy']:.1f}")
    right.axhline(0, color="gray", linewidth=0.8)
    right.set(title=f"RL from the {first_label} model: gain", xlabel="RL step",
              ylabel="gain: sampled accuracy minus step 0's, points")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
