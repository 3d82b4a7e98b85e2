"""The lessons' ledger: every comparative or causal lesson the course teaches, read by one rule from the
per-seed results committed in docs/ (syllabus.json, entropy.json, best_of_n.json, agent_runs.json,
agent_smollm2/, smollm2_runs/, distill_runs.json, majority_vote.json, entropy_remedies.json, sampler_gap.json).

    python benchmarks/lessons.py            # write docs/lessons.md
    python benchmarks/lessons.py --check    # exit 1 if docs/lessons.md differs (tests/test_lessons.py)

A lesson compares two arms that share each seed's start (the SFT model, the reward model, the seed of
the RL run), so each seed gives one paired difference d_s = arm B - arm A of a final held-out score, and
the start's own level cancels. The rule (stated in full in docs/lessons.md, function by function here):

  s0          the score's noise: measured where one model was evaluated twice, else a bound (binomial,
              Hoeffding's for scores read off k of n samples, von Neumann's for a training statistic)
  SE          max(sd(d), s0) / sqrt(n), n seeds; the 95% interval mean +- t(0.975, n - 1) SE
  B > A, B < A   shown (the interval excludes 0; one-sided 5% where the direction was committed before
              the runs), the other way, a lead (every seed agrees, the interval holds 0), not shown, one run
  B = A       no difference within +-2 points (two one-sided tests: the 90% interval inside +-2),
              not resolved, a difference
  Holm        the correction over every row with a test, beside each verdict

Rows that compare nothing (a derivation, a quantity measured without a control, a cause no run
isolated) say so instead of a verdict. Each row names what its two arms differ in; a row whose arms
differ in more than one thing says which, and its verdict is about the arms, not the one cause.
"""
import argparse
import functools
import json
import math
import os
import random
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "lessons.md")


def read(name: str):
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
        return json.load(f)


SYLLABUS, ENTROPY, BEST_OF_N = read("syllabus.json"), read("entropy.json"), read("best_of_n.json")
AGENT = read("agent_runs.json")
DISTILL, MAJORITY, REMEDIES = read("distill_runs.json"), read("majority_vote.json"), read("entropy_remedies.json")
ASYNC = read("async_runs.json")
ASYNC_REGISTERED = "2026-11-29, c60fce4: benchmarks/async_claims.md"  # written before async_runs.py ran
ASYNC_REFERENCE_REGISTERED = "2026-11-29, c5acf4c: benchmarks/async_claims.md"  # before any --reference_pass run
SAMPLER = read("sampler_gap.json")
PROCESS = read("process_runs.json")
PROCESS_REGISTERED = "2026-11-29, 447e4c0: benchmarks/process_claims.md"  # written before process_runs.py ran
SEEDS = SYLLABUS["seeds"]


# ---------------------------------------------------------------------------------------------
# Reading the committed runs
# ---------------------------------------------------------------------------------------------
def evals(method: str, source: dict | None = None) -> dict:
    """{seed: {step: held-out sampled accuracy in points}} of a row of syllabus.json (or entropy.json)."""
    rows = (source or SYLLABUS["results"])[method]
    return {run["seed"]: {e["step"]: e["sampled"] for e in run["evals"]} for run in rows}


def final(method: str, source: dict | None = None) -> dict:
    return {seed: steps[max(steps)] for seed, steps in evals(method, source).items()}


def gain(method: str) -> dict:
    return {seed: steps[max(steps)] - steps[0] for seed, steps in evals(method).items()}


def smollm2(run: str, part: str) -> list[dict]:
    """The evaluation lines (eval/accuracy_*) of docs/smollm2_runs/<run>/<part>/metrics.jsonl."""
    with open(os.path.join(ROOT, "docs", "smollm2_runs", run, part, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "eval/accuracy_sampled" in row]


def smollm2_final(run: str) -> float:
    return 100 * smollm2(run, "grpo")[-1]["eval/accuracy_sampled"]


def pass_at(run: str, part: str, k: str) -> float:
    with open(os.path.join(ROOT, "docs", "smollm2_runs", run, part, "pass_at_k.json"), encoding="utf-8") as f:
        return 100 * json.load(f)["pass@k"][k]


def differences(b: dict, a: dict) -> list[float]:
    """The paired differences b - a over the seeds both hold, in seed order."""
    return [round(b[s] - a[s], 4) for s in sorted(set(a) & set(b))]


# ---------------------------------------------------------------------------------------------
# The noise floor: one model evaluated twice
# ---------------------------------------------------------------------------------------------
def tiny_twice() -> list[float]:
    """Differences of two evaluations of one tiny model on the 500 held-out problems x 4 samples: SFT's own
    final evaluation against the RL run's step 0 (the same weights, drawn again), and rule_ppo's step 0
    (its fresh critic head draws random numbers first) against grpo's; per seed. The 120-step PPO rows add
    their start's SFT evaluation against rm_ppo_120's step 0 where that start is a model of its own (seeds 0-2: a
    one-thread SFT; on seeds 3 and 4 the 120-step rows share the 40-step rows' start, whose pair is already
    counted, and rm_ppo_120's step 0 draws what grpo's does). rule_ppo_120's step 0 is not a second draw: its
    critic is copied, not drawn, so it samples the very same answers. The pairs of one seed share an evaluation,
    so they are not independent: the root mean square is an estimate, not an exact variance."""
    twice = []
    long_ppo = {run["seed"]: run for run in SYLLABUS["results"].get("rm_ppo_120", [])}
    for seed, run in long_ppo.items():
        if run["sft_eval"] != SYLLABUS["starts"].get(str(seed), {}).get("sft"):  # a start of its own
            twice.append(100 * run["sft_eval"]["accuracy_sampled"] - run["evals"][0]["sampled"])
    grpo0 = {seed: steps[0] for seed, steps in evals("grpo").items()}
    rule0 = {seed: steps[0] for seed, steps in evals("rule_ppo").items()}
    perfect0 = {seed: steps[0] for seed, steps in evals("grpo_perfect_teacher").items()}
    for seed in SEEDS:  # a seed whose runs are not all in syllabus.json gives the pairs it has
        start = SYLLABUS["starts"].get(str(seed), {})
        if seed in grpo0 and "sft" in start:
            twice.append(100 * start["sft"]["accuracy_sampled"] - grpo0[seed])
        if seed in grpo0 and seed in rule0:
            twice.append(rule0[seed] - grpo0[seed])
        if seed in perfect0 and "sft_perfect" in start:
            twice.append(100 * start["sft_perfect"]["accuracy_sampled"] - perfect0[seed])
    return [round(d, 4) for d in twice]


SMOLLM2_STARTS = ["seed0", "seed1", "seed2", "sft30-seed0", "sft30-seed1", "sft30-seed2", "sft120-seed0",
                  "sft120-seed1", "sft120-seed2"]


def smollm2_twice() -> list[float]:
    """The same for SmolLM2 on its 64 problems x 4 samples: the SFT run's last evaluation against the GRPO
    run's step 0, where the greedy score shows the same weights and the samples were drawn anew (a pair
    drawn with the same random state is one evaluation, not two, and is left out)."""
    twice = []
    for run in SMOLLM2_STARTS:
        sft, grpo = smollm2(run, "sft")[-1], smollm2(run, "grpo")[0]
        same_weights = sft["eval/accuracy_greedy"] == grpo["eval/accuracy_greedy"]
        if same_weights and sft["eval/accuracy_sampled"] != grpo["eval/accuracy_sampled"]:
            twice.append(round(100 * (sft["eval/accuracy_sampled"] - grpo["eval/accuracy_sampled"]), 4))
    return twice


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


FLOORS = {"tiny": tiny_twice(), "smollm2": smollm2_twice()}
TINY, SMOLLM2 = rms(FLOORS["tiny"]), rms(FLOORS["smollm2"])  # points: s0 of the 500 x 4 and the 64 x 4 evaluations
MARGIN = 2.0  # points of accuracy: a smaller difference is not worth teaching (the margin of "no difference")


def binomial_noise(*arms: tuple[dict, int]) -> float:
    """s0 of a score with no twice-evaluated model of its size: for each arm ({seed: score in points}, the
    number of independent draws behind it), the binomial bound on one evaluation's variance, p(1 - p) / draws
    (over a fixed set of problems the variance is the mean of p_i (1 - p_i) / draws, at most p(1 - p) / draws);
    summed over the two arms, then the root mean square over the seeds. In points."""
    seeds = sorted(set.intersection(*(set(scores) for scores, _ in arms)))
    per_seed = [sum((scores[s] / 100) * (1 - scores[s] / 100) / draws for scores, draws in arms) for s in seeds]
    return 100 * math.sqrt(statistics.fmean(per_seed))


def step_noise(b: list[list[float]], a: list[list[float]], scale: float = 1000.0) -> float:
    """s0 of the difference of two means of the last (up to) 10 logged steps of a training statistic (the entropy of
    steps 31-40; the slip's share of the steps 21-30 that logged one), from the runs' own step-to-step scatter:
    each run's variance per step is half the mean squared difference of successive logged steps (von Neumann's
    estimator: a slow drift of b a step adds only b^2 / 2; it takes the steps as independent draws), so its mean
    over those steps carries that / their number; summed over the two arms, then the root mean square over the
    seeds. In the score's unit (scale: from the logged one, nats to millinats by default)."""
    def var_of_mean(steps: list[float]) -> float:
        last = [scale * e for e in steps[-10:]]
        return statistics.fmean((y - x) ** 2 for x, y in zip(last, last[1:])) / 2 / len(last)

    return math.sqrt(statistics.fmean(var_of_mean(x) + var_of_mean(y) for x, y in zip(b, a)))


# ---------------------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------------------
def t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with an integer number of degrees of freedom (the closed forms of
    Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2 == 1:
        total, term = 0.0, 1.0
        for k in range(1, (df - 1) // 2 + 1):
            term = c if k == 1 else term * c * c * (2 * k - 2) / (2 * k - 1)
            total += term
        return 2 / math.pi * (theta + s * total)
    total, term = 1.0, 1.0
    for k in range(1, df // 2):
        term *= c * c * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_above(t: float, df: int) -> float:
    """P(T > t)."""
    tail = (1 - t_central(t, df)) / 2
    return tail if t >= 0 else 1 - tail


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (p > 0.5), by bisection: 4.303 for p 0.975 and df 2."""
    low, high = 0.0, 1e3
    for _ in range(100):
        middle = (low + high) / 2
        if 1 - t_above(middle, df) < p:  # P(T <= middle) below p: the quantile is higher
            low = middle
        else:
            high = middle
    return (low + high) / 2


def verdict(diffs: list[float], claim: str, noise: float, margin: float = MARGIN, registered: bool = False) -> dict:
    """The rule of the module docstring on paired differences d (B - A, one a seed). claim: 'up' or 'down'
    (a difference of that sign) or 'same' (no difference); noise: s0, the score's evaluation noise in its
    units; registered: the claim and its direction were committed before the runs (a one-sided test).

        SE = max(sd(d), s0) / sqrt(n),  df = n - 1,  95% interval: mean +- t(0.975, df) SE
        up / down (sign s = +1 / -1):  p = 2 P(T > s mean / SE)  (P(T > s mean / SE) if registered); shown if p < 0.05
        same:  p = max(P(T > (mean + m) / SE), P(T > (m - mean) / SE))  (two one-sided tests); within +-m if p < 0.05

    Returns the verdict, the mean, SE, the 95% interval and the p-value of the claim's test."""
    n, mean = len(diffs), statistics.fmean(diffs) + 0.0  # + 0.0: no "-0.00"
    se = max(statistics.stdev(diffs) if n > 1 else 0.0, noise) / math.sqrt(n)
    out = {"mean": mean, "se": se, "n": n, "low": None, "high": None, "p": None}
    if n == 1:
        return {**out, "verdict": "one run"}
    df = n - 1
    out["low"], out["high"] = mean - t_quantile(0.975, df) * se, mean + t_quantile(0.975, df) * se
    if claim == "same":  # two one-sided tests: the 90% interval inside (-margin, +margin)
        p = max(t_above((mean + margin) / se, df), t_above((margin - mean) / se, df))
        if p < 0.05:
            name = f"no difference within +-{margin:g}"
        else:
            name = "a difference" if out["low"] > 0 or out["high"] < 0 else "not resolved"
        return {**out, "verdict": name, "p": p, "margin": margin}
    sign = 1 if claim == "up" else -1
    t = sign * mean / se
    p = t_above(t, df) if registered else min(1.0, 2 * t_above(t, df))
    if p < 0.05:
        name = "shown"
    elif max(sign * out["low"], sign * out["high"]) < 0:
        name = "the other way"  # the 95% interval excludes 0 on the side against the claim
    elif all(d * sign > 0 for d in diffs):
        name = "a lead"
    else:
        name = "not shown"
    return {**out, "verdict": name, "p": p}


def holm(rows: list[dict]) -> None:
    """Holm's step-down correction over every row with a test: the i-th smallest of m p-values is multiplied by
    m - i + 1 (and kept at least the one before it); a row passes when its adjusted p is below 0.05. Sets
    row['holm_p'] and row['holm']: the verdict when it passes, 'not after Holm' when a shown or no-difference verdict
    does not, '-' when the raw verdict claimed nothing to correct."""
    tested = sorted((row for row in rows if row.get("p") is not None), key=lambda row: row["p"])
    m, running = len(tested), 0.0
    for i, row in enumerate(tested):
        running = max(running, min(1.0, (m - i) * row["p"]))
        row["holm_p"] = running
        claimed = row["verdict"] == "shown" or row["verdict"].startswith("no difference")
        row["holm"] = (row["verdict"] if running < 0.05 else "not after Holm") if claimed else "-"


def simulate(n: int, sigma: float, noise: float, effect: float, claim: str, reps: int, seed: int) -> float:
    """The share of `reps` simulated rows whose verdict is the claim's success (shown, or no difference within
    the margin) when n seeds' differences are drawn from a normal of mean `effect` and sd `sigma`."""
    rng = random.Random(seed)
    success = "shown" if claim != "same" else f"no difference within +-{MARGIN:g}"
    hits = sum(verdict([rng.gauss(effect, sigma) for _ in range(n)], claim, noise)["verdict"] == success
               for _ in range(reps))
    return hits / reps


# ---------------------------------------------------------------------------------------------
# The lessons
# ---------------------------------------------------------------------------------------------
def paired(b: dict, a: dict, claim: str, noise: float = TINY, noise_source: str = "measured, 500 x 4",
           registered: str = "") -> dict:
    """A paired row: its per-seed differences, the rule's verdict, and where its noise floor comes from.
    registered: the date and commit at which the claim and its direction were written, before the runs."""
    diffs = differences(b, a)
    return {"diffs": diffs, "claim": claim, "noise": noise, "noise_source": noise_source, "registered": registered,
            **verdict(diffs, claim, noise, registered=bool(registered))}


def pass_at_k(part: str, k: str) -> dict:
    """{seed: pass@k in points} of best_of_n.json's sft or grpo part (200 problems x 64 samples)."""
    return {r["seed"]: 100 * r["pass@k"][k] for r in BEST_OF_N[part]}


def smollm2_pass64() -> tuple[dict, dict]:
    """({seed: GRPO's pass@64}, {seed: SFT's pass@64}) in points, SmolLM2's 64 problems x 64 samples."""
    return ({i: pass_at(f"pass-at-k-seed{i}", "grpo", "64") for i in range(3)},
            {i: pass_at(f"pass-at-k-seed{i}", "sft", "64") for i in range(3)})


def pick_noise(b: dict, a: dict, k_b: int, k_a: int, problems: int = 200, samples: int = 64) -> tuple[float, str]:
    """(s0, its source) of two scores that keep one answer of k samples per problem (pass@k, a vote, a pick),
    each estimated from all k-subsets of the same `samples` answers. Such an estimate is a U-statistic of
    order k, whose variance is at most k / samples of one draw's (Hoeffding 1948): so each arm's binomial bound
    counts problems x samples / k draws. The arms are taken as independent (arms that keep answers from the
    same samples agree more often, so their difference is less noisy than this)."""
    noise = binomial_noise((b, problems * samples / k_b), (a, problems * samples / k_a))
    return noise, f"binomial bound, {problems} problems x {samples} samples, k = {k_b} and {k_a}"


def calls_noise(arm: str, kinds_b: tuple, kinds_a: tuple) -> float:
    """s0 of agent_call_rate(arm, kinds_b) - agent_call_rate(arm, kinds_a): each kind's call rate is a share of
    its problems x 4 episodes (binomial bound), each side the mean over its kinds (the variance over the number
    of kinds squared); the two sides hold other problems, so their variances add. In points."""
    per_seed = []
    for run in AGENT["results"][arm].values():
        last = run["evals"][-1]
        side = [sum(last[f"call_rate/{k}"] * (1 - last[f"call_rate/{k}"]) / (4 * KIND_SIZES[k]) for k in kinds)
                / len(kinds) ** 2 for kinds in (kinds_b, kinds_a)]
        per_seed.append(sum(side))
    return 100 * math.sqrt(statistics.fmean(per_seed))


def entropy_noise(arm: str) -> float:
    """step_noise of an entropy_remedies.json arm against the base arm, seed by seed."""
    by_seed = {r["seed"]: r["entropy"] for r in REMEDIES["results"]["base"]}
    runs = REMEDIES["results"][arm]
    return step_noise([r["entropy"] for r in runs], [by_seed[r["seed"]] for r in runs])


def async_final(arm: str) -> dict:
    """{seed: held-out sampled accuracy at step 40, in points} of an arm of async_runs.json."""
    return {int(seed): run["sampled"] for seed, run in ASYNC["arms"][arm].items()}


def async_seconds(script: str, seeds: list | None = None) -> dict:
    """{seed: mean seconds per step} of async_runs.json's timing runs (TIMED's names), over `seeds` (default all)."""
    return {int(seed): run["step"] for seed, run in ASYNC["timing"][script].items()
            if seeds is None or int(seed) in seeds}


def async_seconds_noise(b: str, a: str, seeds: list | None = None) -> float:
    """step_noise of two timing runs' seconds per step (b's against a's), seed by seed."""
    runs_b, runs_a = ASYNC["timing"][b], ASYNC["timing"][a]
    shared = [sd for sd in sorted(runs_b) if seeds is None or int(sd) in seeds]
    return step_noise([runs_b[sd]["steps"] for sd in shared], [runs_a[sd]["steps"] for sd in shared], 1.0)


def process_final(arm: str) -> dict:
    """{seed: held-out sampled accuracy at step 40, in points} of an RL arm of process_runs.json."""
    return {int(seed): run["evals"][-1]["sampled"] for seed, run in PROCESS["arms"][arm].items()}


def process_series(arm: str, key: str, window: slice) -> dict:
    """{seed: [the training statistic at each step of the window, in points]} (steps without a value left out)."""
    return {int(seed): [100 * v for v in run["series"][key][window] if v is not None]
            for seed, run in PROCESS["arms"][arm].items()}


def process_late(arm: str, key: str = "steps/carry_slip") -> dict:
    """{seed: the mean over training steps 31-40 of a statistic, in points}."""
    return {seed: statistics.fmean(values) for seed, values in process_series(arm, key, slice(30, 40)).items()}


def process_change(arm: str, key: str) -> dict:
    """{seed: the mean over steps 31-40 minus the mean over steps 1-10, in points}."""
    early = process_series(arm, key, slice(0, 10))
    return {seed: statistics.fmean(late) - statistics.fmean(early[seed])
            for seed, late in process_series(arm, key, slice(30, 40)).items()}


def process_step_noise(b: str, a: str, key: str = "steps/carry_slip") -> float:
    """step_noise of a statistic's mean over steps 31-40 in two arms, seed by seed (in points)."""
    late = slice(30, 40)
    shared = sorted(set(process_series(b, key, late)) & set(process_series(a, key, late)))
    return step_noise([process_series(b, key, late)[sd] for sd in shared],
                      [process_series(a, key, late)[sd] for sd in shared], 1.0)


def process_kept(judge: str, N: str = "16") -> dict:
    """{seed: best-of-N's gold accuracy by a judge ('prm' or 'rm') on the SFT model's samples, in points}."""
    return {int(seed): 100 * bon[judge]["best_of_n"][N]["gold"] for seed, bon in PROCESS["best_of_n"].items()
            if judge in bon}


def process_prm(name: str, key: str) -> dict:
    """{seed: a held-out score of prm.py's run ('prm' exact labels, 'prm_estimated'), in points}."""
    return {int(seed): 100 * result[key] for seed, result in PROCESS[name].items()}


def agent_final(arm: str, key: str = "accuracy_sampled") -> dict:
    """{seed: the last evaluation's value, in points} of an arm of agent_runs.json (benchmarks/agent_runs.py)."""
    return {int(seed): 100 * run["evals"][-1][key] for seed, run in AGENT["results"][arm].items()}


def agent_smollm2_final() -> float:
    """The last held-out sampled accuracy, in points, of docs/agent_smollm2/seed0/agent (smollm2_agent.sh)."""
    with open(os.path.join(ROOT, "docs", "agent_smollm2", "seed0", "agent", "metrics.jsonl"), encoding="utf-8") as f:
        return 100 * [row for row in map(json.loads, f) if "eval/accuracy_sampled" in row][-1]["eval/accuracy_sampled"]


def agent_call_rate(arm: str, kinds: tuple) -> dict:
    """{seed: the mean over `kinds` (data/make_data.py's problem_kind) of the last evaluation's call rate, in
    points} of an agent_runs.json arm: each kind weighs alike, whatever its share of the problems."""
    return {int(seed): 100 * statistics.fmean(run["evals"][-1][f"call_rate/{k}"] for k in kinds)
            for seed, run in AGENT["results"][arm].items()}


SUMS, DIFFERENCES = ("carry", "no carry"), ("borrow", "no borrow", "negative")


def kind_sizes() -> dict:
    """{kind: how many of the 500 held-out problems are of that kind} (data/make_data.py's problem_kind)."""
    sys.path.insert(0, os.path.join(ROOT, "data"))
    from make_data import problem_kind

    sizes = {}
    with open(os.path.join(ROOT, "data", "arithmetic", "test.jsonl"), encoding="utf-8") as f:
        for row in map(json.loads, f):
            a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
            kind = problem_kind(int(a), op, int(b))
            sizes[kind] = sizes.get(kind, 0) + 1
    return sizes


KIND_SIZES = kind_sizes()


def distill_final(student: str, arm: str) -> dict:
    """{seed: final held-out sampled accuracy, in points} of an arm of distill_runs.json."""
    return {run["seed"]: run["evals"][-1]["sampled"] for run in DISTILL["results"][student][arm]}


def kept(model: str, way: str, k: str) -> dict:
    """{seed: the share of problems whose kept answer is right, in points} of majority_vote.json: way is pass@k,
    best_of_k or maj@k, k one of 1, 2, 4, ..., 64."""
    return {run["seed"]: 100 * run[way][k] for run in MAJORITY["results"][model]}


REMEDY_ARMS = [("clip_higher", "Clip-higher", "--epsilon_high 0.28 instead of 0.2"),
               ("entropy_bonus", "An entropy bonus", "--entropy_coeff 0.02 instead of 0"),
               ("clip_cov", "Clip-Cov", "--loss_mode clip_cov (2% of tokens) instead of vanilla"),
               ("kl_cov", "KL-Cov", "two things: the KL-Cov penalty on 2% of tokens, and no clip on any token (as in "
                                   "the reference code)")]


def remedy(arm: str, key: str = "final") -> dict:
    """{seed: a score} of an entropy_remedies.json arm: 'final' sampled accuracy (points), 'entropy' of steps 31-40
    (millinats per token), or 'pass@16' (points)."""
    runs = REMEDIES["results"][arm]
    if key == "final":
        return {r["seed"]: r["evals"][-1]["sampled"] for r in runs}
    if key == "entropy":
        return {r["seed"]: 1000 * statistics.fmean(r["entropy"][-10:]) for r in runs}
    return {r["seed"]: 100 * r["pass@k"]["16"] for r in runs}


def sampler_final(arm: str) -> dict:
    """{seed: final held-out sampled accuracy, in points} of an arm of sampler_gap.json."""
    return {run["seed"]: run["evals"][-1]["sampled"] for run in SAMPLER["arms"][arm]}


def best_of_n_gold(part: str, N: str) -> dict:
    return {run["seed"]: 100 * run["best_of_n"][N]["gold"] for run in BEST_OF_N[part]}


def entropy_change() -> dict:
    """{seed: mean entropy of steps 31-40 - entropy at step 1} of entropy.json's base arm (nats per token)."""
    return {run["seed"]: statistics.fmean(run["entropy"][-10:]) - run["entropy"][0] for run in ENTROPY["base"]}


STEP_REWARDS = ("a reward per step (each normalised over the group's steps; a token's advantage the sum over the steps "
                "at or after it, so larger with more steps) instead of the answer step's alone")  # process vs twin


SLIP_COUNTED = ("; the share counts only rollouts whose lines are right up to the first carrying line, lines the "
                "process arm is also paid for, so the arms may differ in which rollouts count")


def process_rows() -> list[dict]:
    """The registered claims of benchmarks/process_claims.md (C1-C8, S1-S3, L1-L2), read from process_runs.json."""
    rows, final_unit = [], "points, final sampled accuracy (step 40)"
    slip_unit = ("points of carrying sums whose first carrying line is wrong (among rollouts whose lines are right up "
                 "to it), mean of training steps 31-40")
    for i, (lesson, a, b, differs, claim, score) in enumerate((
            ("GRPO with process supervision (exact step labels) ends above its outcome twin", "grpo_outcome",
             "grpo_process", STEP_REWARDS + ", the same exact judge", "up",
             "final"),
            ("GRPO with process supervision gets the slip's line wrong less often than its outcome twin",
             "grpo_outcome", "grpo_process", "as the row above" + SLIP_COUNTED, "down", "slip"),
            ("PPO with a reward at each step's end (exact labels) ends above PPO with the checker's reward at the "
             "last token", "ppo_outcome", "ppo_process", "a +-1 reward at each step's end instead of one at the "
                                                         "last token, so the return grows with the number of steps "
                                                         "and a wrong answer with right lines can return more than "
                                                         "0 (the critic starts from the PRM in both, so the outcome "
                                                         "arm's values can already drop at a wrong line: both arms "
                                                         "start with a critic that reads steps)",
             "up", "final"),
            ("PPO with step rewards gets the slip's line wrong less often than its outcome twin", "ppo_outcome",
             "ppo_process", "as the row above" + SLIP_COUNTED, "down", "slip"),
            ("GRPO with process supervision by the PRM ends below process supervision by the exact labels",
             "grpo_process", "grpo_process_prm", "the judge: the PRM's p_j instead of the exact label (and the PRM's "
                                                 "reading at the answer step instead of the outcome label)",
             "down", "final"),
            ("GRPO with process supervision by the PRM ends above the PRM's answer step alone",
             "grpo_outcome_prm", "grpo_process_prm", STEP_REWARDS + ", the same PRM", "up", "final"),
            ("PPO with step rewards by the PRM ends below PPO with the exact step labels", "ppo_process",
             "ppo_process_prm", "the judge: 2 p_j - 1 of the PRM instead of the exact label (and the PRM's "
                                "reading at the answer step instead of the checker's)", "down", "final"))):
        if not (PROCESS["arms"].get(a) and PROCESS["arms"].get(b)):
            continue
        if score == "final":
            row = paired(process_final(b), process_final(a), claim, registered=PROCESS_REGISTERED)
        else:
            row = paired(process_late(b), process_late(a), claim, process_step_noise(b, a),
                         "measured, the runs' step-to-step scatter (points)", PROCESS_REGISTERED)
        rows.append(dict(id=f"L{81 + i}", lesson=lesson, where="docs/process.md",
                         arms=f"process_runs.json: {a} -> {b}", differs=differs,
                         unit=final_unit if score == "final" else slip_unit, **row))
    if PROCESS["arms"].get("grpo_process_prm"):
        change = process_change("grpo_process_prm", "steps/judge_minus_exact")
        control = process_change("grpo_outcome_prm", "steps/judge_minus_exact")
        early = process_series("grpo_process_prm", "steps/judge_minus_exact", slice(0, 10))
        late = process_series("grpo_process_prm", "steps/judge_minus_exact", slice(30, 40))
        rows.append(dict(id="L88", lesson="Trained against the PRM, the policy's lines are overrated more late in "
                                          "training than early", where="docs/process.md",
                         arms="process_runs.json grpo_process_prm: steps 1-10 -> steps 31-40",
                         differs="40 steps of training against the PRM (the same run, early and late); its control, "
                                 "the outcome twin against the same PRM (never paid for the PRM's line scores), rose "
                                 "by " + ", ".join(f"{d:+.2f}" for d in control.values()) + " per seed",
                         unit="points of the PRM's mean reward on line steps minus the exact label",
                         **paired(change, {seed: 0.0 for seed in change}, "up",
                                  step_noise([late[sd] for sd in sorted(change)], [early[sd] for sd in sorted(change)],
                                             1.0), "measured, the runs' step-to-step scatter (points)",
                                  PROCESS_REGISTERED)))
    bon = [int(seed) for seed, b in PROCESS["best_of_n"].items() if "prm" in b and "rm" in b]
    if bon:
        prm16, rm16 = process_kept("prm"), process_kept("rm")
        vote = {int(sd): 100 * b["prm"]["maj@k"]["16"] for sd, b in PROCESS["best_of_n"].items() if "prm" in b}
        random1 = {int(sd): 100 * b["prm"]["pass@k"]["1"] for sd, b in PROCESS["best_of_n"].items() if "prm" in b}
        for i, (lesson, other, k, name, differs) in enumerate((
                ("Best-of-16 by the PRM is right more often than best-of-16 by the outcome reward model", rm16, 16,
                 "best of 16 by the reward model", "the judge: the PRM's minimum over steps instead of the reward "
                                                   "model's score (trained on other data, with another loss)"),
                ("Best-of-16 by the PRM is right more often than the majority vote of the 16", vote, 16, "maj@16",
                 "the pick: the PRM's instead of the most given answer"),
                ("Best-of-16 by the PRM is right more often than one of the 16 picked at random", random1, 1,
                 "a pick at random (pass@1)", "the pick: the PRM's instead of a random one"))):
            rows.append(dict(id=f"L{89 + i}", lesson=lesson, where="docs/process.md", differs=differs,
                             arms=f"process_runs.json best_of_n (SFT model, 500 problems x 16 samples): {name} -> "
                                  "best of 16 by the PRM",
                             unit="points of the 500 problems whose kept answer is right",
                             **paired(prm16, other, "up", *pick_noise(prm16, other, 16, k, 500, 16),
                                      registered=PROCESS_REGISTERED)))
    if PROCESS["prm"] and PROCESS["prm_estimated"]:
        for i, (lesson, key) in enumerate((
                ("A PRM trained on Math-Shepherd's estimated labels has a lower held-out step accuracy than one "
                 "trained on the exact labels", "step_accuracy"),
                ("A PRM trained on estimated labels tells right answers from wrong ones worse (AUROC of the minimum "
                 "over steps)", "answer_auroc/min"))):
            exact, estimated = process_prm("prm", key), process_prm("prm_estimated", key)
            rows.append(dict(id=f"L{92 + i}", lesson=lesson, where="docs/process.md",
                             arms="process_runs.json: prm -> prm_estimated",
                             differs="the training labels: Math-Shepherd's hard estimate (4 continuations a step) "
                                     "instead of the exact labels, on the same sampled answers",
                             unit=f"points of {key} on the same 1,000 held-out answers",  # (AUROC x 100)
                             **paired(estimated, exact, "down", *prm_noise(key), registered=PROCESS_REGISTERED)))
    return rows


SMOLLM2_PROCESS_REGISTERED = "2026-11-29, 89e207c: benchmarks/process_claims.md (SmolLM2)"  # before its runs
TWIN_AFTER = "; A, the twin, run after B had been read"  # process_claims.md's record of 2026-11-30


def smollm2_process_rows() -> list[dict]:
    """The registered SmolLM2 claims of benchmarks/process_claims.md (R1-R3): benchmarks/smollm2_process.sh's two
    arms, where run, and the committed outcome chain (docs/smollm2_runs/sft120-seed<s>/), each from the seed's 120-step
    SFT model (for the new arms made again by the chain's own command)."""
    seeds = [s for s in range(3) if os.path.isfile(os.path.join(ROOT, "docs", "smollm2_runs", f"sft120-seed{s}",
                                                                "grpo_process", "metrics.jsonl"))]
    if not seeds:
        return []
    final = lambda arm: {s: 100 * smollm2(f"sft120-seed{s}", arm)[-1]["eval/accuracy_sampled"]  # noqa: E731
                         for s in seeds}

    def slip(arm: str) -> dict:  # {seed: [steps/carry_slip of steps 21-30, in points]}
        series = {}
        for s in seeds:
            with open(os.path.join(ROOT, "docs", "smollm2_runs", f"sft120-seed{s}", arm, "metrics.jsonl"),
                      encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            series[s] = [100 * r["steps/carry_slip"] for r in rows if 21 <= r["step"] <= 30
                         and r.get("steps/carry_slip") is not None]
        return series

    unit = "points, final sampled accuracy (step 30, 64 held-out problems x 4)"
    rows = [dict(id="L95", lesson="On SmolLM2, GRPO with process supervision (exact step labels) ends above the "
                                  "committed outcome chain (grpo.py, benchmarks/smollm2.sh)",
                 where="docs/process.md; docs/real_models.md",
                 arms="smollm2_runs/sft120-seed*: grpo -> grpo_process",
                 differs="a reward per step (exact labels, normalised over the group's steps, summed over the steps "
                         "at or after each token, so larger with more steps) instead of grpo.py's correctness (+-1) "
                         "plus format (+1.25 or -1) per answer; no dynamic sampling (the chain drew up to 6 sampling "
                         "rounds a step, groups with spread only); the SFT start made again (equal greedy evaluations, "
                         "losses close, not bit for bit, its sampled evaluations drawn anew)", unit=unit,
                 **paired(final("grpo_process"), final("grpo"), "up", SMOLLM2, "measured, SmolLM2 64 x 4",
                          SMOLLM2_PROCESS_REGISTERED + "; A, the chain, had run before"))]
    if all(os.path.isfile(os.path.join(ROOT, "docs", "smollm2_runs", f"sft120-seed{s}", "grpo_outcome",
                                       "metrics.jsonl")) for s in seeds):  # the outcome twin, where it was run
        process, outcome = slip("grpo_process"), slip("grpo_outcome")
        rows[:0] = [dict(id="L94", lesson="On SmolLM2, GRPO with process supervision (exact step labels) ends above "
                                          "its outcome twin", where="docs/process.md; docs/real_models.md",
                         arms="smollm2_runs/sft120-seed*: grpo_outcome -> grpo_process",
                         differs=STEP_REWARDS + ", the same exact judge",
                         unit=unit,
                         **paired(final("grpo_process"), final("grpo_outcome"), "up", SMOLLM2,
                                  "measured, SmolLM2 64 x 4", SMOLLM2_PROCESS_REGISTERED + TWIN_AFTER))]
        rows.append(dict(id="L96", lesson="On SmolLM2, GRPO with process supervision gets the slip's line wrong less "
                                          "often than its outcome twin", where="docs/process.md; docs/real_models.md",
                         arms="smollm2_runs/sft120-seed*: grpo_outcome -> grpo_process",
                         differs="as L94" + SLIP_COUNTED,
                         unit="points of carrying sums whose first carrying line is wrong (among rollouts whose "
                              "lines are right up to it), mean of the training steps 21-30 that had any",
                         **paired({s: statistics.fmean(v) for s, v in process.items()},
                                  {s: statistics.fmean(v) for s, v in outcome.items()}, "down",
                                  step_noise([process[s] for s in seeds], [outcome[s] for s in seeds], 1.0),
                                  "measured, the runs' step-to-step scatter (points)",
                                  SMOLLM2_PROCESS_REGISTERED + TWIN_AFTER)))
    return rows


def prm_noise(key: str) -> tuple[float, str]:
    """s0 of a held-out PRM score. Both PRMs of a seed read the same held-out answers, and no PRM was trained twice,
    so a binomial bound over those answers stands in: the step accuracy as a share of the 1,000 answers (a
    conservative count: each holds 3 or 4 steps, correlated within it), the AUROC as a share of min(right,
    wrong) answers, the order of Hanley and McNeil's (1982) bound on its variance."""
    exact, estimated = process_prm("prm", key), process_prm("prm_estimated", key)
    if key.startswith("answer_auroc"):
        draws = min(min(r["right_answers"], 1 - r["right_answers"]) * r["n"] for r in PROCESS["prm"].values())
        return binomial_noise((exact, draws), (estimated, draws)), f"binomial bound, {draws:.0f} answers"
    return binomial_noise((exact, 1000), (estimated, 1000)), "binomial bound, 1,000 held-out answers"


def lessons() -> list[dict]:
    """Every comparative or causal lesson the pages teach: its sentence, where it is taught, the two arms
    and what differs, and the evidence (paired, or why there is no verdict)."""
    s = SYLLABUS["results"]
    rows = [
        dict(id="L1", lesson="Four updates per batch raise GRPO's held-out accuracy at 40 steps",
             where="docs/dpo.md (the controls)", arms="grpo -> grpo_4_iterations",
             differs="num_iterations 4 instead of 1", unit="points, final sampled accuracy",
             **paired(final("grpo_4_iterations"), final("grpo"), "up")),
        dict(id="L2", lesson="Four updates per batch raise PPO's held-out accuracy at 40 steps",
             where="docs/dpo.md (the controls)", arms="rm_ppo -> rm_ppo_4_updates",
             differs="2 PPO epochs of 2 mini-batches instead of 1 of 1", unit="points, final sampled accuracy",
             **paired(final("rm_ppo_4_updates"), final("rm_ppo"), "up")),
        dict(id="L3", lesson="With 4 updates per batch, lr 3e-4 ends below lr 5e-5",
             where="docs/dpo.md (the controls)", arms="grpo_4_iterations -> grpo_4_iterations_3e-4",
             differs="learning rate 3e-4 instead of 5e-5", unit="points, final sampled accuracy",
             **paired(final("grpo_4_iterations_3e-4"), final("grpo_4_iterations"), "down")),
        dict(id="L4", lesson="Where the clip acts (lr 3e-4, 4 updates), removing it ends lower",
             where="docs/dpo.md (the controls)", arms="grpo_4_iterations_3e-4 -> grpo_4_iterations_3e-4_no_clip",
             differs="no clip (epsilon 1e6) instead of 0.2", unit="points, final sampled accuracy",
             **paired(final("grpo_4_iterations_3e-4_no_clip"), final("grpo_4_iterations_3e-4"), "down")),
        dict(id="L5", lesson="Offline DPO on the shipped pairs at lr 5e-5 ends below lr 5e-6",
             where="docs/dpo.md (the controls)", arms="dpo_offline -> dpo_offline_5e-5",
             differs="learning rate 5e-5 instead of 5e-6", unit="points, final sampled accuracy",
             **paired(final("dpo_offline_5e-5"), final("dpo_offline"), "down")),
        dict(id="L6", lesson="At lr 5e-5, offline DPO on the start's own pairs ends above DPO on the shipped pairs",
             where="docs/dpo.md (the controls)", arms="dpo_offline_5e-5 -> dpo_own_pairs",
             differs="the pairs: the start's own samples ranked by the checker (also 1.1k pairs instead of 3k)",
             unit="points, final sampled accuracy",
             **paired(final("dpo_own_pairs"), final("dpo_offline_5e-5"), "up")),
        dict(id="L7", lesson="PPO with the checker's reward ends where PPO with the reward model does (40 steps)",
             where="README.md (what each stage gains); docs/dpo.md (the controls); docs/experiments.md",
             arms="rm_ppo -> rule_ppo",
             differs="two things: the reward (the checker's +-1) and the critic's start (a fresh head on the "
                     "SFT model instead of the reward model)", unit="points, final sampled accuracy",
             **paired(final("rule_ppo"), final("rm_ppo"), "same")),
        dict(id="L33", lesson="PPO with the checker's reward ends above PPO with the reward model at 120 steps",
             where="README.md (what each stage gains); docs/classic_rlhf.md; docs/dpo.md (the controls)",
             arms="rm_ppo_120 -> rule_ppo_120",
             differs="the reward alone (the checker's +-1 instead of the reward model's score; the critic starts "
                     "from the reward model in both)", unit="points, final sampled accuracy (step 120)",
             **paired(final("rule_ppo_120"), final("rm_ppo_120"), "up")),
        dict(id="L8", lesson="Online KTO ends above online DPO (both judged by the checker)",
             where="docs/dpo.md (KTO)", arms="dpo_online_rule -> kto_online",
             differs="the loss (KTO's, which learns from ties too)", unit="points, final sampled accuracy",
             **paired(final("kto_online"), final("dpo_online_rule"), "up")),
        dict(id="L9", lesson="Pairs sampled once for 10 steps teach as much as pairs sampled at every step",
             where="docs/dpo.md (iterative DPO)", arms="dpo_online_rule -> dpo_iterative_10",
             differs="steps_per_generation 10 instead of 1", unit="points, final sampled accuracy",
             **paired(final("dpo_iterative_10"), final("dpo_online_rule"), "same")),
        dict(id="L10", lesson="From a perfect teacher's SFT, GRPO gains less than from the careless teacher's",
             where="README.md; docs/dpo.md; docs/experiments.md",
             arms="grpo -> grpo_perfect_teacher", differs="the SFT data: a perfect teacher's demonstrations "
             "(the start is also higher: less to gain)", unit="points of gain (step 40 - step 0)",
             **paired(gain("grpo_perfect_teacher"), gain("grpo"), "down", math.sqrt(2) * TINY,
                      "measured, 500 x 4; a difference of two gains, sqrt(2) s0")),
        dict(id="L11", lesson="MIX ends above GRPO at 40 steps",
             where="docs/dpo.md (the side by side); docs/mix.md", arms="grpo -> mix",
             differs="MIX's expert rows and their loss; also 12 prompts a step instead of 16",
             unit="points, final sampled accuracy", **paired(final("mix"), final("grpo"), "up")),
        dict(id="L12", lesson="Online DPO with the checker ends above GRPO at 40 steps",
             where="docs/dpo.md (the side by side)", arms="grpo -> dpo_online_rule",
             differs="the whole method (two samples a prompt and DPO's loss, against groups of 8)",
             unit="points, final sampled accuracy", **paired(final("dpo_online_rule"), final("grpo"), "up")),
        dict(id="L13", lesson="RFT ends above GRPO at 40 steps",
             where="docs/dpo.md; docs/best_of_n.md", arms="grpo -> rft",
             differs="the whole method (no baseline, no negatives, no KL, another normalisation)",
             unit="points, final sampled accuracy", **paired(final("rft"), final("grpo"), "up")),
        dict(id="L14", lesson="PPO (reward model) ends below GRPO at 40 steps",
             where="README.md (what each stage gains); docs/dpo.md", arms="grpo -> rm_ppo",
             differs="the whole method (a critic and GAE, one sample a prompt, lr 2e-5, the KL in the reward, "
                     "a learned reward)", unit="points, final sampled accuracy",
             **paired(final("rm_ppo"), final("grpo"), "down")),
        dict(id="L15", lesson="Clip-higher (epsilon_high 0.28) leaves the final accuracy unchanged at lr 5e-5",
             where="docs/grpo.md (entropy)", arms="base -> clip_higher (entropy.json; base = grpo_4_iterations)",
             differs="epsilon_high 0.28 instead of 0.2", unit="points, final sampled accuracy",
             **paired(final("clip_higher", ENTROPY), final("base", ENTROPY), "same")),
        dict(id="L16", lesson="Sampling at temperature 1.2 leaves the final accuracy unchanged",
             where="docs/grpo.md (entropy)", arms="base -> temperature_1.2 (entropy.json)",
             differs="rollout temperature 1.2 instead of 1.0", unit="points, final sampled accuracy",
             **paired(final("temperature_1.2", ENTROPY), final("base", ENTROPY), "same")),
        dict(id="L17", lesson="Best-of-N by the reward model over-optimises: gold at N = 64 is below gold at N = 4",
             where="docs/best_of_n.md", arms="N = 4 -> N = 64, the SFT model's samples, judged by the reward model",
             differs="N", unit="points of gold accuracy (200 problems x 64 samples)",
             **paired(best_of_n_gold("sft", "64"), best_of_n_gold("sft", "4"), "down",
                      *pick_noise(best_of_n_gold("sft", "64"), best_of_n_gold("sft", "4"), 64, 4))),
        dict(id="L18", lesson="Online DPO with the reward model as judge falls between step 20 and step 40",
             where="docs/dpo.md (online DPO with a learned judge)", arms="dpo_online_rm at step 20 -> at step 40",
             differs="20 more steps of the same run", unit="points, sampled accuracy",
             **paired({sd: v[40] for sd, v in evals("dpo_online_rm").items()},
                      {sd: v[20] for sd, v in evals("dpo_online_rm").items()}, "down")),
        dict(id="L19", lesson="SmolLM2: GRPO after 120 SFT steps ends above GRPO after the script's short SFT",
             where="docs/real_models.md", arms="SFT 20 steps -> SFT 120 steps, then GRPO 30 steps",
             differs="SFT steps (the start)", unit="points, final sampled accuracy (64 problems x 4)",
             **paired({i: smollm2_final(f"sft120-seed{i}") for i in range(3)},
                      {i: smollm2_final(f"seed{i}") for i in range(3)}, "up", SMOLLM2, "measured, SmolLM2 64 x 4")),
        dict(id="L20", lesson="SmolLM2: GRPO lowers pass@64 (it trades coverage for pass@1)",
             where="docs/real_models.md (pass@k)", arms="SFT -> GRPO, 64 samples of each of 64 problems",
             differs="30 GRPO steps", unit="points of pass@64 (64 problems x 64 samples)",
             **paired(*smollm2_pass64(), "down", *pick_noise(*smollm2_pass64(), 64, 64, problems=64))),
        dict(id="L21", lesson="GRPO raises the tiny model's pass@1 over SFT's",
             where="docs/best_of_n.md", arms="SFT -> GRPO (best_of_n.json, 200 problems x 64 samples)",
             differs="40 GRPO steps", unit="points of pass@1 (200 problems x 64 samples)",
             **paired(pass_at_k("grpo", "1"), pass_at_k("sft", "1"), "up",
                      *pick_noise(pass_at_k("grpo", "1"), pass_at_k("sft", "1"), 1, 1))),
        dict(id="L22", lesson="GRPO leaves the tiny model's pass@64 unchanged (SFT's is already near 100%, so a "
                              "2-point rise is out of reach: the test can fail on one side only)",
             where="docs/best_of_n.md", arms="SFT -> GRPO (best_of_n.json)", differs="40 GRPO steps",
             unit="points of pass@64 (200 problems x 64 samples)",
             **paired(pass_at_k("grpo", "64"), pass_at_k("sft", "64"), "same",
                      *pick_noise(pass_at_k("grpo", "64"), pass_at_k("sft", "64"), 64, 64))),
        dict(id="L34", lesson="GRPO with the calculator ends above GRPO whose calls are refused, from the same start",
             where="docs/agent.md", arms="agent no_tool -> tool (agent_runs.json)",
             differs="--max_tool_calls 2 instead of 0: the calculator answers", unit="points, final sampled "
             "accuracy (step 120)", **paired(agent_final("tool"), agent_final("no_tool"), "up")),
        dict(id="L35", lesson="A price per call lowers how often the policy calls", where="docs/agent.md",
             arms="agent tool -> cost", differs="--tool_call_cost 0.25 instead of 0",
             unit="points of call rate, all problems (step 120)",
             **paired(agent_final("cost", "call_rate"), agent_final("tool", "call_rate"), "down",
                      binomial_noise((agent_final("cost", "call_rate"), 2000),
                                     (agent_final("tool", "call_rate"), 2000)),
                      "binomial bound, 500 x 4 episodes")),
        dict(id="L36", lesson="With a price per call, the policy calls more on differences than on sums",
             where="docs/agent.md", arms="agent cost: sums (carry, no carry) -> differences (borrow, no borrow, "
             "negative)", differs="the operator (the same runs, the same evaluation)",
             unit="points of call rate (step 120)",
             **paired(agent_call_rate("cost", DIFFERENCES), agent_call_rate("cost", SUMS), "up",
                      calls_noise("cost", DIFFERENCES, SUMS), "binomial bound, each kind's problems x 4")),
        dict(id="L37", lesson="GRPO with the calculator ends above the course's GRPO, which never sees one",
             where="docs/agent.md", arms="agent_runs.json: grpo -> tool",
             differs="two things: the start (SFT on demonstrations half of which call the calculator) and the "
                     "calculator at rollout and evaluation", unit="points, final sampled accuracy (step 120)",
             **paired(agent_final("tool"), agent_final("grpo"), "up")),
        dict(id="L38", lesson="A price per call lowers held-out accuracy", where="docs/agent.md",
             arms="agent tool -> cost", differs="--tool_call_cost 0.25 instead of 0",
             unit="points, final sampled accuracy (step 120)",
             **paired(agent_final("cost"), agent_final("tool"), "down")),
        dict(id="L39", lesson="With a price per call, the policy calls more on sums that carry than on sums that "
                              "do not", where="docs/agent.md", arms="agent cost: no carry -> carry",
             differs="whether the sum carries (the same runs, the same evaluation)",
             unit="points of call rate (step 120)",
             **paired(agent_call_rate("cost", ("carry",)), agent_call_rate("cost", ("no carry",)), "up",
                      calls_noise("cost", ("carry",), ("no carry",)), "binomial bound, 111 and 136 problems x 4")),
        dict(id="L40", lesson="With a price per call, the policy calls more on differences that borrow than on "
                              "those that do not", where="docs/agent.md", arms="agent cost: no borrow -> borrow",
             differs="whether the difference borrows (the same runs, the same evaluation)",
             unit="points of call rate (step 120)",
             **paired(agent_call_rate("cost", ("borrow",)), agent_call_rate("cost", ("no borrow",)), "up",
                      calls_noise("cost", ("borrow",), ("no borrow",)), "binomial bound, 58 and 70 problems x 4")),
        dict(id="L41", lesson="SmolLM2 with the calculator ends above its best chain without one",
             where="docs/agent.md (a real model)", arms="sft120-seed0's GRPO -> agent_smollm2/seed0's agent",
             differs="three things: the SFT data (half the demonstrations call), the calculator, and GRPO's "
                     "dynamic sampling (up to 6 sampling rounds a step, which agent.py does not have)",
             unit="points, final sampled accuracy (64 problems x 4)",
             **paired({0: agent_smollm2_final()}, {0: smollm2_final("sft120-seed0")}, "up", SMOLLM2,
                      "measured, SmolLM2 64 x 4")),
        dict(id="L42", lesson="On-policy distillation ends above GRPO at equal samples (a student of the teacher's "
                              "size)", where="docs/distill.md", arms="distill_runs.json student: grpo -> gkd",
             differs="three things: the signal (a teacher's distribution at every token instead of the checker's "
                     "reward per completion), the batch (128 prompts x 1 sample instead of 16 x 8), no KL term",
             unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("student", "gkd"), distill_final("student", "grpo"), "up")),
        dict(id="L43", lesson="On-policy distillation ends above SFT on the teacher's samples (a student of the "
                              "teacher's size)", where="docs/distill.md",
             arms="distill_runs.json student: sft_teacher -> gkd",
             differs="two things: who samples (the student instead of the teacher) and the loss (the reverse KL "
                     "over the vocabulary instead of the NLL of the sampled tokens)",
             unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("student", "gkd"), distill_final("student", "sft_teacher"), "up")),
        dict(id="L44", lesson="SFT on the teacher's samples ends below GRPO (a student of the teacher's size)",
             where="docs/distill.md", arms="distill_runs.json student: grpo -> sft_teacher",
             differs="the signal and the sampler: the teacher's text imitated instead of the student's own samples "
                     "rewarded by the checker (and the batch, no KL term)",
             unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("student", "sft_teacher"), distill_final("student", "grpo"), "down")),
        dict(id="L45", lesson="On-policy distillation ends above GRPO at equal samples (a student of half the "
                              "width)", where="docs/distill.md", arms="distill_runs.json small: grpo -> gkd",
             differs="as L42", unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("small", "gkd"), distill_final("small", "grpo"), "up")),
        dict(id="L46", lesson="On-policy distillation ends above SFT on the teacher's samples (a student of half "
                              "the width)", where="docs/distill.md", arms="distill_runs.json small: sft_teacher -> gkd",
             differs="as L43", unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("small", "gkd"), distill_final("small", "sft_teacher"), "up")),
        dict(id="L47", lesson="SFT on the teacher's samples ends above GRPO (a student of half the width)",
             where="docs/distill.md", arms="distill_runs.json small: grpo -> sft_teacher", differs="as L44",
             unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("small", "sft_teacher"), distill_final("small", "grpo"), "up")),
        *[dict(id=f"L{48 + i}", lesson=f"{name} keeps the policy's entropy higher than the aggressive setting alone",
               where="docs/grpo.md (entropy)", arms=f"entropy_remedies.json: base -> {arm}", differs=change,
               unit="millinats per completion token, the mean of steps 31-40",
               **paired(remedy(arm, "entropy"), remedy("base", "entropy"), "up", entropy_noise(arm),
                        "measured, the runs' step-to-step scatter"))
          for i, (arm, name, change) in enumerate(REMEDY_ARMS)],
        *[dict(id=f"L{52 + i}", lesson=f"{name} {'leaves' if claim == 'same' else 'lowers'} the final accuracy of "
                                       f"the aggressive setting{' unchanged' if claim == 'same' else ''}",
               where="docs/grpo.md (entropy)", arms=f"entropy_remedies.json: base -> {arm}", differs=change,
               unit="points, final sampled accuracy (step 40)", **paired(remedy(arm), remedy("base"), claim))
          for i, ((arm, name, change), claim) in enumerate(zip(REMEDY_ARMS, ("same", "down", "down", "down")))],
        *[dict(id=f"L{56 + i}", lesson=f"A majority vote of 64 samples is right more often than one sample ({name})",
               where="docs/best_of_n.md", arms=f"majority_vote.json {model}: pass@1 -> maj@64",
               differs="the answer kept: the most given of 64 samples instead of one sample (the same samples)",
               unit="points of the 200 problems whose kept answer is right",
               **paired(kept(model, "maj@k", "64"), kept(model, "pass@k", "1"), "up",
                        *pick_noise(kept(model, "maj@k", "64"), kept(model, "pass@k", "1"), 64, 1)))
          for i, (model, name) in enumerate((("sft", "SFT"), ("grpo", "GRPO")))],
        dict(id="L58", lesson="With 4 samples of the SFT model, the reward model's pick is right more often than "
                              "the vote", where="docs/best_of_n.md", arms="majority_vote.json sft: best of 4 -> maj@4",
             differs="the rule that keeps one of the same 4 samples: the most given answer instead of the reward "
                     "model's top score", unit="points of the 200 problems whose kept answer is right",
             **paired(kept("sft", "maj@k", "4"), kept("sft", "best_of_k", "4"), "down",
                      *pick_noise(kept("sft", "maj@k", "4"), kept("sft", "best_of_k", "4"), 4, 4))),
        dict(id="L59", lesson="With 4 samples of the GRPO model, the vote is right more often than the reward "
                              "model's pick", where="docs/best_of_n.md", arms="majority_vote.json grpo: best of 4 -> "
                                                                              "maj@4", differs="as L58",
             unit="points of the 200 problems whose kept answer is right",
             **paired(kept("grpo", "maj@k", "4"), kept("grpo", "best_of_k", "4"), "up",
                      *pick_noise(kept("grpo", "maj@k", "4"), kept("grpo", "best_of_k", "4"), 4, 4))),
        *[dict(id=f"L{60 + i}", lesson=f"With 64 samples, the vote is right more often than the reward model's pick "
                                       f"({name})", where="docs/best_of_n.md",
               arms=f"majority_vote.json {model}: best of 64 -> maj@64", differs="as L58, of 64 samples",
               unit="points of the 200 problems whose kept answer is right",
               **paired(kept(model, "maj@k", "64"), kept(model, "best_of_k", "64"), "up",
                        *pick_noise(kept(model, "maj@k", "64"), kept(model, "best_of_k", "64"), 64, 64)))
          for i, (model, name) in enumerate((("sft", "SFT"), ("grpo", "GRPO")))],
        dict(id="L66", lesson="GRPO raises held-out sampled accuracy above its SFT start in 40 steps",
             where="README.md (what each stage gains); docs/dpo.md (the side by side)",
             arms="grpo at step 0 -> at step 40 (syllabus.json)", differs="40 GRPO steps",
             unit="points, sampled accuracy (step 40 - step 0)",
             **paired(final("grpo"), {sd: v[0] for sd, v in evals("grpo").items()}, "up")),
        dict(id="L67", lesson="On-policy distillation's student ends above its teacher (a student of the teacher's "
                              "size)", where="docs/distill.md", arms="distill_runs.json: the teacher -> student gkd",
             differs="the model: the student after 40 steps of distillation instead of the teacher it learns from",
             unit="points, final sampled accuracy (step 40)",
             **paired(distill_final("student", "gkd"),
                      {int(sd): 100 * t["accuracy_sampled"] for sd, t in DISTILL["teachers"].items()}, "up")),
        dict(id="L70", lesson="SmolLM2: GRPO after a 20-step SFT ends where it ends after a 30-step SFT",
             where="docs/real_models.md", arms="SFT 30 steps -> SFT 20 steps, then GRPO 30 steps",
             differs="SFT steps (the start)", unit="points, final sampled accuracy (64 problems x 4)",
             **paired({i: smollm2_final(f"seed{i}") for i in range(3)},
                      {i: smollm2_final(f"sft30-seed{i}") for i in range(3)}, "same", SMOLLM2,
                      "measured, SmolLM2 64 x 4")),
        dict(id="L63", lesson="A bf16 sampler leaves GRPO's final accuracy unchanged, within what 3 seeds resolve",
             where="docs/scaling.md (the sampler)", arms="sampler_gap.json: fp32 -> bf16",
             differs="the sampler: a bf16 copy of the weights (decode_step) instead of the float32 model, in the "
                     "training rollouts and in the evaluations alike",
             unit="points, final sampled accuracy (step 40)",
             **paired(sampler_final("bf16"), sampler_final("fp32"), "same")),
        dict(id="L64", lesson="The sampler's correction (TIS) leaves a bf16-sampled GRPO run's final accuracy "
                              "unchanged, within what 3 seeds resolve",
             where="docs/scaling.md (the sampler)", arms="sampler_gap.json: bf16 -> bf16_tis",
             differs="--vllm_importance_sampling_correction true (token_truncate, C = 3)",
             unit="points, final sampled accuracy (step 40)",
             **paired(sampler_final("bf16_tis"), sampler_final("bf16"), "same")),
        dict(id="L71", lesson="The explorer and the trainer apart (one update stale, pi_ref's pass in the trainer) "
                              "take fewer seconds per step than grpo.py on the 2-core CPU",
             where="docs/async.md",
             arms="async_runs.json timing, seeds 2-4 as registered: grpo.py -> async_rl.py --reference_pass trainer",
             differs="two processes of one thread each, sampling and training at once, instead of one process of "
                     "two threads taking turns (and the trainer's batch received, its weights sent)",
             unit="seconds per step (steps 2-20 of 20)",
             **paired(async_seconds("async_rl_ref_trainer", [2, 3, 4]), async_seconds("grpo", [2, 3, 4]), "down",
                      async_seconds_noise("async_rl_ref_trainer", "grpo", [2, 3, 4]),
                      "measured, the runs' step-to-step scatter (seconds)", ASYNC_REGISTERED)),
        dict(id="L79", lesson="Computing pi_ref's log-probs in the explorer instead of the trainer takes the pair "
                              "fewer seconds per step on the 2-core CPU", where="docs/async.md",
             arms="async_runs.json timing: async_rl.py --reference_pass trainer -> explorer",
             differs="the reference model's inference pass over each batch run by the explorer, sent with the batch",
             unit="seconds per step (steps 2-20 of 20)",
             **paired(async_seconds("async_rl"), async_seconds("async_rl_ref_trainer"), "down",
                      async_seconds_noise("async_rl", "async_rl_ref_trainer"),
                      "measured, the runs' step-to-step scatter (seconds)", ASYNC_REFERENCE_REGISTERED)),
        dict(id="L80", lesson="The explorer and the trainer apart, at async_rl.py's defaults, take fewer seconds per "
                              "step than grpo.py on the 2-core CPU", where="docs/async.md; README.md",
             arms="async_runs.json timing: grpo.py -> async_rl.py",
             differs="two processes of one thread each, sampling (and pi_ref's pass) in one while the other trains, "
                     "instead of one process of two threads taking turns",
             unit="seconds per step (steps 2-20 of 20)",
             **paired(async_seconds("async_rl"), async_seconds("grpo"), "down",
                      async_seconds_noise("async_rl", "grpo"),
                      "measured, the runs' step-to-step scatter (seconds)", ASYNC_REFERENCE_REGISTERED)),
        *[dict(id=f"L{72 + i}", lesson=lesson, where="docs/async.md", arms=f"async_runs.json: {a} -> {b}",
               differs=differs, unit="points, final sampled accuracy (step 40)",
               **paired(async_final(b), async_final(a), claim, registered=ASYNC_REGISTERED if registered else ""))
          for i, (lesson, a, b, differs, claim, registered) in enumerate((
              ("One update of staleness, corrected, leaves the final accuracy unchanged", "sync", "stale1",
               "--sync_offset 1 instead of 0 (and the correction on)", "same", True),
              ("Four updates of staleness, uncorrected, lower the final accuracy", "sync", "stale4_plain",
               "--sync_offset 4 instead of 0, no correction", "down", True),
              ("At four updates of staleness the correction raises the final accuracy", "stale4_plain", "stale4",
               "--vllm_importance_sampling_correction true (token_truncate, C = 3)", "up", True),
              ("Two updates of staleness, corrected, leave the final accuracy unchanged", "sync", "stale2",
               "--sync_offset 2 instead of 0 (and the correction on)", "same", False),
              ("Four updates of staleness, corrected, leave the final accuracy unchanged", "sync", "stale4",
               "--sync_offset 4 instead of 0 (and the correction on)", "same", False),
              ("At one update of staleness the correction leaves the final accuracy unchanged", "stale1_plain",
               "stale1", "--vllm_importance_sampling_correction true (token_truncate, C = 3)", "same", False),
              ("At two updates of staleness the correction leaves the final accuracy unchanged", "stale2_plain",
               "stale2", "--vllm_importance_sampling_correction true (token_truncate, C = 3)", "same", False)))],
        *process_rows(),
        *smollm2_process_rows(),
    ]
    no_verdict = [
        dict(id="L23", lesson="At the defaults PPO's and GRPO's clip never acts (one update per batch: the ratio is 1)",
             where="README.md (the clip)", kind="mechanism, measured",
             evidence="clip_fraction of the grpo and rm_ppo rows: "
                      + ", ".join(f"{run['means'].get('clip_fraction', run['means'].get('clip_fraction/actor')):g}"
                                  for m in ("grpo", "rm_ppo") for run in s[m]) + " (every seed)"),
        dict(id="L24", lesson="If four updates help GRPO (L1), it is not through the clip",
             where="docs/dpo.md (the controls)", kind="a cause no run isolated",
             evidence="the clip acted on " + ", ".join(f"{100 * run['means']['clip_fraction']:.2f}%"
                                                      for run in s["grpo_4_iterations"])
                      + " of grpo_4_iterations' tokens; no run removed the clip at lr 5e-5"),
        dict(id="L25", lesson="No entropy collapse in 40 GRPO steps", where="docs/grpo.md (entropy)",
             kind="an observation", evidence="entropy of steps 31-40 minus step 1's, base arm: "
             + ", ".join(f"{v:+.4f}" for v in entropy_change().values()) + " nats per token"),
        dict(id="L62", lesson="No entropy collapse at the aggressive setting either (4 updates, no KL term, lr 1e-4)",
             where="docs/grpo.md (entropy)", kind="an observation",
             evidence="entropy of steps 31-40 over step 1's, base arm of entropy_remedies.json: " + ", ".join(
                 f"{statistics.fmean(r['entropy'][-10:]) / r['entropy'][0]:.2f}" for r in REMEDIES["results"]["base"])
             + "; pass@16 of its final models " + ", ".join(
                 f"{100 * r['pass@k']['16']:.1f}%" for r in REMEDIES["results"]["base"]) + " against the start's "
             + ", ".join(f"{100 * r['pass@k']['16']:.1f}%" for r in REMEDIES["sft_pass@k"])),
        dict(id="L26", lesson="A reward model's accuracy on the policy's own pairs predicts PPO's gain",
             where="docs/classic_rlhf.md; docs/metrics.md",
             kind=f"a correlation over {len(SEEDS)} seeds, no control; the committed runs do not support it",
             evidence="policy-pair accuracy " + ", ".join(
                 f"{100 * SYLLABUS['starts'][str(sd)]['rm']['policy_pairwise_accuracy']:.1f}%" for sd in SEEDS)
             + " against rm_ppo's gains " + ", ".join(f"{g:+.2f}" for g in gain("rm_ppo").values())
             + " (40 steps); at 120 steps (rm_ppo_120: other starts on seeds 0-2, the same on 3 and 4) " + ", ".join(
                 f"{100 * run['rm_eval']['policy_pairwise_accuracy']:.1f}%"
                 for run in SYLLABUS["results"]["rm_ppo_120"])
             + " against " + ", ".join(f"{g:+.2f}" for g in gain("rm_ppo_120").values())
             + ": not in the same order either time"),
        dict(id="L27", lesson="Pairs from the policy's own samples stop PPO gaming the reward model",
             where="docs/classic_rlhf.md; reward_model.py --help", kind="one seed, results not committed; "
                                                                         "contradicted by a committed run",
             evidence="classic_rlhf.md's seed 2 (an earlier machine): an RM with pairs from 2,000 prompts gave PPO "
                      "+8.0 where one with 500 gave +4.6; PPO against a synthetic-only RM at these settings was "
                      "not run. Against it: rm_ppo_120's seed 1, whose RM has the default pairs from all 3,000 "
                      "prompts, was gamed (held-out sampled " + " -> ".join(
                          f"{e['sampled']:.2f}" for e in SYLLABUS["results"]["rm_ppo_120"][1]["evals"]) + ")"),
        dict(id="L65", lesson="GRPO's gain is mostly the careless teacher's slip unlearned",
             where="README.md; docs/dpo.md; docs/experiments.md", kind="a reading: one seed's table by kind and the "
             "headroom, no control", evidence="L10 shows the smaller gain from a perfect teacher's start, whose start "
             "is also higher (less to gain); which problems the gain comes from is one seed's table by kind "
             "(docs/experiments.md)"),
        dict(id="L68", lesson="The notebooks' own small runs: a reward model on synthetic pairs only ranks the "
                              "policy's pairs worse (notebook 02); best-of-N by notebook 02's reward model shows "
                              "no gain over one sample that one run can tell from noise (notebook 08)",
             where="notebook 02; notebook 08",
             kind="one run each, on the notebooks' checkpoints (300 SFT steps, 64 held-out problems)",
             evidence="the executed notebooks' outputs (tests/test_notebook_numbers.py holds the pages to them); "
                      "no seeds, no verdict"),
        dict(id="L69", lesson="GRPO's variants (loss types, reward scalings, two updates per batch, clip-higher, "
                              "GSPO) on the chain's start", where="docs/grpo.md (variants)",
             kind="one run each", evidence="docs/grpo_variants.json: seed 0 each (and plain GRPO on seed 1); gaps "
             "of a few points between runs that share no paired seeds, no verdict"),
        dict(id="L28", lesson="Online DPO with the checker is GRPO's signal with groups of 2",
             where="docs/dpo.md; notebook 07", kind="mathematics",
             evidence="derived in docs/dpo.md and checked by tests/test_dpo.py"),
        dict(id="L29", lesson="GRPO, RLOO and REINFORCE++ learn alike here", where="docs/dpo.md",
             kind="results not committed", evidence="per-seed results of the rloo and reinforce_pp rows are "
             "not in docs/syllabus.json; no verdict"),
        dict(id="L30", lesson="MIX helps from a weak start and learns what the policy never samples",
             where="docs/mix.md; notebook 06", kind="one run each",
             evidence="one tiny weak-start seed (MIX at 12 prompts a step against GRPO's 16) and one SmolLM2 "
                      "seed (docs/real_models.md); suggestive only"),
        dict(id="L32", lesson="SFT's greedy answer is right more often than its careless teacher",
             where="README.md (the task and the data)", kind="a measurement per seed against the teacher's rate",
             evidence=f"held-out greedy accuracy of the {len(SEEDS)} SFT starts "
             + ", ".join(f"{100 * SYLLABUS['starts'][str(sd)]['sft']['accuracy_greedy']:.1f}%" for sd in SEEDS)
             + " against the 79.7% of the teacher's demonstrations that are right (data/demos); the margin on "
               "seed 1 is within the noise"),
        dict(id="L31", lesson="SmolLM2's settings (dynamic sampling, groups of 8, the learning rates, LoRA, the SFT "
                              "length on seed 0)",
             where="docs/real_models.md (how the settings were chosen)", kind="one run each",
             evidence="one seed each on 64 problems, whose evaluations differ by "
                      f"{SMOLLM2:.1f} points when one model is evaluated twice: the gaps of 0.4 to 2 points between "
                      "the dynamic-sampling, group-size and LoRA runs do not rank them; larger gaps (lr 4e-5's fall at "
                      "step 10, the longer SFTs of seed 0) are single runs too"),
    ]
    return rows + no_verdict


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
CLAIMS = {"up": "B > A", "down": "B < A", "same": "B = A"}


SIMULATED = [(3, 0.99), (3, 2.0), (3, 4.0), (5, 0.99), (5, 2.0), (5, 4.0)]  # (seeds, sd of d) the page simulates
REPS = 4000


def error_rates(n: int, sigma: float, reps: int = REPS, seed: int = 0) -> dict:
    """The rule's rates on simulated rows (the tiny model's floor): a directional claim called shown when there
    is no effect (false) and when the effect is the margin (power); a claim of no difference called no
    difference when the effect is the margin (false) and when there is none."""
    return {"false shown": simulate(n, sigma, TINY, 0.0, "up", reps, seed),
            "shown at +m": simulate(n, sigma, TINY, MARGIN, "up", reps, seed + 1),
            "false no difference": simulate(n, sigma, TINY, MARGIN, "same", reps, seed + 2),
            "no difference at 0": simulate(n, sigma, TINY, 0.0, "same", reps, seed + 3)}


def interval(row: dict) -> str:
    if row["low"] is None:
        return f"{row['mean']:+.2f}"
    return f"{row['mean']:+.2f} [{row['low']:+.2f}, {row['high']:+.2f}]"


def page() -> str:
    tiny, big = FLOORS["tiny"], FLOORS["smollm2"]
    rows = lessons()
    holm(rows)
    tested = sum(row.get("p") is not None for row in rows)
    kept = [row for row in rows if row.get("holm", "-") not in ("-", "not after Holm")]
    five = sum(len(row.get("diffs", [])) >= 5 for row in rows)
    out = [
        "# The lessons' ledger",
        "",
        "Every comparative or causal lesson the course teaches, with the runs behind it and a verdict given by",
        "one rule. Written by `python benchmarks/lessons.py` from the per-seed results in `docs/` (a test",
        "regenerates it and fails if a number or a verdict moves); the pages state each lesson no more",
        "strongly than its verdict here, and a test holds each sentence that links a row to the row's verdict.",
        "",
        "## The rule",
        "",
        "Two arms share each seed's start (the SFT model, the reward model, the RL run's seed), so each seed",
        "gives a paired difference d = B - A of a final score: the start's own level cancels, and what the",
        "start does to the difference itself stays in the seeds' spread.",
        "",
        "- **The score's noise** s0, the spread of d that evaluation alone would give. Where one model was",
        "  evaluated twice (the same weights, new random draws), it is measured: the tiny model's 500 problems",
        f"  x 4 samples differ by {', '.join(f'{d:+.2f}' for d in tiny)} points (root mean square",
        f"  {TINY:.2f}), SmolLM2's 64 x 4 by {', '.join(f'{d:+.2f}' for d in big)} (root mean square {SMOLLM2:.2f}).",
        "  A training statistic (the entropy of steps 31-40, a slip's share) takes each run's step-to-step",
        "  scatter. Any other score takes the binomial bound at its own size and level, p(1 - p) / draws for",
        "  each arm (over a fixed set of problems the variance is the mean of p_i (1 - p_i) / draws, never",
        "  more): a subset of problems",
        "  and call rates have their own. A score read off k of n samples per problem (pass@k, a vote, a pick,",
        "  averaged over the k-subsets of the same n) counts problems x n / k draws: the variance of such an",
        "  average (a U-statistic of order k) is at most k / n of one draw's (Hoeffding 1948). Each row names its",
        "  s0 and where it comes from; a difference of two gains (four evaluations) takes sqrt(2) s0.",
        "- **Standard error** of the mean of n seeds: SE = max(sd(d), s0) / sqrt(n); the **95% interval** is",
        f"  mean +- t(0.975, n - 1) SE: {t_quantile(0.975, 2):.2f} SE with 3 seeds, {t_quantile(0.975, 4):.2f} with 5.",
        "- **A difference** (B > A or B < A) is *shown* when the 95% interval excludes 0 on the claimed side (a",
        "  two-sided 5% test). Where the claim and its direction were committed, dated, before the runs (the",
        "  row says when), a one-sided 5% test: t = mean / SE above "
        f"{t_quantile(0.95, 2):.2f} with 3 seeds, {t_quantile(0.95, 4):.2f} with 5.",
        "  *The other way*: the interval excludes 0 on the other side. *A lead*: not shown, but every seed on",
        "  the claimed side, a hypothesis for more seeds and not a result (with no effect, every seed lands on",
        "  a given side 1 time in 8 with 3 seeds, 1 in 32 with 5). *Not shown*: any other case (the seeds",
        "  disagree or one is 0, or every seed lies on the other side without the interval excluding 0).",
        "  *One run*: a single seed, no interval.",
        "- **No difference** (B = A) is *no difference within +-m* when the 90% interval (mean +- t(0.95, n - 1)",
        f"  SE) lies inside +-m (two one-sided tests at 5%), with m = {MARGIN:g} points of accuracy: a smaller",
        "  difference is not one this course teaches. Otherwise it is *not resolved* (the 95% interval holds",
        "  0), or *a difference* (it does not). A difference not shown is never read as no difference.",
        f"- **Many rows at once.** {tested} rows carry a test; by chance alone some would pass. The column *after",
        "  Holm* applies Holm's correction over all of them (the i-th smallest p-value is multiplied by",
        f"  {tested} - i + 1, and kept at least the one before): the chance that any verdict this column keeps is",
        "  false is at most 5%. The first row to pass needs a two-sided t above "
        f"{t_quantile(1 - 0.025 / tested, 2):.1f} with 3 seeds and {t_quantile(1 - 0.025 / tested, 4):.1f} with 5,",
        f"  a registered row's one-sided t above {t_quantile(1 - 0.05 / tested, 2):.1f} and "
        f"{t_quantile(1 - 0.05 / tested, 4):.1f} (the next ones a little less);",
        f"  {len(kept)} of them do" + (f" ({', '.join(row['id'] for row in kept)})." if kept else ".")
        + " The pages quote each row's own verdict, the one a reader of that lesson alone would",
        "  draw; this column says which would survive a reader who counts every row at once.",
        "- A row whose arms differ in more than one thing says so: its verdict is about the two arms, not",
        "  about one cause.",
        "",
        "What the rule's errors are, simulated (`error_rates`, "
        f"{REPS} rows each, d normal with the sd given, s0 = {TINY:.2f}):",
        "",
        "| seeds | sd of d | a difference shown when there is none | shown when it is +2 | no difference "
        "when it is 2 | no difference when there is none |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, sigma in SIMULATED:
        rates = error_rates(n, sigma)
        out.append(f"| {n} | {sigma:g} | " + " | ".join(f"{100 * rates[k]:.1f}%" for k in
                                                          ("false shown", "shown at +m", "false no difference",
                                                           "no difference at 0")) + " |")
    out += [
        "",
        "The first and third columns are the rule's errors: at most 2.5% (a two-sided 5% test, on the claimed",
        "side) and 5% (two one-sided tests at 5%); s0 makes both smaller when the seeds' spread is near it. The",
        "table simulates a claim written after its runs: a claim registered before them takes the one-sided test,",
        "whose rate in the first column is at most 5%, twice the two-sided one's, and whose chance in the second",
        "is higher than the table's (with 3 seeds its t must pass 2.92, not 4.30). The second and fourth are what",
        "three seeds can do: a 2-point effect is rarely shown, and no difference is seldom resolved unless the",
        "seeds' spread is near s0, which is why the comparisons the README quotes ran on five seeds, L4 apart",
        f"({five} rows here have five or more). Even five seeds resolve a 2-point effect reliably only when the",
        "seeds' spread is near s0: where sd(d) is 1.5 to 2 points, as for several of the README's rows, a",
        "verdict of not shown is weak evidence either way. Seeds 3 and 4 ran after seeds 0-2 had been read",
        "(on 2026-11-29, on another machine of two cores, with the same code), for the rows the course leans",
        "on: the simulation takes the seeds as drawn alike, and a machine's float order is part of what a seed",
        "draws.",
        "",
        "Not taken: a problem-level view. The per-problem answers of most runs are not committed. They would",
        "replace the binomial bound's p(1 - p) by the mean of p_i (1 - p_i) (a smaller s0), and, for rows whose",
        "arms keep answers from the same samples (best-of-N, the vote), give the two arms' covariance; the",
        "measured s0 would not shrink, since two evaluations' draws are independent given the problems.",
        "",
        "## Comparisons",
        "",
        "| id | lesson | A -> B | differs in | claim | d per seed | mean [95% interval] | s0 | verdict | after Holm |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "diffs" in row:
            claim = CLAIMS[row["claim"]] + (f" (registered {row['registered']})" if row["registered"] else "")
            out.append(f"| {row['id']} | {row['lesson']} | {row['arms']} | {row['differs']} | {claim} "
                       f"| {', '.join(f'{d:+.2f}' for d in row['diffs'])} | {interval(row)} "
                       f"| {row['noise']:.2f} ({row['noise_source']}) | **{row['verdict']}** "
                       f"| {row.get('holm', '')} |")
    out += ["", "Units: those of the score each row's section below names (points, unless it says otherwise).", "",
            "## Lessons without a paired comparison", "", "| id | lesson | what it rests on | evidence |",
            "| --- | --- | --- | --- |"]
    for row in rows:
        if "diffs" not in row:
            out.append(f"| {row['id']} | {row['lesson']} | {row['kind']} | {row['evidence']} |")
    out += ["", "## Where each is taught, and its score", ""]
    for row in rows:
        out.append(f"### {row['id']}")
        out.append("")
        out.append(f"{row['lesson']}. Taught in {row['where']}."
                   + (f" Score: {row['unit']}." if "unit" in row else ""))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/lessons.md is out of date")
    args = parser.parse_args()
    text = page()
    if args.check:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                sys.exit("docs/lessons.md is out of date: run python benchmarks/lessons.py")
        print("docs/lessons.md is up to date")
        return
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
