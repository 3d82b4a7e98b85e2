"""Process against outcome rewards on the tiny model: the runs of benchmarks/process_claims.md, and their report.

    python benchmarks/process_runs.py --seeds 2 3 4                 # train what is missing (two jobs at a time)
    python benchmarks/process_runs.py --seeds 2 3 4 --report        # docs/process_runs.json and docs/process.png

Per seed s, from the syllabus's SFT model (out/syllabus/sft/s, `sft.py --seed s`) and reward model
(out/syllabus/rm/s): two process reward models (prm.py, exact and estimated labels), seven RL arms (the claims
file's table), and best-of-N on the held-out problems judged by the PRM and by the reward model. Each job runs in
its own process with one thread (OMP_NUM_THREADS=1), two at a time; a job starts when the folders it reads are
finished; a folder with an eval.json is finished and kept. What a job cost is in its folder's cost.json.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = "out/process"
SFT, RM = "out/syllabus/sft/{seed}", "out/syllabus/rm/{seed}"
PRM, PRM_ESTIMATED = f"{OUT}/prm/{{seed}}", f"{OUT}/prm_estimated/{{seed}}"
RL = "--max_steps 40 --eval_steps 20".split()
REGISTERED = "2026-11-29, 447e4c0: benchmarks/process_claims.md"  # the claims, written before any run
JOBS = {  # name: (script and settings, the folders it needs), in the order they start; {sft}, {rm}, {prm}: the seed's
    "prm": ("prm.py --model {sft}", ["sft"]),
    "grpo_outcome": ("grpo_process.py --model {sft} --process_supervision false", ["sft"]),
    "grpo_process": ("grpo_process.py --model {sft}", ["sft"]),
    "grpo_process_prm": ("grpo_process.py --model {sft} --process_reward_model {prm}", ["prm"]),
    "grpo_outcome_prm": ("grpo_process.py --model {sft} --process_supervision false --process_reward_model {prm}",
                         ["prm"]),
    "ppo_outcome": ("ppo.py --model {sft} --reward_model rule --value_model {prm}", ["prm"]),
    "ppo_process": ("ppo.py --model {sft} --reward_model rule --process_rewards true --value_model {prm}", ["prm"]),
    "ppo_process_prm": ("ppo.py --model {sft} --reward_model {prm} --process_rewards true", ["prm"]),
    "prm_estimated": ("prm.py --model {sft} --labels estimated", ["sft"]),
    "bon_prm": ("best_of_n.py --model {sft} --judge {prm} --num_samples 16", ["prm"]),
    "rm": ("reward_model.py --model {sft}", ["sft"]),
    "bon_rm": ("best_of_n.py --model {sft} --judge {rm} --num_samples 16", ["rm"]),
}
RL_ARMS = [name for name in JOBS if name.startswith(("grpo", "ppo"))]


def folder(name: str, seed: int) -> str:
    return {"rm": RM, "prm": PRM, "prm_estimated": PRM_ESTIMATED}.get(name, f"{OUT}/{name}/{{seed}}").format(seed=seed)


def finished(path: str) -> bool:
    return os.path.isfile(os.path.join(ROOT, path, "eval.json"))


def train(name: str, seed: int):
    """One job into its folder (unless finished), one thread, its cost in cost.json (benchmarks/syllabus.py's)."""
    out = folder(name, seed)
    if finished(out):
        return
    places = {"sft": SFT.format(seed=seed), "rm": RM.format(seed=seed), "prm": PRM.format(seed=seed)}
    command = [sys.executable, *JOBS[name][0].format(**places).split(), "--seed", str(seed),
               *(RL if name in RL_ARMS else []), "--output_dir", out, "--overwrite_output_dir", "true"]
    print(" ".join(command[1:]), flush=True)
    started = time.perf_counter()
    with open(os.path.join(ROOT, OUT, f"{name}_{seed}.log"), "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(command[1:])} failed: {OUT}/{name}_{seed}.log")
    with open(os.path.join(ROOT, out, "cost.json"), "w") as f:
        json.dump({"cpu_minutes": (usage.ru_utime + usage.ru_stime) / 60,
                   "wall_minutes": (time.perf_counter() - started) / 60, "threads": "1"}, f)


def run_all(seeds: list[int], names: list[str], workers: int = 2):
    """Every job of every seed, `workers` at a time, each once the folders it needs are finished."""
    os.makedirs(os.path.join(ROOT, OUT), exist_ok=True)
    todo = [(name, seed) for name in names for seed in seeds]  # a job's seeds together: the PRMs come first
    lock, failures = threading.Lock(), []

    def ready(name, seed):
        return all(finished(folder(need, seed)) for need in JOBS[name][1] if need != "sft")

    def worker():
        while not failures:
            with lock:
                job = next((j for j in todo if ready(*j)), None)
                if job is None:
                    if not todo:
                        return
                else:
                    todo.remove(job)
            if job is None:
                time.sleep(5)
                continue
            try:
                train(*job)
            except SystemExit as error:
                failures.append(str(error))

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit("; ".join(failures))


# ---------------------------------------------------------------------------------------------
# The report: docs/process_runs.json (what the ledger and the page read) and docs/process.png
# ---------------------------------------------------------------------------------------------
SERIES = ("accuracy", "steps/carry_slip", "steps/borrow_slip", "steps/other_lines", "steps/judge_minus_exact",
          "steps/per_completion", "completion_length")  # per training step, when the run logs it


def read_run(path: str) -> dict:
    """An RL run's evaluations (points) and its per-step series."""
    with open(os.path.join(ROOT, path, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [{"step": r["step"], "greedy": 100 * r["eval/accuracy_greedy"], "sampled": 100 * r["eval/accuracy_sampled"]}
             for r in rows if "eval/accuracy_sampled" in r]
    series = {key: [r.get(key) for r in rows if r["step"] > 0] for key in SERIES if any(key in r for r in rows)}
    return {"evals": evals, "series": series}


def read_json(path: str) -> dict:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return json.load(f)


def report(seeds: list[int]) -> dict:
    data = {"seeds": seeds, "registered": REGISTERED, "arms": {}, "prm": {}, "prm_estimated": {}, "best_of_n": {}}
    for arm in RL_ARMS:
        data["arms"][arm] = {str(s): read_run(folder(arm, s)) for s in seeds if finished(folder(arm, s))}
    for name in ("prm", "prm_estimated"):
        data[name] = {str(s): read_json(os.path.join(folder(name, s), "eval.json")) for s in seeds
                      if finished(folder(name, s))}
    for name, judge in (("bon_prm", "prm"), ("bon_rm", "rm")):
        for s in seeds:
            if finished(folder(name, s)):
                result = read_json(os.path.join(folder(name, s), "eval.json"))
                data["best_of_n"].setdefault(str(s), {})[judge] = {key: result[key] for key in
                                                                   ("pass@k", "maj@k", "best_of_n", "n")}
    with open(os.path.join(ROOT, "docs", "process_runs.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    plot(data)
    return data


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def plot(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    styles = {"grpo_outcome": ("tab:blue", "--"), "grpo_process": ("tab:blue", "-"),
              "grpo_outcome_prm": ("tab:orange", "--"), "grpo_process_prm": ("tab:orange", "-"),
              "ppo_outcome": ("tab:green", "--"), "ppo_process": ("tab:green", "-"),
              "ppo_process_prm": ("tab:red", "-")}
    for ax, family in zip(axes[:2], ("grpo", "ppo")):
        for arm, runs in data["arms"].items():
            if not arm.startswith(family) or not runs:
                continue
            color, line = styles[arm]
            steps_ = [e["step"] for e in next(iter(runs.values()))["evals"]]
            ax.plot(steps_, [mean(r["evals"][i]["sampled"] for r in runs.values()) for i in range(len(steps_))],
                    color=color, linestyle=line, marker="o", label=arm)
        ax.set(title=f"{family.upper()}: held-out sampled accuracy (mean of {len(data['seeds'])} seeds)",
               xlabel="step", ylabel="%")
        ax.legend(fontsize=7)
    for arm in ("grpo_outcome", "grpo_process", "ppo_outcome", "ppo_process"):
        runs = data["arms"].get(arm) or {}
        rates = [r["series"]["steps/carry_slip"] for r in runs.values() if "steps/carry_slip" in r["series"]]
        if rates:
            per_step = [mean(100 * (row[i] if row[i] is not None else float("nan")) for row in rates)
                        for i in range(min(map(len, rates)))]
            window = [mean(per_step[max(0, i - 4): i + 1]) for i in range(len(per_step))]
            axes[2].plot(range(1, len(window) + 1), window, color=styles[arm][0], linestyle=styles[arm][1], label=arm)
    axes[2].set(title="the slip's line wrong (first carry), 5-step mean", xlabel="step", ylabel="% of carrying sums")
    axes[2].legend(fontsize=7)
    bon = [b for b in data["best_of_n"].values() if "prm" in b and "rm" in b]
    if bon:
        Ns = [int(N) for N in bon[0]["prm"]["best_of_n"]]
        for label, values, color in (
                ("best of N by the PRM (min)", [mean(100 * b["prm"]["best_of_n"][str(N)]["gold"] for b in bon)
                                                 for N in Ns], "tab:orange"),
                ("best of N by the reward model", [mean(100 * b["rm"]["best_of_n"][str(N)]["gold"] for b in bon)
                                                   for N in Ns], "tab:green"),
                ("majority vote (maj@N)", [mean(100 * b["prm"]["maj@k"][str(N)] for b in bon) for N in Ns],
                 "tab:purple"),
                ("pass@N (the checker picks)", [mean(100 * b["prm"]["pass@k"][str(N)] for b in bon) for N in Ns],
                 "tab:gray"),
                ("one at random (pass@1)", [mean(100 * b["prm"]["pass@k"]["1"] for b in bon)] * len(Ns), "black")):
            axes[3].plot(Ns, values, marker="o" if "random" not in label else None, color=color, label=label,
                         linestyle=":" if "random" in label else "-")
        axes[3].set(xscale="log", title=f"SFT's held-out answers: one kept of N ({len(bon)} seeds)", xlabel="N",
                    ylabel="kept answer right (%)")
        axes[3].set_xticks(Ns, [str(N) for N in Ns])
        axes[3].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "docs", "process.png"), dpi=80)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="write docs/process_runs.json and docs/process.png")
    args = parser.parse_args()
    if args.report:
        report(args.seeds)
    else:
        run_all(args.seeds, args.jobs, args.workers)


if __name__ == "__main__":
    main()
