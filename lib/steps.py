"""A completion's steps, their exact labels, and the token that ends each (process rewards, docs/process.md).

An outcome reward judges the whole answer once; a process reward judges each step. On the shipped arithmetic a
step is one line of the worked answer, one column of the sum or difference (`7+5=12`, then `4+8+1=13`) or the sign
line of a negative result, and its truth is known: the line data/make_data.py's solver writes there. So each step can be
labelled without a person (Lightman et al. 2023 paid people for PRM800K) and without sampling (Math-Shepherd,
Wang et al. 2024, estimates labels by rollouts: prm.py's estimated_labels):

    steps(completion)            the lines inside <think>, then the answer step (the rest, up to the end)
    exact_labels(q, completion, answer)
                                 per step 1 or 0: a line is right when it and every line before it are the
                                 lines the solver writes for the question q; the answer step is the outcome
                                 (the checker's against the answer: the right number, the answer closed)
    end_tokens(...)              the completion token that ends each step (a line's last character; the
                                 answer's last token): where a process reward model reads its score, and
                                 where PPO puts a step's reward

A bad input has a defined label, never an error: a completion with no lines has the answer step alone; a line
whose text is not the solver's (`5+7=12` for `7+5=12`, or no sum at all) is a wrong line (0), and so is each line
after it (the prefix is broken); text with no tags is all line steps and an empty answer step. The kinds of step
(step_kinds) say where the careless teacher's slips sit: the first line that receives a carry, the first that
pays a borrow back, and the answer of a negative result (its minus sign).
"""
import re

import torch

import common
from data.make_data import solve
from lib import distributed

QUESTION = re.compile(r"What is (\d+) ([-+]) (\d+)\?")
STEP_KINDS = ("carry", "no carry", "borrow", "no borrow", "sign", "extra", "answer", "answer, negative")


def parse_question(question: str) -> tuple[int, str, int] | None:
    """'What is 47 + 85?' -> (47, '+', 85); None for a question that is not the shipped arithmetic."""
    match = QUESTION.search(question)
    return (int(match[1]), match[2], int(match[3])) if match else None


def true_lines(question: str) -> list[str] | None:
    """The lines the solver writes for the question (data/make_data.py's solve, no slip), or None."""
    problem = parse_question(question)
    return solve(*problem)[0].split("\n") if problem else None


def steps(completion: str) -> list[tuple[str, int]]:
    """The completion's steps as (text, end): each non-empty line of its reasoning (inside <think>, or before
    <answer> when the tags are missing), then the answer step, from the reasoning's end to the completion's;
    end is the index just after the step's last character (the answer step's is len(completion), so every
    completion has at least that one step, even an empty one)."""
    body_end = next((i for i in (completion.find("</think>"), completion.find("<answer>")) if i >= 0),
                    len(completion))
    opening = completion.find("<think>")
    body_start = opening + len("<think>") if 0 <= opening < body_end else 0
    found, start = [], body_start
    for line in completion[body_start:body_end].split("\n"):
        if line.strip():
            found.append((line.strip(), start + len(line.rstrip())))
        start += len(line) + 1
    return [*found, (completion[body_end:], len(completion))]


def outcome_label(completion: str, answer: str) -> int:
    """1 when the completion's number is the dataset's and its answer is closed (ppo.py's rule_scores), else 0."""
    return int(common.is_correct(completion, answer) and completion.strip().endswith("</answer>"))


def exact_labels(question: str, completion: str, answer: str) -> list[int]:
    """One label per step of steps(completion): a line is 1 when it and every line before it equal the solver's
    lines for the question, one for one (a missing, extra or different line breaks the prefix); the answer step
    is outcome_label. Needs a question of the shipped arithmetic (parse_question); see the module docstring."""
    truth = true_lines(question)
    if truth is None:
        common.fail(f"exact step labels need the shipped arithmetic's questions ('What is 47 + 85?'), not "
                    f"{question[:60]!r}: use a process reward model (prm.py)")
    labels, prefix_right = [], True
    for j, (text, _) in enumerate(steps(completion)[:-1]):
        prefix_right = prefix_right and j < len(truth) and text == truth[j]
        labels.append(int(prefix_right))
    return [*labels, outcome_label(completion, answer)]


def line_labels(question: str, completion: str) -> list[int]:
    """Each line judged alone (1 when it equals the solver's line at its place, whatever came before), without
    the answer step. Not what PRM800K's labellers gave (Lightman et al.: each step rated in the context of those
    before it, no labels after the first error: exact_labels' structure up to the first error, with correctness as
    the criterion where exact_labels asks for the solver's text). Not a training label here."""
    truth = true_lines(question) or []
    return [int(j < len(truth) and text == truth[j]) for j, (text, _) in enumerate(steps(completion)[:-1])]


def step_kinds(question: str, completion: str) -> list[str]:
    """The kind of each step (STEP_KINDS), from the solver's line at its place: 'carry' a sum column that
    receives a carry (+1), 'borrow' a difference column that pays one back (-1), 'no carry' / 'no borrow' the
    others, 'sign' the line that says a < b, 'extra' a line beyond the solver's; then 'answer', or
    'answer, negative' when the result is below 0 (the minus sign the careless teacher drops)."""
    problem, truth = parse_question(question), true_lines(question) or []
    kinds = []
    for j in range(len(steps(completion)) - 1):
        line = truth[j] if j < len(truth) else None
        kinds.append("extra" if line is None else "sign" if "<" in line else
                     ("carry" if line.count("+") == 2 else "no carry") if "+" in line else
                     ("borrow" if line.count("-") == 2 else "no borrow"))
    negative = problem is not None and problem[1] == "-" and problem[0] < problem[2]
    return [*kinds, "answer, negative" if negative else "answer"]


def slip_step(question: str) -> int | None:
    """Where the careless teacher's slip sits, as an index into steps(): the first line that receives a carry or
    pays a borrow back ('carry' / 'borrow' in step_kinds of the true answer); None when the problem has none.
    A negative result's teacher also drops the minus sign, in the answer step: a negative result with a borrow
    (49-66) has both slips, and this returns the borrow's line."""
    truth = true_lines(question)
    if truth is None:
        return None
    kinds = step_kinds(question, "<think>" + "\n".join(truth) + "</think>")[:-1]
    return next((j for j, kind in enumerate(kinds) if kind in ("carry", "borrow")), None)


def slip_errors(questions: list[str], completions: list[str], answers: list[str]) -> dict:
    """How often the slip's step is wrong: over completions of problems with a first carry (or borrow), the share
    whose line at that place is wrong (exact_labels 0, the lines before it right), against the share of wrong
    lines elsewhere. The metric of 'is the teacher's slip unlearned': {'steps/carry_slip': .., ...}. Under torchrun
    the counts are summed over the processes first, so every process logs the same rates and the same keys (a key is
    left out when no process judged such a line)."""
    counts = {"carry_slip": [0, 0], "borrow_slip": [0, 0], "other_lines": [0, 0]}
    for question, completion, answer in zip(questions, completions, answers):
        if parse_question(question) is None:
            continue
        labels, kinds, slip = exact_labels(question, completion, answer)[:-1], step_kinds(question, completion), \
            slip_step(question)
        for j, label in enumerate(labels):
            if j > 0 and not labels[j - 1]:
                break  # after the first wrong line nothing is judged: the prefix is broken
            key = f"{kinds[j]}_slip" if j == slip else "other_lines"
            counts[key][0] += 1 - label
            counts[key][1] += 1
    summed = distributed.global_sum(torch.tensor(list(counts.values()), dtype=torch.float64,
                                                 device=distributed.get_device())).tolist()  # [3, 2]
    return {f"steps/{key}": wrong / total for key, (wrong, total) in zip(counts, summed) if total}


def end_tokens(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
               step_ends: list[list[int]]) -> list[list[int]]:
    """For each row, the index (in its completion's tokens) of the token that ends each step: for a line, the token
    holding its last character; for the answer step, the completion's last real token (its EOS when it stopped),
    where an outcome reward model reads its score. completion_ids, completion_mask [N, T]; step_ends [N] lists of
    character ends (steps()'s, into the decoded text). A token's characters are read off the growing decoded
    prefix, so a tokenizer that merges characters (SmolLM2's BPE) works as the tiny model's one byte per token."""
    positions = []
    for ids, mask, ends in zip(completion_ids.tolist(), completion_mask.tolist(), step_ends):
        ids = ids[: sum(mask)]
        lengths = [len(text) for text in tokenizer.batch_decode([ids[: k + 1] for k in range(len(ids))],
                                                               skip_special_tokens=True)]  # [T']
        last = max(len(ids) - 1, 0)
        positions.append([next((k for k, length in enumerate(lengths) if length >= end), last)
                          for end in ends[:-1]] + [last])
    return positions
