"""Speed benchmark: ppo.py, grpo.py and mix.py at their default tiny configs, and the same GRPO
work through TRL's GRPOTrainer, one after the other on this machine. One command:

    pip install -r benchmarks/requirements.txt     # trl: only the benchmark needs it
    python benchmarks/run.py                       # ~4 min on a 2-core laptop; needs out/sft and out/rm
    python benchmarks/run.py --chain               # the README's whole chain at full defaults (~20 min),
                                                   # then docs/compare.png: accuracy vs step and vs wall-clock
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


# the README's order; each reads out/sft (and out/rm)
CHAIN = ["sft.py", "reward_model.py", "ppo.py", "grpo.py", "mix.py"]


def run_chain(workdir):
    """Every script at its defaults, one after the other (writing out/<script>): wall time and peak memory."""
    results, result_file = [], os.path.join(workdir, "rss.json")
    for script in CHAIN:
        start = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--child", script, result_file, "--overwrite_output_dir", "true"],
                       cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out_dir = os.path.join(ROOT, "out", script.replace(".py", "").replace("reward_model", "rm"))
        results.append({"name": script, "wall_s": time.perf_counter() - start, **json.load(open(result_file)),
                        "eval": json.load(open(os.path.join(out_dir, "eval.json")))})
        print(f"  {script}: {results[-1]['wall_s']:.0f} s, peak RSS {results[-1]['peak_rss_mb']:.0f} MB", flush=True)
    print("\n| script | wall time (s) | peak RSS (MB) |\n|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['wall_s']:.0f} | {r['peak_rss_mb']:.0f} |")
    print(f"| the chain | {sum(r['wall_s'] for r in results):.0f} | {max(r['peak_rss_mb'] for r in results):.0f} |")
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first is a warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each script, interleaved; medians over all")
    parser.add_argument("--only", nargs="*", default=list(RUNS), help=f"a subset of: {', '.join(RUNS)}")
    parser.add_argument("--chain", action="store_true",
                        help="instead: time the whole default chain (sft.py ... mix.py)")
    parser.add_argument("--figure", default="docs/compare.png", help="with --chain: where the accuracy figure goes")
    parser.add_argument("--output", default=None,
                        help="the table as JSON (default out/bench/results.json or chain.json)")
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
        with tempfile.TemporaryDirectory() as workdir:
            results = run_chain(workdir)
        with open(args.output or os.path.join(ROOT, "out/bench/chain.json"), "w") as f:
            json.dump(results, f, indent=1)
        print()  # and the figure of held-out accuracy vs step and vs wall-clock, from the runs' metrics.jsonl
        subprocess.run([sys.executable, "docs/compare_runs.py", "SFT=out/sft", "PPO (reward model)=out/ppo",
                        "GRPO=out/grpo", "MIX=out/mix", "--gains", "--title",
                        "The default chain, seed 0: SFT on the demonstrations, then PPO, GRPO and MIX from it, "
                        "120 steps each\n(held-out: 500 problems, evaluated points; sampled = mean of 4 samples "
                        "at temperature 1; wall times: the README's table)", "--output", args.figure],
                       cwd=ROOT, check=True)
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
