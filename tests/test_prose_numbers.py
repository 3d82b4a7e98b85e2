"""A number quoted in two places of the prose is the same number in both, and a number the prose
derives (a gain, a share, a sum of times) equals what its parts give: when a table is re-measured, a
sentence that quoted the old figure fails here instead of drifting (as 0.4 + 0.3 + 0.3 against the
table's 0.32 + 0.26 + 0.25 once did)."""
import json
import os
import re
import statistics
import sys

import pytest

from conftest import ROOT, load_benchmark


def read(*path) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def table_row(text: str, first_cell: str) -> list[str]:
    """The cells of the markdown table row whose first cell starts with first_cell."""
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first_cell):
            return cells
    raise AssertionError(f"no table row starting with {first_cell!r}")


def number(cell: str) -> float:
    return float(re.search(r"-?\d+(\.\d+)?", cell.replace(",", "")).group())


def test_speed_ratio_is_the_speed_tables():
    page = re.search(r"grpo.py generates ([\d.]+)x the completions per second", read("docs", "speed.md"))
    assert page
    ours, trl = (number(table_row(read("docs", "speed.md"), name)[5]) for name in ("grpo.py", "TRL GRPOTrainer"))
    assert ours / trl == pytest.approx(float(page.group(1)), abs=0.01)


def chain_runs() -> dict:
    """docs/chain.json (`python benchmarks/run.py --chain`): the quickstart's runs, by command."""
    return {run["command"]: run for run in json.loads(read("docs", "chain.json"))["runs"]}


def test_readme_chain_table_is_the_committed_chain():
    """Every row of the README's table (wall time, greedy and sampled accuracy at the end) is the committed run."""
    runs, readme = chain_runs(), read("README.md")
    for command, run in runs.items():
        if command == "python reward_model.py":
            continue  # on the PPO row: its wall time is the first of two
        first = "`python reward_model.py` then `python ppo.py`" if command == "python ppo.py" else f"`{command}`"
        cells = table_row(readme, first + " (")
        seconds = re.findall(r"(\d+) s", cells[1])
        if command == "python ppo.py":
            assert [int(s) for s in seconds] == [round(runs["python reward_model.py"]["wall_s"]), round(run["wall_s"])]
        else:
            assert [int(s) for s in seconds] == [round(run["wall_s"])], command
        for cell, key in ((cells[2], "accuracy_greedy"), (cells[3], "accuracy_sampled")):
            assert f"{100 * run['eval'][key]:.2f}".rstrip("0").rstrip(".") + "%" == cell, (command, key)


def test_experiments_chain_table_is_the_committed_chain():
    run = load_benchmark("run")
    assert run.chain_table(json.loads(read("docs", "chain.json"))) in read("docs", "experiments.md")


def test_speed_pages_chain_table_is_the_committed_chain():
    speed = read("docs", "speed.md").split("**The whole chain**")[1]
    for command, run in chain_runs().items():
        cells = table_row(speed, f"`{command}`")
        assert [int(c) for c in cells[1:4]] == [round(run["wall_s"]), round(run["cpu_s"]), round(run["peak_rss_mb"])]


def test_readme_gains_are_the_tables_differences():
    readme = read("README.md")
    start = float(re.search(r"\(([\d.]+)% at its step-0 evaluation", readme).group(1))
    rows = {"GRPO": "`python grpo.py`", "MIX": "`python mix.py`", "PPO": "`python reward_model.py` then"}
    quoted = re.search(r"GRPO adds \*\*([\d.]+) points of sampled accuracy\*\* .*?, MIX ([\d.]+)\s.*?PPO ([\d.]+) ",
                       readme, re.DOTALL)
    assert quoted
    for (name, row), gain in zip(rows.items(), quoted.groups()):
        assert float(gain) == pytest.approx(number(table_row(readme, row)[3]) - start, abs=0.05 + 1e-9), name
    others = re.search(r"online DPO ([\d.]+), online KTO ([\d.]+) and RFT ([\d.]+)\.", " ".join(readme.split()))
    assert others
    rows = ("`python dpo.py --online true` (", "`python dpo.py --online true --loss_type kto", "`python rft.py`")
    for row, gain in zip(rows, others.groups()):
        assert float(gain) == pytest.approx(number(table_row(readme, row)[3]) - start, abs=0.05 + 1e-9), row


def test_the_careless_teachers_share_of_wrong_answers():
    """README and metrics.md quote how many demonstrations are wrong; count them in data/demos."""
    wrong = total = 0
    with open(os.path.join(ROOT, "data", "demos", "train.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            a, op, b = re.match(r"What is (-?\d+) ([+-]) (-?\d+)\?", row["question"]).groups()
            truth = int(a) + int(b) if op == "+" else int(a) - int(b)
            wrong += int(row["answer"].split("####")[1]) != truth
            total += 1
    quoted = re.search(r"so ([\d,]+) of the ([\d,]+) answers \(([\d.]+)%\) are wrong", read("README.md"))
    assert quoted
    assert (int(quoted.group(1).replace(",", "")), int(quoted.group(2).replace(",", ""))) == (wrong, total)
    assert float(quoted.group(3)) == round(100 * wrong / total, 1)
    right = re.search(r"against the ([\d.]+)% of its demonstrations that are right", read("docs", "metrics.md"))
    assert right and float(right.group(1)) == round(100 * (total - wrong) / total, 1)
    # the first page: SFT's samples against the teacher, its greedy answer, GRPO's samples (the chain's table)
    readme = " ".join(read("README.md").split())
    sft, grpo = table_row(read("README.md"), "`python sft.py`"), table_row(read("README.md"), "`python grpo.py`")
    assert (f"({sft[3]} against the teacher's {100 * (total - wrong) / total:.1f}%), while its greedy answer, the "
            f"teacher's most frequent one, is right {sft[2]} of the time") in readme
    assert f"({grpo[3]} after GRPO)" in readme
    step0 = float(re.search(r"\(([\d.]+)% at its step-0 evaluation", readme).group(1))
    gap = number(sft[3]) - step0
    assert f"{step0}% against the {sft[3]} of SFT's own final evaluation, a {gap:.1f}-point" in readme


def test_dpo_page_counts_the_shipped_pairs_whose_rejected_answer_is_the_teachers_slip():
    """docs/dpo.md says how many shipped preference pairs reject exactly the careless teacher's answer
    (data/make_data.py's "careless" kind, which the SFT policy writes): solve each problem carelessly
    and count the pairs whose rejected answer is that (and differs from the chosen one)."""
    sys.path.insert(0, os.path.join(ROOT, "data"))
    import make_data

    careless = total = 0
    with open(os.path.join(ROOT, "data", "preference", "train.jsonl"), encoding="utf-8") as f:
        for row in map(json.loads, f):
            a, op, b = re.match(r"What is (-?\d+) ([+-]) (-?\d+)\?", row["prompt"]).groups()
            slip = make_data.completion(*make_data.solve(int(a), op, int(b), careless=True))
            careless += row["rejected"] == slip != row["chosen"]
            total += 1
    quoted = f"Of its {total:,} rejected answers, {careless} ({100 * careless / total:.1f}%) are the careless teacher's"
    assert quoted in " ".join(read("docs", "dpo.md").split())


def test_dpo_pages_tables_are_the_committed_syllabus_runs():
    """docs/dpo.md's side-by-side and controls tables are what benchmarks/syllabus.py prints from the
    committed docs/syllabus.json (each run's evaluations, settings and cost)."""
    syllabus = load_benchmark("syllabus")
    saved, page = json.loads(read("docs", "syllabus.json")), read("docs", "dpo.md")
    assert saved["seeds"] == [0, 1, 2, 3, 4]
    assert syllabus.table(saved["results"]) in page
    assert syllabus.controls_table(saved["results"]) in page
    assert syllabus.ppo_seeds_table(saved["results"]) in read("docs", "classic_rlhf.md")


def test_dpo_page_quotes_the_kto_and_iterative_dpo_rows():
    """docs/dpo.md's bullets on online KTO and iterative DPO quote docs/syllabus.json: the gains, per seed
    against online DPO, the ties KTO learns from, the minutes."""
    syllabus = load_benchmark("syllabus")
    results = json.loads(read("docs", "syllabus.json"))["results"]
    page = " ".join(read("docs", "dpo.md").split())

    def gain(method):
        return statistics.fmean(syllabus.gains(results[method]))

    def minutes(method):
        return f"{statistics.fmean(run['cost']['cpu_minutes'] for run in results[method]):.1f}"

    def on_seeds_of(method, other):  # other's runs on method's seeds
        seeds = [run["seed"] for run in results[method]]
        return [run for run in results[other] if run["seed"] in seeds]

    def per_seed(method):  # its gain minus online DPO's, seed by seed: "a, b and c"
        online = syllabus.gains(on_seeds_of(method, "dpo_online_rule"))
        return in_words([f"{a - b:+.1f}" for a, b in zip(syllabus.gains(results[method]), online)])

    kto = syllabus.gains(results["kto_online"])
    assert (f"{gain('kto_online'):.1f} points ({min(kto):.1f} to {max(kto):.1f}) against "
            f"{gain('dpo_online_rule'):.1f}, per seed {per_seed('kto_online')}") in page
    assert all(a > b for a, b in zip(kto, syllabus.gains(results["dpo_online_rule"])))  # "on every seed"
    ties = [100 * run["means"]["online/ties"] for run in results["kto_online"]]
    assert f"{min(ties):.0f}% to {max(ties):.0f}% of the pairs it sampled were ties" in page
    assert f"It costs more, {minutes('kto_online')} minutes against {minutes('dpo_online_rule')}" in page
    online = on_seeds_of("dpo_iterative_10", "dpo_online_rule")  # the same three seeds
    assert (f"it gained {gain('dpo_iterative_10'):.1f} points against online DPO's "
            f"{statistics.fmean(syllabus.gains(online)):.1f} on the same three seeds (per seed "
            f"{per_seed('dpo_iterative_10')})") in page
    assert (f"it took {minutes('dpo_iterative_10')} minutes against "
            f"{statistics.fmean(run['cost']['cpu_minutes'] for run in online):.1f} on those seeds") in page
    uses = [40 * 64 / run["own_pairs"]["pairs"] for run in results["dpo_own_pairs"]]
    assert all(1.5 < u < 2.5 for u in uses) and "each pair used about twice" in page


def smollm2_evals(name: str, stage: str = "grpo") -> list[dict]:
    """The evaluation rows of a committed SmolLM2 run, docs/smollm2_runs/<name>/<stage>/metrics.jsonl."""
    with open(os.path.join(ROOT, "docs", "smollm2_runs", name, stage, "metrics.jsonl"), encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if "eval/accuracy_sampled" in row]


def test_real_models_smollm2_table_is_the_committed_runs():
    """docs/real_models.md's table of SmolLM2 runs (benchmarks/smollm2.sh and the runs that chose its
    settings) quotes, for every run folder under docs/smollm2_runs/, what its metrics.jsonl files say:
    the held-out sampled accuracy at each GRPO evaluation, the gain over GRPO's step-0 evaluation (the SFT
    model), greedy accuracy at the start and the end, and the runs' clocks (time/elapsed) in minutes."""
    page, runs = read("docs", "real_models.md"), os.path.join(ROOT, "docs", "smollm2_runs")
    names = sorted(name for name in os.listdir(runs)  # pass-at-k-seed*: reruns of sft120-seed* (the test below)
                   if not name.startswith("pass-at-k-"))
    assert len([name for name in names if name.startswith("seed")]) >= 3, "the chain's figures need 3 seeds"
    for name in names:
        rl = "mix" if os.path.isdir(os.path.join(runs, name, "mix")) else "grpo"  # the RL run: GRPO's, or MIX's
        evals = {stage: smollm2_evals(name, stage) for stage in ("sft", rl)}
        sampled = [100 * row["eval/accuracy_sampled"] for row in evals[rl]]
        greedy = [100 * row["eval/accuracy_greedy"] for row in evals[rl]]
        minutes = [row["time/elapsed"] / 60 for row in (evals["sft"][-1], evals[rl][-1])]
        cells = table_row(page, f"`{name}`")
        assert cells[3] == " → ".join(f"{a:.1f}" for a in sampled), name
        assert cells[4] == f"**{sampled[-1] - sampled[0]:+.1f}**", name
        assert cells[5] == f"{greedy[0]:.1f} → {greedy[-1]:.1f}", name
        assert cells[6] == f"{minutes[0]:.1f} + {minutes[1]:.1f}", name


def test_real_models_three_seeds_paragraph_is_the_committed_runs():
    """The paragraphs after docs/real_models.md's SmolLM2 table quote the script's three seeds (20 SFT
    steps, folders seed0-seed2) and the 30-step chains they replaced (sft30-seed0-2), from their
    metrics.jsonl: each GRPO gain and their mean, where GRPO starts and ends, and how far sampled and
    greedy accuracy stand apart at the start and at the end over all six chains; and the three 120-step
    chains' ends and gains, quoted as the best models."""
    def evals(name):  # [(sampled %, greedy %)] at each of the GRPO run's evaluations
        return [(100 * row["eval/accuracy_sampled"], 100 * row["eval/accuracy_greedy"]) for row in smollm2_evals(name)]

    def span(values):
        return f"{min(values):.1f}% to {max(values):.1f}%"

    page = " ".join(read("docs", "real_models.md").split())
    new, old = ([evals(f"{prefix}seed{seed}") for seed in range(3)] for prefix in ("", "sft30-"))
    gains = [run[-1][0] - run[0][0] for run in new]
    assert (f"after 20 SFT steps, GRPO adds {gains[0]:.1f}, {gains[1]:.1f} and {gains[2]:.1f} points of held-out "
            f"sampled accuracy over its own step-0 evaluation of the SFT model on seeds 0, 1 and 2 (mean "
            f"{sum(gains) / 3:.1f})") in page
    assert (f"GRPO gained {', '.join(f'{run[-1][0] - run[0][0]:.1f}' for run in old[:2])} and "
            f"{old[2][-1][0] - old[2][0][0]:.1f} (`sft30-seed0` to `-seed2`)") in page
    def per_seed(values, unit=""):  # "a, b and c"
        return f"{values[0]}{unit}, {values[1]}{unit} and {values[2]}{unit}"

    assert (f"Twenty steps start GRPO at {per_seed([f'{run[0][0]:.1f}' for run in new], '%')} sampled on seeds 0, "
            f"1 and 2, against {per_seed([f'{run[0][0]:.1f}' for run in old], '%')} after thirty, and the 20-step "
            f"chain's gain minus the 30-step chain's is "
            f"{per_seed([f'{n[-1][0] - n[0][0] - o[-1][0] + o[0][0]:+.1f}' for n, o in zip(new, old)])} points") in page
    starts_lower = [n[0][0] < o[0][0] for n, o in zip(new, old)]
    gained_more = [n[-1][0] - n[0][0] > o[-1][0] - o[0][0] for n, o in zip(new, old)]
    assert starts_lower == gained_more == [True, False, True]  # "Two seeds of three ...; seed 1 ...: not shown"
    assert "Two seeds of three started lower after 20 steps and gained more; seed 1 started higher and gained less" \
        in page
    assert (f"it ends close to where it ended from 30 "
            f"({span([run[-1][0] for run in new])} sampled, against {span([run[-1][0] for run in old])}; greedy "
            f"{new[0][-1][1]:.1f}% on seeds 0 and 1, as on all three 30-step chains, and {new[2][-1][1]:.1f}% "
            f"on seed 2)") in page
    assert new[0][-1][1] == new[1][-1][1] == old[0][-1][1] == old[1][-1][1] == old[2][-1][1]
    end_gaps = [abs(run[-1][1] - run[-1][0]) for run in new + old]
    start_gaps = [abs(run[0][1] - run[0][0]) for run in new + old]
    assert (f"sampled and greedy end {min(end_gaps):.1f} to {max(end_gaps):.1f} points apart, from "
            f"{min(start_gaps):.1f} to {max(start_gaps):.1f} apart at GRPO's step 0") in page
    best = [evals(f"sft120-seed{seed}") for seed in range(3)]
    assert (f"120 SFT steps ({best[0][-1][0]:.1f}%, {best[1][-1][0]:.1f}% and {best[2][-1][0]:.1f}% sampled after "
            f"GRPO on seeds 0, 1 and 2, `sft120-seed0` to `-seed2`), most of it SFT's work (GRPO added "
            f"{best[0][-1][0] - best[0][0][0]:+.1f}, {best[1][-1][0] - best[1][0][0]:+.1f} and "
            f"{best[2][-1][0] - best[2][0][0]:+.1f})") in page
    assert (f"after GRPO they sample {span([run[-1][0] for run in best])} right, against "
            f"{span([run[-1][0] for run in new])} after a 20-step SFT, higher on each of three seeds") in page
    assert all(b[-1][0] > n[-1][0] for b, n in zip(best, new))  # "on each of three seeds"


def test_by_kind_table_and_its_figures_are_the_committed_run():
    """docs/experiments.md's accuracy by kind of problem is benchmarks/by_kind.py's table of the committed
    docs/by_kind.json; the sentence after it quotes its carry row and the teacher's carelessness."""
    by_kind = load_benchmark("by_kind")
    run, readme = json.loads(read("docs", "by_kind.json")), read("docs", "experiments.md")
    assert by_kind.table(run) in readme
    careless = re.search(r'"--careless", type=float, default=([\d.]+)', read("data", "make_data.py")).group(1)
    sft, grpo = run["SFT"]["carry"], run["GRPO"]["carry"]
    quoted = " ".join(readme.split())
    assert (f"forgets the first carry in {100 * float(careless):.0f}% of its demonstrations" in quoted and
            f"right ({100 * sft['accuracy_greedy']:.1f}%), but its samples are right "
            f"{100 * sft['accuracy_sampled']:.1f}% of the time, near the teacher's {100 - 100 * float(careless):.0f}%;"
            f" GRPO, rewarded for the right number, takes them to {100 * grpo['accuracy_sampled']:.1f}%") in quoted


def test_real_models_plateau_is_the_share_of_easy_problems_and_the_kind_table_is_committed():
    """docs/real_models.md explains the SmolLM2 plateau by the kinds of the 64 held-out problems: how many
    leave room for no slip of the teacher (problem_kind), their share, and that share as the greedy
    accuracy at which the GRPO runs from the three 30-step SFT models end; its table by kind is
    benchmarks/by_kind.py's table of the committed docs/smollm2_by_kind.json."""
    by_kind = load_benchmark("by_kind")
    page = " ".join(read("docs", "real_models.md").split())
    assert by_kind.table(json.loads(read("docs", "smollm2_by_kind.json"))) in read("docs", "real_models.md")
    with open(os.path.join(ROOT, "data", "arithmetic", "test.jsonl"), encoding="utf-8") as f:
        kinds = [by_kind.kind_of(json.loads(line)["question"]) for line in f][:64]
    easy, sums, differences = (sum(k in which for k in kinds) for which in
                               (("no carry", "no borrow"), ("no carry",), ("no borrow",)))
    share = f"{100 * easy / 64:.1f}"
    assert (f"{easy} leave room for no slip ({sums} sums without a carry, {differences} differences without a "
            f"borrow): {easy} of 64 is {share}%") in page
    for seed in range(3):
        assert f"{100 * smollm2_evals(f'sft30-seed{seed}')[-1]['eval/accuracy_greedy']:.1f}" == share


GPU_RUN = os.path.join("docs", "gpu_runs", "h100-2026-11-25")


def gpu_chain_cells(call: str, stage: str) -> list[str]:
    """What docs/scaling.md's table of the tiny chain on the H100 says of one run, from its committed
    metrics.jsonl: steps done, the median seconds per step (step 1, the warm-up, left out, as
    benchmarks/gpu.py reads it), and each held-out evaluation's accuracies (greedy, sampled)."""
    with open(os.path.join(ROOT, GPU_RUN, call, "chain", stage, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    seconds = sorted(row["time/step"] for row in rows if "time/step" in row and row["step"] > 1)
    evals = [row for row in rows if "eval/accuracy_greedy" in row or "eval/pairwise_accuracy" in row]
    if stage == "rm":
        scores = [f"{100 * evals[-1]['eval/pairwise_accuracy']:.1f}% of shipped pairs, "
                  f"{100 * evals[-1]['eval/policy_pairwise_accuracy']:.1f}% of policy pairs", ""]
    else:
        scores = [" → ".join(f"{100 * row[f'eval/accuracy_{kind}']:.1f}" for row in evals)
                  for kind in ("greedy", "sampled")]
    return [str(rows[-1]["step"]), f"{statistics.median(seconds):.3f} s", *scores]


def test_scaling_gpu_figures_are_the_committed_h100_run():
    """docs/scaling.md quotes benchmarks/gpu.py's H100 run as the script printed it (part (b)'s table and
    precision line, from the committed gpu.json) and the tiny chain's runs from their metrics.jsonl."""
    gpu = load_benchmark("gpu")
    page = read("docs", "scaling.md")
    run = json.loads(read(GPU_RUN, "call1", "gpu.json"))
    assert gpu.settings_table(run["b"]["runs"]) in page
    assert gpu.show_precision(run["b"]["precision"]) in page
    for call, stage, first_cell in [
            ("call1", "sft", "`sft.py` (call 1)"), ("call1", "grpo", "`grpo.py` (call 1"),
            ("call2", "sft", "`sft.py` (call 2)"), ("call2", "grpo", "`grpo.py --max_steps 40`"),
            ("call2", "rm", "`reward_model.py --max_steps 300`"), ("call2", "ppo", "`ppo.py --max_steps 40`")]:
        assert table_row(page, first_cell)[1:5] == gpu_chain_cells(call, stage), first_cell
    # the prose on the tiny GRPO step's spread in call 1 (and call 2's median over the same steps)
    steps = {call: [json.loads(line) for line in read(GPU_RUN, call, "chain", "grpo", "metrics.jsonl").splitlines()]
             for call in ("call1", "call2")}
    seconds = lambda call, first, last: [r["time/step"] for r in steps[call] if first <= r["step"] <= last]  # noqa: E731
    every = seconds("call1", 1, 200)
    assert (f"{min(every):.2f} to {max(every):.2f} s a step in call 1; its median over steps 2-40 was "
            f"{statistics.median(seconds('call1', 2, 40)):.2f} s, over steps 41-109 "
            f"{statistics.median(seconds('call1', 41, 109)):.2f} s") in " ".join(page.split())
    assert f"{statistics.median(seconds('call2', 2, 40)):.2f} s over steps 2-40" in page


def test_the_pages_quote_the_committed_syllabus_runs():
    """Every figure the README and docs/dpo.md quote from the side-by-side and its controls is what the
    committed docs/syllabus.json says: the gains, the ties, the log-probs, the clip fractions, the pairs."""
    syllabus = load_benchmark("syllabus")
    results = json.loads(read("docs", "syllabus.json"))["results"]
    page, readme = (" ".join(read(*path).split()) for path in (("docs", "dpo.md"), ("README.md",)))

    def gain(method):  # the mean gain over the seeds, as the table prints it
        return f"{statistics.fmean(syllabus.gains(results[method])):.1f}"

    def per_seed(method, key):
        return [run[key] for run in results[method]]

    def span(values, fmt="{:.1f}"):
        return f"{fmt.format(min(values))} to {fmt.format(max(values))}"

    ties = [f"{100 * m['online/ties']:.0f}%" for m in per_seed("dpo_online_rule", "means")]
    assert (f"PPO gained {gain('rm_ppo')} points with the reward model and {gain('rule_ppo')} with the checker's own "
            f"reward in its place (`--reward_model rule`, which also gives the critic a fresh head), GRPO "
            f"{gain('grpo')}") in readme
    assert f"gains of {gain('grpo')}, {gain('mix')} and {gain('dpo_online_rule')} points" in page
    finals = {m: [run["evals"][-1]["sampled"] for run in results[m]] for m in ("grpo", "mix", "dpo_online_rule")}
    mix_lead = [m - g for m, g in zip(finals["mix"], finals["grpo"])]
    dpo_lead = [d - g for d, g in zip(finals["dpo_online_rule"], finals["grpo"])]
    signed = lambda values: in_words([f"{v:+.2f}" for v in values])  # noqa: E731
    assert f"MIX's final accuracy minus GRPO's, per seed, {signed(mix_lead)}" in page
    assert f"online DPO's {signed(dpo_lead)}" in page
    assert f"{in_words(ties)} of its pairs were ties" in page
    starts = [run["evals"][0] for run in results["grpo"]]
    sampled = in_words([f"{s['sampled']:.1f}%" for s in starts])
    greedy = in_words([f"{s['greedy']:.1f}%" for s in starts])
    assert f"sample {sampled} right at step 0 (and {greedy} greedy)" in page
    beta = results["dpo_offline"][0]["settings"]["beta"]
    rejected = [m["rewards/rejected"] / beta for m in per_seed("dpo_offline", "last10")]
    assert f"falls (to {max(rejected):.2f} to {min(rejected):.2f} nats" in page
    for method, key, quoted in [
            ("dpo_offline", "logps/chosen", "chosen ones had a summed log-prob of {} to {}"),
            ("dpo_offline", "logps/rejected", "the shipped rejected ones {} to {}"),
            ("dpo_own_pairs", "logps/rejected", "rejected answers start at a summed log-prob of {} to {}")]:
        values = [m[key] for m in per_seed(method, "first")]
        digits = 2 if key == "logps/chosen" else 1
        assert quoted.format(f"{max(values):.{digits}f}", f"{min(values):.{digits}f}") in page, (method, key)
    hacked = syllabus.gains(results["dpo_online_rm"])
    rises = [run["evals"][1]["sampled"] > run["evals"][0]["sampled"] for run in results["dpo_online_rm"]]
    falls = [run["evals"][2]["sampled"] < run["evals"][1]["sampled"] for run in results["dpo_online_rm"]]
    assert all(rises) and all(falls)
    assert f"({in_words([f'{h:+.1f}' for h in hacked])} points at the end)" in page
    assert f"PPO on them gained {span(syllabus.gains(results['rm_ppo']))}" in page
    rm_ties = [100 * m["online/ties"] for m in per_seed("dpo_online_rm", "means")]
    assert f"two identical samples ({min(rm_ties):.0f}% to {max(rm_ties):.0f}% of the pairs here)" in page
    # the controls
    rows = {line.split("|")[1].strip(): line for line in syllabus.controls_table(results).splitlines()[2:]}
    difference = {name: row.split("|")[5].strip() for name, row in rows.items()}
    assert f"as on the reward model ({difference['rule_ppo']}; per seed" in page
    assert f"against GRPO's {gain('grpo')}" in page
    assert f"at that rate** (+{gain('dpo_own_pairs')} points" in page
    assert f"made the {difference['dpo_own_pairs'].lstrip('+')} points between the two rows" in page
    pairs = [f"{run['own_pairs']['pairs']:,}" for run in results["dpo_own_pairs"]]
    assert f"({pairs[0]}, {pairs[1]} and {pairs[2]} pairs from 4,000 prompts" in page
    assert f"gained {difference['grpo_4_iterations'].lstrip('+')} points more than with one" in page
    assert f"mini-batches {difference['rm_ppo_4_updates'].lstrip('+')} more" in page
    clipped = {m: [100 * run["means"][key] for run in results[m]]
               for m, key in (("grpo_4_iterations", "clip_fraction"), ("rm_ppo_4_updates", "clip_fraction/actor"))}
    assert (f"The clip acted on {span(clipped['grpo_4_iterations'], '{:.2f}%')} of GRPO's tokens and "
            f"{span(clipped['rm_ppo_4_updates'], '{:.2f}%')} of PPO's") in page
    # the perfect teacher, and the starts (each SFT model's own final evaluation)
    saved = json.loads(read("docs", "syllabus.json"))
    starts, experiments = saved["starts"], " ".join(read("docs", "experiments.md").split())
    seeds = [run["seed"] for run in results["grpo_perfect_teacher"]]
    perfect = in_words([f"{100 * starts[str(s)]['sft_perfect']['accuracy_sampled']:.1f}%" for s in seeds])
    own = in_words([f"{100 * starts[str(s)]['sft']['accuracy_sampled']:g}%" for s in seeds])
    gains = syllabus.gains(results["grpo_perfect_teacher"])
    assert seeds == [0, 1, 2, 3, 4]
    assert (f"samples {perfect} right on seeds {in_words(seeds)} (careless teacher: {own}), and 40 GRPO steps at the "
            f"default learning rate then gain {statistics.fmean(gains):.1f} points "
            f"({in_words([f'{g:+.1f}' for g in gains])}) against {gain('grpo')} from the careless start") in page
    assert (f"which samples {perfect} right on seeds {in_words(seeds)}, 40 GRPO steps at the default learning rate "
            f"gained {statistics.fmean(gains):.1f} points, against {gain('grpo')} from the") in experiments
    # processor minutes against wall-clock minutes, where a run had the machine to itself
    alone = [results[m][1]["cost"] for m in ("rule_ppo", "grpo_perfect_teacher")]
    assert all(abs(c["wall_minutes"] / c["cpu_minutes"] - 1) < 0.01 for c in alone)
    assert (f"(rule_ppo seed 1: {alone[0]['cpu_minutes']:.2f} processor and {alone[0]['wall_minutes']:.2f} wall-clock "
            f"minutes; grpo_perfect_teacher seed 1: {alone[1]['cpu_minutes']:.2f} and "
            f"{alone[1]['wall_minutes']:.2f})") in page
    # the clip, where it acts: GRPO at lr 3e-4 with four updates, with and without it
    clip, no_clip = results["grpo_4_iterations_3e-4"], results["grpo_4_iterations_3e-4_no_clip"]
    assert all(run["means"]["clip_fraction"] == 0 and run["settings"]["epsilon"] == 1e6 for run in no_clip)
    assert (f"the clip acted on {span([100 * run['means']['clip_fraction'] for run in clip], '{:.2f}%')} of GRPO's "
            f"tokens. That rate alone cost {difference['grpo_4_iterations_3e-4'].lstrip('-')} points against lr 5e-5 "
            f"(a gain of {gain('grpo_4_iterations_3e-4')} against "
            f"{rows['grpo_4_iterations_3e-4'].split('|')[4].split()[0]}") in page  # the row's gain, its three seeds
    per_seed_difference = rows["grpo_4_iterations_3e-4_no_clip"].split("|")[6].strip().split(", ")
    assert (f"gained {gain('grpo_4_iterations_3e-4_no_clip')} points, "
            f"{difference['grpo_4_iterations_3e-4_no_clip'].lstrip('-')} fewer (per seed {per_seed_difference[0]}, "
            f"{per_seed_difference[1]} and {per_seed_difference[2]})") in page
    assert (f"mean KL to pi_ref over the run was {span([run['means']['kl'] for run in no_clip], '{:.3f}')} against "
            f"{span([run['means']['kl'] for run in clip], '{:.3f}')} with the clip, and at step 20 they sampled "
            f"{span([run['evals'][1]['sampled'] for run in no_clip], '{:.1f}%')} right against "
            f"{span([run['evals'][1]['sampled'] for run in clip], '{:.1f}%')}") in page
    sft = [(100 * starts[s]["sft"]["accuracy_greedy"], 100 * starts[s]["sft"]["accuracy_sampled"]) for s in "012"]
    assert (f"ends at {sft[0][0]:.1f}% / {sft[0][1]:.1f}%" in experiments and
            f"end at {sft[1][0]:.1f}% / {sft[1][1]:g}% and {sft[2][0]:.1f}% / {sft[2][1]:.1f}% there" in experiments)
    assert f"SFT seed 0 ends at {sft[0][0]:.1f}% greedy / {sft[0][1]:.1f}% sampled on this VM" in page


def test_grpo_page_quotes_the_committed_entropy_runs():
    """docs/grpo.md's entropy table is what benchmarks/entropy.py prints from docs/entropy.json, and its prose
    quotes that file; the base arm is the side-by-side's grpo_4_iterations made again (the same gains)."""
    entropy = load_benchmark("entropy")
    results = json.loads(read("docs", "entropy.json"))
    text = read("docs", "grpo.md")
    page = " ".join(text.split())
    assert entropy.table(results) in text

    def mean(arm, part):
        return statistics.fmean(run["entropy"][0] if part == "first" else statistics.fmean(run["entropy"][-10:])
                                for run in results[arm])

    def gain(runs):
        return statistics.fmean(run["evals"][-1]["sampled"] - run["evals"][0]["sampled"] for run in runs)

    changes = [statistics.fmean(run["entropy"][-10:]) - run["entropy"][0] for run in results["base"]]
    assert (f"went from {mean('base', 'first'):.3f} to {mean('base', 'last'):.3f} nats per token (steps 31-40), a "
            f"change of {statistics.fmean(changes):.3f} whose seeds span {min(changes):.3f} to {max(changes):+.3f}"
            ) in page
    syllabus = [run for run in json.loads(read("docs", "syllabus.json"))["results"]["grpo_4_iterations"]
                if run["seed"] in (0, 1, 2)]  # entropy.json's seeds
    assert [run["evals"] for run in results["base"]] == [[{"step": e["step"], "sampled": e["sampled"]}
                                                          for e in run["evals"]] for run in syllabus]
    lower = [b["evals"][-1]["sampled"] - c["evals"][-1]["sampled"] for b, c in zip(results["base"],
                                                                                     results["clip_higher"])]
    assert (f"the same entropy ({mean('clip_higher', 'last'):.3f}), a gain of {gain(results['clip_higher']):.1f} "
            f"against {gain(results['base']):.1f}, and per seed a final accuracy {lower[0]:.2f}, {lower[1]:.2f} and "
            f"{lower[2]:.2f} points lower") in page and min(lower) > 0
    clip = statistics.fmean(100 * run["clip_fraction"] for run in results["clip_higher"])
    assert f"the clip acts on {clip:.2f}% of tokens" in page
    hot = [statistics.fmean(run["entropy"][-10:]) - run["entropy"][0] for run in results["temperature_1.2"]]
    assert (f"{mean('temperature_1.2', 'first'):.3f} at step 1), fell more ({statistics.fmean(hot):.3f}), and the "
            f"gain was about the same ({gain(results['temperature_1.2']):.1f})") in page



def in_words(values) -> str:
    """'a', 'a and b', 'a, b and c'."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def test_real_models_pass_at_k_is_the_committed_evaluations():
    """docs/real_models.md's pass@k paragraph: its tables are what benchmarks/pass_at_k.py --smollm2 prints
    from the committed evaluations (docs/smollm2_runs/pass-at-k-seed*/, seeds 0, 1 and 2), which of the
    models evaluated have the held-out evaluations of the sft120-seed* chains they rerun, and the prose
    quotes those files: pass@1 and pass@64, where the curves cross, the problems lost and gained, the
    borrows, and the minutes."""
    bench = load_benchmark("pass_at_k")
    results, text = bench.smollm2_results("docs"), read("docs", "real_models.md")
    page, seeds = " ".join(text.split()), results["seeds"]
    assert seeds == [0, 1, 2]
    assert bench.smollm2_table(results) in text and bench.smollm2_kinds(results) in text
    assert "`bash benchmarks/smollm2_pass_at_k.sh 0 1 2`" in page
    scores = {(seed, stage): [[(row["step"], row["eval/accuracy_greedy"], row["eval/accuracy_sampled"])
                               for row in smollm2_evals(f"{name}-seed{seed}", stage)]
                              for name in ("pass-at-k", "sft120")] for seed in seeds for stage in ("sft", "grpo")}
    equal = {key for key, (rerun, table) in scores.items() if rerun == table}
    assert equal == {(0, "sft"), (0, "grpo"), (1, "sft")}  # "to the last digit"; the others below
    for seed in (1, 2):  # the GRPO models that are another draw: where each ended, against the table's
        rerun, table = ([100 * row[2] for row in rows] for rows in scores[seed, "grpo"])
        assert (f"ended at {rerun[-1]:.1f}% sampled ({rerun[-1] - rerun[0]:+.1f}) where `sft120-seed{seed}` ended at "
                f"{table[-1]:.1f}% ({table[-1] - table[0]:+.1f})") in page
    assert scores[1, "grpo"][0][1] != scores[1, "grpo"][1][1] and scores[1, "grpo"][0][0] == scores[1, "grpo"][1][0]
    (*before, last), (*table_before, table_last) = scores[2, "sft"]  # seed 2's SFT: only its last sampled one differs
    assert before == table_before and last[:2] == table_last[:2] and last[2] != table_last[2]
    assert (f"its last sampled evaluation came out {100 * last[2]:.1f}% where `sft120-seed2` printed "
            f"{100 * table_last[2]:.1f}%") in page
    runs = list(zip(results["sft"], results["grpo"]))
    mean = lambda model, k: 100 * statistics.fmean(run["pass@k"][k] for run in results[model])  # noqa: E731
    assert (f"GRPO took pass@1 from {mean('sft', '1'):.1f}% to {mean('grpo', '1'):.1f}% and pass@64 from "
            f"{mean('sft', '64'):.1f}% to {mean('grpo', '64'):.1f}%") in page
    change = [{k: 100 * (grpo["pass@k"][k] - sft["pass@k"][k]) for k in sft["pass@k"]} for sft, grpo in runs]
    assert all(c["1"] > 0 > c["64"] for c in change)  # "raised pass@1 on every seed, and lowered pass@64"
    assert f"{-change[0]['64']:.1f}" == f"{-change[1]['64']:.1f}"  # "by 12.5 points on two"
    assert f"by {-change[0]['64']:.1f} points on two and {-change[2]['64']:.1f} on the third" in page
    below = [[int(k) for k in c if c[k] < 0] for c in change]
    crossings = [ks[0] for ks in below]  # on each seed, GRPO's curve below SFT's from this k up
    assert all(ks == [j for j in map(int, c) if j >= ks[0]] for ks, c in zip(below, change))
    where = in_words(f"from k = {k} up on seed {seed}" for k, seed in zip(crossings, seeds))
    assert f"GRPO's curve lies below SFT's {where}:" in page
    assert f"the k where it comes moved from {min(crossings)} to {max(crossings)} between seeds" in page
    assert f"GRPO's pass@k lies below SFT's {where}" in " ".join(read("docs", "best_of_n.md").split())
    word = {2: "two", 4: "four", 8: "eight"}[max(crossings[:2])]
    assert f"on seeds 0 and 1, {word} answers of the SFT model more often hold a right one than {word} of GRPO's" \
        in page
    counts = [bench.problems(sft, grpo) for sft, grpo in runs]
    lost, gained = ([c[f"right only in {model}'s answers"] for c in counts] for model in ("SFT", "GRPO"))
    assert f"where pass@1 rose most ({change[2]['1']:+.1f} points)" in page and change[2]["1"] == max(
        c["1"] for c in change)
    assert (f"stays above SFT's up to k = {crossings[2] // 2} and ends one problem below it ({lost[2]} problems "
            f"lost, {gained[2]} gained)") in page and round(-change[2]["64"] * 64 / 100) == 1
    assert (f"On seeds 0, 1 and 2, {in_words(lost)} problems that some answer of the SFT model got right got no "
            f"right answer in GRPO's 64 ({in_words(gained)} the other way)") in page
    order, kinds = bench.problem_kinds(64)
    lost = [(kinds[i], a) for sft, grpo in runs
            for i, (a, b) in enumerate(zip(sft["right_per_problem"], grpo["right_per_problem"])) if b == 0 < a]
    few = sum(a <= 3 for _, a in lost)
    assert (f"Every problem GRPO lost had been right in at most {max(a for _, a in lost)} of the SFT model's 64 "
            f"answers, {few} of the {len(lost)} in 3 or fewer") in page
    borrows = sum(kind == "borrow" for kind, _ in lost)
    assert f"Of them, {borrows} of {len(lost)} are differences that borrow" in page and borrows > len(lost) / 2
    borrow = [i for i, kind in enumerate(kinds) if kind == "borrow"]
    share = [[100 * sum(run["right_per_problem"][i] for i in borrow) / (64 * len(borrow)) for run in results[m]]
             for m in ("sft", "grpo")]
    assert share[1][0] < share[0][0] and share[1][1] < share[0][1] and share[1][2] > share[0][2]
    assert (f"On seeds 0 and 1, SFT's samples got differences that borrow right in {share[0][0]:.1f}% and "
            f"{share[0][1]:.1f}% of answers and GRPO took that to {share[1][0]:.1f}% and {share[1][1]:.1f}%") in page
    assert f"borrows too ({share[0][2]:.1f}% to {share[1][2]:.1f}%)" in page
    p = statistics.fmean(share[0]) / 100
    assert f"at {100 * p:.1f}% (the seeds' mean) right, a group of 4 answers holds a right one in " \
           f"{100 * (1 - (1 - p) ** 4):.0f}% of groups" in page
    clocks = [json.loads(read("docs", "smollm2_runs", f"pass-at-k-seed{seed}", stage, "pass_at_k.json"))["wall_minutes"]
              for seed in seeds for stage in ("sft", "grpo")]
    assert f"each 64-sample evaluation {min(clocks):.1f} to {max(clocks):.1f} minutes" in page
    trained = [in_words(f"{smollm2_evals(f'pass-at-k-seed{seed}', stage)[-1]['time/elapsed'] / 60:.1f}"
                        for seed in seeds) for stage in ("sft", "grpo")]
    assert f"SFT took {trained[0]} minutes and GRPO {trained[1]} by their own clocks" in page


def test_mix_page_weak_start_rows_are_the_committed_runs():
    """docs/mix.md's weak-start rows and the sentences on them are docs/mix_runs/weak-seed0/'s metrics."""
    page = " ".join(read("docs", "mix.md").split())
    runs = {}
    for name in ("grpo", "mix"):
        with open(os.path.join(ROOT, "docs", "mix_runs", "weak-seed0", name, "metrics.jsonl")) as f:
            runs[name] = [json.loads(line) for line in f]
        evals = [row for row in runs[name] if "eval/accuracy_sampled" in row]
        cells = next(cells for line in read("docs", "mix.md").splitlines() if line.startswith("| weak:")
                     for cells in [[c.strip() for c in line.strip("|").split("|")]]
                     if cells[1].startswith(f"`{name}.py"))
        quoted = re.findall(r"[\d.]+", cells[2])
        assert len(quoted) == len(evals) == 4
        for q, row in zip(quoted, evals):
            assert float(q) == pytest.approx(100 * row["eval/accuracy_sampled"], abs=0.005), name
        assert number(cells[3]) == pytest.approx(100 * evals[-1]["eval/accuracy_greedy"], abs=0.05)
        gain = 100 * (evals[-1]["eval/accuracy_sampled"] - evals[0]["eval/accuracy_sampled"])
        assert f"{name.upper()} {gain:.2f}" in page
    zero = statistics.fmean(row["frac_reward_zero_std"] for row in runs["grpo"] if "frac_reward_zero_std" in row)
    assert f"GRPO's groups ({100 * zero:.0f}%)" in page
    nll = [row["expert/sft_loss"] for row in runs["mix"] if "expert/sft_loss" in row]
    assert f"went from {nll[0]:.3f} to {nll[-1]:.3f}" in page
    with open(os.path.join(ROOT, "docs", "mix_runs", "weak-seed0", "sft", "eval.json")) as f:
        sft = json.load(f)
    assert f"{100 * sft['accuracy_greedy']:.1f}% greedy but only {100 * sft['accuracy_sampled']:.1f}%" in page


def test_classic_rlhf_hacked_seed_paragraph_is_the_committed_runs():
    """classic_rlhf.md's paragraph on the 120-step PPO seeds: the reward model's score and the checker's accuracy
    of the same completions over the first and last 8 steps, the KL at the end, and the differences, from the
    per-step metrics committed in docs/syllabus.json."""
    page = " ".join(read("docs", "classic_rlhf.md").split())
    results = json.loads(read("docs", "syllabus.json"))["results"]
    rm, rule = ({run["seed"]: run for run in results[m]} for m in ("rm_ppo_120", "rule_ppo_120"))

    def window(run, key, first):
        values = run["per_step"][key]
        return statistics.fmean(values[:8] if first else values[-8:])

    hacked = rm[1]
    assert (f"Over steps 1-8 the reward model's mean score was {window(hacked, 'score', True):.2f} and the checker's "
            f"accuracy of the same completions {window(hacked, 'accuracy', True):.2f}; over steps 113-120, "
            f"{window(hacked, 'score', False):.2f} and {window(hacked, 'accuracy', False):.2f}") in page
    others = [window(rm[s], "kl_sum", False) for s in rm if s != 1]
    assert (f"reached {window(hacked, 'kl_sum', False):.2f}, against {min(others):.2f} to {max(others):.2f} on the "
            "other") in page
    for seed in (0, 2):
        run = rm[seed]
        assert (f"{window(run, 'score', True):.2f} -> {window(run, 'score', False):.2f} and "
                f"{window(run, 'accuracy', True):.2f} -> {window(run, 'accuracy', False):.2f}") in page
    assert f"greedy {hacked['evals'][0]['greedy']:.1f}% -> {hacked['evals'][-1]['greedy']:.1f}%" in page
    gain = rule[1]["evals"][-1]["sampled"] - rule[1]["evals"][0]["sampled"]
    assert f"the same PPO gained {gain:.2f} points, and its KL stayed at {window(rule[1], 'kl_sum', False):.2f}" in page
    diffs = [rule[s]["evals"][-1]["sampled"] - rm[s]["evals"][-1]["sampled"] for s in sorted(rm)]
    assert f"by {in_words([f'{d:.2f}' for d in diffs])} points" in page
    pairs = [100 * rm[s]["rm_eval"]["policy_pairwise_accuracy"] for s in sorted(rm)]
    assert (f"{100 * hacked['rm_eval']['pairwise_accuracy']:.1f}% on the shipped pairs (the highest of the five) and "
            f"{pairs[1]:.1f}% on the policy's (the others {min(pairs):.1f}% to {max(pairs):.1f}%)") in page
    assert max(rm[s]["rm_eval"]["pairwise_accuracy"] for s in rm) == hacked["rm_eval"]["pairwise_accuracy"]
    minutes = [run["cost"]["cpu_minutes"] for m in (rm, rule) for run in m.values()]
    assert f"{min(minutes):.1f} to {max(minutes):.1f} processor minutes a PPO run" in page


def test_pages_quote_the_120_step_ppo_control_per_seed():
    """README.md and docs/dpo.md quote rule_ppo_120 - rm_ppo_120 per seed (final sampled accuracy), syllabus.json's."""
    results = json.loads(read("docs", "syllabus.json"))["results"]
    final = {m: {run["seed"]: run["evals"][-1]["sampled"] for run in results[m]}
             for m in ("rm_ppo_120", "rule_ppo_120")}
    diffs = [final["rule_ppo_120"][s] - final["rm_ppo_120"][s] for s in sorted(final["rm_ppo_120"])]
    quoted = f"by {in_words([f'{d:.1f}' for d in diffs])} points"
    for page in (read("README.md"), read("docs", "dpo.md")):
        assert quoted in " ".join(page.split())


def test_classic_rlhf_and_mix_pages_quote_the_committed_chain():
    """classic_rlhf.md's first table and its score/accuracy paragraph, and mix.md's default-start rows and
    sentences, are the quickstart's runs in docs/chain.json."""
    runs = chain_runs()
    rm, ppo = runs["python reward_model.py"], runs["python ppo.py"]
    classic = read("docs", "classic_rlhf.md")
    flat = " ".join(classic.split())
    percent = lambda x: f"{round(100 * x, 2):g}%"  # noqa: E731
    cells = table_row(classic, "`python reward_model.py` (")
    assert number(cells[1]) == round(rm["wall_s"])
    assert (f"pairwise accuracy {percent(rm['eval']['pairwise_accuracy'])} on the shipped pairs, "
            f"{100 * rm['eval']['policy_pairwise_accuracy']:.1f}% on pairs") in cells[2]
    cells = table_row(classic, "`python ppo.py` (")
    assert number(cells[1]) == round(ppo["wall_s"])
    e = ppo["evals"]
    assert cells[2] == (f"held-out sampled accuracy {percent(e[0]['eval/accuracy_sampled'])} -> "
                        + " -> ".join(f"{percent(r['eval/accuracy_sampled'])} at step {r['step']}" for r in e[1:])
                        + "; greedy " + " -> ".join(percent(r["eval/accuracy_greedy"]) for r in e))
    steps = ppo["per_step"]
    mean = lambda key, a, b: statistics.fmean(steps[key][a:b])  # noqa: E731
    assert (f"Over steps 1-8 the reward model's mean score was {mean('score', 0, 8):.2f} and the rule-based accuracy "
            f"of the same completions {mean('accuracy', 0, 8):.2f}; over steps 81-88, {mean('score', 80, 88):.2f} "
            f"and {mean('accuracy', 80, 88):.2f}; over steps 113-120, {mean('score', 112, 120):.2f} and "
            f"{mean('accuracy', 112, 120):.2f}, with the KL to the reference (`kl_sum`, k1 summed over a completion) "
            f"at {mean('kl_sum', 112, 120):.2f}") in flat
    mix_page = " ".join(read("docs", "mix.md").split())
    for name in ("grpo", "mix"):
        run = runs[f"python {name}.py"]
        row = next(line for line in read("docs", "mix.md").splitlines()
                   if line.startswith("| `out/sft` (700 steps) |") and f"`python {name}.py`" in line)
        cells = [c.strip() for c in row.strip("|").split("|")]
        quoted = [float(x) for x in re.findall(r"[\d.]+", cells[2])]
        assert quoted == [round(100 * r["eval/accuracy_sampled"], 2) for r in run["evals"]], name
        assert number(cells[3]) == round(100 * run["eval"]["accuracy_greedy"], 1)
        assert number(cells[4]) == round(run["wall_s"])
        zero = statistics.fmean(run["per_step"]["frac_reward_zero_std"])
        if name == "grpo":
            assert f"taught nothing, against {100 * zero:.0f}% from the full start" in mix_page


def test_grpo_variants_table_is_the_committed_runs():
    """docs/grpo.md's variants table is benchmarks/grpo_variants.py's table of the committed docs/grpo_variants.json,
    and its grpo row is the quickstart's GRPO run (the same command from the same out/sft)."""
    variants = load_benchmark("grpo_variants")
    runs = json.loads(read("docs", "grpo_variants.json"))
    assert variants.table(runs) in read("docs", "grpo.md")
    chain = chain_runs()["python grpo.py"]
    assert [e["sampled"] for e in runs["grpo"]["evals"]] == [100 * e["eval/accuracy_sampled"] for e in chain["evals"]]
    final = {name: run["evals"][-1]["sampled"] for name, run in runs.items()}
    page = " ".join(read("docs", "grpo.md").split())
    assert f"the default's two seeds ended {abs(final['grpo'] - final['grpo_seed1']):.1f} points apart" in page
    spread = max(abs(final[n] - final["grpo"]) for n in ("dapo", "dr_grpo", "batch_std"))
    assert f"end within {spread:.2f} points of the default" in page
    assert f"ended {final['grpo_2it'] - final['grpo']:.1f} points higher" in page
    assert f"clipped {100 * runs['gspo_2it']['clip_fraction']:.0f}% of the tokens" in page
    assert f"ended at {final['gspo_2it']:g}, {final['grpo_2it'] - final['gspo_2it']:.2f} points under" in page


def test_agent_page_tables_are_the_committed_runs():
    """docs/agent.md's tables are what benchmarks/agent_runs.py prints from the committed docs/agent_runs.json
    (3 seeds, the three arms' evaluations with the calculator, the call rates by kind)."""
    agent_runs = load_benchmark("agent_runs")
    saved, page = json.loads(read("docs", "agent_runs.json")), read("docs", "agent.md")
    assert saved["seeds"] == [0, 1, 2]
    for table in "\n".join(agent_runs.tables(saved)).split("\n\n"):  # the accuracy table, the call-rate table
        assert table in page


def test_agent_page_smollm2_table_is_the_committed_runs():
    """docs/agent.md's SmolLM2 table: the calculator's run (benchmarks/smollm2_agent.sh, docs/agent_smollm2/) and
    the best SFT chain without it (docs/smollm2_runs/sft120-seed0), each evaluation's greedy / sampled accuracy."""
    page = read("docs", "agent.md")

    def evals(*path):
        with open(os.path.join(ROOT, "docs", *path, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        return " → ".join(f"{100 * r['eval/accuracy_greedy']:.1f} / {100 * r['eval/accuracy_sampled']:.1f}"
                          for r in rows if "eval/accuracy_sampled" in r)

    assert table_row(page, "SFT on `data/tool_demos`")[1] == evals("agent_smollm2", "seed0", "sft_tool")
    assert table_row(page, "`agent.py` from it")[1] == evals("agent_smollm2", "seed0", "agent")
    assert table_row(page, "SFT on `data/demos`")[1] == evals("smollm2_runs", "sft120-seed0", "sft")
    assert table_row(page, "`grpo.py` from it")[1] == evals("smollm2_runs", "sft120-seed0", "grpo")


def test_distill_page_table_is_the_committed_runs():
    """docs/distill.md's table is what benchmarks/distill_runs.py prints from the committed docs/distill_runs.json
    (3 seeds; two students, three arms each, and the teacher), and the prose's numbers are the table's."""
    distill_runs = load_benchmark("distill_runs")
    saved, page = json.loads(read("docs", "distill_runs.json")), read("docs", "distill.md")
    assert saved["seeds"] == [0, 1, 2]
    assert "\n".join(distill_runs.tables(saved)) in page
    for sentence in distill_runs.prose(saved):
        assert sentence in " ".join(page.split()), sentence


def test_majority_vote_table_is_the_committed_runs():
    """docs/best_of_n.md's majority-vote table is what benchmarks/majority_vote.py prints from the committed
    docs/majority_vote.json (3 seeds, SFT and GRPO, three ways to keep one answer of k)."""
    majority_vote = load_benchmark("majority_vote")
    saved, page = json.loads(read("docs", "majority_vote.json")), read("docs", "best_of_n.md")
    assert saved["seeds"] == [0, 1, 2]
    assert "\n".join(majority_vote.tables(saved)) in page
    for sentence in majority_vote.prose(saved):
        assert sentence in " ".join(page.split()), sentence


def test_entropy_remedies_table_is_the_committed_runs():
    """docs/grpo.md's remedies table is what benchmarks/entropy_remedies.py prints from the committed
    docs/entropy_remedies.json (5 seeds, the aggressive setting and four remedies, pass@k of each)."""
    entropy_remedies = load_benchmark("entropy_remedies")
    saved, page = json.loads(read("docs", "entropy_remedies.json")), read("docs", "grpo.md")
    assert saved["seeds"] == [0, 1, 2, 3, 4]
    assert "\n".join(entropy_remedies.tables(saved)) in page
    for sentence in entropy_remedies.prose(saved):
        assert sentence in " ".join(page.split()), sentence


def test_sampler_gap_table_is_the_committed_runs():
    """docs/scaling.md's table of the bf16 sampler on the CPU is what benchmarks/sampler_gap.py prints from the
    committed docs/sampler_gap.json (3 seeds: the float32 sampler, the bf16 one, the bf16 one with TIS)."""
    sampler_gap = load_benchmark("sampler_gap")
    saved, page = json.loads(read("docs", "sampler_gap.json")), read("docs", "scaling.md")
    assert saved["seeds"] == [0, 1, 2] and list(saved["arms"]) == ["fp32", "bf16", "bf16_tis"]
    assert sampler_gap.table(saved) in page
    for sentence in sampler_gap.prose(saved):
        assert sentence in " ".join(page.split()), sentence


def test_async_page_and_readme_quote_the_committed_runs():
    """docs/async.md's table and sentences, and the README's ratio of steps per minute, are what
    benchmarks/async_runs.py prints from the committed docs/async_runs.json (3 seeds, 7 arms; the timing runs, 4
    scripts on 5 seeds)."""
    async_runs = load_benchmark("async_runs")
    saved, page = json.loads(read("docs", "async_runs.json")), read("docs", "async.md")
    assert saved["seeds"] == [2, 3, 4] and list(saved["arms"]) == list(async_runs.ARMS)
    assert all(sorted(runs) == ["2", "3", "4"] for runs in saved["arms"].values())
    assert saved["timing_seeds"] == [2, 3, 4, 5, 6] and list(saved["timing"]) == list(async_runs.TIMED)
    assert all(sorted(runs) == ["2", "3", "4", "5", "6"] for runs in saved["timing"].values())
    assert async_runs.table(saved) in page
    for sentence in async_runs.prose(saved):
        assert sentence in " ".join(page.split()), sentence
    assert async_runs.readme_sentence(saved) in " ".join(read("README.md").split())


def test_process_page_and_readme_quote_the_committed_runs():
    """docs/process.md's tables (the RL arms, the PRMs, the labels' agreement, the selection, SmolLM2's runs, the
    claims as the ledger reads them) and its sentences with numbers are what benchmarks/process_runs.py prints from
    the committed docs/process_runs.json (3 seeds, 7 RL arms, two PRMs a seed, best-of-16 by two judges) and
    docs/smollm2_runs/sft120-seed0..2 (the process arm and the outcome chain, 3 seeds)."""
    process_runs = load_benchmark("process_runs")
    saved, page = json.loads(read("docs", "process_runs.json")), read("docs", "process.md")
    assert saved["seeds"] == [2, 3, 4] and list(saved["arms"]) == process_runs.RL_ARMS
    assert all(sorted(runs) == ["2", "3", "4"] for runs in saved["arms"].values())
    assert sorted(saved["prm"]) == sorted(saved["prm_estimated"]) == sorted(saved["best_of_n"]) == ["2", "3", "4"]
    for table in (process_runs.rl_table(saved), process_runs.prm_table(saved), process_runs.agreement_table(saved),
                  process_runs.selection_table(saved), process_runs.smollm2_table(), process_runs.claims_table()):
        assert table in page, table.splitlines()[0]
    assert list(process_runs.smollm2_runs()["grpo_process"]) == [0, 1, 2]
    text = " ".join(page.split())
    for sentence in process_runs.prose(saved):  # the page may start a sentence with it, capitalised
        assert sentence in text or sentence[0].upper() + sentence[1:] in text, sentence
