"""What the explorer and the trainer apart buy and cost (async_rl.py; claims in benchmarks/async_claims.md,
written before the runs).

    python benchmarks/async_runs.py                     # the arms: staleness 0, 1, 2, 4, with and without the
                                                        # correction, 40 steps from sft.py --seed s (out/async/)
    python benchmarks/async_runs.py --timing            # seconds per step, seeds 2-6: grpo.py against the pair
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


TIMED = {  # name: (script, threads (None: the script's default), flags)
    "grpo": ("grpo.py", None, []), "grpo_1thread": ("grpo.py", "1", []),
    "async_rl": ("async_rl.py", None, []),
    "async_rl_ref_trainer": ("async_rl.py", None, ["--reference_pass", "trainer"])}
ARM_SEEDS, TIMING_SEEDS = [2, 3, 4], [2, 3, 4, 5, 6]  # what the report reads


def timing_run(name: str, seed: int) -> str:
    """One timing run (TIMED: grpo.py with its default threads, grpo.py on one thread, the pair at sync_offset 1
    with one thread each, pi_ref's pass in the explorer or in the trainer), TIMING_STEPS steps, one evaluation at
    the end."""
    script, threads, flags = TIMED[name]
    sft = start(seed)
    folder = f"{OUT}/timing/{name}/{seed}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each script's own default threads
    env.update({"OMP_NUM_THREADS": threads} if threads else {})
    subprocess.run([sys.executable, script, "--model", sft, "--seed", str(seed), "--max_steps", str(TIMING_STEPS),
                    "--eval_steps", str(TIMING_STEPS), "--eval_on_start", "false", "--num_eval_examples", "50",
                    "--output_dir", folder, "--overwrite_output_dir", "true", *flags], cwd=ROOT, check=True, env=env)
    return folder


def rows(folder: str) -> list[dict]:
    with open(os.path.join(ROOT, folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def seconds_per_step(folder: str) -> dict:
    """Mean seconds of a step, its parts, from step 2 on (step 1 includes the pair's first batch, which no
    overlap can hide). time/explorer is the explorer's whole work on a batch (generation, decoding, scoring, and
    pi_ref's pass where it runs there); grpo.py's time/generation is rollout.generate alone."""
    steps = [r for r in rows(folder) if "time/step" in r and 1 < r["step"] <= TIMING_STEPS]
    mean = lambda key: sum(r.get(key, 0.0) for r in steps) / len(steps)  # noqa: E731
    return {"step": mean("time/step"), "waiting": mean("time/waiting"), "generation": mean("time/generation"),
            "explorer": mean("time/explorer"), "steps": [r["time/step"] for r in steps]}


def report(seeds: list[int], timing_seeds: list[int]):
    results = {"steps": STEPS, "seeds": seeds, "timing_seeds": timing_seeds, "arms": {}, "timing": {}}
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
                                if "sampling/sampling_logp_difference/mean" in r) / STEPS,
                "logp_gap_max": max(r.get("sampling/sampling_logp_difference/max", 0.0) for r in rows(folder)),
                **({"weight_min": min(r["sampling/importance_sampling_ratio/min"] for r in rows(folder)
                                      if "sampling/importance_sampling_ratio/min" in r),
                    "weight_max": max(r["sampling/importance_sampling_ratio/max"] for r in rows(folder)
                                      if "sampling/importance_sampling_ratio/max" in r)}
                   if "true" in ARMS[arm] else {})}
    for script in TIMED:
        results["timing"][script] = {str(seed): seconds_per_step(f"{OUT}/timing/{script}/{seed}")
                                     for seed in timing_seeds
                                     if os.path.isfile(os.path.join(ROOT, OUT, "timing", script, str(seed),
                                                                    "eval.json"))}
    saved = os.path.join(ROOT, "docs", "async_runs.json")
    if os.path.isfile(saved):  # A1's first sitting, whose folders the later sitting overwrote: kept as recorded
        with open(saved) as f:
            results.update({key: value for key, value in json.load(f).items() if key == "first_sitting"})
    with open(saved, "w") as f:
        json.dump(results, f, indent=1)
    figure(results)
    return results


def table(results: dict) -> str:
    """docs/async.md's table: per arm, the staleness, the two policies' gap, and the held-out sampled accuracy at
    step 40 per seed and its mean; then the timing."""
    seeds = [str(seed) for seed in results["seeds"]]
    lines = ["| arm | staleness (from batch sync_offset + 1 on) | mean abs log pi_old - log mu | "
             + " | ".join(f"seed {s}" for s in seeds)
             + " | mean |", "|---|---|---|" + "---|" * (len(seeds) + 1)]
    for arm, runs in results["arms"].items():
        if sorted(runs) != sorted(seeds):
            continue
        values = [runs[s]["sampled"] for s in seeds]
        gap = sum(runs[s]["logp_gap"] for s in seeds) / len(seeds)
        lines.append(f"| {arm} | {runs[seeds[0]]['staleness']} | {gap:.4f} | "
                     + " | ".join(f"{v:.1f}" for v in values) + f" | {sum(values) / len(values):.1f} |")
    timing, seeds = results["timing"], [str(seed) for seed in results["timing_seeds"]]
    lines += ["", "| seconds per step (steps 2-20 of 20) | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
              "|---|" + "---|" * (len(seeds) + 1)]
    for name, label in TIMING_ROWS:
        values = [timing[name][s]["step"] for s in seeds]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {sum(values) / len(values):.2f} |")
    return "\n".join(lines)


TIMING_ROWS = (("grpo", "grpo.py, two threads (torch's default on this VM)"), ("grpo_1thread", "grpo.py, one thread"),
               ("async_rl_ref_trainer", "async_rl.py --reference_pass trainer, one thread each"),
               ("async_rl", "async_rl.py (pi_ref's pass in the explorer), one thread each"))


def speed_ratio(results: dict, against: str = "grpo", pair: str = "async_rl", seeds=None) -> float:
    """`against`'s mean seconds per step (grpo.py on two threads, grpo_1thread, or the other layout of the pair) over
    `pair`'s: the pair's steps per minute in units of the other's, over the timing seeds (or `seeds`)."""
    seeds = [str(seed) for seed in (seeds or results["timing_seeds"])]
    return (sum(results["timing"][against][s]["step"] for s in seeds)
            / sum(results["timing"][pair][s]["step"] for s in seeds))


def per_seed_ratios(results: dict, against: str, pair: str = "async_rl", seeds=None) -> str:
    return ", ".join(f"{results['timing'][against][s]['step'] / results['timing'][pair][s]['step']:.2f}"
                     for s in [str(seed) for seed in (seeds or results["timing_seeds"])])


def prose(results: dict) -> list[str]:
    """docs/async.md's sentences with numbers, as they must read from results (a test keeps them so)."""
    seeds = [str(seed) for seed in results["timing_seeds"]]
    mean = lambda script, key: sum(results["timing"][script][s][key] for s in seeds) / len(seeds)  # noqa: E731
    trainer = lambda pair: mean(pair, "step") - mean(pair, "waiting")  # noqa: E731
    train1 = mean("grpo_1thread", "step") - mean("grpo_1thread", "generation")
    return [f"grpo.py took {mean('grpo', 'step'):.2f} s a step on two threads, {mean('grpo', 'generation'):.2f} s "
            f"of it sampling, and {mean('grpo_1thread', 'step'):.2f} s on one thread, "
            f"{mean('grpo_1thread', 'generation'):.2f} s of it sampling",
            f"With pi_ref's pass in the trainer, the pair took {mean('async_rl_ref_trainer', 'step'):.2f} s a step: "
            f"the explorer's batch took {mean('async_rl_ref_trainer', 'explorer'):.2f} s and the trainer's work "
            f"(a step less its waiting) {trainer('async_rl_ref_trainer'):.2f} s, waiting "
            f"{mean('async_rl_ref_trainer', 'waiting'):.3f} s for a batch",
            "With the pass in the explorer (the default), the explorer's batch took "
            f"{mean('async_rl', 'explorer'):.2f} s and the trainer's work {trainer('async_rl'):.2f} s, waiting "
            f"{mean('async_rl', 'waiting'):.3f} s: "
            f"{mean('async_rl', 'step'):.2f} s a step",
            f"{speed_ratio(results, 'async_rl_ref_trainer'):.2f} times the steps per minute of the trainer-side layout "
            f"(per seed {per_seed_ratios(results, 'async_rl_ref_trainer')})",
            f"{speed_ratio(results):.2f} times the steps per minute of grpo.py on two threads (per seed "
            f"{per_seed_ratios(results, 'grpo')}), and {speed_ratio(results, 'grpo_1thread'):.2f} times those of "
            f"grpo.py on one thread (per seed {per_seed_ratios(results, 'grpo_1thread')})",
            "the trainer-side layout ran "
            f"{speed_ratio(results, pair='async_rl_ref_trainer', seeds=results['seeds']):.2f} times grpo.py's steps "
            f"per minute on seeds {', '.join(str(s) for s in results['seeds'])} (per seed "
            f"{per_seed_ratios(results, 'grpo', 'async_rl_ref_trainer', results['seeds'])})",
            f"everything but rollout.generate in grpo.py's step took {train1:.2f} s on one thread",
            spread(results, "grpo"), weakest_seed(results), without_weakest_baseline(results), first_sitting(results),
            tails(results)]


def weakest_seed(results: dict) -> str:
    """The seed where the pair gained least on grpo.py (two threads)."""
    timing = results["timing"]
    seed = min(timing["grpo"], key=lambda s: timing["grpo"][s]["step"] / timing["async_rl"][s]["step"])
    return (f"on seed {seed} the pair took {timing['async_rl'][seed]['step']:.2f} s a step and grpo.py "
            f"{timing['grpo'][seed]['step']:.2f} s")


def weakest_baseline(results: dict) -> tuple[str, float]:
    """(the seed whose grpo.py on two threads gained least over its own run on one thread, the ratio without it)."""
    timing = results["timing"]
    seed = max(timing["grpo"], key=lambda s: timing["grpo"][s]["step"] / timing["grpo_1thread"][s]["step"])
    return seed, speed_ratio(results, seeds=[int(s) for s in sorted(timing["grpo"]) if s != seed])


def without_weakest_baseline(results: dict) -> str:
    """The page's sentence on that seed."""
    timing, (seed, rest) = results["timing"], weakest_baseline(results)
    return (f"on seed {seed} grpo.py on two threads took {timing['grpo'][seed]['step']:.2f} s a step, little less "
            f"than on one ({timing['grpo_1thread'][seed]['step']:.2f} s); without that seed the ratio is "
            f"{rest:.2f}")


def first_sitting(results: dict) -> str:
    """A1's first measurement, an earlier sitting (docs/async_runs.json's first_sitting)."""
    first = {**results["first_sitting"], "timing_seeds": results["first_sitting"]["seeds"]}
    return (f"a first sitting on the same VM, earlier the same day, measured the trainer-side layout at "
            f"{speed_ratio(first, pair='async_rl_ref_trainer'):.2f} times grpo.py's steps per minute (per seed "
            f"{per_seed_ratios(first, 'grpo', 'async_rl_ref_trainer')})")


def spread(results: dict, name: str) -> str:
    """The page's sentence on how far one timed script's seconds per step ranged over the seeds."""
    steps = {seed: run["step"] for seed, run in results["timing"][name].items()}
    low, high = min(steps, key=steps.get), max(steps, key=steps.get)
    return (f"{TIMED[name][0]}'s step on two threads ranged from {steps[low]:.2f} s (seed {low}) to "
            f"{steps[high]:.2f} s (seed {high})")


def tails(results: dict) -> str:
    """The page's sentence on the tails the mean gap hides: the largest single-token |log pi_old - log mu| of a run
    (corrected or not), and the corrected runs' weights, over every step and seed."""
    arms = results["arms"]
    largest = lambda arm: max(run["logp_gap_max"] for name in (arm, arm + "_plain")  # noqa: E731
                              for run in arms[name].values())  # corrected and plain runs alike
    low = min(run["weight_min"] for arm in ("stale1", "stale2", "stale4") for run in arms[arm].values())
    high = max(run["weight_max"] for arm in ("stale1", "stale2", "stale4") for run in arms[arm].values())
    return (f"the largest single-token gap of a run was {largest('stale1'):.2f} nats at one update of staleness and "
            f"{largest('stale4'):.2f} at four, and the corrected runs' weights ranged from {low:.2f} to {high:.2f}")


def readme_sentence(results: dict) -> str:
    """The README's file table quotes the ratio of steps per minute and the ledger's verdict on it (L80)."""
    import lessons

    rows = lessons.lessons()
    lessons.holm(rows)  # the correction over the whole ledger, as docs/lessons.md shows it
    row = next(row for row in rows if row["id"] == "L80")
    said = {"shown": "faster, shown", "not shown": "that it is faster is not shown"}[row["verdict"]]
    said += ", though not after Holm's correction over the ledger" * (row.get("holm") == "not after Holm")
    return (f"on the 2-core CPU, two processes of one thread each, it ran {speed_ratio(results):.2f} times the steps "
            f"per minute of grpo.py on two threads ({len(results['timing_seeds'])} seeds, per seed "
            f"{per_seed_ratios(results, 'grpo')}; {weakest_baseline(results)[1]:.2f} without seed "
            f"{weakest_baseline(results)[0]}, whose grpo.py ran about as fast on one thread): {said} "
            "([L80](docs/lessons.md#l80))")


def pair_lanes(sample: float, train: float, steps: int = 4) -> tuple[list, list]:
    """The pair at sync_offset 1, simulated from mean seconds (the explorer's batch, the trainer's step): trainer
    step k starts when step k - 1 has ended and batch k has arrived; the explorer starts batch i once batch i - 1
    is sent and version i - 2 is published (the end of trainer step i - 2). (start, width, colour) bars."""
    sent, trained, explorer, trainer = [], [], [], []
    for i in range(steps + 1):
        begin = max(sent[-1] if sent else 0.0, trained[i - 2] if i >= 2 else 0.0)
        if sent and begin > sent[-1]:  # waiting for the weights batch i needs
            explorer.append((sent[-1], begin - sent[-1], "lightgrey"))
        explorer.append((begin, sample, "tab:blue"))
        sent.append(begin + sample)
        if i < steps:
            previous = trained[-1] if trained else 0.0
            start_k = max(previous, sent[i])
            trainer.append((previous, start_k - previous, "lightgrey"))
            trained.append(start_k + train)
            trainer.append((start_k, train, "tab:orange"))
    return explorer, trainer


def figure(results: dict):
    """docs/async.png: left, four steps of each (who waits for whom), simulated from the mean seconds of steps
    2-20; right, each arm's held-out sampled accuracy at step 40 minus the synchronous run's, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, scores) = plt.subplots(1, 2, figsize=(14, 5.2), gridspec_kw={"width_ratios": [1.3, 1]})
    seeds = [str(seed) for seed in results["timing_seeds"]]
    mean = lambda script, key: sum(results["timing"][script][s][key] for s in seeds) / len(seeds)  # noqa: E731
    lanes = []
    for name, label in (("grpo", "grpo.py, 2 threads"), ("grpo_1thread", "grpo.py, 1 thread")):
        sample, train = mean(name, "generation"), mean(name, "step") - mean(name, "generation")
        lanes.append((label, [(i * (sample + train), sample, "tab:blue") for i in range(4)] +
                      [(i * (sample + train) + sample, train, "tab:orange") for i in range(4)]))
    for name, where in (("async_rl_ref_trainer", "pi_ref in trainer"), ("async_rl", "pi_ref in explorer")):
        explorer, trainer = pair_lanes(mean(name, "explorer"), mean(name, "step") - mean(name, "waiting"))
        lanes += [(f"pair ({where}): explorer", explorer), (f"pair ({where}): trainer", trainer)]
    for y, (_, bars) in enumerate(reversed(lanes)):
        for start, width, colour in bars:
            timeline.broken_barh([(start, width)], (y - 0.35, 0.7), color=colour, edgecolor="white")
    timeline.set_yticks(range(len(lanes)), [name for name, _ in reversed(lanes)], fontsize=8)
    timeline.set_xlabel("seconds: simulated from the mean timings of steps 2-20, seeds " + ", ".join(seeds)
                        + " (the pair's first wait included)")
    timeline.set_title(f"sampling (blue), training (orange), waiting (grey); seconds a step: grpo.py "
                       f"{mean('grpo', 'step'):.2f} (2 threads), {mean('grpo_1thread', 'step'):.2f} (1 thread);\n"
                       f"the pair {mean('async_rl_ref_trainer', 'step'):.2f} (pi_ref in the trainer), "
                       f"{mean('async_rl', 'step'):.2f} (pi_ref in the explorer)", fontsize=9)
    arms = [arm for arm in ARMS if arm != "sync" and results["arms"].get(arm)]
    for seed in results["seeds"]:
        base = results["arms"]["sync"][str(seed)]["sampled"]
        scores.plot(range(len(arms)), [results["arms"][arm][str(seed)]["sampled"] - base for arm in arms], "o",
                    alpha=0.8, label=f"seed {seed}")
    scores.axhline(0, color="k", linewidth=0.8)
    scores.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
    scores.set_ylabel("accuracy at step 40 minus sync's (points)")
    scores.set_title("each arm against the synchronous run, seed by seed", fontsize=9)
    scores.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "docs", "async.png"), dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="the seeds to run (default: "
                        + " ".join(map(str, ARM_SEEDS)) + ", with --timing " + " ".join(map(str, TIMING_SEEDS)) + ")")
    parser.add_argument("--timing", action="store_true", help="the seconds-per-step runs (the machine to themselves)")
    parser.add_argument("--report", action="store_true", help="only write docs/async_runs.json and docs/async.png")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--timed", nargs="+", default=list(TIMED), choices=list(TIMED))
    args = parser.parse_args()
    seeds = args.seeds or (TIMING_SEEDS if args.timing else ARM_SEEDS)
    if args.timing:
        for seed in seeds:
            for name in args.timed:
                timing_run(name, seed)
    elif not args.report:
        for seed in seeds:
            for arm in args.arms:
                arm_run(arm, seed)
    print(table(report(ARM_SEEDS, TIMING_SEEDS)))


if __name__ == "__main__":
    main()
