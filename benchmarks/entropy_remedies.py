"""GRPO's entropy at an aggressive setting, and four remedies for its fall, on three seeds, with pass@k beside it.

The aggressive setting (`base`) is grpo.py with four updates per batch, no KL term and twice the default
learning rate: the settings that make the policy surer fastest without wrecking it (at lr 2e-4 or 3e-4 the
runs crash and recover). Each remedy changes one thing against it:

    base           grpo.py --num_iterations 4 --beta 0 --learning_rate 1e-4
    clip_higher    base with --epsilon_high 0.28 (DAPO)
    entropy_bonus  base with --entropy_coeff 0.02: the loss minus 0.02 x the token mean of the entropy
    clip_cov       base as grpo_entropy.py --loss_mode clip_cov --clip_cov_ratio 0.02 (Cui et al. 2025)
    kl_cov         base as grpo_entropy.py --loss_mode kl_cov --kl_cov_ratio 0.02 (Cui et al. 2025)

Cui et al.'s ratios (2e-4 for Clip-Cov, 2e-3 or 2e-4 for KL-Cov) are for batches of millions of tokens; a
step here has about 3,000, where 2e-4 picks one token, so both use 0.02 (about 60 tokens a step). Each arm
runs from benchmarks/syllabus.py's SFT model of the seed, 40 steps, evaluated every 20 on the 500 held-out
problems; then best_of_n.py samples 16 answers to each of the first 200 held-out problems from its final
model, and from the SFT model, for pass@k, k = 1..16.

    python benchmarks/entropy_remedies.py            # the runs (a finished one is read), docs/entropy_remedies.*
    python benchmarks/entropy_remedies.py --report   # the figure and table from docs/entropy_remedies.json
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS, OUT = "out/syllabus", "out/entropy_remedies"
JSON, FIGURE = "docs/entropy_remedies.json", "docs/entropy_remedies.png"
BASE = ["--num_iterations", "4", "--beta", "0", "--learning_rate", "1e-4"]
ARMS = {"base": [], "clip_higher": ["--epsilon_high", "0.28"], "entropy_bonus": ["--entropy_coeff", "0.02"],
        "clip_cov": ["--loss_mode", "clip_cov", "--clip_cov_ratio", "0.02"],
        "kl_cov": ["--loss_mode", "kl_cov", "--kl_cov_ratio", "0.02"]}
SCRIPTS = {"clip_cov": "grpo_entropy.py", "kl_cov": "grpo_entropy.py"}  # the others run grpo.py
COLORS = {"base": "black", "clip_higher": "tab:orange", "entropy_bonus": "tab:red", "clip_cov": "tab:green",
          "kl_cov": "tab:blue", "sft": "tab:gray"}


def syllabus():
    spec = importlib.util.spec_from_file_location("syllabus", os.path.join(ROOT, "benchmarks", "syllabus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pass_at_k(model: str, folder: str, seed: int) -> dict:
    """best_of_n.py's pass@k (k = 1, 2, 4, 8, 16) of a model, 16 samples of the first 200 held-out problems."""
    if not os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
        subprocess.run([sys.executable, "best_of_n.py", "--model", model, "--num_samples", "16", "--num_eval_examples",
                        "200", "--seed", str(seed), "--output_dir", folder, "--overwrite_output_dir", "true"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(ROOT, folder, "eval.json")) as f:
        return json.load(f)["pass@k"]


def run(arm: str, seed: int) -> dict:
    """One arm at one seed: its entropy and share of groups without spread per step, its evaluations, and the
    pass@k of its final model."""
    bench, sft = syllabus(), f"{RUNS}/sft/{seed}"
    if not os.path.isfile(os.path.join(ROOT, sft, "eval.json")):
        raise SystemExit(f"error: no SFT model at {sft}: run `python benchmarks/syllabus.py --methods grpo` first")
    folder = bench.train(f"{OUT}/{arm}/{seed}", [SCRIPTS.get(arm, "grpo.py"), "--model", sft, "--seed", str(seed),
                                                 "--max_steps", "40", "--eval_steps", "20", *BASE, *ARMS[arm]])
    rows = bench.read_rows(folder)
    train = [row for row in rows if row["step"] > 0 and "entropy" in row]
    return {"seed": seed, "cost": bench.read_cost(folder), "entropy": [row["entropy"] for row in train],
            "frac_reward_zero_std": [row["frac_reward_zero_std"] for row in train],
            "clip_fraction": statistics.fmean(row["clip_fraction"] for row in train),
            "evals": [{"step": row["step"], "sampled": 100 * row["eval/accuracy_sampled"],
                       "greedy": 100 * row["eval/accuracy_greedy"]} for row in rows if "eval/accuracy_sampled" in row],
            "pass@k": pass_at_k(folder, f"{OUT}/pass_at_k/{arm}/{seed}", seed)}


def where_the_entropy_is(seed: int, problems: int = 128) -> dict:
    """Where the SFT model's entropy sits: one sampled completion of each of the first `problems` held-out
    problems, the entropy at each completion token; the share of the total held by the 5% of tokens highest
    in entropy, and the median token's entropy (nats)."""
    sys.path.insert(0, ROOT)
    import torch

    import common
    from lib import rollout

    torch.manual_seed(seed)
    model, tokenizer = common.load_model(os.path.join(ROOT, RUNS, "sft", str(seed)))
    model.eval()
    questions = list(common.load_split(os.path.join(ROOT, "data/arithmetic"), "test")["question"][:problems])
    with torch.no_grad():
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(
            model, tokenizer, [common.make_prompt(tokenizer, q) for q in questions], 64)
        _, entropy = rollout.completion_logprobs_and_entropy(model, torch.cat([prompt_ids, completion_ids], 1),
                                                             torch.cat([prompt_mask, completion_mask], 1),
                                                             completion_ids.shape[1])
    values = entropy[completion_mask.bool()].sort(descending=True).values  # [tokens]
    top = max(1, len(values) // 20)
    return {"seed": seed, "tokens": len(values), "mean": values.mean().item(), "median": values.median().item(),
            "top5_share": (values[:top].sum() / values.sum()).item()}


def measure(seeds: list[int], jobs: int) -> dict:
    with ThreadPoolExecutor(jobs) as pool:
        submitted = {(arm, seed): pool.submit(run, arm, seed) for arm in ARMS for seed in seeds}
        sft = {seed: pool.submit(pass_at_k, f"{RUNS}/sft/{seed}", f"{OUT}/pass_at_k/sft/{seed}", seed)
               for seed in seeds}
        results = {arm: [submitted[arm, seed].result() for seed in seeds] for arm in ARMS}
        return {"seeds": seeds, "base": " ".join(BASE), "arms": {arm: " ".join(a) for arm, a in ARMS.items()},
                "sft_pass@k": [{"seed": seed, "pass@k": sft[seed].result()} for seed in seeds],
                "sft_entropy": [where_the_entropy_is(seed) for seed in seeds], "results": results}


def cell(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(min(values))} to {fmt.format(max(values))})"


def tables(data: dict) -> list[str]:
    """The markdown table docs/grpo.md quotes (tests/test_prose_numbers.py holds the page to it): mean (range over
    seeds); the entropy in nats per completion token; the final sampled accuracy's difference to base, per seed."""
    base = data["results"]["base"]
    lines = ["| arm | entropy, step 1 | entropy, steps 31-40 | groups with equal rewards, steps 31-40 | "
             "final accuracy | minus base, per seed | pass@1 | pass@16 | minutes, one core |", "| --- |" + " --- |" * 8]
    for seed_runs in [{"arm": "sft (the start)", "runs": data["sft_pass@k"]}]:
        lines.append(f"| {seed_runs['arm']} | | | | | | {cell([100 * r['pass@k']['1'] for r in seed_runs['runs']])} | "
                     f"{cell([100 * r['pass@k']['16'] for r in seed_runs['runs']])} | |")
    for arm, runs in data["results"].items():
        versus = ", ".join(f"{r['evals'][-1]['sampled'] - b['evals'][-1]['sampled']:+.1f}" for r, b in zip(runs, base))
        lines.append(
            f"| {arm} | {cell([r['entropy'][0] for r in runs], '{:.3f}')} | "
            f"{cell([statistics.fmean(r['entropy'][-10:]) for r in runs], '{:.3f}')} | "
            f"{cell([100 * statistics.fmean(r['frac_reward_zero_std'][-10:]) for r in runs], '{:.0f}')}% | "
            f"{cell([r['evals'][-1]['sampled'] for r in runs])} | {versus if arm != 'base' else ''} | "
            f"{cell([100 * r['pass@k']['1'] for r in runs])} | {cell([100 * r['pass@k']['16'] for r in runs])} | "
            f"{statistics.fmean(r['cost']['cpu_minutes'] for r in runs):.1f} |")
    return lines


def per_seed(data: dict, arm: str, score) -> list[float]:
    """score(run) of an arm minus score(run) of base, per seed."""
    return [score(r) - score(b) for r, b in zip(data["results"][arm], data["results"]["base"])]


def prose(data: dict) -> list[str]:
    """The sentences of docs/grpo.md that quote the runs (tests/test_prose_numbers.py finds each in the page):
    the base arm's fall, where the start's entropy sits, and each remedy against base, per seed."""
    def listed(values, fmt="{:+.1f}"):
        return ", ".join(fmt.format(v) for v in values)

    base, where = data["results"]["base"], data["sft_entropy"]
    late = lambda r: statistics.fmean(r["entropy"][-10:])  # noqa: E731
    sentences = [
        f"from {statistics.fmean(r['entropy'][0] for r in base):.3f} at step 1 to "
        f"{statistics.fmean(late(r) for r in base):.3f} nats per token over steps 31-40 (per seed "
        f"{listed([100 * (late(r) / r['entropy'][0] - 1) for r in base], '{:+.0f}%')})",
        f"the 5% of completion tokens highest in entropy hold {100 * min(w['top5_share'] for w in where):.0f}% to "
        f"{100 * max(w['top5_share'] for w in where):.0f}% of it, and the median token has "
        f"{min(w['median'] for w in where):.3f} to {max(w['median'] for w in where):.3f} nats",
    ]
    pass16 = [statistics.fmean(100 * r["pass@k"]["16"] for r in runs)
              for runs in [*data["results"].values(), data["sft_pass@k"]]]
    sentences.append(f"({min(pass16):.1f}% to {max(pass16):.1f}% on average)")
    for arm in data["results"]:
        if arm != "base":
            sentences.append(
                f"`{arm}` against base, per seed: entropy of steps 31-40 "
                f"{listed(per_seed(data, arm, lambda r: 1000 * late(r)))} millinats per token, final accuracy "
                f"{listed(per_seed(data, arm, lambda r: r['evals'][-1]['sampled']))} points, pass@16 "
                f"{listed(per_seed(data, arm, lambda r: 100 * r['pass@k']['16']))}")
    return sentences


def figure(data: dict):
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    def smooth(values, window=5):  # the batch's entropy moves with its prompts: a 5-step running mean
        return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]

    for arm, runs in data["results"].items():
        steps = range(1, len(runs[0]["entropy"]) + 1)
        mean = smooth([statistics.fmean(c) for c in zip(*[r["entropy"] for r in runs])])
        left.plot(steps, mean, color=COLORS[arm], label=arm, linewidth=2 if arm == "base" else 1.3)
        ks = [int(k) for k in runs[0]["pass@k"]]
        middle.plot(ks, [statistics.fmean(100 * r["pass@k"][str(k)] for r in runs) for k in ks], color=COLORS[arm],
                    marker="o", label=arm)
        if arm != "base":
            base = data["results"]["base"]
            offset = 0.08 * (list(data["results"]).index(arm) - 2.5)
            right.plot([r["seed"] + offset for r in runs], [r["evals"][-1]["sampled"] - b["evals"][-1]["sampled"]
                                                            for r, b in zip(runs, base)], color=COLORS[arm], marker="o",
                       linestyle="none", label=arm)
    sft = data["sft_pass@k"]
    ks = [int(k) for k in sft[0]["pass@k"]]
    middle.plot(ks, [statistics.fmean(100 * r["pass@k"][str(k)] for r in sft) for k in ks], color=COLORS["sft"],
                linestyle="--", marker="o", label="sft (the start)")
    left.set(xlabel="step", ylabel="entropy (nats per completion token)",
             title="entropy: mean of the seeds, 5-step running mean")
    middle.set(xscale="log", xlabel="k", ylabel="pass@k (%)", title="pass@k of the final models (mean of seeds)")
    middle.set_xticks(ks, [str(k) for k in ks])
    right.axhline(0, color="black", linewidth=0.8)
    right.set(xlabel="seed", xticks=data["seeds"], ylabel="points", title="final sampled accuracy minus base's")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GRPO at {data['base']}, 40 steps, and four remedies (one change each), seeds "
                 f"{', '.join(map(str, data['seeds']))}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, FIGURE), dpi=110)
    print(f"wrote {FIGURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--report", action="store_true", help="train nothing: the figure and table from the json")
    args = parser.parse_args()
    if not args.report:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ["TQDM_DISABLE"] = "1"
        with open(os.path.join(ROOT, JSON), "w") as f:
            json.dump(measure(args.seeds, args.jobs), f, indent=1)
    with open(os.path.join(ROOT, JSON)) as f:
        data = json.load(f)
    print("\n".join(tables(data)))
    figure(data)


if __name__ == "__main__":
    main()
