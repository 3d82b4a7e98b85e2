"""pass@k and best-of-N of the SFT and GRPO models of benchmarks/syllabus.py, on three seeds.

For each seed s, best_of_n.py samples 64 answers to each of the first 200 held-out problems from the
SFT model of seed s and from the GRPO model trained from it (40 steps), and scores them with that
seed's reward model (reward_model.py, the one PPO and online DPO read). One figure, docs/best_of_n.png:
pass@k of SFT against GRPO for k = 1..64 (does GRPO sharpen what SFT's samples hold, or add to it?),
and best-of-N of the SFT model against the bound KL(best-of-N || SFT) <= log N - (N - 1) / N, the kept answer's
gold accuracy (the checker) and its proxy score (the reward model's): the over-optimisation curve; and
on the same KL axis, PPO and online DPO trained on those reward models (syllabus.py's rm_ppo and
dpo_online_rm runs) at their evaluations (along_training), their KLs estimated from samples: a bound and two
estimates on one axis, which show where each run went, not why.

    python benchmarks/syllabus.py --methods grpo        # the models (a finished run is read, not repeated)
    python benchmarks/pass_at_k.py                      # the evaluations, docs/best_of_n.json and .png
    python benchmarks/pass_at_k.py --report             # the figure and table from docs/best_of_n.json

With --smollm2 it evaluates nothing either: it reads the runs of benchmarks/smollm2_pass_at_k.sh
(SmolLM2-135M-Instruct, SFT for 120 steps, then GRPO; 64 samples of each of 64 held-out problems from
both), committed under docs/smollm2_runs/pass-at-k-seed*/, and prints pass@k of both models, the
problems only one of them solved, and both by kind of problem (benchmarks/by_kind.py); its figure is
docs/smollm2_pass_at_k.png.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"sft": "SFT", "grpo": "GRPO, 40 steps from it"}
TRAINED = {"rm_ppo": "PPO", "dpo_online_rm": "online DPO"}  # trained on the same reward model (syllabus.py's runs)


def evaluate(model: str, seed: int, args) -> dict:
    """best_of_n.py on one model (a finished evaluation is read, not repeated); its minutes added."""
    folder = os.path.join(args.out, model, str(seed))
    if not os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
        started = time.perf_counter()
        subprocess.run([sys.executable, "best_of_n.py", "--model", f"{args.runs}/{model}/{seed}",
                        "--judge", f"{args.runs}/rm/{seed}", "--num_samples", str(args.num_samples),
                        "--num_eval_examples", str(args.num_eval_examples), "--seed", str(seed),
                        "--output_dir", folder, "--overwrite_output_dir", "true"], cwd=ROOT, check=True)
        with open(os.path.join(ROOT, folder, "minutes.json"), "w") as f:
            json.dump({"wall_minutes": (time.perf_counter() - started) / 60,
                       "threads": os.environ.get("OMP_NUM_THREADS", "default")}, f)
    with open(os.path.join(ROOT, folder, "eval.json")) as f:
        result = json.load(f)
    with open(os.path.join(ROOT, folder, "minutes.json")) as f:
        return {**result, **json.load(f), "seed": seed}


def along_training(method: str, seed: int, runs: str) -> list[dict]:
    """A syllabus.py run trained on the reward model, at its evaluations (steps 0, 20, 40): gold = held-out
    sampled accuracy, and the mean over the 5 steps up to it of the KL to pi_ref of the policy's samples and
    their reward-model score (proxy). The KL: PPO's kl_sum (log pi - log pi_ref summed over a sample); online
    DPO's mean log-ratio of its counted pairs' two samples, (rewards/chosen + rewards/rejected) / (2 beta)
    (tied pairs, two identical samples, are left out of it). Step 0: the start, KL 0."""
    with open(os.path.join(ROOT, runs, method, str(seed), "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(ROOT, runs, method, str(seed), "run.json")) as f:
        beta = json.load(f)["settings"].get("beta")

    def kl(row):
        return row["kl_sum"] if "kl_sum" in row else (row["rewards/chosen"] + row["rewards/rejected"]) / (2 * beta)

    points = []
    for row in rows:
        if "eval/accuracy_sampled" in row:
            window = [r for r in rows if row["step"] - 5 < r["step"] <= row["step"] and "score" in r]
            points.append({"step": row["step"], "gold": row["eval/accuracy_sampled"],
                           "kl": statistics.fmean(kl(r) for r in window) if window else 0.0,
                           "proxy": statistics.fmean(r["score"] for r in window) if window else None})
    return points


def band(ax, xs, runs: list[list[float]], label: str, color: str, marker: str = "o"):
    """The mean over seeds (points, joined) and their range (band)."""
    columns = list(zip(*runs))
    ax.plot(xs, [statistics.fmean(c) for c in columns], marker=marker, color=color, label=label, markersize=4)
    ax.fill_between(xs, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2, linewidth=0)


def pass_at_k_panel(ax, results: dict, labels: dict):
    """pass@k of the SFT model against the GRPO model, k = 1..n: mean over seeds and their range."""
    ks = [int(k) for k in results["sft"][0]["pass@k"]]
    for model, color in (("sft", "tab:blue"), ("grpo", "tab:orange")):
        band(ax, ks, [[100 * v for v in run["pass@k"].values()] for run in results[model]], labels[model], color)
    ax.set(xscale="log", xlabel="k: answers sampled per problem", ylabel="pass@k: at least one right (%)",
           title="pass@k, SFT against GRPO")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.legend(fontsize=8)


def figure(results: dict, path: str, num_eval_examples: int, num_samples: int):
    fig, (left, right, proxy, third) = plt.subplots(1, 4, figsize=(20, 4.6))
    pass_at_k_panel(left, results, MODELS)
    sft = results["sft"]
    kl = [row["kl"] for row in sft[0]["best_of_n"].values()]
    band(right, kl, [[100 * v for v in run["pass@k"].values()] for run in sft],
         "best of N by the checker (= pass@N)", "tab:gray", marker=".")
    band(right, kl, [[100 * row["gold"] for row in run["best_of_n"].values()] for run in sft],
         "best of N by the reward model: gold (checker)", "tab:green")
    band(proxy, kl, [[row["proxy"] for row in run["best_of_n"].values()] for run in sft],
         "the kept answer's proxy score (reward model)", "tab:red", marker="s")
    bound = "KL(best-of-N || SFT policy) <= log N - (N-1)/N, nats (the bound)"
    for ax in (right, proxy):
        top = ax.secondary_xaxis("top")  # N, above the KL bound it gives
        top.set_xticks(kl, [str(N) for N in sft[0]["best_of_n"]], fontsize=7)
        top.set_xlabel("N", fontsize=8)
        ax.legend(fontsize=7, loc="lower left")
    right.set(xlabel=bound, ylabel="kept answer right (%)", title="best-of-N of the SFT model: gold (checker)")
    proxy.set(xlabel=bound, ylabel="reward model's score of the kept answer",
              title="the same answers: proxy (reward model)")
    band(third, kl, [[100 * row["gold"] for row in run["best_of_n"].values()] for run in sft],
         "best-of-N by the reward model (N = 1 ... 64), at its KL bound", "tab:green")
    for method, color in (("rm_ppo", "tab:purple"), ("dpo_online_rm", "tab:brown")):
        for i, points in enumerate(results["along_training"][method]):  # one line per seed, steps 0, 20, 40
            third.plot([p["kl"] for p in points], [100 * p["gold"] for p in points], marker="^", color=color,
                       alpha=0.8, label=f"{TRAINED[method]} on it, steps 0, 20, 40 (a seed each)" if i == 0 else None)
    third.set(xlabel="KL to SFT, nats (best-of-N: an upper bound;\n"
                     "PPO: k1 sum, online DPO: log-ratio, estimated from samples)",
              ylabel="right (%): kept answer, or held-out sampled",
              title="gold along KL: where each run went, not why")
    third.legend(fontsize=7, loc="lower left")
    for ax in (left, right, proxy, third):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{num_samples} samples at temperature 1 of each of {num_eval_examples} held-out problems; mean of "
                 f"{len(sft)} seeds (line) and their range (band). Right: PPO and online DPO trained on each seed's "
                 "reward model (benchmarks/syllabus.py),\ntheir held-out sampled accuracy (500 problems) against the "
                 "KL of their samples to the SFT policy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cell(values: list[float]) -> str:
    """Shares as '%' mean (range over seeds)."""
    values = [100 * v for v in values]
    return f"{statistics.fmean(values):.1f} ({min(values):.1f} to {max(values):.1f})"


def pass_at_k_rows(results: dict, first: str) -> list[str]:
    """A markdown table's head and one pass@k row per model: mean (range over seeds), in %."""
    ks = list(results["sft"][0]["pass@k"])
    lines = [f"| {first} | " + " | ".join(ks) + " |", "| --- |" + " --- |" * len(ks)]
    for model in MODELS:
        lines.append(f"| pass@k, {model} | " + " | ".join(cell([run["pass@k"][k] for run in results[model]])
                                                         for k in ks) + " |")
    return lines


def table(results: dict) -> str:
    """pass@k of each model, and best-of-N of the SFT model: mean (range over seeds), in %."""
    ks = list(results["sft"][0]["pass@k"])
    lines = pass_at_k_rows(results, "k or N")
    sft = results["sft"]
    lines.append("| SFT best-of-N by the reward model, right | " + " | ".join(
        cell([run["best_of_n"][k]["gold"] for run in sft]) for k in ks) + " |")
    lines.append("| its reward-model score | " + " | ".join(
        f"{statistics.fmean(run['best_of_n'][k]['proxy'] for run in sft):.2f}" for k in ks) + " |")
    lines.append("| KL(best-of-N \\|\\| SFT) at most, nats (log N - (N-1)/N) | " + " | ".join(
        f"{sft[0]['best_of_n'][k]['kl']:.2f}" for k in ks) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct: benchmarks/smollm2_pass_at_k.sh's runs, committed under docs/smollm2_runs/
# ---------------------------------------------------------------------------------------------
SMOLLM2 = {"sft": "SFT, 120 steps", "grpo": "GRPO, 30 steps from it"}


def smollm2_results(docs: str) -> dict:
    """Each seed's two evaluations, docs/smollm2_runs/pass-at-k-seed<s>/{sft,grpo}/pass_at_k.json."""
    runs = os.path.join(ROOT, docs, "smollm2_runs")
    seeds = sorted(int(name.removeprefix("pass-at-k-seed")) for name in os.listdir(runs)
                   if name.startswith("pass-at-k-seed"))
    results = {"seeds": seeds}
    for model in SMOLLM2:
        results[model] = []
        for seed in seeds:
            with open(os.path.join(runs, f"pass-at-k-seed{seed}", model, "pass_at_k.json")) as f:
                results[model].append(json.load(f))
    return results


def problems(sft: dict, grpo: dict) -> dict:
    """Of the problems, how many no sample of a model got right, and how many only one model's samples did."""
    pairs = list(zip(sft["right_per_problem"], grpo["right_per_problem"]))
    return {"no answer right: SFT": sum(a == 0 for a, _ in pairs),
            "no answer right: GRPO": sum(b == 0 for _, b in pairs),
            "right only in GRPO's answers": sum(a == 0 < b for a, b in pairs),
            "right only in SFT's answers": sum(b == 0 < a for a, b in pairs)}


def smollm2_table(results: dict) -> str:
    """pass@k of both models (mean and range over seeds, %), then each seed's count of problems no sample
    solved, and solved in one model's samples only."""
    lines = pass_at_k_rows(results, "k")
    counts = [problems(s, g) for s, g in zip(results["sft"], results["grpo"])]
    lines += ["", f"| seed: problems (of {results['sft'][0]['n']}) with | " + " | ".join(counts[0]) + " |",
              "| --- |" + " --- |" * len(counts[0])]
    lines += [f"| {seed} | " + " | ".join(str(c[key]) for key in c) + " |" for seed, c in zip(results["seeds"], counts)]
    return "\n".join(lines)


def problem_kinds(n: int, dataset: str = "data/arithmetic") -> tuple[list[str], list[str]]:
    """The kinds in benchmarks/by_kind.py's order, and the kind of each of the first n held-out problems."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import by_kind  # noqa: E402  (a script beside this one)

    test = by_kind.common.load_splits(os.path.join(ROOT, dataset), ("question", "answer"), n)[1]
    return by_kind.KINDS, [by_kind.kind_of(question) for question in test["question"]]


def smollm2_kinds(results: dict, dataset: str = "data/arithmetic") -> str:
    """By kind of problem (benchmarks/by_kind.py: sums that carry or not, differences that borrow or not,
    negative results): each kind's share of right answers (pass@1) and its problems that some answer got
    right (pass@n), SFT -> GRPO, one value per seed."""
    order, kinds = problem_kinds(results["sft"][0]["n"], dataset)
    samples = results["sft"][0]["num_samples"]
    lines = [f"| kind | problems | right answers, SFT → GRPO (%) | problems some answer of {samples} got right, "
             "SFT → GRPO |", "| --- | --- | --- | --- |"]
    for kind in order:
        rows = [i for i, k in enumerate(kinds) if k == kind]
        right = [[[run["right_per_problem"][i] for i in rows] for run in results[model]] for model in SMOLLM2]
        share = lambda counts: f"{100 * sum(counts) / (samples * len(rows)):.1f}"  # noqa: E731
        solved = lambda counts: str(sum(c > 0 for c in counts))  # noqa: E731
        lines.append(f"| {kind} | {len(rows)} | " + " | ".join("; ".join(f"{f(a)} → {f(b)}" for a, b in zip(*right))
                                                               for f in (share, solved)) + " |")
    return "\n".join(lines)


def smollm2_figure(results: dict, path: str):
    """Left: pass@k, SFT against GRPO. Right: each problem's right answers of 64, SFT's against GRPO's."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    pass_at_k_panel(left, results, SMOLLM2)
    n = results["sft"][0]["num_samples"]
    order, kinds = problem_kinds(results["sft"][0]["n"])
    for i, (seed, sft, grpo) in enumerate(zip(results["seeds"], results["sft"], results["grpo"])):
        for kind, color in zip(order, ("tab:green", "tab:blue", "tab:olive", "tab:red", "tab:purple")):
            rows = [j for j, k in enumerate(kinds) if k == kind]
            right.scatter([sft["right_per_problem"][j] for j in rows], [grpo["right_per_problem"][j] for j in rows],
                          s=16, alpha=0.6, color=color, marker="os^"[i % 3], label=kind if i == 0 else None)
    markers = ", ".join(f"{'os^'[i % 3]} seed {seed}" for i, seed in enumerate(results["seeds"]))
    right.plot([0, n], [0, n], color="gray", linewidth=0.8, linestyle="--")
    right.set(xlabel=f"SFT model: right answers of {n}", ylabel=f"GRPO model: right answers of {n}",
              title=f"each held-out problem ({markers})")
    right.text(0.97 * n, 0.03 * n, "below the line: SFT right more often", ha="right", fontsize=8, color="gray")
    right.legend(fontsize=7, title="kind of problem", title_fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct: {n} samples at temperature 1 of each of {results['sft'][0]['n']} held-out "
                 f"problems (benchmarks/smollm2_pass_at_k.sh, seed{'s' * (len(results['seeds']) > 1)} "
                 f"{', '.join(map(str, results['seeds']))})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", default="out/syllabus", help="benchmarks/syllabus.py's runs")
    parser.add_argument("--out", default="out/pass_at_k", help="where the evaluations go")
    parser.add_argument("--num_samples", type=int, default=64)
    parser.add_argument("--num_eval_examples", type=int, default=200)
    parser.add_argument("--docs", default="docs")
    parser.add_argument("--report", action="store_true", help="evaluate nothing: figure and table from the json")
    parser.add_argument("--smollm2", action="store_true", help="evaluate nothing: the figure and table of "
                        "benchmarks/smollm2_pass_at_k.sh's runs (docs/smollm2_runs/pass-at-k-seed*)")
    args = parser.parse_args()
    if args.smollm2:
        results = smollm2_results(args.docs)
        smollm2_figure(results, os.path.join(ROOT, args.docs, "smollm2_pass_at_k.png"))
        print(smollm2_table(results) + "\n\n" + smollm2_kinds(results))
        return
    path = os.path.join(ROOT, args.docs, "best_of_n.json")
    if args.report:
        with open(path) as f:
            results = json.load(f)
    else:
        results = {model: [evaluate(model, seed, args) for seed in args.seeds] for model in MODELS}
        results["along_training"] = {method: [along_training(method, seed, args.runs) for seed in args.seeds]
                                     for method in TRAINED}
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    first = results["sft"][0]
    figure(results, os.path.join(ROOT, args.docs, "best_of_n.png"), first["n"], first["num_samples"])
    print(table(results))


if __name__ == "__main__":
    main()
