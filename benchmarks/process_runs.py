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
import math
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
    "judges": ("benchmarks/process_runs.py --judges {sft} {prm} {rm}", ["prm", "rm"]),
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
    data = {"seeds": seeds, "registered": REGISTERED, "arms": {}, "prm": {}, "prm_estimated": {}, "best_of_n": {},
            "judges": {str(s): read_json(os.path.join(folder("judges", s), "eval.json")) for s in seeds
                       if finished(folder("judges", s))}}
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


ARM_NAMES = {"grpo_outcome": "GRPO, outcome twin (exact judge)", "grpo_process": "GRPO, process (exact labels)",
             "grpo_outcome_prm": "GRPO, outcome twin (the PRM's answer step)",
             "grpo_process_prm": "GRPO, process (the PRM)", "ppo_outcome": "PPO, the checker's reward at the end",
             "ppo_process": "PPO, step rewards (exact labels)", "ppo_process_prm": "PPO, step rewards (the PRM)"}
KINDS = ("no carry", "carry", "no borrow", "borrow", "sign", "extra", "all")


def late_mean(run: dict, key: str) -> float:
    """A training statistic's mean over steps 31-40, in points."""
    return 100 * mean(run["series"][key][30:40])


def rl_table(data: dict) -> str:
    """Each arm: held-out sampled accuracy at step 0 and step 40, and the slip's error rate over steps 31-40, per
    seed, and the steps per completion (grpo_process.py's arms)."""
    seeds = [str(s) for s in data["seeds"]]
    lines = ["| arm | sampled accuracy, step 0 -> 40, per seed | mean at 40 | the first carrying line wrong (the "
             "carry slip), steps 31-40 (%), per seed |", "| --- | --- | --- | --- |"]
    for arm, name in ARM_NAMES.items():
        runs = data["arms"].get(arm, {})
        if not all(s in runs for s in seeds):
            continue
        finals = [runs[s]["evals"][-1]["sampled"] for s in seeds]
        lines.append(f"| {name} | " + ", ".join(f"{runs[s]['evals'][0]['sampled']:.1f} -> "
                                                 f"{runs[s]['evals'][-1]['sampled']:.1f}" for s in seeds)
                     + f" | {mean(finals):.1f} | " + ", ".join(f"{late_mean(runs[s], 'steps/carry_slip'):.1f}"
                                                              for s in seeds) + " |")
    return "\n".join(lines)


def prm_table(data: dict) -> str:
    """The PRMs on their held-out answers (exact labels), per seed: step accuracy (all, carry, borrow), answer AUROC
    (min, product); and the judges' AUROC on one more set of answers (the PRM's and the reward model's)."""
    seeds = [str(s) for s in data["seeds"] if str(s) in data["prm"]]
    row = lambda r, key: ", ".join(f"{100 * r[s][key]:.1f}" for s in seeds if s in r)  # noqa: E731
    lines = ["| held out, per seed (%) | PRM on exact labels | PRM on estimated labels |", "| --- | --- | --- |"]
    for key, name in (("step_accuracy", "step accuracy, every step (answer steps included)"),
                      ("step_accuracy/no carry", "step accuracy, no carry"),
                      ("step_accuracy/carry", "step accuracy, carry"), ("step_accuracy/no borrow",
                                                                         "step accuracy, no borrow"),
                      ("step_accuracy/borrow", "step accuracy, borrow"), ("step_accuracy/sign", "step accuracy, sign"),
                      ("step_accuracy/extra", "step accuracy, extra lines (rare)"),
                      ("step_accuracy/answer", "step accuracy, answer steps (result not negative)"),
                      ("step_accuracy/answer, negative", "step accuracy, answer steps (negative result)"),
                      ("answer_auroc/min", "AUROC of the answer's score, min over steps"),
                      ("answer_auroc/product", "AUROC, product over steps")):
        lines.append(f"| {name} | {row(data['prm'], key)} | {row(data['prm_estimated'], key)} |")
    if data.get("judges"):
        judged = [s for s in seeds if s in data["judges"]]
        lines.append("| AUROC on the SFT model's answers: the PRM (min) / the reward model | "
                     + ", ".join(f"{100 * data['judges'][s]['auroc/prm_min']:.1f} / "
                                 f"{100 * data['judges'][s]['auroc/orm']:.1f}" for s in judged) + " | |")
    return "\n".join(lines)


def agreement_table(data: dict) -> str:
    """Math-Shepherd's hard estimate against the exact label, over the training answers' line steps, by kind: the
    share that agree and the two errors, pooled over the seeds (steps counted)."""
    runs = list(data["prm_estimated"].values())
    lines = ["| kind of step | line steps | estimate agrees | a broken prefix called right (% of the line steps) | a "
             "right prefix called wrong (% of the line steps) |", "| --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        n = sum(r.get(f"label_steps/{kind}", 0) for r in runs)
        if not n:
            continue
        share = lambda name: sum(r.get(f"label_{name}/{kind}", 0) * r.get(f"label_steps/{kind}", 0)  # noqa: E731
                                 for r in runs) / n
        lines.append(f"| {kind} | {n:,.0f} | {100 * share('agreement'):.1f}% | "
                     f"{100 * share('wrong_called_right'):.1f}% | {100 * share('right_called_wrong'):.1f}% |")
    return "\n".join(lines)


def selection_table(data: dict) -> str:
    """Best-of-16 on the SFT model's 16 samples of each of the 500 held-out problems, per seed: the answer kept
    right (%) by each way of keeping one."""
    bon = {s: b for s, b in data["best_of_n"].items() if "prm" in b and "rm" in b}
    lines = ["| one answer kept of 16 | " + " | ".join(f"seed {s}" for s in bon) + " | mean |",
             "| --- |" + " --- |" * (len(bon) + 1)]
    for name, value in (("at random (pass@1)", lambda b: b["prm"]["pass@k"]["1"]),
                        ("majority vote (maj@16)", lambda b: b["prm"]["maj@k"]["16"]),
                        ("best of 16 by the reward model", lambda b: b["rm"]["best_of_n"]["16"]["gold"]),
                        ("best of 16 by the PRM (min)", lambda b: b["prm"]["best_of_n"]["16"]["gold"]),
                        ("the checker picks (pass@16)", lambda b: b["prm"]["pass@k"]["16"])):
        values = [100 * value(b) for b in bon.values()]
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {mean(values):.1f} |")
    return "\n".join(lines)


SMOLLM2_ARMS = {  # docs/smollm2_runs/sft120-seed<s>/<arm>: (its name, the folder of its SFT start's metrics)
    "grpo": ("grpo.py, the outcome chain (benchmarks/smollm2.sh: correctness plus format, dynamic sampling)", "sft"),
    "grpo_outcome": ("grpo_process.py, outcome twin (exact judge)", "sft_again"),
    "grpo_process": ("grpo_process.py, process (exact labels)", "sft_again")}


def smollm2_runs() -> dict:
    """{arm: {seed: read_run of docs/smollm2_runs/sft120-seed<seed>/<arm>, with "start": its SFT run's}}
    (benchmarks/smollm2_process.sh's arms where run, and the committed chain's GRPO run), for the seeds that have
    the process arm."""
    def path(seed: int, part: str) -> str:
        return os.path.join("docs", "smollm2_runs", f"sft120-seed{seed}", part)

    seeds = [s for s in range(3) if os.path.isfile(os.path.join(ROOT, path(s, "grpo_process"), "metrics.jsonl"))]
    return {arm: {s: {**read_run(path(s, arm)), "start": read_run(path(s, sft))["evals"][-1]} for s in seeds}
            for arm, (_, sft) in SMOLLM2_ARMS.items()
            if all(os.path.isfile(os.path.join(ROOT, path(s, arm), "metrics.jsonl")) for s in seeds)}


def smollm2_rows(seed: int, arm: str) -> list[dict]:
    """The logged lines of docs/smollm2_runs/sft120-seed<seed>/<arm>/metrics.jsonl."""
    with open(os.path.join(ROOT, "docs", "smollm2_runs", f"sft120-seed{seed}", arm, "metrics.jsonl"),
              encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def smollm2_minutes(seed: int, arm: str) -> float:
    """A SmolLM2 run's own clock at its end (time/elapsed of its last line), in minutes."""
    return smollm2_rows(seed, arm)[-1]["time/elapsed"] / 60


def smollm2_mean(seed: int, arm: str, key: str) -> float:
    """The mean over a SmolLM2 run's training steps of a logged value."""
    return mean([row.get(key) for row in smollm2_rows(seed, arm) if row["step"] > 0])


def smollm2_resolution() -> float:
    """The smallest mean difference of SmolLM2's 64 x 4 evaluation that 3 seeds can show under the rule for a
    registered claim: the one-sided t quantile times the measured s0 over sqrt(3) (larger when the seeds spread
    more than evaluation noise)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import lessons

    return lessons.t_quantile(0.95, 2) * lessons.SMOLLM2 / 3 ** 0.5


def smollm2_table() -> str:
    """SmolLM2: each arm's SFT start (its last held-out evaluation, greedy / sampled), its held-out sampled accuracy
    at step 0 and step 30 (64 problems x 4), and the slip's error rate over training steps 21-30, per seed."""
    runs = smollm2_runs()
    if not runs:
        return ""
    seeds = list(runs["grpo_process"])
    lines = [f"| arm (seeds {', '.join(map(str, seeds))}) | SFT start, greedy / sampled, per seed | sampled accuracy, "
             "step 0 -> 30, per seed | mean at 30 | the first carrying line wrong, steps 21-30 (%), per seed |",
             "| --- | --- | --- | --- | --- |"]
    for arm, (name, _) in SMOLLM2_ARMS.items():
        if arm not in runs:
            continue
        slip = ", ".join(f"{100 * mean(runs[arm][s]['series']['steps/carry_slip'][20:30]):.1f}" for s in seeds
                         ) if "steps/carry_slip" in runs[arm][seeds[0]]["series"] else "not logged"
        lines.append(f"| {name} | " + ", ".join(f"{runs[arm][s]['start']['greedy']:.1f} / "
                                                 f"{runs[arm][s]['start']['sampled']:.1f}" for s in seeds)
                     + " | " + ", ".join(f"{runs[arm][s]['evals'][0]['sampled']:.1f} -> "
                                         f"{runs[arm][s]['evals'][-1]['sampled']:.1f}" for s in seeds)
                     + f" | {mean([runs[arm][s]['evals'][-1]['sampled'] for s in seeds]):.1f} | {slip} |")
    return "\n".join(lines)


PROCESS_ROWS = [f"L{i}" for i in range(81, 97)]  # benchmarks/lessons.py's rows of the registered claims


def claims_table() -> str:
    """The registered claims as the ledger reads them: per-seed differences, their mean and 95% interval, the
    verdict and the verdict after Holm's correction over the whole ledger (docs/lessons.md)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import lessons

    rows = lessons.lessons()
    lessons.holm(rows)
    lines = ["| row | claim, registered before the runs (L95's A, the SmolLM2 chain, had run before; L94's and L96's "
             "A, the twin, was run after B had been read) | per seed | mean [95% interval] | verdict | after Holm |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row["id"] in PROCESS_ROWS:
            interval = f"[{row['low']:+.2f}, {row['high']:+.2f}]" if row["low"] is not None else ""
            lines.append(f"| [{row['id']}](lessons.md#{row['id'].lower()}) | {row['lesson']} | "
                         + ", ".join(f"{d:+.2f}" for d in row["diffs"]) + f" | {row['mean']:+.2f} {interval} | "
                         f"{row['verdict']} | {row.get('holm', '-')} |")
    return "\n".join(lines)


def ledger() -> dict:
    """{row id: row} of benchmarks/lessons.py, Holm's correction applied over the whole ledger."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import lessons

    rows = lessons.lessons()
    lessons.holm(rows)
    return {row["id"]: row for row in rows}


def said(row: dict) -> str:
    """A row's verdict as the page words it, with Holm's where it differs."""
    holm = " (not after Holm's correction over the ledger)" if row.get("holm") == "not after Holm" else ""
    return f"{row['verdict']}{holm} ([{row['id']}](lessons.md#{row['id'].lower()}))"


def smollm2_start_sentences(seeds: list[int]) -> list[str]:
    """The page's comparison of the SmolLM2 SFT starts made again with the committed ones, and the slip column's
    coverage."""
    def losses(seed, part):
        return {row["step"]: row["loss"] for row in smollm2_rows(seed, part) if "loss" in row}

    gap = max(abs(again[k] - committed[k]) / abs(committed[k]) for s in seeds
              for committed, again in [(losses(s, "sft"), losses(s, "sft_again"))] for k in committed if k in again)
    exponent = math.floor(math.log10(gap))
    bound = f"{math.ceil(gap / 10 ** exponent)}e{exponent}"  # the largest relative difference, rounded up
    runs = smollm2_runs()
    starts = {s: [runs[arm][s]["evals"][0]["sampled"] for arm in ("grpo", "grpo_process")] for s in seeds}
    equal = [s for s in seeds if starts[s][0] == starts[s][1]]
    (other,) = [s for s in seeds if s not in equal]  # the sentence names one seed whose starts differ
    answers = round(abs(starts[other][1] - starts[other][0]) / 100 * 256)
    steps = [sum(v is not None for v in runs["grpo_process"][s]["series"]["steps/carry_slip"][20:30]) for s in seeds]
    return [f"their logged training losses agree to a relative {bound} or closer, not bit for bit",
            f"is equal for seeds {' and '.join(map(str, equal))} and differs for seed {other} "
            f"({starts[other][0]:.1f} against {starts[other][1]:.1f}, "
            + ("one answer" if answers == 1 else f"{answers} answers") + " in 256)",
            "averaged over the steps that had any (" + ", ".join(map(str, steps[:-1])) + f" and {steps[-1]} of steps "
            "21-30)"]


def smollm2_twin_sentences(seeds: list[int], rows: dict) -> list[str]:
    """The page's sentences on SmolLM2's outcome twin (descriptions beside the registered rows L94-L96): where it
    ended against the committed chain, how often each arm's gradient was clipped (its norm above
    --max_grad_norm 1, harness.py's default, which smollm2_settings.sh keeps), the twin's clocks, and the mean
    difference the rule would need to show L96 (as smollm2_resolution, with L96's own measured scatter)."""
    runs = smollm2_runs()
    final = {arm: {s: runs[arm][s]["evals"][-1]["sampled"] for s in seeds} for arm in ("grpo", "grpo_outcome")}

    def norms(arm: str, seed: int) -> list[float]:  # the gradient's norm before clipping, a value per step
        return [row["grad_norm"] for row in smollm2_rows(seed, arm) if "grad_norm" in row]

    def clipped(arm: str) -> str:
        return ", ".join(str(sum(norm > 1.0 for norm in norms(arm, s))) for s in seeds)

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import lessons

    needed = lessons.t_quantile(0.95, 2) * rows["L96"]["noise"] / 3 ** 0.5
    fell = {arm: [s for s in seeds if runs[arm][s]["evals"][-1]["greedy"] < runs[arm][s]["evals"][0]["greedy"]]
            for arm in ("grpo_process", "grpo_outcome", "grpo")}

    def seeds_of(arm: str) -> str:
        return ("seed " if len(fell[arm]) == 1 else "seeds ") + " and ".join(map(str, fell[arm]))
    return ["the twin ended " + ", ".join(f"{final['grpo_outcome'][s] - final['grpo'][s]:+.1f}" for s in seeds)
            + " points from the chain at step 30 (seeds " + ", ".join(map(str, seeds)) + ")",
            "the gradient's norm was above 1, so clipped, on " + clipped("grpo_process") + " of the process arm's "
            f"{len(norms('grpo_process', seeds[0]))} steps and on " + clipped("grpo_outcome") + " of the twin's",
            "the twin's runs, three at a time, took " + ", ".join(
                f"{smollm2_minutes(s, 'grpo_outcome'):.1f}" for s in seeds) + " minutes by their own clocks",
            f"a registered difference in the slip's share would need a mean of about {needed:.0f} points",
            f"in greedy accuracy, {len(fell['grpo_process']) + len(fell['grpo_outcome'])} of the "
            f"{2 * len(seeds)} runs of `grpo_process.py` ended below their step 0 (the process arm's "
            f"{seeds_of('grpo_process')}, the twin's {seeds_of('grpo_outcome')}), and "
            f"{len(fell['grpo']) or 'none'} of the chain's {len(seeds)}"]


def harm_sentences(data: dict, seeds: list[str]) -> list[str]:
    """The page's description of the runs against the PRM whose accuracy fell (descriptions, not registered: no
    lesson)."""
    def evals(arm, seed):
        return data["arms"][arm][seed]["evals"]

    fell = sorted((arm, s) for arm in data["arms"] for s in seeds if evals(arm, s)[-1]["sampled"] < evals(arm, s)[0][
        "sampled"])
    assert fell == [("grpo_outcome_prm", "2"), ("grpo_process_prm", "2")], fell  # the first sentence names these
    ppo, twin, exact = evals("ppo_process_prm", "2"), evals("grpo_outcome_prm", "3"), evals("grpo_outcome", "3")
    by_prm = [arm for arm in data["arms"] if arm.endswith("_prm")]
    by_rule = [arm for arm in data["arms"] if not arm.endswith("_prm")]
    below = [[(a, s) for a in arms for s in seeds if evals(a, s)[-1]["greedy"] < evals(a, s)[0]["greedy"]]
             for arms in (by_prm, by_rule)]
    seed_2 = sum(s == "2" for _, s in below[0])
    return [
        "seed 2's two GRPO runs against the PRM are the only runs whose held-out sampled accuracy at step 40 is below "
        f"their start's (its PPO run against the PRM ended above it, {ppo[0]['sampled']:.1f} to "
        f"{ppo[-1]['sampled']:.1f}, while its greedy accuracy fell, {ppo[0]['greedy']:.1f} to {ppo[-1]['greedy']:.1f})",
        f"its outcome twin against the PRM fell from {twin[1]['sampled']:.1f} at step {twin[1]['step']} to "
        f"{twin[-1]['sampled']:.1f} at step {twin[-1]['step']}, its greedy accuracy from {twin[0]['greedy']:.1f} at "
        f"step 0 ({twin[1]['greedy']:.1f} at step {twin[1]['step']}) to {twin[-1]['greedy']:.1f}, and it ended "
        f"{exact[-1]['sampled'] - twin[-1]['sampled']:.1f} points below the same seed's twin against the exact judge "
        f"({twin[-1]['sampled']:.1f} against {exact[-1]['sampled']:.1f})",
        f"of the {len(by_prm) * len(seeds)} runs against the PRM, {len(below[0])} ended below their start in greedy "
        f"accuracy ({seed_2} of them seed 2's); of the {len(by_rule) * len(seeds)} runs rewarded by the rule (the "
        "exact labels or the checker), " + ("none" if not below[1] else str(len(below[1]))) + " did"]


def prose(data: dict) -> list[str]:
    """The page's sentences that carry numbers, each as printed here (tests/test_prose_numbers.py)."""
    seeds = [str(s) for s in data["seeds"]]
    rows = ledger()
    runs = list(data["prm_estimated"].values())
    n = sum(r["label_steps/all"] for r in runs)
    share = lambda name: sum(r[f"label_{name}/all"] * r["label_steps/all"] for r in runs) / n  # noqa: E731
    sentences = [f"pooled over the {len(runs)} seeds' {n:,.0f} line steps, the hard estimate agreed with the exact "
                 f"label on {100 * share('agreement'):.1f}% of them; {100 * share('right_called_wrong'):.1f}% of them "
                 f"were right prefixes it called wrong and {100 * share('wrong_called_right'):.1f}% broken ones it "
                 "called right"]
    bon = data["best_of_n"]
    best_N = {s: max(bon[s]["prm"]["best_of_n"], key=lambda N: bon[s]["prm"]["best_of_n"][N]["gold"]) for s in seeds}
    sentences.append("best of N by the PRM was right most often at N = " + ", ".join(best_N[s] for s in seeds)
                     + " (seeds " + ", ".join(seeds) + "), at " + ", ".join(
                         f"{100 * bon[s]['prm']['best_of_n'][best_N[s]]['gold']:.1f}%" for s in seeds)
                     + ", against " + ", ".join(f"{100 * bon[s]['prm']['best_of_n']['16']['gold']:.1f}%"
                                                for s in seeds) + " at N = 16, while the PRM's score of the kept "
                     "answer rose from " + ", ".join(f"{bon[s]['prm']['best_of_n'][best_N[s]]['proxy']:.3f}"
                                                     for s in seeds)
                     + " to " + ", ".join(f"{bon[s]['prm']['best_of_n']['16']['proxy']:.3f}" for s in seeds))
    hacked = data["arms"]["grpo_process_prm"]
    sentences.append("the PRM's mean reward on line steps minus the exact label went from " + ", ".join(
        f"{100 * mean(hacked[s]['series']['steps/judge_minus_exact'][:10]):+.1f}" for s in seeds) + " points over "
        "steps 1-10 to " + ", ".join(f"{100 * mean(hacked[s]['series']['steps/judge_minus_exact'][30:40]):+.1f}"
                                    for s in seeds) + f" over steps 31-40 (seeds {', '.join(seeds)}): "
        + said(rows["L88"]))
    control = data["arms"]["grpo_outcome_prm"]
    sentences.append("in the outcome twin against the same PRM, whose policy is never paid for the PRM's line scores, "
                     "it went from " + ", ".join(
                         f"{100 * mean(control[s]['series']['steps/judge_minus_exact'][:10]):+.1f}" for s in seeds)
                     + " to " + ", ".join(f"{100 * mean(control[s]['series']['steps/judge_minus_exact'][30:40]):+.1f}"
                                          for s in seeds))
    grpo_arms = ("grpo_outcome", "grpo_process", "grpo_outcome_prm", "grpo_process_prm")
    sentences.append("GRPO's rollouts held " + ", ".join(
        f"{mean(mean(data['arms'][arm][s]['series']['steps/per_completion'][30:40]) for s in seeds):.2f}"
        for arm in grpo_arms) + " steps per answer over steps 31-40 (" + ", ".join(grpo_arms)
        + "; the mean of the seeds), against " + ", ".join(
            f"{mean(mean(data['arms'][arm][s]['series']['steps/per_completion'][:10]) for s in seeds):.2f}"
            for arm in grpo_arms) + " over steps 1-10")
    smollm2_seeds = list(smollm2_runs().get("grpo_process", {}))
    import lessons  # on the path since ledger() above

    final = lessons.smollm2_final  # a SmolLM2 chain's last held-out sampled accuracy, in points
    sentences += [] if not smollm2_seeds else ["a run of `grpo_process.py` on SmolLM2 took " + ", ".join(
        f"{smollm2_minutes(seed, 'grpo_process'):.1f}" for seed in smollm2_seeds) + " minutes by its own clock "
        f"(seeds {', '.join(map(str, smollm2_seeds))}; one thread each, two runs at a time on the 2-core machine; "
        "evaluations included), not comparable with the chain's clocks (two threads, alone)",
        "drew " + ", ".join(f"{smollm2_mean(seed, 'grpo', 'dynamic_sampling/rounds'):.2f}" for seed in smollm2_seeds)
        + " sampling rounds (of 8 prompts x 4) a step on average (seeds " + ", ".join(map(str, smollm2_seeds))
        + "), keeping only the groups whose rewards differ, where `grpo_process.py` drew one and kept every group",
        "the chain's reruns from the same recipe (`smollm2_runs/pass-at-k-seed*`, [real_models.md](real_models.md)) "
        "ended " + ", ".join(f"{final(f'pass-at-k-seed{seed}') - final(f'sft120-seed{seed}'):+.1f}"
                             for seed in smollm2_seeds) + " points of held-out sampled accuracy from it",
        f"the rule shows a registered difference in final accuracy only if its mean is at least about "
        f"{smollm2_resolution():.1f} points"]
    sentences += harm_sentences(data, seeds) + (smollm2_start_sentences(smollm2_seeds) if smollm2_seeds else [])
    if "grpo_outcome" in smollm2_runs():  # the SmolLM2 twin, where it was run
        sentences += smollm2_twin_sentences(smollm2_seeds, rows)
    for row_id in ("L81", "L82", "L83", "L84", "L85", "L86", "L87", "L89", "L90", "L91", "L92", "L93", "L94", "L95",
                   "L96"):
        if row_id not in rows:  # a SmolLM2 arm not run
            continue
        row = rows[row_id]
        first = row["lesson"].split()[0]
        lesson = row["lesson"] if len(first) > 1 and first.isupper() else row["lesson"][0].lower() + row["lesson"][1:]
        sentences.append(f"the claim that {lesson}: per seed "
                         + ", ".join(f"{d:+.2f}" for d in row["diffs"]) + f", {said(row)}")
    return sentences


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
        ax.set(title=f"{family.upper()}: held-out sampled accuracy", xlabel="step",
               ylabel=f"% (mean of {len(data['seeds'])} seeds)")
        ax.legend(fontsize=7)
    for arm in ("grpo_outcome", "grpo_process", "ppo_outcome", "ppo_process"):
        runs = data["arms"].get(arm) or {}
        rates = [r["series"]["steps/carry_slip"] for r in runs.values() if "steps/carry_slip" in r["series"]]
        if rates:  # a step whose batch held no carrying sum has no value: the window's mean skips it
            window = [mean(100 * row[j] for row in rates for j in range(max(0, i - 4), i + 1) if row[j] is not None)
                      for i in range(min(map(len, rates)))]
            axes[2].plot(range(1, len(window) + 1), window, color=styles[arm][0], linestyle=styles[arm][1], label=arm)
    axes[2].set(title="the first carrying line wrong", xlabel="step",
                ylabel="% of carrying sums (5 steps, 3 seeds)")
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
        axes[3].set(xscale="log", title="one answer kept of N (the SFT model)", xlabel="N",
                    ylabel=f"kept answer right (%, mean of {len(bon)} seeds)")
        axes[3].set_xticks(Ns, [str(N) for N in Ns])
        axes[3].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "docs", "process.png"), dpi=80)


def judges(sft: str, prm_folder: str, rm_folder: str, seed: int, output_dir: str):
    """The PRM (the minimum and the product of its steps' p_j) and the outcome reward model (its score at the last
    token) as classifiers of right and wrong answers, on the same answers: the SFT policy's 2 samples of each
    held-out problem, labelled by the checker. Writes output_dir/eval.json (the AUROC of each, the share of right
    answers, n)."""
    sys.path.insert(0, ROOT)
    import torch

    import common
    import prm
    import reward_model
    from lib import rollout, steps

    torch.manual_seed(seed)
    policy, tokenizer = common.load_model(os.path.join(ROOT, sft))
    judge = common.load_model(os.path.join(ROOT, prm_folder), scalar_head=True, reward_model=True)[0].eval()
    orm = common.load_model(os.path.join(ROOT, rm_folder), scalar_head=True, reward_model=True)[0].eval()
    test = common.load_split(os.path.join(ROOT, "data/arithmetic"), "test")
    questions = [q for q in test["question"] for _ in range(2)]
    answers = [a for a in test["answer"] for _ in range(2)]
    prm_min, prm_product, orm_scores, outcomes = [], [], [], []
    with torch.no_grad():
        for start in range(0, len(questions), 256):
            qs, golds = questions[start: start + 256], answers[start: start + 256]
            prompts = [common.make_prompt(tokenizer, q) for q in qs]
            prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(policy, tokenizer, prompts, 64)
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            input_ids = torch.cat([prompt_ids, completion_ids], 1)
            attention_mask = torch.cat([prompt_mask, completion_mask], 1)
            ends = steps.end_tokens(tokenizer, completion_ids, completion_mask,
                                    [[end for _, end in steps.steps(t)] for t in texts])
            probs = prm.step_probs(judge, input_ids, attention_mask, completion_ids.shape[1], ends, 256)
            prm_min += [prm.answer_score(p, "min") for p in probs]
            prm_product += [prm.answer_score(p, "product") for p in probs]
            orm_scores += reward_model.sequence_scores(orm, input_ids, attention_mask).tolist()
            outcomes += [steps.outcome_label(t, g) for t, g in zip(texts, golds)]
    result = {"auroc/prm_min": prm.auroc(prm_min, outcomes), "auroc/prm_product": prm.auroc(prm_product, outcomes),
              "auroc/orm": prm.auroc(orm_scores, outcomes), "right_answers": sum(outcomes) / len(outcomes),
              "n": len(outcomes)}
    os.makedirs(os.path.join(ROOT, output_dir), exist_ok=True)
    with open(os.path.join(ROOT, output_dir, "eval.json"), "w") as f:
        json.dump(result, f)
    print(result)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", action="store_true", help="write docs/process_runs.json and docs/process.png")
    parser.add_argument("--judges", nargs=3, metavar=("SFT", "PRM", "RM"),
                        help="the PRM and the reward model as judges of the same held-out answers (a job)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="")
    parser.add_argument("--overwrite_output_dir", default="true")
    args = parser.parse_args()
    if args.judges:
        judges(*args.judges[:3], seed=args.seed, output_dir=args.output_dir)
    elif args.report:
        report(args.seeds)
    else:
        run_all(args.seeds, args.jobs, args.workers)


if __name__ == "__main__":
    main()
