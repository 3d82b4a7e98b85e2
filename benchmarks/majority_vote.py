"""Majority vote (maj@k) against a reward model's pick and the checker's (pass@k), on three seeds.

For each seed s, best_of_n.py samples 64 answers to each of the first 200 held-out problems from the SFT
model of seed s and from the GRPO model trained from it (benchmarks/syllabus.py's sft and grpo, 40 steps),
and keeps one answer of k three ways, for k = 1, 2, 4, ..., 64:

    pass@k       the checker picks: right if any of the k is (a perfect judge; the ceiling)
    best of k    the reward model of seed s (reward_model.py, syllabus.py's rm) picks its top-scored answer
    maj@k        no judge: the answer most of the k give (self-consistency, Wang et al. 2023)

    python benchmarks/majority_vote.py               # the evaluations (one at a time), docs/majority_vote.json, .png
    python benchmarks/majority_vote.py --report      # the figure and table from docs/majority_vote.json

The models and reward models are read from out/syllabus/ (syllabus.py and distill_runs.py train them; a
missing one is refused in one sentence); the evaluations go to out/majority_vote/<model>/<seed>/.
"""
import argparse
import importlib.util
import json
import os
import statistics
import types

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JSON, FIGURE = "docs/majority_vote.json", "docs/majority_vote.png"
MODELS = {"sft": "SFT", "grpo": "GRPO, 40 steps from it"}
WAYS = {"pass@k": ("the checker picks (pass@k)", "tab:blue", "o"),
        "best_of_k": ("the reward model picks (best of k)", "tab:green", "s"),
        "maj@k": ("no judge: the most given answer (maj@k)", "tab:purple", "^")}


def pass_at_k_module():
    spec = importlib.util.spec_from_file_location("pass_at_k", os.path.join(ROOT, "benchmarks", "pass_at_k.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(seeds: list[int]) -> dict:
    args = types.SimpleNamespace(out="out/majority_vote", runs="out/syllabus", num_samples=64, num_eval_examples=200)
    for model in MODELS:
        for seed in seeds:
            for folder in (f"{args.runs}/{model}/{seed}", f"{args.runs}/rm/{seed}"):
                if not os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
                    raise SystemExit(f"error: no run at {folder}: run `python benchmarks/distill_runs.py` (the grpo "
                                     "models) and `python benchmarks/syllabus.py --methods grpo` (the reward models)")
    evaluate = pass_at_k_module().evaluate
    results = {}
    for model in MODELS:
        results[model] = []
        for seed in seeds:
            run = evaluate(model, seed, args)
            results[model].append({"seed": seed, "minutes": run["wall_minutes"], "n": run["n"],
                                   "pass@k": run["pass@k"], "maj@k": run["maj@k"],
                                   "best_of_k": {k: row["gold"] for k, row in run["best_of_n"].items()}})
    return {"seeds": seeds, "num_samples": args.num_samples, "num_eval_examples": args.num_eval_examples,
            "results": results}


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.1f} ({min(values):.1f} to {max(values):.1f})"


def tables(data: dict) -> list[str]:
    """The markdown table docs/best_of_n.md quotes (tests/test_prose_numbers.py holds the page to it): each way at
    k = 1, 4, 16, 64, mean (range over seeds), and maj@k minus the reward model's pick, per seed."""
    ks = ["1", "4", "16", "64"]
    lines = ["| model | way | " + " | ".join(f"k = {k}" for k in ks) + " |", "| --- | --- |" + " --- |" * len(ks)]
    for model in MODELS:
        runs = data["results"][model]
        for way in WAYS:
            lines.append(f"| {model} | {way} | " + " | ".join(spread([100 * r[way][k] for r in runs]) for k in ks)
                         + " |")
        lines.append(f"| {model} | maj@k minus best of k, per seed | " + " | ".join(
            ", ".join(f"{100 * (r['maj@k'][k] - r['best_of_k'][k]):+.1f}" for r in runs) for k in ks) + " |")
    return lines


def prose(data: dict) -> list[str]:
    """The sentences of docs/best_of_n.md that quote the runs (tests/test_prose_numbers.py finds each in the page):
    for each model, the vote's gain over one sample, where the reward model's pick peaks, and what a perfect
    judge adds over the vote at k = 64."""
    def listed(values):
        return ", ".join(f"{v:+.1f}" for v in values)

    sentences = []
    for model in MODELS:
        runs = data["results"][model]
        peaks = [max(r["best_of_k"], key=lambda k: r["best_of_k"][k]) for r in runs]
        vote_gain = [100 * (r["maj@k"]["64"] - r["pass@k"]["1"]) for r in runs]
        judge_gain = [100 * (r["pass@k"]["64"] - r["maj@k"]["64"]) for r in runs]
        sentences += [
            f"{model}: maj@64 minus pass@1, per seed, {listed(vote_gain)} points",
            f"{model}: the reward model's pick was best at k = {', '.join(peaks)} (per seed) and fell to "
            f"{statistics.fmean(100 * r['best_of_k']['64'] for r in runs):.1f} at k = 64",
            f"{model}: pass@64 minus maj@64, per seed, {listed(judge_gain)}",
        ]
    def vote_minus_judge(model, k):
        return [100 * (r["maj@k"][k] - r["best_of_k"][k]) for r in data["results"][model]]

    at_64 = vote_minus_judge("sft", "64") + vote_minus_judge("grpo", "64")
    sentences += [f"(the row above: {listed(vote_minus_judge('sft', '4'))})",
                  f"already behind ({listed(vote_minus_judge('grpo', '4'))})",
                  f"the vote was ahead by {min(at_64):.0f} to {max(at_64):.0f} points"]
    return sentences


def figure(data: dict):
    fig, axes = plt.subplots(1, len(MODELS), figsize=(11, 4), sharey=True)
    for ax, model in zip(axes, MODELS):
        runs = data["results"][model]
        ks = [int(k) for k in runs[0]["pass@k"]]
        for way, (label, color, marker) in WAYS.items():
            for i, r in enumerate(runs):
                ax.plot(ks, [100 * v for v in r[way].values()], color=color, marker=marker, alpha=0.7,
                        label=label if i == 0 else None)
        ax.set(xscale="log", title=f"{MODELS[model]}: one line a seed", xlabel="k (answers sampled per problem)")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("the kept answer right (%)")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"One answer kept of k: {data['num_samples']} samples of each of {data['num_eval_examples']} "
                 f"held-out problems, {len(data['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, FIGURE), dpi=110)
    print(f"wrote {FIGURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report", action="store_true", help="only the table and figure, from the json")
    args = parser.parse_args()
    if not args.report:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ["TQDM_DISABLE"] = "1"
        with open(os.path.join(ROOT, JSON), "w") as f:
            json.dump(measure(args.seeds), f, indent=1)
    with open(os.path.join(ROOT, JSON)) as f:
        data = json.load(f)
    print("\n".join(tables(data)))
    figure(data)


if __name__ == "__main__":
    main()
