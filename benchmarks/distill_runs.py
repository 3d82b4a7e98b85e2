"""On-policy distillation against SFT on the teacher's samples and against GRPO, at equal samples, 3 seeds.

Each seed s has a teacher and two students, all from benchmarks/syllabus.py's starts:

    teacher      sft_perfect/s: sft.py on a perfect teacher's demonstrations (data/make_data.py --careless 0)
    student      sft/s: sft.py on the careless teacher's demonstrations (the course's SFT model)
    small        sft_small/s: the same SFT, with a model of half the width (sft.py --model tiny-small)

and from each student three arms of 40 steps, 128 sampled completions a step, learning rate 5e-5 (the
RL scripts' default), evaluated every 20 steps on the 500 held-out problems:

    gkd          distill.py --teacher_model_name_or_path teacher: the student samples, the reverse KL to
                 the teacher at each of its tokens (on-policy distillation)
    sft_teacher  sft.py on 40 x 128 completions the teacher sampled (temperature 1) for training prompts:
                 SFT on the teacher's samples (off-policy distillation, sequence-level KD), 128 a step
    grpo         grpo.py: 16 prompts x 8 samples, the checker's reward, no teacher

So per step each arm samples 128 completions: the student's (gkd, grpo) or the teacher's (sft_teacher).
The teacher never sees the checker; GRPO never sees the teacher.

    python benchmarks/distill_runs.py               # the runs (one thread each, two at a time), then the report
    python benchmarks/distill_runs.py --report      # docs/distill.png and the table from docs/distill_runs.json

Outputs: the starts in out/syllabus/ (shared with syllabus.py; a finished run is read, not repeated),
the arms in out/distill_runs/<student>_<arm>/<seed>/, docs/distill_runs.json, docs/distill.png.
"""
import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS, OUT, JSON, FIGURE = "out/syllabus", "out/distill_runs", "docs/distill_runs.json", "docs/distill.png"
STEPS, BATCH, LR = 40, 128, "5e-5"
STUDENTS = {"student": "sft", "small": "sft_small"}
ARMS = ("gkd", "sft_teacher", "grpo")
COLORS = {"gkd": "tab:green", "sft_teacher": "tab:orange", "grpo": "tab:blue"}


def syllabus():
    spec = importlib.util.spec_from_file_location("syllabus", os.path.join(ROOT, "benchmarks", "syllabus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def starts(seed: int) -> dict:
    """The seed's teacher and students (trained unless there)."""
    bench = syllabus()
    return {"teacher": bench.start("sft_perfect", seed, RUNS)["sft"],
            "student": bench.train(f"{RUNS}/sft/{seed}", ["sft.py", "--seed", str(seed)]),
            "small": bench.train(f"{RUNS}/sft_small/{seed}", ["sft.py", "--model", "tiny-small", "--seed", str(seed)])}


def teacher_samples(teacher: str, folder: str, seed: int) -> dict:
    """STEPS x BATCH completions the teacher samples at temperature 1, BATCH training prompts a step (each step's
    drawn without replacement, as the RL scripts draw theirs), written in the data's schema (question, answer
    'reasoning #### n') so sft.py reads them; with data/arithmetic's held-out split beside them. A completion
    that does not parse back into <think>...</think><answer>...</answer> exactly is left out (counted)."""
    path = os.path.join(ROOT, folder)
    if os.path.isfile(os.path.join(path, "stats.json")):
        return json.load(open(os.path.join(path, "stats.json")))
    sys.path.insert(0, ROOT)
    import torch

    import common
    from lib import rollout

    torch.manual_seed(seed)
    model, tokenizer = common.load_model(os.path.join(ROOT, teacher))
    model.eval()
    train = common.load_split(os.path.join(ROOT, "data/arithmetic"), "train")
    rng = random.Random(seed)
    rows, tokens, right = [], 0, 0
    for _ in range(STEPS):
        picked = train[rng.sample(range(len(train)), BATCH)]
        prompts = [common.make_prompt(tokenizer, q) for q in picked["question"]]
        with torch.no_grad():
            *_, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 64)
        tokens += int(completion_mask.sum())
        for text, question, answer in zip(tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
                                          picked["question"], picked["answer"]):
            right += common.is_correct(text, answer)
            reasoning, final = text.partition("</think>")[0].removeprefix("<think>"), common.extract_answer(text)
            as_data = f"{reasoning}\n#### {final}"
            if final is not None and common.format_completion(*common.split_gsm8k_answer(as_data)) == text:
                rows.append({"question": question, "answer": as_data})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    shutil.copy(os.path.join(ROOT, "data/arithmetic/test.jsonl"), os.path.join(path, "test.jsonl"))
    stats = {"samples": STEPS * BATCH, "kept": len(rows), "right": right / (STEPS * BATCH), "tokens": tokens}
    json.dump(stats, open(os.path.join(path, "stats.json"), "w"))
    return stats


def arm(name: str, who: str, seed: int, folders: dict) -> dict:
    """One arm from one student at one seed: its evaluations, minutes and sampled tokens."""
    bench, student = syllabus(), folders[who]
    common_args = ["--seed", str(seed), "--max_steps", str(STEPS), "--eval_steps", "20"]
    if name == "grpo" and who == "student":  # the syllabus's own grpo run of this seed
        folder = bench.train(f"{RUNS}/grpo/{seed}", ["grpo.py", "--model", student, *common_args])
    elif name == "grpo":
        folder = bench.train(f"{OUT}/{who}_grpo/{seed}", ["grpo.py", "--model", student, *common_args])
    elif name == "gkd":
        folder = bench.train(f"{OUT}/{who}_gkd/{seed}", ["distill.py", "--model", student,
                                                         "--teacher_model_name_or_path", folders["teacher"],
                                                         *common_args])
    else:
        samples = f"{OUT}/teacher_samples/{seed}"
        stats = teacher_samples(folders["teacher"], samples, seed)
        folder = bench.train(f"{OUT}/{who}_sft_teacher/{seed}", [
            "sft.py", "--model", student, "--dataset", samples, *common_args, "--per_device_train_batch_size",
            str(BATCH), "--learning_rate", LR, "--warmup_steps", "10", "--weight_decay", "0.0", "--eval_on_start",
            "true", "--logging_steps", "1"])
    rows = bench.read_rows(folder)
    train = [row for row in rows if "loss" in row]
    if name == "sft_teacher":
        tokens = stats["tokens"]
    elif name == "gkd":
        tokens = sum(row["sampled_tokens"] for row in train)
    else:
        tokens = round(sum(row["completion_length"] * BATCH for row in train))
    return {"seed": seed, "cost": bench.read_cost(folder), "sampled_tokens": tokens,
            "evals": [{"step": row["step"], "sampled": 100 * row["eval/accuracy_sampled"],
                       "greedy": 100 * row["eval/accuracy_greedy"]} for row in rows if "eval/accuracy_sampled" in row],
            **({"loss": [row["loss"] for row in train]} if name == "gkd" else {})}


def measure(seeds: list[int], jobs: int = 2) -> dict:
    with ThreadPoolExecutor(jobs) as pool:
        folders = dict(zip(seeds, pool.map(starts, seeds)))
    bench = syllabus()
    teachers = {str(s): bench.read_json(f"{folders[s]['teacher']}/eval.json") for s in seeds}
    samples = {}
    with ThreadPoolExecutor(jobs) as pool:
        submitted = {(who, name, seed): pool.submit(arm, name, who, seed, folders[seed])
                     for who in STUDENTS for name in ARMS for seed in seeds}
        results = {who: {name: [] for name in ARMS} for who in STUDENTS}
        for (who, name, seed), job in submitted.items():
            results[who][name].append(job.result())
    for seed in seeds:
        samples[str(seed)] = teacher_samples(folders[seed]["teacher"], f"{OUT}/teacher_samples/{seed}", seed)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    import torch
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"one thread a run, {jobs} at a time", "seeds": seeds, "teachers": teachers, "teacher_samples": samples,
            "results": results}


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.1f} ({min(values):.1f} to {max(values):.1f})"


def tables(data: dict) -> list[str]:
    """The markdown table docs/distill.md quotes (tests/test_prose_numbers.py holds the page to it): held-out sampled
    accuracy at step 0 and 40, the gain, the difference to GRPO's final accuracy on each seed, sampled tokens and
    minutes; mean (range over seeds)."""
    lines = ["| student | arm | step 0 | step 40 | gain | minus GRPO, per seed | sampled tokens | minutes, one core |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for who in STUDENTS:
        grpo = data["results"][who]["grpo"]
        for name in ARMS:
            runs = data["results"][who][name]
            first, last = [r["evals"][0]["sampled"] for r in runs], [r["evals"][-1]["sampled"] for r in runs]
            versus = ", ".join(f"{r['evals'][-1]['sampled'] - g['evals'][-1]['sampled']:+.1f}"
                               for r, g in zip(runs, grpo)) if name != "grpo" else ""
            lines.append(f"| {who} | {name} | {spread(first)} | {spread(last)} | "
                         f"{spread([b - a for a, b in zip(first, last)])} | {versus} | "
                         f"{statistics.fmean(r['sampled_tokens'] for r in runs):,.0f} | "
                         f"{statistics.fmean(r['cost']['cpu_minutes'] for r in runs):.1f} |")
    teacher = [100 * t["accuracy_sampled"] for t in data["teachers"].values()]
    lines.append(f"| teacher | (sft_perfect) | {spread(teacher)} | | | | | |")
    return lines


def final_minus(data: dict, who: str, name: str, other: str) -> list[float]:
    """Per seed: the final sampled accuracy of arm `name` minus that of arm `other` (or of the teacher)."""
    runs = data["results"][who][name]
    if other == "teacher":
        return [r["evals"][-1]["sampled"] - 100 * data["teachers"][str(r["seed"])]["accuracy_sampled"] for r in runs]
    return [r["evals"][-1]["sampled"] - o["evals"][-1]["sampled"] for r, o in zip(runs, data["results"][who][other])]


def prose(data: dict) -> list[str]:
    """The sentences of docs/distill.md that quote the runs (tests/test_prose_numbers.py finds each in the page)."""
    def listed(values):
        return ", ".join(f"{v:+.1f}" for v in values)

    samples = data["teacher_samples"].values()
    return [
        f"on-policy distillation ended above GRPO on every seed ({listed(final_minus(data, 'student', 'gkd', 'grpo'))} "
        f"points) and above SFT on the teacher's samples on every seed "
        f"({listed(final_minus(data, 'student', 'gkd', 'sft_teacher'))})",
        f"its final sampled accuracy minus its teacher's: {listed(final_minus(data, 'student', 'gkd', 'teacher'))}",
        f"SFT on the teacher's samples gained less than GRPO on every seed "
        f"({listed(final_minus(data, 'student', 'sft_teacher', 'grpo'))})",
        f"on-policy distillation ended above GRPO by {listed(final_minus(data, 'small', 'gkd', 'grpo'))} and above "
        f"SFT on the teacher's samples by {listed(final_minus(data, 'small', 'gkd', 'sft_teacher'))}",
        f"SFT on the teacher's samples ended above GRPO by "
        f"{listed(final_minus(data, 'small', 'sft_teacher', 'grpo'))}",
        f"the teacher's samples were right {min(100 * x['right'] for x in samples):.1f}% to "
        f"{max(100 * x['right'] for x in samples):.1f}% of the time",
        f"{statistics.fmean(r['evals'][-1]['sampled'] for r in data['results']['small']['gkd']):.1f} with on-policy "
        f"distillation, against the teacher's "
        f"{statistics.fmean(100 * t['accuracy_sampled'] for t in data['teachers'].values()):.1f}",
    ]


SEED_MARKERS = ("o", "s", "^", "D", "v")  # one a seed in the two students' panels, the teachers' marks included


def figure(data: dict):
    """docs/distill.png: each student's arms, one line a seed (marker: the seed), beside each seed's own teacher
    (a black mark of the same shape at the right edge); and each arm's final accuracy minus GRPO's, per seed."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    teachers = {int(seed): 100 * t["accuracy_sampled"] for seed, t in data["teachers"].items()}
    paired = axes[2]
    for i, (who, marker) in enumerate(zip(STUDENTS, ("o", "s"))):
        grpo = data["results"][who]["grpo"]
        for name in ("gkd", "sft_teacher"):
            runs = data["results"][who][name]
            paired.plot([r["seed"] + 0.1 * i for r in runs], [r["evals"][-1]["sampled"] - g["evals"][-1]["sampled"]
                                                              for r, g in zip(runs, grpo)], color=COLORS[name],
                        marker=marker, linestyle="none", label=f"{who}: {name}")
    paired.axhline(0, color=COLORS["grpo"], linewidth=1)
    paired.set(title="final accuracy minus GRPO's, per seed", xlabel="seed", ylabel="points",
               xticks=data["seeds"])
    paired.grid(alpha=0.3)
    paired.legend(fontsize=7)
    for ax, who in zip(axes, STUDENTS):
        for name in ARMS:
            for i, r in enumerate(data["results"][who][name]):
                ax.plot([e["step"] for e in r["evals"]], [e["sampled"] for e in r["evals"]],
                        marker=SEED_MARKERS[r["seed"] % len(SEED_MARKERS)], color=COLORS[name], alpha=0.75,
                        label=name if i == 0 else None)
        for i, (seed, value) in enumerate(sorted(teachers.items())):
            ax.scatter(44, value, marker=SEED_MARKERS[seed % len(SEED_MARKERS)], color="black", s=40, zorder=3,
                       label="each seed's teacher (its marker)" if i == 0 else None)
        ax.set(title=f"{who} ({STUDENTS[who]}): one line a seed", xlabel="step (128 sampled completions each)",
               xticks=[0, 20, 40], xlim=(-2, 47))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy, sampled (%)")
    low = min(e["sampled"] for who in STUDENTS for runs in data["results"][who].values() for r in runs
              for e in r["evals"])
    for ax in axes[:2]:
        ax.set_ylim(low - 3, max(*teachers.values(), 85) + 3)
    axes[0].legend(fontsize=8)
    axes[1].legend(handles=[Line2D([], [], marker=SEED_MARKERS[s % len(SEED_MARKERS)], color="grey", linestyle="none",
                                   label=f"seed {s}") for s in sorted(teachers)], fontsize=8, loc="lower right")
    fig.suptitle(f"On-policy distillation (gkd), SFT on the teacher's samples, GRPO: {len(data['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, FIGURE), dpi=110)
    print(f"wrote {FIGURE}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    parser.add_argument("--report", action="store_true", help="only the table and figure, from docs/distill_runs.json")
    args = parser.parse_args()
    if not args.report:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ["TQDM_DISABLE"] = "1"
        data = measure(args.seeds, args.jobs)
        with open(os.path.join(ROOT, JSON), "w") as f:
            json.dump(data, f, indent=1)
    with open(os.path.join(ROOT, JSON)) as f:
        data = json.load(f)
    print("\n".join(tables(data)))
    figure(data)


if __name__ == "__main__":
    main()
