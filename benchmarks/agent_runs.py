"""agent.py measured: GRPO with the calculator, without it, and with a price per call, 3 seeds.

Each seed s is one start, `sft.py --dataset data/tool_demos --seed s` (a teacher that calls the
calculator in half its demonstrations and works the columns, slips included, in the other half).
From it, three arms of `agent.py --seed s` at its defaults (120 steps of 16 prompts x 8 episodes,
evaluated every 40 on the 500 held-out problems with the calculator), each one change from `tool`:

    tool       the calculator answers up to 2 calls a completion
    no_tool    --max_tool_calls 0: every call is refused ('error: no calls left'), so the only way to
               the reward is the policy's own column work, from the same start
    cost       --tool_call_cost 0.25: each call takes a quarter point off the reward

and, for context, the course's GRPO without a calculator anywhere: `grpo.py --seed s` at its defaults
(the same 120 steps and batch) from `sft.py --seed s` on data/demos, the teacher that never calls:

    grpo       another start (demonstrations without calls) and no calculator: two changes from tool

    python benchmarks/agent_runs.py                 # the runs (one thread each, two at a time), then the report
    python benchmarks/agent_runs.py --report        # docs/agent.png and the tables from docs/agent_runs.json

Outputs: out/agent_runs/<sft or arm>/<seed>/ (a finished run is read, not repeated), docs/agent_runs.json
(each run's evaluations, its training call rates by kind, minutes), docs/agent.png, and markdown tables.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from agent import KINDS  # noqa: E402  (data/make_data.py's kinds of problem)
OUT, JSON, FIGURE = "out/agent_runs", "docs/agent_runs.json", "docs/agent.png"
ARMS = {"tool": [], "no_tool": ["--max_tool_calls", "0"], "cost": ["--tool_call_cost", "0.25"]}


def run(command: list[str], folder: str) -> float:
    """Run `command` into folder with one thread, unless a finished run is there; its minutes."""
    if os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
        return json.load(open(os.path.join(ROOT, folder, "minutes.json")))["minutes"]
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    subprocess.run([sys.executable, *command, "--output_dir", folder, "--overwrite_output_dir", "true"], cwd=ROOT,
                   env=env, check=True, stdout=subprocess.DEVNULL)
    minutes = (time.perf_counter() - start) / 60
    json.dump({"minutes": minutes}, open(os.path.join(ROOT, folder, "minutes.json"), "w"))
    return minutes


def read_run(folder: str, minutes: float) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(ROOT, folder, "metrics.jsonl"))]
    evals = [{"step": row["step"], **{key[5:]: value for key, value in row.items() if key.startswith("eval/")}}
             for row in rows if "eval/accuracy_sampled" in row]
    steps = [row for row in rows if "loss" in row]
    per_step = {key: [row.get(key) for row in steps] for key in ["call_rate", *(f"call_rate/{k}" for k in KINDS),
                                                                 "accuracy", "reply_tokens"]}
    return {"minutes": round(minutes, 2), "evals": evals, "per_step": per_step}


def measure(seeds: list[int]) -> dict:
    def start(seed):
        folder = f"{OUT}/sft/{seed}"
        return seed, read_run(folder, run(["sft.py", "--dataset", "data/tool_demos", "--seed", str(seed)], folder))

    def plain_start(seed):
        folder = f"{OUT}/sft_plain/{seed}"
        return seed, read_run(folder, run(["sft.py", "--seed", str(seed)], folder))

    with ThreadPoolExecutor(2) as pool:
        starts = dict(pool.map(start, seeds))
        plain_starts = dict(pool.map(plain_start, seeds))

    def arm(job):
        name, seed = job
        folder = f"{OUT}/{name}/{seed}"
        command = ["agent.py", "--model", f"{OUT}/sft/{seed}", "--seed", str(seed), *ARMS[name]]
        return name, seed, read_run(folder, run(command, folder))

    def grpo(seed):
        folder = f"{OUT}/grpo/{seed}"
        command = ["grpo.py", "--model", f"{OUT}/sft_plain/{seed}", "--seed", str(seed)]
        return "grpo", seed, read_run(folder, run(command, folder))

    results = {name: {} for name in [*ARMS, "grpo"]}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(arm, (name, seed)) for seed in seeds for name in ARMS]
        jobs += [pool.submit(grpo, seed) for seed in seeds]
        for job in jobs:
            name, seed, result = job.result()
            results[name][str(seed)] = result
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    import torch
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            "one thread a run, two runs at a time", "seeds": seeds, "arms": {k: " ".join(v) for k, v in ARMS.items()},
            "sft": {str(seed): result for seed, result in starts.items()},
            "sft_plain": {str(seed): result for seed, result in plain_starts.items()}, "results": results}


def last(result: dict) -> dict:
    return result["evals"][-1]


def first(result: dict) -> dict:
    return result["evals"][0]


def tables(data: dict) -> list[str]:
    """The markdown tables docs/agent.md quotes (tests/test_prose_numbers.py holds the page to them): held-out
    sampled accuracy with the calculator by arm and seed, and the call rate by kind at the first and last
    evaluation."""
    seeds = [str(s) for s in data["seeds"]]
    res = data["results"]
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | minutes |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for name, when, label in [("tool", first, "start (step 0)"), ("no_tool", first, "start, calls refused"),
                              *((name, last, name) for name in ARMS), ("grpo", first, "grpo.py's start (step 0)"),
                              ("grpo", last, "grpo.py")]:
        values = [100 * when(res[name][s])["accuracy_sampled"] for s in seeds]
        minutes = f"{statistics.mean(res[name][s]['minutes'] for s in seeds):.1f}" if when is last else ""
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {statistics.mean(values):.1f} | "
                     f"{minutes} |")
    lines += ["", "| arm | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for name, when, label in [("tool", first, "start (step 0)"), ("tool", last, "tool"), ("no_tool", last, "no_tool"),
                              ("cost", last, "cost")]:
        lines.append(f"| {label} | " + " | ".join(
            f"{statistics.mean(when(res[name][s])[f'call_rate/{k}'] for s in seeds):.2f}" for k in KINDS) + " |")
    return lines


def report(data: dict):
    print("\n".join(tables(data)))
    figure(data)


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def figure(data: dict):
    seeds = [str(s) for s in data["seeds"]]
    res = data["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"tool": "tab:green", "no_tool": "tab:red", "cost": "tab:blue", "grpo": "tab:gray"}
    for name in colors:
        for s in seeds:
            evals = res[name][s]["evals"]
            axes[0].plot([e["step"] for e in evals], [100 * e["accuracy_sampled"] for e in evals], color=colors[name],
                         marker="o", alpha=0.7, label=name if s == seeds[0] else None)
    axes[0].set(title="held-out sampled accuracy, with the calculator", xlabel="step", ylabel="%")
    axes[0].legend()
    for ax, name in zip(axes[1:], ("tool", "cost")):
        for kind in KINDS:
            per_seed = [res[name][s]["per_step"][f"call_rate/{kind}"] for s in seeds]
            mean = [statistics.mean(v for v in step if v is not None) for step in zip(*per_seed)]
            ax.plot(range(1, len(mean) + 1), smooth(mean), label=kind)
        ax.set(title=f"{name}: share of episodes that call, by kind", xlabel="step", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
    fig.suptitle(f"agent.py, {len(seeds)} seeds (training call rates: mean over seeds, 10-step running mean)")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, FIGURE), dpi=110)
    print(f"wrote {FIGURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report", action="store_true", help="only the tables and figure, from docs/agent_runs.json")
    args = parser.parse_args()
    if not args.report:
        data = measure(args.seeds)
        with open(os.path.join(ROOT, JSON), "w") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(ROOT, JSON)) as f:
        report(json.load(f))


if __name__ == "__main__":
    main()
