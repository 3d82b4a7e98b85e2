"""Speed benchmark: ppo.py, grpo.py and mix.py at their default tiny configs, and the same GRPO
work through TRL's GRPOTrainer, one after the other on this machine. One command:

    pip install -r benchmarks/requirements.txt     # trl: only the benchmark needs it
    python benchmarks/run.py                       # ~4 min on a 2-core laptop; needs out/sft and out/rm
    python benchmarks/run.py --chain               # the README's quickstart at full defaults (~30 min) into
                                                   # docs/chain.json, then docs/compare.png from it
    python benchmarks/run.py --model path/to/model.gguf --steps 4 --rounds 1 -- \\
        --per_device_train_batch_size 16 --num_generations 4     # grpo.py vs TRL on a real model, these settings

Each run is its own process (so peak memory is its own), trains --steps steps from out/sft (PPO:
and out/rm), and is timed from the `time/*` fields of its metrics.jsonl (TRL: a callback timing
each optimizer step). The first step of a run is a warm-up and is left out; the scripts take
turns (--rounds), and the table shows medians over all their measured steps.
  completions/s     = completions generated per step / seconds per step
  tokens/s          = completion tokens generated per step / seconds per step
  peak RSS          = the process's maximum resident memory (whole run: data, models, evaluation)
"""
import argparse
import importlib.util
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {  # name: (script, completions generated per step at its default config)
    "ppo.py": ("ppo.py", 128),  # 128 prompts x 1 sample
    "grpo.py": ("grpo.py", 128),  # 16 prompts x 8 samples
    "mix.py": ("mix.py", 96),  # 12 prompts x 8 samples (+ 32 expert rows, not generated)
    "TRL GRPOTrainer": ("benchmarks/trl_grpo.py", 128),  # grpo.py's settings
}
BASELINE = " (baseline)"  # with --baseline: the same script of another checkout


def child(script, args, result_file):
    """Run one script in this process (started by main()), then record its peak resident memory."""
    sys.argv = [script, *args]
    sys.path.insert(0, ROOT)
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    with open("/proc/self/status") as status:  # VmHWM: this process's peak (ru_maxrss would count its parent's too)
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    with open(result_file, "w") as f:
        json.dump({"peak_rss_mb": peak_kb / 1024}, f)


def run(name, steps, workdir, extra=(), baseline=None):
    """One short training run of `name` in its own process: its step times, completion lengths, peak RSS, wall time.
    extra: grpo.py settings that grpo.py and TRL's run both take (--model, batch, lengths, ...). A name ending in
    BASELINE runs that script of the checkout `baseline` instead (its own benchmarks/run.py starts it), on this
    checkout's files (out/sft, data/)."""
    repo = baseline if name.endswith(BASELINE) else ROOT
    script, _ = RUNS[name.removesuffix(BASELINE)]
    out, result_file = os.path.join(workdir, name.split()[0].replace(".py", "")), os.path.join(workdir, "rss.json")
    if script.startswith("benchmarks/"):
        args = ["--max_steps", str(steps), "--output_dir", out, "--result", os.path.join(workdir, "trl.json"), *extra]
    else:  # a short run: evaluate a few problems only, checkpoint once at the end
        args = ["--max_steps", str(steps), "--output_dir", out, "--overwrite_output_dir", "true",
                "--num_eval_examples", "8", "--eval_steps", str(steps),
                "--save_steps", str(steps), *(["--eval_on_start", "false", *extra] if extra else [])]
    start = time.perf_counter()
    # in this checkout's folder (its out/sft, data/), the script and modules of `repo` (its run.py's child())
    subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "run.py"), "--child", script, result_file, *args],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    measured = {"wall_s": time.perf_counter() - start, **json.load(open(result_file))}
    if script.startswith("benchmarks/"):
        trl = json.load(open(os.path.join(workdir, "trl.json")))
        # warm-up step left out
        return {**measured, "step": trl["step_times"][1:], "length": trl["completion_length"][1:]}
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "time/step" in r][1:]  # training steps, warm-up step left out
    return {**measured, "step": [r["time/step"] for r in rows], "length": [r["completion_length"] for r in rows],
            **{part: [r[f"time/{part}"] for r in rows] for part in ("generation", "forward", "backward")
               if f"time/{part}" in rows[0]}}  # a baseline before commit 110f32d logged time/logprobs, not forward


def summary(name, runs, per_step=None):
    """Medians over every measured step of every round of one script (per_step: completions per step)."""
    every = {key: [x for r in runs for x in r[key]] for key in runs[0] if isinstance(runs[0][key], list)}
    seconds, per_step = statistics.median(every["step"]), per_step or RUNS[name.removesuffix(BASELINE)][1]
    return {
        "name": name,
        "step_s": seconds,
        "steps_measured": len(every["step"]),
        **{part: statistics.median(every[part]) for part in ("generation", "forward", "backward") if part in every},
        "completions_per_s": per_step / seconds,
        "tokens_per_s": statistics.mean(every["length"]) * per_step / seconds,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
    }


# the README's quickstart, in its order: (the command's arguments, the run's folder); each RL run reads out/sft
CHAIN = [("sft.py", [], "out/sft"), ("reward_model.py", [], "out/rm"), ("ppo.py", [], "out/ppo"),
         ("grpo.py", [], "out/grpo"), ("mix.py", [], "out/mix"), ("dpo.py", ["--online", "true"], "out/dpo"),
         ("dpo.py", ["--online", "true", "--loss_type", "kto", "--output_dir", "out/kto"], "out/kto"),
         ("rft.py", [], "out/rft")]
EVAL_KEYS = ("step", "eval/accuracy_sampled", "eval/accuracy_greedy", "time/elapsed")
PER_STEP_KEYS = ("score", "accuracy", "kl_sum", "frac_reward_zero_std")


def read_run(out_dir: str) -> dict:
    """What docs/chain.json keeps of a finished run: its final evaluation, every held-out evaluation (its
    metrics.jsonl rows that hold one) and, step by step where it logs them, PPO's reward-model score, the
    checker's accuracy of the same completions and the KL, and GRPO's and MIX's share of groups with no spread."""
    with open(os.path.join(ROOT, out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    kept = {"eval": json.load(open(os.path.join(ROOT, out_dir, "eval.json"))),
            "evals": [{key: row[key] for key in EVAL_KEYS if key in row} for row in rows
                      if "eval/accuracy_sampled" in row]}
    per_step = {key: [row[key] for row in rows if key in row] for key in PER_STEP_KEYS}
    if any(per_step.values()):
        kept["per_step"] = {key: values for key, values in per_step.items() if values}
    return kept


def run_chain(workdir):
    """Every quickstart command at its defaults, one after the other (writing out/<script>): wall time, processor
    time, peak memory, and the run's held-out evaluations (its metrics.jsonl rows that hold one)."""
    results, result_file = [], os.path.join(workdir, "rss.json")
    for script, args, out_dir in CHAIN:
        start, before = time.perf_counter(), os.times()
        subprocess.run([sys.executable, __file__, "--child", script, result_file, *args, "--overwrite_output_dir",
                        "true"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = os.times()
        results.append({"command": " ".join(["python", script, *args]), "output_dir": out_dir,
                        "wall_s": time.perf_counter() - start,
                        "cpu_s": after.children_user + after.children_system - before.children_user
                        - before.children_system, **json.load(open(result_file)), **read_run(out_dir)})
        last = results[-1]
        print(f"  {last['command']}: {last['wall_s']:.0f} s, peak RSS {last['peak_rss_mb']:.0f} MB", flush=True)
    print("\n| command | wall time (s) | processor time (s) | peak RSS (MB) |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['command']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['peak_rss_mb']:.0f} |")
    print(f"| the chain | {sum(r['wall_s'] for r in results):.0f} | {sum(r['cpu_s'] for r in results):.0f} | "
          f"{max(r['peak_rss_mb'] for r in results):.0f} |")
    return results


def percent(fraction: float) -> str:
    """An accuracy as the pages quote it: 0.731 -> 73.1%, 0.9125 -> 91.25%."""
    return f"{round(100 * fraction, 2):g}%"


def chain_table(chain: dict) -> str:
    """docs/experiments.md's table of the chain: each run's steps, minutes on its own clock (time/elapsed) and
    held-out accuracy at its first and last evaluations (PPO's also at step 40)."""
    runs = {r["output_dir"].split("/")[-1]: r for r in chain["runs"]}
    lines = ["| run | steps | minutes | held-out sampled | held-out greedy |", "| --- | --- | --- | --- | --- |"]
    names = {"sft": "SFT", "ppo": "PPO", "grpo": "GRPO", "mix": "MIX", "dpo": "online DPO", "kto": "online KTO",
             "rft": "RFT"}
    for key, name in names.items():
        evals = runs[key]["evals"]
        first, last = evals[0], evals[-1]
        sampled = [percent(first["eval/accuracy_sampled"]) + (f" (step {first['step']})" if key == "sft" else "")]
        if key == "ppo":
            sampled.append(f"{percent(evals[1]['eval/accuracy_sampled'])} (step {evals[1]['step']})")
        sampled.append(percent(last["eval/accuracy_sampled"]))
        minutes = f"{last['time/elapsed'] / 60:.1f}" + (
            f" (+ {runs['rm']['wall_s'] / 60:.1f} wall minutes for its reward model)" if key == "ppo" else "")
        lines.append(f"| {name} | {last['step']} | {minutes} | {' -> '.join(sampled)} | "
                     f"{percent(first['eval/accuracy_greedy'])} -> {percent(last['eval/accuracy_greedy'])} |")
    return "\n".join(lines)


def chain_figure(chain: dict, path: str):
    """docs/compare.png from docs/chain.json: SFT's held-out accuracy at the steps it was evaluated (points, not a
    curve), and each RL run's gain, its held-out sampled accuracy minus its own step-0 evaluation (SFT's model
    sampled anew, the same draw for every run), with bars of +-2 x the noise of one evaluation (the noise floor of
    docs/lessons.md, a difference of two evaluations, / sqrt 2). Those bars are for comparing curves, which share
    the step-0 evaluation: two curves closer than their bars cannot be told apart on one seed. A gain against 0 is a
    difference of two evaluations, whose noise is the floor itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import lessons
    import syllabus

    floor = lessons.rms(lessons.FLOORS["tiny"])  # two evaluations of one model: a difference's noise
    one_eval = floor / 2**0.5
    runs = {r["output_dir"].split("/")[-1]: r for r in chain["runs"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    sft = runs["sft"]["evals"]
    for key, marker in (("eval/accuracy_greedy", "s"), ("eval/accuracy_sampled", "o")):
        left.scatter([r["step"] for r in sft], [100 * r[key] for r in sft], marker=marker, color="black",
                     label=key.split("_")[-1] + (" (mean of 4 at T=1)" if "sampled" in key else ""))
    left.set(title="SFT: held-out accuracy where it was evaluated", xlabel="SFT step", ylabel="accuracy, %",
             xlim=(0, None))
    what = {"ppo": ("rm_ppo", "PPO, reward model (128 prompts x 1 a step)"),
            "grpo": ("grpo", "GRPO (16 prompts x 8)"), "mix": ("mix", "MIX (12 prompts x 8 + 32 expert answers)"),
            "dpo": ("dpo_online_rule", "online DPO, the checker (64 prompts x 2)"),
            "kto": ("kto_online", "online KTO, the checker (64 prompts x 2)"), "rft": ("rft", "RFT (16 prompts x 8)")}
    what["ppo"] = (what["ppo"][0], what["ppo"][1] + f", after its reward model's {runs['rm']['wall_s']:.0f} s")
    for name, (color, label) in what.items():
        evals = runs[name]["evals"]
        start = evals[0]["eval/accuracy_sampled"]
        right.errorbar([r["step"] for r in evals], [100 * (r["eval/accuracy_sampled"] - start) for r in evals],
                       yerr=2 * one_eval, marker="o", ms=4, capsize=2, color=syllabus.COLORS[color],
                       label=f"{label}: {percent(start)} -> {percent(evals[-1]['eval/accuracy_sampled'])}")
    right.axhline(0, color="grey", lw=0.8)
    right.set(title="RL from SFT's model: gain over its own step-0 evaluation", xlabel="RL step (a step's size differs:"
              " the legend)", ylabel=f"sampled accuracy - step 0's, points\n(bars: +-2 x {one_eval:.2f}, one "
              "evaluation's noise: see the title)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"The quickstart at its defaults, seed 0, one run each ({chain['date']}, docs/chain.json); held-out: "
                 f"500 problems. Step 0 is SFT's model sampled again, not SFT's own final evaluation "
                 f"({percent(runs['sft']['eval']['accuracy_sampled'])}).\nRight, bars: +-2 x {one_eval:.2f}, one "
                 "evaluation's noise, for comparing curves (they share the step-0 evaluation); a gain against 0 is a "
                 f"difference of two evaluations, noise {floor:.2f}: +-2 x {floor:.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, path), dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each script, interleaved; medians over all")
    parser.add_argument("--only", nargs="*", default=list(RUNS), help=f"a subset of: {', '.join(RUNS)}")
    parser.add_argument("--chain", action="store_true",
                        help="instead: time the whole default chain (sft.py ... mix.py)")
    parser.add_argument("--figure", default="docs/compare.png", help="with --chain: where the accuracy figure goes")
    parser.add_argument("--output", default=None,
                        help="the table as JSON (default out/bench/results.json; with --chain docs/chain.json)")
    parser.add_argument("--report", action="store_true", help="with --chain: run nothing, redraw from its JSON")
    parser.add_argument("--baseline", default=None,
                        help="also time the scripts (not TRL) of another checkout, e.g. the commit before a speed-up "
                             "(git worktree add /tmp/before <commit>), in the same rounds: rows '<script> (baseline)'")
    parser.add_argument("--model", default=None, help="compare grpo.py and TRL on this model (a folder or a .gguf) "
                                                      "instead of out/sft; grpo.py settings may follow `--`")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    per_step = None
    if args.model or extra:  # a real model: grpo.py and TRL only, both with these settings
        extra = ["--model", args.model or "out/sft", *extra]
        args.only = [name for name in args.only if name in ("grpo.py", "TRL GRPOTrainer")]
        sys.path.insert(0, ROOT)
        import common
        import grpo
        settings = common.parse_config(grpo.Config, extra)
        per_step = settings.per_device_train_batch_size * settings.gradient_accumulation_steps
    import torch  # only to print the setup

    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}")
    os.makedirs(os.path.join(ROOT, "out/bench"), exist_ok=True)
    if not args.chain and not args.model and not os.path.isfile(os.path.join(ROOT, "out/sft/config.json")):
        sys.exit(
            "error: the runs start from out/sft (and ppo.py from out/rm): "
            "run `python sft.py && python reward_model.py` first"
        )
    if not args.chain and "TRL GRPOTrainer" in args.only and importlib.util.find_spec("trl") is None:
        sys.exit("error: trl is not installed: `pip install -r benchmarks/requirements.txt`, or leave it out with "
                 "--only ppo.py grpo.py mix.py")
    if args.chain:
        chain_path = os.path.join(ROOT, args.output or "docs/chain.json")
        if not args.report:
            with tempfile.TemporaryDirectory() as workdir:
                runs = run_chain(workdir)
            with open("/proc/cpuinfo") as f:  # the processor's name (platform.processor() is often only x86_64)
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
            machine = f"{name or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
            with open(chain_path, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "machine": machine, "runs": runs}, f, indent=1)
        with open(chain_path) as f:
            chain = json.load(f)
        print(chain_table(chain))
        chain_figure(chain, args.figure)
        print(f"{chain_path}; the figure: {args.figure}")
        return
    names = [name + suffix for name in args.only for suffix in
             ("", *([BASELINE] if args.baseline and not name.startswith("TRL") else []))]
    runs = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as workdir:
        for round in range(args.rounds):  # rounds interleave the scripts, so a slow spell of the machine hits all
            for name in names:
                runs[name].append(run(name, args.steps, workdir, extra, args.baseline))
                print(f"  round {round + 1}, {name}: median {statistics.median(runs[name][-1]['step']):.2f} s/step "
                      f"({runs[name][-1]['wall_s']:.0f} s)", flush=True)
    results = [summary(name, runs[name], per_step) for name in names]

    dash = lambda r, key: f"{r[key]:.2f}" if key in r else "-"  # noqa: E731
    print(
        "\n| run | s/step | generation | forward passes | the rest: backward, optimizer | completions/s | tokens/s "
        "| peak RSS (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['step_s']:.2f} | {dash(r, 'generation')} | {dash(r, 'forward')} "
            f"| {dash(r, 'backward')} "
            f"| {r['completions_per_s']:.3g} | {r['tokens_per_s']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    by_name = {r["name"]: r for r in results}

    def speed_ratio(fast, slow):  # the same work: seconds per step of `slow` over those of `fast`, all and per round
        rounds = [statistics.median(b["step"]) / statistics.median(a["step"]) for a, b in zip(runs[fast], runs[slow])]
        print(f"{fast} / {slow}, completions/s at the same configuration: "
              f"{by_name[slow]['step_s'] / by_name[fast]['step_s']:.2f}x (medians of all rounds; round by round "
              + ", ".join(f"{r:.2f}x" for r in rounds) + ")")

    print()
    if "grpo.py" in by_name and "TRL GRPOTrainer" in by_name:
        speed_ratio("grpo.py", "TRL GRPOTrainer")
    for name in args.only:
        if name + BASELINE in by_name:
            speed_ratio(name, name + BASELINE)
    with open(args.output or os.path.join(ROOT, "out/bench/results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[4:], sys.argv[3])
    else:
        main()
