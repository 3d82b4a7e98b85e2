"""The shipped data and its generator: GSM8K schema, true answers, disjoint splits, the careless teacher."""
import itertools
import os
import random
import subprocess
import sys

import pytest

import common
import grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "data"))
from make_data import make_pair, problem_kind, solve  # noqa: E402


def parse(question: str) -> tuple[int, str, int]:
    a, op, b = question.removeprefix("What is ").removesuffix("?").split()
    return int(a), op, int(b)


def true_result(question: str) -> int:
    a, op, b = parse(question)
    return a + b if op == "+" else a - b


def test_solve_is_right_for_every_small_problem():
    for a, b, op in itertools.product(range(120), range(120), "+-"):
        reasoning, result = solve(a, op, b)
        assert result == (a + b if op == "+" else a - b) and reasoning


@pytest.mark.parametrize("a, op, b, reasoning, result", [
    (47, "+", 85, "7+5=12\n4+8+1=13", 132),
    (75, "-", 28, "15-8=7\n7-2-1=4", 47),
    (28, "-", 75, "28<75 so -(75-28)\n15-8=7\n7-2-1=4", -47),
    (93, "-", 42, "3-2=1\n9-4=5", 51),
])
def test_worked_reasoning_hand_written(a, op, b, reasoning, result):
    assert solve(a, op, b) == (reasoning, result)


@pytest.mark.parametrize("a, op, b, reasoning, result", [
    (47, "+", 85, "7+5=12\n4+8=12", 122),  # forgot the carry
    (75, "-", 28, "15-8=7\n7-2=5", 57),  # forgot to pay back the borrow
    (28, "-", 75, "28<75 so -(75-28)\n15-8=7\n7-2=5", 57),  # ... and the minus sign
    (12, "-", 13, "12<13 so -(13-12)\n3-2=1\n1-1=0", 1),  # no borrow, but the minus sign
    (93, "-", 42, "3-2=1\n9-4=5", 51),  # nothing to forget: still right
])
def test_careless_teacher_forgets_the_first_carry_or_borrow_and_the_sign(a, op, b, reasoning, result):
    assert solve(a, op, b, careless=True) == (reasoning, result)


@pytest.mark.parametrize("a, op, b, kind", [
    (47, "+", 85, "carry"), (43, "+", 26, "no carry"), (72, "+", 85, "no carry"),  # 7+8=15 is the last column
    (75, "-", 28, "borrow"), (93, "-", 42, "no borrow"), (50, "-", 50, "no borrow"),
    (28, "-", 75, "negative"), (12, "-", 13, "negative"), (195, "+", 8, "carry"), (100, "-", 1, "borrow"),
])
def test_problem_kind_is_the_slip_the_problem_leaves_room_for(a, op, b, kind):
    assert problem_kind(a, op, b) == kind
    # a carry or a borrow is exactly what the careless teacher's slip changes the result of
    if kind != "negative":
        assert (solve(a, op, b, careless=True) != solve(a, op, b)) == (kind in ("carry", "borrow"))


def test_shipped_data_schema_splits_and_truth():
    demos = common.load_split("data/demos", "train")
    train = common.load_split("data/arithmetic", "train")
    test = common.load_split("data/arithmetic", "test")
    assert demos.column_names == train.column_names == test.column_names == ["question", "answer"]
    assert (len(demos), len(train), len(test)) == (6000, 4000, 500)
    assert list(common.load_split("data/demos", "test")["question"]) == list(test["question"])
    sets = [set(demos["question"]), set(train["question"]), set(test["question"])]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    # RL problems and the test set carry true answers (the reward's ground truth) ...
    for row in list(train) + list(test):
        assert int(common.split_gsm8k_answer(row["answer"])[1]) == true_result(row["question"])
    # ... while about 35% of the demonstrations with a carry, borrow or sign to forget are careless.
    wrong = sum(int(common.split_gsm8k_answer(r["answer"])[1]) != true_result(r["question"]) for r in demos)
    could_slip = sum(solve(*parse(q), careless=True)[1] != true_result(q) for q in demos["question"])
    assert 0.30 < wrong / could_slip < 0.40


def test_make_data_is_deterministic(tmp_path):
    subprocess.run([sys.executable, "data/make_data.py", "--out", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True)
    for name in ("demos/train.jsonl", "demos/test.jsonl", "arithmetic/train.jsonl", "arithmetic/test.jsonl",
                 "tool_demos/train.jsonl", "tool_demos/test.jsonl"):
        with open(tmp_path / name) as a, open(os.path.join(ROOT, "data", name)) as b:
            assert a.read() == b.read(), name


def test_tool_demos_are_the_demos_with_about_half_their_rows_calling_the_calculator():
    """data/tool_demos: row for row the problems of data/demos; a row either is data/demos' own (its slips
    kept) or calls the calculator, whose reply is the true result and is copied into the answer."""
    demos, tools = common.load_split("data/demos", "train"), common.load_split("data/tool_demos", "train")
    assert list(demos["question"]) == list(tools["question"])
    calling = 0
    for demo, row in zip(demos, tools):
        if row["answer"] == demo["answer"]:
            continue
        calling += 1
        a, op, b = parse(row["question"])
        result = true_result(row["question"])
        assert row["answer"] == f"<calc>{a}{op}{b}</calc><result>{result}</result>\n#### {result}"
    assert 0.45 < calling / len(tools) < 0.55


@pytest.mark.parametrize("a, op, b, column, reasoning, result", [
    (47, "+", 85, 0, "7+5=13\n4+8+1=13", 133),  # the slipped ones digit shows in the result
    (47, "+", 85, 1, "7+5=12\n4+8+1=14", 142),
    (75, "-", 28, 1, "15-8=7\n7-2-1=5", 57),
    (19, "+", 30, 0, "9+0=8\n1+3=4", 48),  # a 9 slips down, so no carry appears
])
def test_a_wrong_column_is_off_by_one_and_the_result_follows(a, op, b, column, reasoning, result):
    assert solve(a, op, b, wrong_column=column) == (reasoning, result)


def test_make_pair_kinds():
    rng = random.Random(0)
    chosen = "<think>7+5=12\n4+8+1=13</think><answer>132</answer>"
    pair = make_pair(47, "+", 85, "careless", rng)
    assert pair == {"prompt": "What is 47 + 85?", "chosen": chosen,
                    "rejected": "<think>7+5=12\n4+8=12</think><answer>122</answer>"}
    final = make_pair(47, "+", 85, "final", rng)["rejected"]
    assert final.startswith("<think>7+5=12\n4+8+1=13</think><answer>") and final != chosen
    assert make_pair(93, "-", 42, "careless", rng)["rejected"] != make_pair(93, "-", 42, "careless", rng)["chosen"]
    assert not grpo.FORMAT.match(make_pair(47, "+", 85, "format", rng)["rejected"])
