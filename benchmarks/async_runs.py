"""What the explorer and the trainer apart buy and cost (async_rl.py; claims in benchmarks/async_claims.md,
written before the runs).

    python benchmarks/async_runs.py --seeds 2 3 4       # the arms: staleness 0, 1, 2, 4, with and without the
                                                        # correction, 40 steps from sft.py --seed s (out/async/)
    python benchmarks/async_runs.py --timing --seeds 2 3 4   # seconds per step: grpo.py against the pair
    python benchmarks/async_runs.py --report            # docs/async_runs.json and docs/async.png

Each arm starts from out/syllabus/sft/<seed> (benchmarks/syllabus.py trains it when missing). The timing runs
need the machine to themselves: run nothing else meanwhile.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import syllabus  # noqa: E402  (its train(): one run into a folder, with its cost)

OUT, STEPS = "out/async", 40
CORRECTION = "--vllm_importance_sampling_correction"
ARMS = {  # name: async_rl.py's flags
    "sync": ["--sync_offset", "0", CORRECTION, "false"],
    **{f"stale{s}{suffix}": ["--sync_offset", str(s), CORRECTION, flag]
       for s in (1, 2, 4) for suffix, flag in (("", "true"), ("_plain", "false"))},
}
TIMING_STEPS = 20


def start(seed: int) -> str:
    """The seed's SFT model, the syllabus's (trained here when missing)."""
    return syllabus.train(f"out/syllabus/sft/{seed}", ["sft.py", "--seed", str(seed)])


def arm_run(arm: str, seed: int) -> str:
    sft = start(seed)
    return syllabus.train(f"{OUT}/{arm}/{seed}", ["async_rl.py", "--model", sft, "--seed", str(seed), "--max_steps",
                                                  str(STEPS), "--eval_steps", "20", *ARMS[arm]])


def timing_run(script: str, seed: int) -> str:
    """One timing run: grpo.py or the pair (sync_offset 1), TIMING_STEPS steps, one evaluation at the end."""
    sft = start(seed)
    folder = f"{OUT}/timing/{script.removesuffix('.py')}/{seed}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each script's own default threads
    subprocess.run([sys.executable, script, "--model", sft, "--seed", str(seed), "--max_steps", str(TIMING_STEPS),
                    "--eval_steps", str(TIMING_STEPS), "--eval_on_start", "false", "--num_eval_examples", "50",
                    "--output_dir", folder, "--overwrite_output_dir", "true"], cwd=ROOT, check=True, env=env)
    return folder


def rows(folder: str) -> list[dict]:
    with open(os.path.join(ROOT, folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def seconds_per_step(folder: str) -> dict:
    """Mean seconds of a step, its parts, from step 2 on (step 1 includes the pair's first batch, which no
    overlap can hide), leaving out the last (it holds the evaluation's wait)."""
    steps = [r for r in rows(folder) if "time/step" in r and 1 < r["step"] < TIMING_STEPS]
    mean = lambda key: sum(r.get(key, 0.0) for r in steps) / len(steps)  # noqa: E731
    return {"step": mean("time/step"), "waiting": mean("time/waiting"), "generation": mean("time/generation"),
            "explorer_sampling": mean("time/explorer_sampling"), "steps": [r["time/step"] for r in steps]}


def report(seeds: list[int]):
    results = {"steps": STEPS, "seeds": seeds, "arms": {}, "timing": {}}
    for arm in ARMS:
        results["arms"][arm] = {}
        for seed in seeds:
            folder = f"{OUT}/{arm}/{seed}"
            if not os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
                continue
            evals = [r for r in rows(folder) if "eval/accuracy_sampled" in r]
            results["arms"][arm][str(seed)] = {
                "sampled": 100 * evals[-1]["eval/accuracy_sampled"], "greedy": 100 * evals[-1]["eval/accuracy_greedy"],
                "start_sampled": 100 * evals[0]["eval/accuracy_sampled"],
                "staleness": max(r.get("off_policy/mean", 0) for r in rows(folder)),
                "logp_gap": sum(r["sampling/sampling_logp_difference/mean"] for r in rows(folder)
                                if "sampling/sampling_logp_difference/mean" in r) / STEPS}
    for script in ("grpo", "async_rl"):
        results["timing"][script] = {str(seed): seconds_per_step(f"{OUT}/timing/{script}/{seed}") for seed in seeds
                                     if os.path.isfile(os.path.join(ROOT, OUT, "timing", script, str(seed),
                                                                    "eval.json"))}
    with open(os.path.join(ROOT, "docs", "async_runs.json"), "w") as f:
        json.dump(results, f, indent=1)
    figure(results)
    return results


def table(results: dict) -> str:
    """docs/async.md's table: per arm, the staleness, the two policies' gap, and the held-out sampled accuracy at
    step 40 per seed and its mean; then the timing."""
    seeds = [str(seed) for seed in results["seeds"]]
    lines = ["| arm | staleness | mean abs log pi_old - log mu | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean |", "|---|---|---|" + "---|" * (len(seeds) + 1)]
    for arm, runs in results["arms"].items():
        if sorted(runs) != sorted(seeds):
            continue
        values = [runs[s]["sampled"] for s in seeds]
        gap = sum(runs[s]["logp_gap"] for s in seeds) / len(seeds)
        lines.append(f"| {arm} | {runs[seeds[0]]['staleness']} | {gap:.4f} | "
                     + " | ".join(f"{v:.1f}" for v in values) + f" | {sum(values) / len(values):.1f} |")
    timing = results["timing"]
    if timing.get("grpo") and timing.get("async_rl"):
        grpo = [timing["grpo"][s]["step"] for s in seeds]
        pair = [timing["async_rl"][s]["step"] for s in seeds]
        lines += ["", "| seconds per step | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
                  "|---|" + "---|" * (len(seeds) + 1),
                  "| grpo.py | " + " | ".join(f"{v:.2f}" for v in grpo) + f" | {sum(grpo) / len(grpo):.2f} |",
                  "| async_rl.py | " + " | ".join(f"{v:.2f}" for v in pair) + f" | {sum(pair) / len(pair):.2f} |"]
    return "\n".join(lines)


def speed_ratio(results: dict) -> float:
    """grpo.py's mean seconds per step over the pair's: how many of the pair's steps fit in one of grpo.py's."""
    seeds = [str(seed) for seed in results["seeds"]]
    grpo = sum(results["timing"]["grpo"][s]["step"] for s in seeds)
    return grpo / sum(results["timing"]["async_rl"][s]["step"] for s in seeds)


def prose(results: dict) -> list[str]:
    """docs/async.md's sentences with numbers, as they must read from results (a test keeps them so)."""
    seeds = [str(seed) for seed in results["seeds"]]
    timing = results["timing"]
    mean = lambda script, key: sum(timing[script][s][key] for s in seeds) / len(seeds)  # noqa: E731
    sample, step = mean("grpo", "generation"), mean("grpo", "step")
    pair, wait = mean("async_rl", "step"), mean("async_rl", "waiting")
    return [f"grpo.py took {step:.2f} s a step, {sample:.2f} s of it sampling and {step - sample:.2f} s training",
            f"the pair took {pair:.2f} s a step, of which the trainer waited {wait:.2f} s for the explorer",
            f"{speed_ratio(results):.2f} times grpo.py's steps per minute"]


def readme_sentence(results: dict) -> str:
    """The README's file table quotes the ratio of steps per minute."""
    return (f"one update stale, it runs {speed_ratio(results):.2f} times grpo.py's steps per minute on the 2-core CPU "
            f"({len(results['seeds'])} seeds, [L71](docs/lessons.md#l71))")


def figure(results: dict):
    """docs/async.png: left, the timeline of four steps (who waits for whom), drawn from the measured mean
    seconds; right, each arm's held-out sampled accuracy at step 40, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, scores) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    seeds = sorted(set(results["timing"].get("grpo", {})) & set(results["timing"].get("async_rl", {})))
    if seeds:
        mean = lambda script, key: sum(results["timing"][script][s][key] for s in seeds) / len(seeds)  # noqa: E731
        sample, train = mean("grpo", "generation"), mean("grpo", "step") - mean("grpo", "generation")
        lanes = [("grpo.py", [(i * (sample + train), sample, "tab:blue") for i in range(4)] +
                  [(i * (sample + train) + sample, train, "tab:orange") for i in range(4)])]
        a_sample, a_step = mean("async_rl", "explorer_sampling"), mean("async_rl", "step")
        a_wait = mean("async_rl", "waiting")
        a_train = a_step - a_wait
        lanes += [("pair: explorer", [(i * a_step, a_sample, "tab:blue") for i in range(5)]),
                  ("pair: trainer", [(a_step * (i + 1) - a_train, a_train, "tab:orange") for i in range(4)] +
                   [(a_step * (i + 1) - a_step, a_wait, "lightgrey") for i in range(4)])]
        for y, (_, bars) in enumerate(reversed(lanes)):
            for start, width, colour in bars:
                timeline.broken_barh([(start, width)], (y - 0.35, 0.7), color=colour, edgecolor="white")
        timeline.set_yticks(range(len(lanes)), [name for name, _ in reversed(lanes)])
        timeline.set_xlabel("seconds (measured means, seeds " + ", ".join(seeds) + ")")
        timeline.set_title(f"four steps: sampling (blue), training (orange), waiting (grey); "
                           f"{sample + train:.2f} s vs {a_step:.2f} s a step", fontsize=9)
    arms = [arm for arm in ARMS if results["arms"].get(arm)]
    for x, arm in enumerate(arms):
        values = results["arms"][arm]
        scores.scatter([x] * len(values), [v["sampled"] for v in values.values()], color="tab:green")
        scores.plot([x - 0.25, x + 0.25], [sum(v["sampled"] for v in values.values()) / len(values)] * 2, color="k")
    scores.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
    scores.set_ylabel("held-out sampled accuracy at step 40 (%)")
    scores.set_title("staleness x correction (black: the mean over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "docs", "async.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--timing", action="store_true", help="the seconds-per-step runs (the machine to themselves)")
    parser.add_argument("--report", action="store_true", help="only write docs/async_runs.json and docs/async.png")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = parser.parse_args()
    if args.timing:
        for seed in args.seeds:
            for script in ("grpo.py", "async_rl.py"):
                timing_run(script, seed)
    elif not args.report:
        for seed in args.seeds:
            for arm in args.arms:
                arm_run(arm, seed)
    print(table(report(args.seeds)))


if __name__ == "__main__":
    main()
