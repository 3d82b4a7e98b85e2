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


@pytest.mark.parametrize("diffs, claim, expected", [
    ([2.0, 3.0, 4.0], "up", "shown"),  # sd 1, SE max(1, 1)/sqrt(3) = 0.577: mean 3 > 1.155
    ([0.5, 0.6, 0.7], "up", "a lead"),  # every seed up, SE 1/sqrt(3) from the floor: mean 0.6 < 1.155
    ([1.0, -1.0, 2.0], "up", "not shown"),  # the seeds disagree
    ([-2.0, -3.0, -4.0], "up", "not shown"),  # every seed the other way
    ([-2.0, -3.0, -4.0], "down", "shown"),
    ([5.0], "up", "one run"),
    ([0.2, -0.1, 0.1], "same", "shown"),  # mean 0.067 <= 1.155
    ([3.0, 3.0, 3.0], "same", "not shown"),  # mean 3 > 1.155: there is a difference
])
def test_the_rule_on_hand_numbers(monkeypatch, diffs, claim, expected):
    monkeypatch.setitem(lessons.FLOORS, "tiny", [1.0, -1.0])  # root mean square 1
    name, mean, se = lessons.verdict(diffs, claim, "tiny")
    assert name == expected
    assert mean == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)


def test_the_standard_error_is_the_seeds_spread_or_the_floor_whichever_is_larger(monkeypatch):
    monkeypatch.setitem(lessons.FLOORS, "tiny", [1.0])
    assert lessons.verdict([2.0, 3.0, 4.0], "up", "tiny")[2] == pytest.approx(1 / 3 ** 0.5, abs=1e-12)  # sd 1
    assert lessons.verdict([0.0, 4.0, 8.0], "up", "tiny")[2] == pytest.approx(4 / 3 ** 0.5, abs=1e-12)  # sd 4
    assert lessons.verdict([3.0, 3.0, 3.0], "up", "tiny")[2] == pytest.approx(1 / 3 ** 0.5, abs=1e-12)  # sd 0


def test_the_noise_floor_is_one_model_evaluated_twice():
    """The 120-step PPO rows first: seed 0's SFT (one thread) evaluated 72.9% at its end and 73.1% at
    rm_ppo_120's step 0: -0.2. Then the 40-step rows, seed 0: SFT's own final evaluation 74.6% against GRPO's
    step 0 of the same weights, 73.8%: +0.8; rule_ppo's step 0, 72.35%, against it: -1.45."""
    tiny = lessons.FLOORS["tiny"]
    assert tiny[0] == pytest.approx(-0.2, abs=1e-9)
    assert tiny[3:5] == [pytest.approx(0.8, abs=1e-9), pytest.approx(-1.45, abs=1e-9)]
    assert len(tiny) == 12 and len(lessons.FLOORS["smollm2"]) >= 3


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
