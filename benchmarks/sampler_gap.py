"""A bf16 sampler on the CPU: how large the gap to the float32 trainer is, and whether TIS changes a GRPO run.

On a GPU the rollout samples from a bf16 copy of the weights (lib/rollout.py's static cache) while the trainer's pass
runs under autocast. The CPU can run the same sampler: rollout.generate under torch.autocast("cpu", bfloat16) with
static_cache=True computes decode_step on a bf16 copy of the weights, as on a GPU (uncaptured), and the trainer's
pass stays float32. Three arms from benchmarks/syllabus.py's SFT model of each seed, grpo.py at the syllabus's
settings (40 steps, evaluated every 20 on the 500 held-out problems):

    fp32       grpo.py as it runs on the CPU: the sampler is the float32 model
    bf16       every rollout (training and evaluation) by the bf16 sampler, no correction
    bf16_tis   the same with --vllm_importance_sampling_correction true (token_truncate, C = 3)

Each run logs the gap (sampling/* in metrics.jsonl); the runs are compared seed by seed.

    python benchmarks/sampler_gap.py            # the runs (a finished one is read), docs/sampler_gap.json
    python benchmarks/sampler_gap.py --report   # the table from docs/sampler_gap.json
"""
import argparse
import functools
import json
import os
import runpy
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS, OUT, JSON = "out/syllabus", "out/sampler_gap", "docs/sampler_gap.json"
ARMS = {"fp32": (False, []), "bf16": (True, []),
        "bf16_tis": (True, ["--vllm_importance_sampling_correction", "true"])}  # (bf16 sampler, extra settings)
GAP = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max", "sampling/kl")


def bf16_sampler():
    """Every rollout.generate call from here on samples with a bf16 copy of the weights (the static cache's
    decode_step, uncaptured on the CPU), the prompts' pass under bf16 autocast too: the GPU's sampler."""
    import torch

    from lib import rollout

    plain = rollout.generate

    @functools.wraps(plain)
    def generate(model, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(model, *args, **{**kwargs, "static_cache": True})

    rollout.generate = generate


def child(bf16: bool, args: list):
    """One script run in this process, with the bf16 sampler when asked."""
    sys.path.insert(0, ROOT)
    if bf16:
        bf16_sampler()
    sys.argv = args
    runpy.run_path(os.path.join(ROOT, args[0]), run_name="__main__")


def run(arm: str, seed: int) -> dict:
    """One arm at one seed (a finished run is read): its evaluations, last-10-step reward, and its gap per step."""
    sft, folder = f"{RUNS}/sft/{seed}", f"{OUT}/{arm}/{seed}"
    if not os.path.isfile(os.path.join(ROOT, sft, "eval.json")):
        raise SystemExit(f"error: no SFT model at {sft}: run `python benchmarks/syllabus.py --methods grpo` first")
    bf16, extra = ARMS[arm]
    if not os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
        command = ["grpo.py", "--model", sft, "--seed", str(seed), "--max_steps", "40", "--eval_steps", "20", *extra,
                   "--output_dir", folder, "--overwrite_output_dir", "true"]
        print(arm, " ".join(command), flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "bf16" if bf16 else "fp32", *command],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
    with open(os.path.join(ROOT, folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [row for row in rows if "reward" in row]
    return {"seed": seed, "gap": {key.rsplit("/", 1)[-1] if "difference" in key else "kl":
                                  [row[key] for row in train] for key in GAP},
            "reward_last10": statistics.fmean(row["reward"] for row in train[-10:]),
            "evals": [{"step": row["step"], "sampled": 100 * row["eval/accuracy_sampled"],
                       "greedy": 100 * row["eval/accuracy_greedy"]} for row in rows if "eval/accuracy_sampled" in row]}


def median_gap(run: dict, key: str) -> float:
    """The median over a run's steps of one of its logged gaps (mean, max or kl)."""
    return statistics.median(run["gap"][key])


def table(data: dict) -> str:
    """Per arm and seed: the gap (the median over the 40 steps of each step's mean and max |d| and KL), the held-out
    accuracy at step 40, the reward of the last 10 steps."""
    lines = ["| arm | seed | gap: mean abs d (median) | max abs d (median) | KL (median) | greedy, step 40 | "
             "sampled, step 40 | reward, last 10 steps |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, runs in data["arms"].items():
        for r in runs:
            last = r["evals"][-1]
            lines.append(f"| {arm} | {r['seed']} | {median_gap(r, 'mean'):.2e} | {median_gap(r, 'max'):.2e} | "
                         f"{median_gap(r, 'kl'):.2e} | {last['greedy']:.1f}% | {last['sampled']:.1f}% | "
                         f"{r['reward_last10']:.3f} |")
    return "\n".join(lines)


def differences(data: dict, b: str, a: str) -> list[float]:
    """Arm b's sampled accuracy at step 40 minus arm a's, seed by seed, in points."""
    return [round(y["evals"][-1]["sampled"] - x["evals"][-1]["sampled"], 1)
            for x, y in zip(data["arms"][a], data["arms"][b])]


def prose(data: dict) -> list[str]:
    """The sentences docs/scaling.md quotes, from the committed runs."""
    arms = data["arms"]
    spread = lambda arm, key: ", ".join(f"{median_gap(r, key):.1e}" for r in arms[arm])  # noqa: E731
    points = lambda diffs: ", ".join(f"{d:+.1f}" for d in diffs)  # noqa: E731
    return [f"The bf16 sampler's gap to the float32 trainer, the median over a run's steps of each step's mean "
            f"|d|, was {spread('bf16', 'mean')} on the three seeds, against {spread('fp32', 'mean')} for the float32 "
            f"sampler, and of each step's largest |d| {spread('bf16', 'max')} (float32: {spread('fp32', 'max')})",
            f"the bf16 sampler's final sampled accuracy minus the float32 sampler's, seed by seed: "
            f"{points(differences(data, 'bf16', 'fp32'))} points",
            f"with the correction minus without, both bf16-sampled: {points(differences(data, 'bf16_tis', 'bf16'))} "
            f"points"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--report", action="store_true", help="only the table, from docs/sampler_gap.json")
    args = parser.parse_args()
    if not args.report:
        jobs = [(arm, seed) for seed in args.seeds for arm in ARMS]
        with ThreadPoolExecutor(max_workers=2) as pool:  # two runs at a time, one thread each (OMP_NUM_THREADS=1)
            done = list(pool.map(lambda job: run(*job), jobs))
        data = {"seeds": args.seeds, "settings": "grpo.py --max_steps 40 --eval_steps 20 from out/syllabus/sft/<seed>",
                "arms": {arm: [r for (a, _), r in zip(jobs, done) if a == arm] for arm in ARMS}}
        with open(os.path.join(ROOT, JSON), "w") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(ROOT, JSON)) as f:
        data = json.load(f)
    print(table(data), *prose(data), sep="\n\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2] == "bf16", sys.argv[3:])
    else:
        main()
