"""docs/lessons.md, the lessons' ledger: written from the committed per-seed results by benchmarks/lessons.py
(a number or a verdict that moves fails here), its rule checked on hand numbers, its noise floor by hand."""
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import lessons  # noqa: E402


def test_the_ledger_is_what_the_committed_results_give():
    with open(lessons.OUT, encoding="utf-8") as f:
        assert f.read() == lessons.page(), "docs/lessons.md is out of date: run python benchmarks/lessons.py"


@pytest.mark.parametrize("diffs, claim, registered, expected", [
    # s0 = 1, n = 3: SE = max(sd, 1) / sqrt(3); with 2 degrees of freedom P(|T| > t) = 1 - t / sqrt(2 + t^2)
    ([2.0, 3.0, 4.0], "up", False, "shown"),  # sd 1, SE 0.577, t 5.20: p = 1 - 5.20 / 5.39 = 0.035
    ([0.5, 0.6, 0.7], "up", False, "a lead"),  # every seed up, t 1.04: p 0.41
    ([1.5, 2.0, 2.5], "up", False, "a lead"),  # t 3.46: two-sided p 0.074 ...
    ([1.5, 2.0, 2.5], "up", True, "shown"),  # ... one-sided 0.037 when the direction was written first
    ([1.0, -1.0, 2.0], "up", False, "not shown"),  # the seeds disagree
    ([-2.0, -3.0, -4.0], "up", False, "the other way"),  # the 95% interval [-5.48, -0.52]
    ([-2.0, -3.0, -4.0], "down", False, "shown"),
    ([5.0], "up", False, "one run"),
    ([0.2, -0.1, 0.1], "same", False, "no difference within +-2"),  # 90%: 0.067 +- 2.92 x 0.577 in (-2, 2)
    ([1.0, 1.0, 1.0], "same", False, "not resolved"),  # 90% [-0.69, 2.69] leaves +-2; 95% [-1.48, 3.48] holds 0
    ([3.0, 3.0, 3.0], "same", False, "a difference"),  # 95% [0.52, 5.48]
])
def test_the_rule_on_hand_numbers(diffs, claim, registered, expected):
    row = lessons.verdict(diffs, claim, 1.0, registered=registered)
    assert row["verdict"] == expected
    assert row["mean"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)


def test_the_interval_and_p_value_by_hand():
    row = lessons.verdict([2.0, 3.0, 4.0], "up", 1.0)
    se = 1 / 3 ** 0.5
    assert row["se"] == pytest.approx(se, abs=1e-12)
    assert (row["low"], row["high"]) == (pytest.approx(3 - 4.302653 * se, abs=1e-5),
                                         pytest.approx(3 + 4.302653 * se, abs=1e-5))
    t = 3 / se
    assert row["p"] == pytest.approx(1 - t / (2 + t * t) ** 0.5, abs=1e-12)


@pytest.mark.parametrize("p, df, table", [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 4, 2.7764),
                                          (0.975, 9, 2.2622), (0.95, 2, 2.9200), (0.95, 4, 2.1318),
                                          (0.95, 5, 2.0150)])
def test_t_quantiles_are_the_tables(p, df, table):
    assert lessons.t_quantile(p, df) == pytest.approx(table, abs=1e-4)


def test_the_standard_error_is_the_seeds_spread_or_the_floor_whichever_is_larger():
    assert lessons.verdict([2.0, 3.0, 4.0], "up", 1.0)["se"] == pytest.approx(1 / 3 ** 0.5, abs=1e-12)  # sd 1
    assert lessons.verdict([0.0, 4.0, 8.0], "up", 1.0)["se"] == pytest.approx(4 / 3 ** 0.5, abs=1e-12)  # sd 4
    assert lessons.verdict([3.0, 3.0, 3.0], "up", 1.0)["se"] == pytest.approx(1 / 3 ** 0.5, abs=1e-12)  # sd 0


def test_holm_multiplies_the_ith_smallest_p_by_m_minus_i_plus_one():
    rows = [{"p": 0.01, "verdict": "shown"}, {"p": 0.04, "verdict": "shown"}, {"p": 0.03, "verdict": "shown"},
            {"p": None, "verdict": "one run"}]
    lessons.holm(rows)
    assert [row.get("holm_p") for row in rows] == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06),
                                                   None]
    assert [row.get("holm") for row in rows] == ["shown", "not after Holm", "not after Holm", None]


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("sigma", [0.5, 0.99, 2.0, 4.0])
def test_the_rules_error_rates_are_what_the_ledger_says(n, sigma):
    """Simulated rows (other random draws than the page's): a directional claim with no effect is called shown
    at most 2.5% of the time, a claim of no difference at an effect of the margin is called no difference at
    most 5%, as docs/lessons.md states; 3 Monte-Carlo standard errors of slack."""
    reps = 4000
    false_shown = lessons.simulate(n, sigma, lessons.TINY, 0.0, "up", reps, seed=100 + n)
    false_same = lessons.simulate(n, sigma, lessons.TINY, lessons.MARGIN, "same", reps, seed=200 + n)
    assert false_shown <= 0.025 + 3 * (0.025 * 0.975 / reps) ** 0.5
    assert false_same <= 0.05 + 3 * (0.05 * 0.95 / reps) ** 0.5
    with open(lessons.OUT, encoding="utf-8") as f:
        page = " ".join(f.read().split())
    assert "at most 2.5% (a two-sided 5% test, on the claimed side) and 5% (two one-sided tests at 5%)" in page


def test_binomial_noise_by_hand():
    """Two arms at 50% and 80% on 200 draws each: 100 sqrt(0.25 / 200 + 0.16 / 200) = 4.53 points."""
    assert lessons.binomial_noise(({0: 50.0}, 200), ({0: 80.0}, 200)) == pytest.approx(
        100 * (0.41 / 200) ** 0.5, abs=1e-9)


def test_step_noise_by_hand():
    """Steps alternating 0 and 2 millinats: successive differences 2, so the variance a step is 4 / 2 = 2 and a
    10-step mean carries 0.2; two such arms 0.4, sd 0.632."""
    steps = [0.000, 0.002] * 20
    assert lessons.step_noise([steps], [steps]) == pytest.approx(0.4 ** 0.5, abs=1e-9)


def test_the_kinds_of_problem_are_counted_from_the_held_out_data():
    assert sum(lessons.KIND_SIZES.values()) == 500 and set(lessons.KIND_SIZES) == {
        "carry", "no carry", "borrow", "no borrow", "negative"}


def test_the_noise_floor_is_one_model_evaluated_twice():
    """The 120-step PPO rows first: seed 0's SFT (one thread) evaluated 72.9% at its end and 73.1% at
    rm_ppo_120's step 0: -0.2. Then the 40-step rows, seed 0: SFT's own final evaluation 74.6% against GRPO's
    step 0 of the same weights, 73.8%: +0.8; rule_ppo's step 0, 72.35%, against it: -1.45."""
    tiny = lessons.FLOORS["tiny"]
    assert tiny[0] == pytest.approx(-0.2, abs=1e-9)
    assert tiny[3:5] == [pytest.approx(0.8, abs=1e-9), pytest.approx(-1.45, abs=1e-9)]  # after seeds 0-2's 120-step
    assert len(tiny) == 18 and len(lessons.FLOORS["smollm2"]) >= 3  # 3 + 3 a seed (seeds 3, 4: one start)


def test_every_row_names_its_arms_and_what_differs():
    for row in lessons.lessons():
        assert row["lesson"] and row["where"]
        if "diffs" in row:
            assert " -> " in row["arms"] and row["differs"] and row["unit"] and len(row["diffs"]) >= 1
        else:
            assert row["kind"] and row["evidence"]


def test_the_pages_quote_the_noise_floor_the_ledger_computes():
    """dpo.md, mix.md and real_models.md quote the root mean square of one model evaluated twice."""
    def page(*path):
        with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
            return " ".join(f.read().split())

    tiny, smollm2 = (lessons.rms(lessons.FLOORS[name]) for name in ("tiny", "smollm2"))
    assert f"two evaluations of one model differ by {tiny:.2f} points, root mean square" in page("docs", "dpo.md")
    assert f"near the {tiny:.2f} points by which two evaluations of one model differ" in page("docs", "mix.md")
    assert f"two evaluations of one model differ by {smollm2:.1f} points (root mean square" in page(
        "docs", "real_models.md")


def test_the_first_page_quotes_the_sft_starts_greedy_range():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    greedy = [100 * lessons.SYLLABUS["starts"][str(s)]["sft"]["accuracy_greedy"] for s in lessons.SEEDS]
    assert f"{min(greedy):.1f}% to {max(greedy):.1f}%)" in readme and min(greedy) > 79.7  # the teacher's rate


def test_every_page_that_teaches_a_lesson_links_its_row():
    """Each page a row names (README.md, docs/*.md) links the row by its id, e.g. [L7](docs/lessons.md#comparisons):
    a reader of the lesson reaches its evidence and verdict in one click."""
    missing = []
    for row in lessons.lessons():
        for place in row.get("where", "").split(";"):
            page = place.strip().split(" ")[0]
            if not page.endswith(".md"):
                continue  # a notebook or a --help text: no links there
            with open(os.path.join(ROOT, page), encoding="utf-8") as f:
                text = f.read()
            if f"[{row['id']}](" not in text:
                missing.append(f"{row['id']} in {page}")
    assert not missing, "rows a page teaches without linking them: " + ", ".join(missing)


def test_the_one_change_ppo_control_starts_where_its_row_does():
    """rule_ppo_120 changes only the reward: its critic is copied from the same reward model, so no random
    number is drawn before the step-0 evaluation, and both arms sample the very same answers there."""
    rows = {m: {run["seed"]: run for run in lessons.SYLLABUS["results"][m]} for m in ("rm_ppo_120", "rule_ppo_120")}
    for seed, run in rows["rm_ppo_120"].items():
        same = ("step", "sampled", "greedy")  # (not its clock)
        assert [rows["rule_ppo_120"][seed]["evals"][0][k] for k in same] == [run["evals"][0][k] for k in same]
        assert rows["rule_ppo_120"][seed]["settings"]["reward_model"] == "rule"


def test_the_first_page_names_the_rows_that_survive_holm():
    """README's "Reading a comparison" names the shown rows that Holm's correction keeps, as the ledger finds them."""
    rows = lessons.lessons()
    lessons.holm(rows)
    kept = [row["id"] for row in rows if row.get("holm") == "shown"]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    assert f"only {' and '.join(kept)} stay shown" in readme
