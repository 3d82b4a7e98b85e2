"""The course's methods side by side, and the controls behind its comparisons.

Each seed s is one start: `sft.py --seed s`, then from it `reward_model.py --seed s` (PPO's reward
model and the online-DPO judge). Every method trains from that start with `--seed s` for 40 steps
and is evaluated every 20 on the 500 held-out problems (4 samples each at temperature 1, and
greedy). The range over seeds therefore covers the SFT model, the reward model and the RL run
together, not the RL run alone.

    python benchmarks/syllabus.py                                    # every method, seeds 0 1 2
    python benchmarks/syllabus.py --seeds 0 --methods grpo rule_ppo  # a quick look
    python benchmarks/syllabus.py --report                           # tables and figures from docs/syllabus.json

The syllabus rows run each script at its defaults. A control row changes one thing against the row
CONTROLS names, so the difference between the two is that one thing's effect (on these seeds), but
for rule_ppo, which changes two:

    rule_ppo             rm_ppo with the checker's reward instead of the reward model's score, and so
                         with a fresh critic head on the SFT model instead of the reward model as critic
    rule_ppo_120         rm_ppo_120 (rm_ppo for 120 steps, ppo.py's default length, evaluated every 40) with
                         the checker's reward instead of the reward model's score, the critic starting from
                         the reward model in both arms (--value_model): the reward is the one thing changed
    dpo_offline_5e-5     dpo_offline at online DPO's learning rate (5e-5) instead of 5e-6
    dpo_own_pairs        dpo_offline_5e-5 on the start's own samples ranked once by the checker
                         (own_pairs), instead of the shipped pairs; against dpo_online_rule it is
                         the same pairs' kind sampled once, not at every step from the current policy
    rm_ppo_4_updates     rm_ppo with 2 PPO epochs of 2 mini-batches: 4 updates per batch, 3 of them where the
                         ratio can leave 1
    grpo_4_iterations    grpo with 4 updates per batch (num_iterations 4)
    grpo_perfect_teacher grpo from an SFT model of the same seed trained on a perfect teacher's
                         demonstrations (data/make_data.py --careless 0) instead of the careless one's
    grpo_4_iterations_3e-4
                         grpo_4_iterations at lr 3e-4 instead of 5e-5: steps large enough for the
                         ratio to reach the clip's edge on some tokens
    grpo_4_iterations_3e-4_no_clip
                         grpo_4_iterations_3e-4 with the clip removed (--epsilon 1e6): what the clip
                         held back, at settings where it acts
    dpo_iterative_10     dpo_online_rule with each sampling's pairs used for 10 steps (--steps_per_generation 10:
                         sampled at steps 1, 11, 21, 31) instead of pairs from the current policy at every step

Outputs: out/syllabus/<start or method>/<seed>/ (the runs; a finished run is read, not repeated),
docs/syllabus.json (each run's evaluations, minutes and the metrics the pages quote: the tables and
figures are drawn from it, and tests/test_prose_numbers.py holds the pages to it), docs/syllabus.png
and docs/controls.png, and the markdown tables printed.
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVAL_STEPS = 40, 20
METHODS = {  # name: (script, arguments beyond --model / --seed / --output_dir, the start it trains from)
    "grpo": ("grpo.py", [], "sft"),
    "rloo": ("grpo.py", ["--advantage_estimator", "rloo"], "sft"),
    "reinforce_pp": ("grpo.py", ["--advantage_estimator", "reinforce_pp"], "sft"),
    "mix": ("mix.py", [], "sft"),
    "rm_ppo": ("ppo.py", ["--reward_model", "{rm}"], "sft"),
    "dpo_offline": ("dpo.py", [], "sft"),
    "dpo_online_rule": ("dpo.py", ["--online", "true", "--judge", "rule"], "sft"),
    "dpo_online_rm": ("dpo.py", ["--online", "true", "--judge", "{rm}"], "sft"),
    "rft": ("rft.py", [], "sft"),
    "kto_online": ("dpo.py", ["--online", "true", "--loss_type", "kto"], "sft"),
    # the controls
    "rule_ppo": ("ppo.py", ["--reward_model", "rule"], "sft"),
    "dpo_offline_5e-5": ("dpo.py", ["--learning_rate", "5e-5"], "sft"),
    "dpo_own_pairs": ("dpo.py", ["--dataset", "{own_pairs}", "--learning_rate", "5e-5"], "sft"),
    "rm_ppo_4_updates": ("ppo.py", ["--reward_model", "{rm}", "--num_ppo_epochs", "2", "--num_mini_batches", "2"],
                         "sft"),
    "grpo_4_iterations": ("grpo.py", ["--num_iterations", "4"], "sft"),
    "grpo_perfect_teacher": ("grpo.py", [], "sft_perfect"),
    "grpo_4_iterations_3e-4": ("grpo.py", ["--num_iterations", "4", "--learning_rate", "3e-4"], "sft"),
    "grpo_4_iterations_3e-4_no_clip": ("grpo.py", ["--num_iterations", "4", "--learning_rate", "3e-4",
                                                   "--epsilon", "1e6"], "sft"),
    "dpo_iterative_10": ("dpo.py", ["--online", "true", "--judge", "rule", "--steps_per_generation", "10"], "sft"),
    # PPO at its own default length (120 steps), where the reward's two kinds drift apart
    "rm_ppo_120": ("ppo.py", ["--reward_model", "{rm}"], "sft"),
    "rule_ppo_120": ("ppo.py", ["--reward_model", "rule", "--value_model", "{rm}"], "sft"),
}
LONG = {"rm_ppo_120": 120, "rule_ppo_120": 120}  # rows trained longer than STEPS, evaluated every 40 steps
CONTROLS = {  # control: (the row it changes one thing of, that one thing)
    "rule_ppo": ("rm_ppo", "two things: the reward (the checker instead of the reward model) and the critic's start "
                           "(a fresh head instead of the reward model)"),
    "dpo_offline_5e-5": ("dpo_offline", "the learning rate: 5e-5 instead of 5e-6"),
    "dpo_own_pairs": ("dpo_offline_5e-5", "the pairs: the start's own samples, ranked by the checker"),
    "rm_ppo_4_updates": ("rm_ppo", "4 updates per batch (2 epochs of 2 mini-batches) instead of 1"),
    "grpo_4_iterations": ("grpo", "4 updates per batch instead of 1"),
    "grpo_perfect_teacher": ("grpo", "the SFT data: a perfect teacher's demonstrations"),
    "grpo_4_iterations_3e-4": ("grpo_4_iterations", "the learning rate: 3e-4 instead of 5e-5"),
    "grpo_4_iterations_3e-4_no_clip": ("grpo_4_iterations_3e-4", "no clip (--epsilon 1e6) instead of 0.2"),
    "dpo_iterative_10": ("dpo_online_rule", "the pairs of 10 steps sampled at once, every 10 steps (iterative DPO)"),
    "rule_ppo_120": ("rm_ppo_120", "the reward alone: the checker instead of the reward model, the critic starting "
                                   "from the reward model in both (--value_model)"),
}
NEEDS_RM = ("rm_ppo", "dpo_online_rm", "rm_ppo_4_updates")  # their clock starts after the reward model's training
COLORS = dict(zip(METHODS, ["tab:blue", "lightsteelblue", "slategrey", "tab:orange", "tab:green", "tab:olive",
                            "tab:red", "tab:pink", "tab:cyan", "darkviolet", "tab:purple", "tab:brown", "chocolate",
                            "navy", "tab:gray", "gold", "black", "magenta", "teal", "tab:green",
                            "tab:purple"]))  # a colour a method, every panel


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------
def train(folder: str, command: list[str]) -> str:
    """Run one script into folder unless it holds a finished run (eval.json); returns the folder. What the run
    cost goes to folder/cost.json: its processor minutes (user + system time of the script's process), which
    with one thread (OMP_NUM_THREADS=1) are the minutes it takes alone on one core, whatever else shares the
    machine, and its wall-clock minutes."""
    if not os.path.isfile(os.path.join(ROOT, folder, "eval.json")):
        command = [sys.executable, *command, "--output_dir", folder, "--overwrite_output_dir", "true"]
        print(" ".join(command[1:]), flush=True)
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cost = {"cpu_minutes": (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / 60,
                "wall_minutes": (time.perf_counter() - started) / 60,
                "threads": os.environ.get("OMP_NUM_THREADS", "default")}
        with open(os.path.join(ROOT, folder, "cost.json"), "w") as f:
            json.dump(cost, f)
    return folder


def start(kind: str, seed: int, out: str) -> dict:
    """The folders a seed's methods start from: its SFT model (careless or perfect teacher), its reward model, and
    its own pairs (made only when asked for)."""
    if kind == "sft_perfect":
        data = os.path.join(out, "data_perfect")
        if not os.path.isfile(os.path.join(ROOT, data, "demos", "train.jsonl")):
            subprocess.run([sys.executable, "data/make_data.py", "--careless", "0", "--out", data], cwd=ROOT,
                           check=True)
        return {"sft": train(f"{out}/sft_perfect/{seed}", ["sft.py", "--seed", str(seed),
                                                            "--dataset", f"{data}/demos"])}
    sft = train(f"{out}/sft/{seed}", ["sft.py", "--seed", str(seed)])
    rm = train(f"{out}/rm/{seed}", ["reward_model.py", "--model", sft, "--seed", str(seed)])
    return {"sft": sft, "rm": rm, "own_pairs": f"{out}/own_pairs/{seed}"}


def own_pairs(sft: str, folder: str, seed: int, prompts: str = "data/arithmetic", batch: int = 512) -> dict:
    """One round of semi-online DPO's data: the SFT model's own samples, two per prompt of the train split of
    `prompts`, ranked once by the checker; a pair wherever one sample is right and the other wrong. These are the
    pairs online DPO with --judge rule trains on at its first step (both right or both wrong: a tie, no pair),
    made once from the start instead of at every step from the current policy. Writes folder/train.jsonl."""
    if os.path.isfile(os.path.join(ROOT, folder, "train.jsonl")):
        with open(os.path.join(ROOT, folder, "stats.json")) as f:
            return json.load(f)
    sys.path.insert(0, ROOT)
    import torch

    import common
    from lib import rollout

    torch.manual_seed(seed)
    model, tokenizer = common.load_model(os.path.join(ROOT, sft))
    data = common.load_split(os.path.join(ROOT, prompts), "train")
    rows, right_count = [], 0
    for begin in range(0, len(data), batch // 2):
        part = data[begin : begin + batch // 2]
        texts = [common.make_prompt(tokenizer, q) for q in part["question"] for _ in range(2)]
        *_, completion_ids, _ = rollout.generate(model, tokenizer, texts, 64)
        samples = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        for i, (question, answer) in enumerate(zip(part["question"], part["answer"])):
            a, b = samples[2 * i : 2 * i + 2]
            right_a, right_b = common.is_correct(a, answer), common.is_correct(b, answer)
            right_count += right_a + right_b
            if right_a != right_b:
                rows.append({"prompt": question, "chosen": a if right_a else b, "rejected": b if right_a else a})
    os.makedirs(os.path.join(ROOT, folder), exist_ok=True)
    with open(os.path.join(ROOT, folder, "train.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    stats = {"prompts": len(data), "pairs": len(rows), "samples_right": right_count / (2 * len(data))}
    with open(os.path.join(ROOT, folder, "stats.json"), "w") as f:
        json.dump(stats, f)
    return stats


def run(method: str, seed: int, out: str) -> dict:
    """Train one method at one seed; returns what the pages quote of it (summary)."""
    script, extra, kind = METHODS[method]
    folders = start(kind, seed, out)
    stats = own_pairs(folders["sft"], folders["own_pairs"], seed) if "{own_pairs}" in extra else None
    steps, every = (LONG[method], 2 * EVAL_STEPS) if method in LONG else (STEPS, EVAL_STEPS)
    folder = train(f"{out}/{method}/{seed}", [script, "--model", folders["sft"], "--seed", str(seed),
                                              "--max_steps", str(steps), "--eval_steps", str(every),
                                              *[a.format(**folders) for a in extra]])
    return {"seed": seed, **summary(folder, folders, stats)}


def read_json(path: str) -> dict:
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def read_cost(folder: str) -> dict:
    """train()'s cost.json of a run (processor and wall-clock minutes)."""
    return read_json(os.path.join(folder, "cost.json"))


def read_rows(folder: str) -> list[dict]:
    with open(os.path.join(ROOT, folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summary(folder: str, folders: dict, stats: dict | None) -> dict:
    """A run as the pages quote it: its settings, its evaluations (step, sampled and greedy %, minutes on its
    clock), the reward model's minutes where it needs one, and the means of the training metrics the pages read."""
    rows = read_rows(folder)
    with open(os.path.join(ROOT, folder, "run.json")) as f:
        settings = json.load(f)["settings"]
    train_rows = [row for row in rows if row["step"] > 0]  # every step's row (an evaluation's step holds both)
    means = {key: statistics.fmean(row[key] for row in train_rows if key in row)
             for key in ("clip_fraction", "clip_fraction/actor", "online/ties", "kl", "kl_sum")
             if any(key in row for row in train_rows)}
    first = {key: train_rows[0][key] for key in ("logps/chosen", "logps/rejected") if key in train_rows[0]}
    last10 = {key: statistics.fmean(row[key] for row in train_rows[-10:])
              for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "score", "accuracy")
              if key in train_rows[-1]}
    kept = ("learning_rate", "beta", "kl_coef", "num_iterations", "num_ppo_epochs", "num_mini_batches", "epsilon",
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "mu",
            "expert_data_ratio", "online", "judge", "loss_type", "steps_per_generation", "dataset", "reward_model")
    summary = {"settings": {k: settings.get(k) for k in kept if k in settings},
               "evals": [{"step": row["step"], "sampled": 100 * row["eval/accuracy_sampled"],
                          "greedy": 100 * row["eval/accuracy_greedy"], "minutes": row["time/elapsed"] / 60}
                         for row in rows if "eval/accuracy_sampled" in row],
               "dpo_curve": [{"step": row["step"], "chosen": row["rewards/chosen"], "rejected": row["rewards/rejected"]}
                             for row in train_rows if "rewards/chosen" in row],
               "means": means, "first": first, "last10": last10}
    summary["cost"] = read_cost(folder)
    summary["sft_eval"] = read_json(os.path.join(folders["sft"], "eval.json"))  # the start's own final evaluation
    if len(train_rows) > STEPS:  # a longer run: its reward model's score and the checker's accuracy, step by step
        summary["per_step"] = {key: [row[key] for row in train_rows] for key in ("score", "accuracy", "kl_sum")
                               if key in train_rows[-1]}
    if "rm" in folders and any(folders["rm"] in str(v) for v in settings.values()):
        summary["rm_cost"] = read_cost(folders["rm"])
        with open(os.path.join(ROOT, folders["rm"], "eval.json")) as f:
            summary["rm_eval"] = json.load(f)
    if stats:
        summary["own_pairs"] = stats
    return summary


# ---------------------------------------------------------------------------------------------
# The tables and the figures, from the summaries alone
# ---------------------------------------------------------------------------------------------
def spread(values: list[float]) -> str:
    """mean, and the range over seeds."""
    mean = statistics.fmean(values)
    return f"{mean:.1f} ({min(values):.1f} to {max(values):.1f})" if len(values) > 1 else f"{mean:.1f}"


def gains(runs: list[dict]) -> list[float]:
    """gain = held-out sampled accuracy at the end - at step 0, per seed (points)."""
    return [run["evals"][-1]["sampled"] - run["evals"][0]["sampled"] for run in runs]


def given(run: dict) -> str:
    """What a method was given: learning rate and its KL weight."""
    s = run["settings"]
    kl = (f"kl_coef {s['kl_coef']}" if "kl_coef" in s else f"beta {s['beta']}" if "beta" in s else "no KL term")
    updates = (f", {s['num_ppo_epochs']} epochs x {s['num_mini_batches']} mini-batches"
               if s.get("num_ppo_epochs", 1) * s.get("num_mini_batches", 1) > 1 else
               f", {s['num_iterations']} updates" if s.get("num_iterations", 1) > 1 else "")
    clip = ", no clip" if s.get("epsilon", 0.2) >= 1 else ""
    return f"lr {s['learning_rate'] or ('5e-05' if s.get('online') else '5e-06')}, {kl}{updates}{clip}"


def answers(run: dict) -> str:
    """What a method learned from at each step: its answers, sampled from the policy or read from a dataset."""
    s = run["settings"]
    rows = s["per_device_train_batch_size"] * s.get("gradient_accumulation_steps", 1)
    if "online" in s:  # dpo.py: a row is a pair
        if not s["online"]:
            return f"{rows} pairs of {'its own samples' if 'own_pairs' in s['dataset'] else 'the shipped data'}"
        k = s.get("steps_per_generation", 1)
        return f"{2 * rows} sampled ({rows} prompts x 2)" + (f", every {k} steps" if k > 1 else "")
    if "kl_coef" in s:  # ppo.py
        return f"{rows} sampled (1 a prompt)"
    expert = math.ceil(rows * s["expert_data_ratio"]) if "mu" in s else 0  # mix.py's expert rows
    G = s["num_generations"]
    return f"{rows - expert} sampled ({(rows - expert) // G} prompts x {G})" + (
        f" + {expert} expert answers" if expert else "")


def table(results: dict) -> str:
    """The side-by-side table of the runs of STEPS steps: mean (range over seeds)."""
    lines = [f"| method | seeds | answers a step ({STEPS} steps) | lr, KL weight | minutes on one core (+ reward "
             f"model) | step 0 | step {STEPS} | gain (points) | greedy at {STEPS} |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, runs in ((m, runs) for m, runs in results.items() if m not in LONG):
        minutes = statistics.fmean(run["cost"]["cpu_minutes"] for run in runs)
        rm = f" (+{statistics.fmean(r['rm_cost']['cpu_minutes'] for r in runs):.1f})" if "rm_cost" in runs[0] else ""
        seeds = ", ".join(str(run["seed"]) for run in runs)
        lines.append(f"| {method} | {seeds} | {answers(runs[0])} | {given(runs[0])} | {minutes:.1f}{rm} | "
                     f"{spread([run['evals'][0]['sampled'] for run in runs])} | "
                     f"{spread([run['evals'][-1]['sampled'] for run in runs])} | {spread(gains(runs))} | "
                     f"{spread([run['evals'][-1]['greedy'] for run in runs])} |")
    return "\n".join(lines)


def controls_table(results: dict) -> str:
    """Each control beside its row: the gains per seed, and the difference of the means."""
    lines = ["| control | changes, against | its gain | the row's gain | difference | per seed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for control, (row, change) in CONTROLS.items():
        if control in results and row in results:
            seeds = [run["seed"] for run in results[control]]  # the row on the control's seeds only
            ours, theirs = gains(results[control]), gains([run for run in results[row] if run["seed"] in seeds])
            per_seed = ", ".join(f"{a - b:+.1f}" for a, b in zip(ours, theirs))
            lines.append(f"| {control} | {change}; `{row}` | {spread(ours)} | {spread(theirs)} | "
                         f"{statistics.fmean(ours) - statistics.fmean(theirs):+.1f} | {per_seed} |")
    return "\n".join(lines)


def ppo_seeds_table(results: dict) -> str:
    """PPO at its default length on each seed, with the checker's reward beside it (the critic starting from the
    reward model in both): the start, the reward model, the held-out sampled accuracy at each evaluation."""
    lines = ["| seed | SFT greedy / sampled | reward model: pairwise accuracy, shipped / policy pairs | "
             "PPO sampled: step 0 -> 40 -> 80 -> 120 | gain | PPO greedy at 120 | the checker's reward instead: "
             "gain | difference |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rule = {run["seed"]: run for run in results.get("rule_ppo_120", [])}
    for run in results.get("rm_ppo_120", []):
        sft, rm, evals = run["sft_eval"], run["rm_eval"], run["evals"]
        other = rule.get(run["seed"])
        diff = (f"{gains([other])[0]:+.2f} | {gains([other])[0] - gains([run])[0]:+.2f}" if other else "- | -")
        lines.append(f"| {run['seed']} | {100 * sft['accuracy_greedy']:.1f} / {100 * sft['accuracy_sampled']:.2f} | "
                     f"{100 * rm['pairwise_accuracy']:.1f} / {100 * rm['policy_pairwise_accuracy']:.1f} | "
                     + " -> ".join(f"{e['sampled']:.2f}" for e in evals)
                     + f" | **{gains([run])[0]:+.2f}** | {evals[-1]['greedy']:.1f} | {diff} |")
    return "\n".join(lines)


def band(ax, method: str, runs: list[dict]):
    """The gain at each evaluated step (held-out sampled accuracy - at step 0, per seed): the mean over seeds
    (points, joined) and their range (band)."""
    steps = [e["step"] for e in runs[0]["evals"]]
    curves = list(zip(*[[e["sampled"] - run["evals"][0]["sampled"] for e in run["evals"]] for run in runs]))
    ax.plot(steps, [statistics.fmean(c) for c in curves], marker="o", color=COLORS[method], label=method)
    ax.fill_between(steps, [min(c) for c in curves], [max(c) for c in curves], alpha=0.15, color=COLORS[method])


MARKERS = ["o", "s", "^", "D", "v"]  # one a seed, in every paired figure


def paired_panel(ax, pairs: list[tuple[str, str, str]], results: dict, noise: float):
    """Per-seed paired differences (points of final held-out sampled accuracy, b - a on each seed's shared
    start): one marker shape a seed, the mean as a bar, and the band of +-t(0.975, n - 1) noise / sqrt(n)
    around 0, the half-width of the ledger's 95% interval at the evaluation noise alone: the least a mean of n
    seeds must exceed. A mean outside it may still not be shown: the interval also takes the seeds' own spread
    (the ledger's rule, docs/lessons.md). pairs: (label, a, b), coloured by b."""
    import lessons  # the rule's t quantile (benchmarks/lessons.py)

    for i, (label, a, b) in enumerate(pairs):
        finals = {m: {run["seed"]: run["evals"][-1]["sampled"] for run in results[m]} for m in (a, b)}
        seeds = sorted(set(finals[a]) & set(finals[b]))
        diffs = [finals[b][sd] - finals[a][sd] for sd in seeds]
        for sd, d in zip(seeds, diffs):
            ax.scatter(i, d, marker=MARKERS[sd % len(MARKERS)], color=COLORS[b], s=30, zorder=3,
                       label=f"seed {sd}" if i == 0 else None)
        ax.plot([i - 0.3, i + 0.3], [statistics.fmean(diffs)] * 2, color=COLORS[b], lw=2.5)
        if len(seeds) > 1:
            width = lessons.t_quantile(0.975, len(seeds) - 1) * noise / math.sqrt(len(seeds))
            ax.fill_between([i - 0.4, i + 0.4], -width, width, color="grey", alpha=0.2, lw=0)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(pairs)), [label for label, _, _ in pairs], rotation=30, ha="right", fontsize=8)


def figures(results: dict, seeds: list[int], folder: str):
    """docs/syllabus.png (each method against GRPO seed by seed, the reward model's two uses, offline DPO's
    log-probs) and docs/controls.png (each control against the row it changes, seed by seed)."""
    import lessons  # the noise floor: one model evaluated twice (benchmarks/lessons.py)

    noise = lessons.rms(lessons.FLOORS["tiny"])
    grey = (f"+-t(0.975, n - 1) x {noise:.2f} / sqrt(n), n a pair's seeds, the 95% interval's half-width at the "
            "evaluation noise alone:",
            "the least a mean must exceed; the verdict also needs the seeds' own spread (docs/lessons.md)")
    fig, (kept, judge, moved, level) = plt.subplots(1, 4, figsize=(22, 5.4),
                                                    gridspec_kw={"width_ratios": [1.4, 1, 1, 1]})
    others = [m for m in results if m not in CONTROLS and m not in LONG and m not in ("grpo", "dpo_online_rm")]
    paired_panel(kept, [(m, "grpo", m) for m in others], results, noise)
    for method in ("rm_ppo", "dpo_online_rm"):
        if method in results:
            band(judge, method, results[method])
    gain = "gain: held-out sampled accuracy - at step 0, points"
    kept.set(title="each method minus GRPO, seed by seed (each script's defaults)",
             ylabel="final sampled accuracy - GRPO's, points\n(grey: the noise band, see the title)")
    judge.set(title="one reward model per seed, two ways to use it", xlabel="step", ylabel=gain)
    dpo = [m for m in ("dpo_offline", "dpo_offline_5e-5", "dpo_own_pairs") if m in results]
    for method in dpo:
        runs, beta = results[method], results[method][0]["settings"]["beta"]
        steps = [row["step"] for row in runs[0]["dpo_curve"]]
        for key, style in (("chosen", "-"), ("rejected", "--")):
            moved.plot(steps, [statistics.fmean(run["dpo_curve"][i][key] for run in runs) / beta
                               for i in range(len(steps))], style, color=COLORS[method], label=f"{method}: {key}")
    moved.axhline(0, color="grey", lw=0.8)
    moved.set(title="offline DPO: how far each answer moved\n(a change)", xlabel="step",
              ylabel="log pi - log pi_ref, nats (0 = the start; mean over seeds)")
    shown = [m for m in dpo if m != "dpo_offline_5e-5"]  # its step-1 batch is dpo_offline's: the same bars
    for i, method in enumerate(shown):
        for j, key in enumerate(("chosen", "rejected")):
            value = statistics.fmean(run["first"][f"logps/{key}"] for run in results[method])
            level.bar(3 * i + j, value, color=COLORS[method], hatch="" if key == "chosen" else "//",
                      label=f"{method}: {key}")
    level.set_xticks([3 * i + 0.5 for i in range(len(shown))], shown, fontsize=8)
    level.set(title="offline DPO's pairs at step 1\n(a level; dpo_offline_5e-5's are dpo_offline's)",
              ylabel="summed log pi of the answers, nats (step 1, mean)")
    for ax in (kept, judge, moved, level):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Each method from the same start per seed (sft.py, reward_model.py --seed s), {STEPS} steps, seeds "
                 f"{', '.join(map(str, seeds))}, 500 held-out problems x 4 samples; panel 2: mean over seeds and "
                 "range (band). Each method's learning rate and KL weight differ: docs/dpo.md's table.\n"
                 f"Panel 1, grey: {' '.join(grey)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, folder, "syllabus.png"), dpi=100)

    pairs = [(f"{c}\nminus {row}", row, c) for c, (row, _) in CONTROLS.items() if c in results and row in results
             and c != "grpo_perfect_teacher"]  # its starts differ: its gain, not its final score, is compared
    fig, ax = plt.subplots(figsize=(max(11, 1.5 * len(pairs)), 5.5))
    paired_panel(ax, pairs, results, noise)
    ax.set_ylabel("final sampled accuracy: control - row, points\n(grey: the noise band, see the title)")
    ax.set_title(f"Each control minus the row it changes (one thing; rule_ppo two: the reward and the critic's start), "
                 f"{STEPS} steps (the _120 pair: 120),\nseed by seed (marker shape), the bar their mean. Grey: "
                 + "\n".join(grey), fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, folder, "controls.png"), dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in ("rloo", "reinforce_pp")],
                        choices=list(METHODS), help="default: all but rloo and reinforce_pp")
    parser.add_argument("--out", default="out/syllabus", help="where the runs go")
    parser.add_argument("--docs", default="docs", help="where syllabus.json and the figures go")
    parser.add_argument("--report", action="store_true", help="train nothing: tables and figures from syllabus.json")
    parser.add_argument("--add", action="store_true", help="add these runs to syllabus.json instead of replacing it")
    args = parser.parse_args()
    path = os.path.join(ROOT, args.docs, "syllabus.json")
    if args.report:
        with open(path) as f:
            saved = json.load(f)
        results, seeds = saved["results"], saved["seeds"]
    else:
        done = {(m, seed): run(m, seed, args.out) for seed in args.seeds for m in args.methods}  # a seed at a time
        saved = read_json(path) if args.add else {"seeds": [], "starts": {}, "results": {}}
        for m in args.methods:  # with --add, a seed already saved is replaced and the others kept
            kept = [r for r in saved["results"].get(m, []) if r["seed"] not in args.seeds]
            saved["results"][m] = sorted(kept + [done[m, seed] for seed in args.seeds], key=lambda r: r["seed"])
        saved["seeds"] = sorted(set(saved["seeds"]) | set(args.seeds))
        # each start's own final evaluation (the SFT models and the reward model), from the runs of STEPS steps only:
        # the LONG rows carry their start's (sft_eval, rm_eval), which may come from another machine's float order
        for seed in args.seeds if set(args.methods) - set(LONG) else []:
            saved["starts"].setdefault(str(seed), {}).update({
                name: read_json(f"{args.out}/{name}/{seed}/eval.json") for name in ("sft", "rm", "sft_perfect")
                if os.path.isfile(os.path.join(ROOT, args.out, name, str(seed), "eval.json"))})
        with open(path, "w") as f:
            json.dump(saved, f, indent=1)
        results, seeds = saved["results"], saved["seeds"]
    print(table(results), "", controls_table(results), "", ppo_seeds_table(results), sep="\n")
    figures(results, seeds, args.docs)
    print(f"figures: {args.docs}/syllabus.png, {args.docs}/controls.png; summaries: {path}")


if __name__ == "__main__":
    main()
