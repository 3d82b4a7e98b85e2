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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    run_all(args.seeds, args.jobs, args.workers)


if __name__ == "__main__":
    main()
