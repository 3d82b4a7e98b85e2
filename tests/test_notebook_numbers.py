"""A number a notebook's markdown quotes from the notebook's own committed output is the number that output
prints, at the precision quoted: when a notebook is re-executed and its outputs change, the prose next to
them fails here instead of drifting (as notebook 04's "G = 8 a quarter" once stood next to a printed 12%,
and notebook 01 described slips its printed answers did not contain). A few figures the notebooks quote
from the README or docs/classic_rlhf.md are checked against those pages the same way.

Nothing is executed: the notebooks are read as JSON. Each quote is a row of a table: the notebook, a phrase
that finds its markdown cell (unique among the markdown cells), a regex whose groups are the quoted numbers,
where they come from (a code cell's index, another notebook's code cell, or a page), and regexes whose groups
are the printed numbers."""
import ast
import json
import os
import re
from typing import Callable, NamedTuple

import pytest

from conftest import ROOT

WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
         "ten": 10, "eleven": 11, "twelve": 12}


class Quote(NamedTuple):
    notebook: str  # file name under notebooks/, without .ipynb
    phrase: str  # finds the markdown cell: it occurs in exactly one
    quoted: str  # regex on that cell's text: its groups are the quoted numbers
    source: int | tuple | str  # the code cell (index into nb["cells"]) whose outputs print them, (notebook, index)
    # for a cell of another notebook (notebook 08 quotes the checkpoints notebooks 01 and 02 made), or a page
    printed: str | tuple  # regex(es) on that output or page: their groups, in order, are the printed numbers
    check: Callable | None = None  # (quoted groups, printed groups) -> bool; None: equal one by one


def clean(number: str) -> str:
    number = number.replace("−", "-").replace(",", "").lstrip("+")
    return str(WORDS[number]) if number in WORDS else number


def same_number(quoted: str, printed: str) -> bool:
    """The printed number, rounded to the quoted number's precision, is the quoted number."""
    q, p = clean(quoted), clean(printed)
    if "e" in q.lower():  # 2.5e-02: the same mantissa digits
        digits = len(q.lower().split("e")[0].partition(".")[2])
        return f"{float(p):.{digits}e}" == f"{float(q):.{digits}e}"
    decimals = len(q.partition(".")[2])
    return abs(float(p) - float(q)) <= 0.5 * 10**-decimals + 1e-9


def percent_of_16(quoted, printed) -> bool:
    """A count of the 16 groups, quoted in words or digits, is the share the cell prints (as '{:.0%}')."""
    return all(f"{int(clean(q)) / 16:.0%}" == f"{p}%" for q, p in zip(quoted, printed, strict=True))


def ratio_of(quoted, printed) -> bool:
    """The quoted ratio is the first printed number over the second, at the quoted precision."""
    (ratio,), (a, b) = quoted, printed
    decimals = len(clean(ratio).partition(".")[2])
    return round(float(clean(a)) / float(clean(b)), decimals) == float(clean(ratio))


ADVANTAGES_04 = r"advantages \[B, G\]\n tensor\((\[\[[\s\S]*?\]\])\)"  # notebook 04's [B, G] advantages
LAST_STEP = r"step ([1-9]\d*): held-out"  # the evaluation after training (not step 0's)
SFT_SAVED = r"saved to out/notebooks/sft; held-out accuracy greedy ([\d.]+)%, accuracy sampled ([\d.]+)%"  # 01
RM_SAVED = r"saved to out/notebooks/rm; .*policy pairwise accuracy ([\d.]+)%"  # notebook 02's reward model
SUMS_06 = r"scale_rewards {}: .*easy group (\S+), a wrong answer of the 50/50 group (\S+)\n"  # notebook 06, cell 17


def advantage(printed: str, group: int, i: int) -> str:
    """Advantage i of group (0-based) in notebook 04's printed [B, G] tensor."""
    return str(ast.literal_eval(printed)[group][i])


# The quoted regexes read a markdown cell's text with every run of white space made one space.
QUOTES = [
    # 01: SFT
    Quote("01_sft", "## The demonstrations", r"holds ([\d,]+) worked answers", 3, r"of the (\d+) demonstrations"),
    Quote("01_sft", "far fewer", r"\(([\d.]+)% of (\d+) here\)", 15,
          (r"saved to .*greedy ([\d.]+)%", r"\(n=(\d+)\)")),
    Quote("01_sft", "far fewer", r"far fewer \(([\d.]+)%\)", 15, r"saved to .*accuracy sampled ([\d.]+)%"),
    Quote("01_sft", "What this measures", r"would carry (\d+)% \+ (\d+)% of the summed NLL", 24,
          (r"template .*?(\d+)% of the summed", r"digits and sign .*?(\d+)% of the summed")),
    Quote("01_sft", "What this measures", r"worse than a uniform guess \(([\d.]+) nats a token", 24,
          r"template .*?mean NLL\s+([\d.]+) nats"),
    Quote("01_sft", "What this measures", r"against log (\d+) = ", 5, r"(\d+) token ids"),
    Quote("01_sft", "What this measures", r"against log \d+ = ([\d.]+)\)", 9, r"log\(1/V\) = -([\d.]+)"),
    Quote("01_sft", "What this measures", r"the random part, ([\d.]+) nats per", 24, r"random part: ([\d.]+) nats"),
    Quote("01_sft", "What this measures", r"is still (\d+)% of the summed NLL", 24, r"would carry (\d+)% of"),
    Quote("01_sft", "After 10 steps the larger rate", r"slightly ahead \(([\d.]+) against ([\d.]+)\)", 27,
          (r"lr 0\.02: training loss every 10 steps \[([\d.]+),",
           r"lr 0\.002: training loss every 10 steps \[([\d.]+),")),
    Quote("01_sft", "After 10 steps the larger rate", r"to ([\d.]+) against ([\d.]+) at step (\d+)", 27,
          (r"lr 0\.02: training loss every 10 steps \[.*, ([\d.]+)\]",
           r"lr 0\.002: training loss every 10 steps \[.*, ([\d.]+)\]", LAST_STEP)),
    # 02: the reward model
    Quote("02_reward_model", "## A short run of `reward_model.main`", r"(\d+) steps of (\d+) pairs", 13,
          (r"max_steps=(\d+)", r"per_device_train_batch_size=(\d+)")),
    Quote("02_reward_model", "## A short run of `reward_model.main`", r"samples on (\d+) prompts", 13,
          r"policy_prompts=(\d+)"),
    Quote("02_reward_model", "This short reward model", r"correctly \((\d+)%\)", 13,
          r"saved to .*policy pairwise accuracy ([\d.]+)%"),
    Quote("02_reward_model", "This short reward model",
          r"same problem \(([\d.]+) against ([\d.]+) for 53 \+ 31, ([\d.]+) against ([\d.]+) for 11 \+ 81\)", 16,
          (r"\+([\d.]+) WRONG What is 53", r"\+([\d.]+) right What is 53", r"\+([\d.]+) WRONG What is 11",
           r"\+([\d.]+) right What is 11")),
    Quote("02_reward_model", "As predicted:", r"([\d.]+)% at the first answer", 19,
          r"first answer token\s*: .* ([\d.]+)%"),
    Quote("02_reward_model", "As predicted:", r"([\d.]+)% half-way", 19, r"middle of the answer\s*: .* ([\d.]+)%"),
    Quote("02_reward_model", "As predicted:", r"([\d.]+)% at the end", 19, r"last token \(EOS\)\s*: .* ([\d.]+)%"),
    Quote("02_reward_model", "As predicted:", r"([\d.]+)% at the end, this short model's held-out", 13,
          r"saved to .*held-out pairwise accuracy ([\d.]+)%"),
    Quote("02_reward_model", "In this one run the prediction holds",
          r"\((\d+) steps, (\d+) pairs from (\d+) prompts\)", 13,
          (r"max_steps=(\d+)", r"\((\d+) from the policy\)", r"policy_prompts=(\d+)")),
    Quote("02_reward_model", "In this one run the prediction holds",
          r"own pairs worse \(([\d.]+)% and ([\d.]+)%, against ([\d.]+)% and ([\d.]+)%\)", 22,
          (r"synthetic pairs only +: held-out shipped pairs ([\d.]+)%, the policy's own \d+ pairs ([\d.]+)%",
           r"\+ pairs from \d+ prompts +: held-out shipped pairs ([\d.]+)%, the policy's own \d+ pairs ([\d.]+)%")),
    # 03: PPO
    Quote("03_ppo", "The actor *is* the reference", r"the KL term below is exactly (\d)", 8,
          r"max \|log pi - log pi_ref\| = ([\d.]+)"),
    Quote("03_ppo", "The ratio printed above is exactly", r"The ratio printed above is exactly (\d)", 18,
          r"max \|rho - 1\| = ([\d.e+-]+)", lambda q, p: float(q[0]) == 1 + float(p[0])),
    Quote("03_ppo", "λ = 1 spreads them most", r"\(std ([\d.]+), against ([\d.]+) at λ = 0 and ([\d.]+) at λ = 0\.95\)",
          26, (r"lam  1\.0: .*std ([\d.]+)", r"lam  0\.0: .*std ([\d.]+)", r"lam 0\.95: .*std ([\d.]+)")),
    Quote("03_ppo", "λ = 1 spreads them most", r"\(row 4: ([−\d.]+)\)", 26,
          r"lam  0\.0: first-token advantage per row \[(?:[-\d.]+, ){4}([-\d.]+),"),
    Quote("03_ppo", "λ = 1 spreads them most", r"for a (\d+)-token completion", 6, r"\((\d+) tokens, EOS included\)"),
    # 04: GRPO
    Quote("04_grpo", "Check the first group", r"(\w+) rewards of 2\.25 and (\w+) of 0\.25", 9,
          r"rewards    \[B, G\]\n tensor\(\[\[([^\]]*)\]",
          lambda q, p: [int(clean(w)) for w in q] == [p[0].count("2.250"), p[0].count("0.250")]),
    Quote("04_grpo", "Check the first group", r"so A = \S+ / [\d.]+ = (\S+) and \S+ / [\d.]+ = (\S+)\.", 9,
          ADVANTAGES_04,
          lambda q, p: same_number(q[0], advantage(p[0], 0, 0)) and same_number(q[1], advantage(p[0], 0, 1))),
    Quote("04_grpo", "Check the first group", r"every one gets A = (\S+): it teaches nothing", 9, ADVANTAGES_04,
          lambda q, p: all(same_number(q[0], advantage(p[0], 1, i)) for i in range(8))),
    Quote("04_grpo", "Check the first group", r"gets (\S+) for the right ones and (\S+) for the wrong one", 9,
          ADVANTAGES_04,
          lambda q, p: same_number(q[0], advantage(p[0], 2, 0)) and same_number(q[1], advantage(p[0], 2, 1))),
    Quote("04_grpo", "Check the first group", r"and gets (\S+), (\S+) and (\S+)\. \(", 9, ADVANTAGES_04,
          lambda q, p: [same_number(a, advantage(p[0], 3, i)) for a, i in zip(q, (2, 0, 3))] == [True] * 3),
    Quote("04_grpo", "Check the first group",
          r"both sums for this batch: ([\d.]+) for the first group .*?, (\d+) for the flat second, ([\d.]+) for the "
          r"third .*?, and ([\d.]+) for the last", 9,
          r"sum of \(r - mean\)\^2 per group: tensor\(\[ *([\d.]+), +([\d.]+), +([\d.]+), +([\d.]+)\]\)"),
    Quote("04_grpo", "Check the first group", r"\(([\d.]+) or ([\d.]+): the 10⁻⁴\) and (\d) for the flat one", 9,
          r"sum of A\^2 per group +: tensor\(\[(.*)\]\)",
          lambda q, p: {float(x) for x in q} == {float(x) for x in p[0].split(",")}),
    Quote("04_grpo", "One AdamW step at the run's peak", r"loss went from (\d) to (\S+) \(", 17,
          r"the batch's loss [+-]([\d.]+) -> (\S+) \("),
    Quote("04_grpo", "One AdamW step at the run's peak", r"\((\w+) identical rows, A = (\S+)\) fell \((\S+)\)",
          17, (r"0: A (\S+) .*\((\S+)\)", r"((?:\d: A .*\n)+)"),  # the count: the rows that moved as row 0 did
          lambda q, p: int(clean(q[0])) == p[2].count(f"({p[1]})") and same_number(q[1], p[0])
          and same_number(q[2], p[1])),
    Quote("04_grpo", "One AdamW step at the run's peak", r"the two penalised ones fell too \((\S+) and (\S+)\)", 17,
          (r"1: A .*\((\S+)\)", r"5: A .*\((\S+)\)")),
    Quote("04_grpo", "One AdamW step at the run's peak", r"\(k3 ([\d.e+-]+);", 17,
          r"k3 after one step .*: ([\d.e+-]+)"),
    Quote("04_grpo", "## A short run of `grpo.main`", r"in a loop: (\d+) steps of (\d+) prompts × (\d+)", 19,
          (LAST_STEP, r"activations of one micro-batch \((\d+) x"),
          lambda q, p: q[0] == p[0] and int(q[1]) * int(q[2]) == int(p[1])),
    Quote("04_grpo", "G = 2 leaves", r"G = 2 leaves (\w+) of the 16 groups", 25, r"G =  2: (\d+)%", percent_of_16),
    Quote("04_grpo", "G = 2 leaves", r"nothing to learn \((\d+)%\)", 25, r"G =  2: (\d+)%"),
    Quote("04_grpo", "G = 2 leaves", r"G = 8 and G = 16 (\w+) each \((\w+) of 16", 25,
          (r"G =  8: (\d+)%", r"G = 16: (\d+)%"), percent_of_16),
    Quote("04_grpo", "G = 2 leaves", r"printed as (\d+)%\)", 25, (r"G =  8: (\d+)%", r"G = 16: (\d+)%"),
          lambda q, p: p == (q[0], q[0])),
    Quote("04_grpo", "G = 2 leaves", r"turned (\w+) prompts into signal", 25, (r"G =  2: (\d+)%", r"G =  8: (\d+)%"),
          lambda q, p: int(clean(q[0])) == round(16 * int(p[0]) / 100) - round(16 * int(p[1]) / 100)),
    Quote("04_grpo", "G = 2 leaves", r"going from 8 to 16 turned (none)", 25, (r"G =  8: (\d+)%", r"G = 16: (\d+)%"),
          lambda q, p: p[0] == p[1]),
    Quote("04_grpo", "the clip acts: `clip_fraction` goes",
          r"goes from (\d) to ([\d.]+) and ([\d.]+) at the second and third updates, then falls a little at the "
          r"fourth \(([\d.]+)\)", 28, tuple(rf"update {n}: clip_fraction ([\d.]+)" for n in range(1, 5))),
    Quote("04_grpo", "the policy trained with the KL term",
          r"\(k3 ([\d.]+) against ([\d.]+) with beta 0\) after the same (\d+) steps", 31,
          (r"beta 0\.04: k3 .*? ([\d.]+)\n", r"beta 0\.0: k3 .*? ([\d.]+)\n", r"after (\d+) steps")),
    # 05: MIX
    Quote("05_mix", "With a batch of 32 rows",
          r"= (\d+) rows are expert answers and the other (\d+) are (\d+) prompts × G = (\d+)", 5,
          r"(\d+) prompts x (\d+) rollouts \+ (\d+) expert rows",
          lambda q, p: (q[0], q[2], q[3]) == (p[2], p[0], p[1]) and int(q[1]) == int(p[0]) * int(p[1])),
    Quote("05_mix", "One AdamW step at the run's peak", r"here (\d+) of the (\d+) rise", 13, r"(\d+) of (\d+) up"),
    Quote("05_mix", "One AdamW step at the run's peak",
          r"A < 0 fall most \((\S+) on average\); those with A > 0 fall a little too \((\S+)\).*?on average \((\S+);",
          13, (r"A < 0: mean change of log pi\(o\|q\) (\S+)", r"A > 0: mean change of log pi\(o\|q\) (\S+)",
               r"expert answers: +mean change of log pi\(o\|q\) (\S+),")),
    Quote("05_mix", "README-scale run", r"(\d+) steps of \d+ rows \((\d+) rollouts \+ (\d+) expert answers", 15,
          (LAST_STEP, r"activations of one micro-batch \((\d+) x", r"mix: (\d+) expert rows per step"),
          lambda q, p: q[0] == p[0] and int(q[1]) + int(q[2]) == int(p[1]) and q[2] == p[2]),
    Quote("05_mix", "the expert rows take batch space", r"0\.5 leaves (\d+) rollout rows, (\w+) prompts of G = (\d+)",
          19, r"expert_data_ratio 0\.5: (\d+) expert rows, (\d+) prompts x G = (\d+)",
          lambda q, p: int(q[0]) == 32 - int(p[0]) and int(clean(q[1])) == int(p[1]) and q[2] == p[2]),
    # 06: the comparison
    Quote("06_compare", "Two differences show", r"a wrong number \((\S+)\), so every one", 3, r"reward (\S+) WRONG"),
    Quote("06_compare", "With the group's std", r"squared advantages, ([\d.]+) = G − 1", 17,
          r"scale_rewards group: sum of A\^2 ([\d.]+) \(7 right\), ([\d.]+) \(4 right\)",
          lambda q, p: same_number(q[0], p[0]) and same_number(q[0], p[1])),
    Quote("06_compare", "With the group's std", r"easy group carries ([\d.]+) against the 50/50 group's ([\d.]+)", 17,
          r"scale_rewards none : sum of A\^2 ([\d.]+) \(7 right\), ([\d.]+) \(4 right\)"),
    Quote("06_compare", "With the group's std", r"with the division \((\S+) against (\S+)\)", 17,
          SUMS_06.format("group")),
    Quote("06_compare", "With the group's std", r"without it \((\S+) against (\S+)\)", 17, SUMS_06.format("none ")),
    Quote("06_compare", "With the group's std", r"pushed down ([\d.]+) times as hard", 17, SUMS_06.format("group"),
          ratio_of),
    Quote("06_compare", "With the group's std", r", ([\d.]+) times without it", 17, SUMS_06.format("none "), ratio_of),
    # 07: DPO
    Quote("07_dpo", "Four numbers make a pair", r"implicit rewards are (\S+) and (\S+)\.", 3,
          r"implicit rewards +tensor\(\[ *(\S+), *(\S+)\]\)"),
    Quote("07_dpo", "Four numbers make a pair", r"The loss is −log σ\(0\.2\) = ([\d.]+)\.", 3, r"loss +([\d.]+)"),
    Quote("07_dpo", "Four numbers make a pair", r"= (\S+), and (\S+) for log π\(y_r\)", 3,
          (r"d loss / d logp_c +(\S+)", r"d loss / d logp_r +(\S+)")),
    Quote("07_dpo", "A real pair, scored by the SFT policy", r"the loss is log 2 = ([\d.]+)", 5,
          r"loss ([\d.]+) +\(log 2"),
    Quote("07_dpo", "Now `dpo.main` itself", r"(\d+) steps of \d+ pairs, the held-out accuracy measured on (\d+)", 9,
          (LAST_STEP, r"\(n=(\d+)\)")),
    Quote("07_dpo", "What these runs show",
          r"falls with it, ([\d.]+)% -> ([\d.]+)% greedy and ([\d.]+)% -> ([\d.]+)% sampled in (\d+)", 9,
          (r"offline +held-out sampled accuracy .*greedy ([\d.]+)% -> ([\d.]+)%",
           r"offline +held-out sampled accuracy ([\d.]+)% -> ([\d.]+)%", LAST_STEP)),
    Quote("07_dpo", "What these runs show", r"\(([\d.]+)% -> ([\d.]+)% sampled, ([\d.]+)% -> ([\d.]+)% greedy\)", 9,
          (r"online +held-out sampled accuracy ([\d.]+)% -> ([\d.]+)%",
           r"online +held-out sampled accuracy .*greedy ([\d.]+)% -> ([\d.]+)%")),
    Quote("07_dpo", "What these runs show", r"samples a right answer about one time in (\w+),", 9,
          r"online +held-out sampled accuracy ([\d.]+)%", lambda q, p: int(clean(q[0])) == round(100 / float(p[0]))),
    Quote("09_agent", "With `policy_mask` the gradient is exactly",
          r"the gradient is exactly (\d) at every calculator position", 15,
          r"with policy_mask \(agent\.py\).*\n  calculator positions: \d+, with a nonzero gradient: (\d+)"),
    Quote("10_process", "The first line is right", r"which ends at character (\d+) of the answer", 3,
          r"'4\+8=12'\s+ends at character\s+(\d+)"),
    Quote("08_best_of_n", "pass@k by hand", r"For k = 2: 1 − 10/28 = ([\d.]+)\.", 3, r"k=2: formula ([\d.]+)"),
    Quote("08_best_of_n", "pass@1 is c/n", r"pass@1 is c/n = ([\d.]+),", 3, r"k=1: formula ([\d.]+)",
          lambda q, p: float(q[0]) == float(p[0])),
    Quote("08_best_of_n", "With one sample the kept answer", r"right half the time \(3 of 6\)\. Two samples do "
          r"better, ([\d.]+):", 6, r"N=2: formula ([\d.]+)", lambda q, p: float(q[0]) == float(p[0])),
    Quote("08_best_of_n", "What to look for", r"([\d.]+)% with one sample, ([\d.]+)% with sixteen", 9,
          (r"pass@k: \{'1': ([\d.]+)", r"'16': ([\d.]+)\}")),
    Quote("08_best_of_n", "What to look for",
          r"at N = 2, 4 and 8 its kept answer is right ([\d.]+)%, ([\d.]+)% and ([\d.]+)% of the time, against "
          r"([\d.]+)% for one sample", 9,
          tuple(rf"best of +{n} by the reward model: +([\d.]+)% right" for n in (2, 4, 8, 1))),
    Quote("08_best_of_n", "What to look for", r"gaps of (\S+), (\S+) and (\S+) points", 9,  # N = 2, 4, 8 minus N = 1
          tuple(rf"best of +{n} by the reward model: +([\d.]+)% right" for n in (2, 4, 8, 1)),
          lambda q, p: all(same_number(a, f"{float(b) - float(p[3]):.1f}") for a, b in zip(q, p[:3], strict=True))),
    Quote("08_best_of_n", "What to look for", r"\(([\d.]+)% at N = 16, (\S+) points\)", 9,
          tuple(rf"best of +{n} by the reward model: +([\d.]+)% right" for n in (16, 1)),
          lambda q, p: same_number(q[0], p[0]) and same_number(q[1], f"{float(p[0]) - float(p[1]):.1f}")),
    Quote("08_best_of_n", "What to look for", r"ranks ([\d.]+)% of the policy's own pairs right",
          ("02_reward_model", 13), RM_SAVED),
    Quote("08_best_of_n", "Best-of-N and pass@k", r"SFT policy \(([\d.]+)% greedy / ([\d.]+)% sampled",
          ("01_sft", 15), SFT_SAVED),
]

# Figures the notebooks quote from the README or docs/classic_rlhf.md (the runs they were measured in).
CLASSIC = os.path.join("docs", "classic_rlhf.md")
SEED_2_ROW = r"\| pairs from {} \| [\d.]+ / ([\d.]+) \| [\d.]+ \| ([+-][\d.]+) \|"
PAGE_QUOTES = [
    Quote("01_sft", "A short run of `sft.main`", r"the README's full run is (\d+)\)", "README.md",
          r"`python sft.py` \((\d+) steps"),
    Quote("02_reward_model", "This short reward model", r"ranks ([\d.]+)% of the policy's pairs right", CLASSIC,
          r"([\d.]+)% on pairs of the SFT policy's own samples"),
    Quote("02_reward_model", "In this one run the prediction holds",
          r"\(([\d.]+)% to ([\d.]+)%\), and PPO's gain with it \(from (\S+) to (\S+) points at the same 80 PPO steps; "
          r"(\S+) with 120\)", CLASSIC,
          (SEED_2_ROW.format(r"500 prompts, 300 steps; 80 PPO steps \(old defaults\)"),
           SEED_2_ROW.format(r"3000 prompts, 600 steps"), r"\| the same, 120 PPO steps .*\| ([+-][\d.]+) \|\n"),
          lambda q, p: [same_number(a, b) for a, b in zip(q, (p[0], p[2], p[1], p[3], p[4]))] == [True] * 5),
    Quote("03_ppo", "## A short run of `ppo.main`", r"the README's run is (\d+) steps of (\d+) prompts",
          "README.md", r"`python ppo.py` \((\d+) steps of (\d+) prompts\)"),
    Quote("04_grpo", "## A short run of `grpo.main`",
          r"the README's run: (\d+) steps of (\d+) × (\d+), \+([\d.]+) points", "README.md",
          (r"`python grpo.py` \((\d+) steps of (\d+) prompts x (\d+) samples\)", r"GRPO adds \*\*([\d.]+) points")),
    Quote("05_mix", "README-scale run", r"the README-scale run uses (\d+) rows", "README.md",
          r"`python mix.py` \(\d+ steps of (\d+) prompts x (\d+) samples \+ (\d+) expert answers\)",
          lambda q, p: int(q[0]) == int(p[0]) * int(p[1]) + int(p[2])),
]


def load(notebook: str) -> dict:
    with open(os.path.join(ROOT, "notebooks", notebook + ".ipynb"), encoding="utf-8") as f:
        return json.load(f)


def printed_text(cell: dict) -> str:
    """What a code cell's committed outputs print: streams, and the text of its results."""
    assert cell["cell_type"] == "code"
    parts = []
    for output in cell.get("outputs", []):
        parts.append("".join(output.get("text", "")))
        parts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def markdown_cell(nb: dict, phrase: str) -> tuple[int, str]:
    """The index and text of the one markdown cell that contains phrase."""
    found = [(i, "".join(cell["source"])) for i, cell in enumerate(nb["cells"])
             if cell["cell_type"] == "markdown" and phrase in "".join(cell["source"])]
    assert len(found) == 1, f"{len(found)} markdown cells contain {phrase!r}: update this test's table"
    return found[0]


def mismatch(nb: dict, quote: Quote) -> str | None:
    """None if the quoted numbers are the printed (or the page's) ones, else what differs."""
    index, text = markdown_cell(nb, quote.phrase)
    where = f"{quote.notebook} markdown cell {index}"
    quoted = re.search(quote.quoted, re.sub(r"\s+", " ", text))
    if not quoted:
        return f"{where}: no {quote.quoted!r} in its text: the sentence moved or changed; update this test"
    if isinstance(quote.source, int):
        source, origin = printed_text(nb["cells"][quote.source]), f"cell {quote.source}'s output"
    elif isinstance(quote.source, tuple):
        other, cell = quote.source
        source, origin = printed_text(load(other)["cells"][cell]), f"{other} cell {cell}'s output"
    else:
        with open(os.path.join(ROOT, quote.source), encoding="utf-8") as f:
            source, origin = f.read(), quote.source
    printed = []
    for pattern in (quote.printed,) if isinstance(quote.printed, str) else quote.printed:
        match = re.search(pattern, source)
        if not match:
            return f"{where}: {origin} has no {pattern!r}: update this test"
        printed += match.groups()
    q, p = quoted.groups(), tuple(printed)
    if quote.check:
        ok = quote.check(q, p)
    else:
        ok = len(q) == len(p) and all(same_number(a, b) for a, b in zip(q, p))
    return None if ok else f"{where} quotes {q} ({quoted.group(0)!r}) but {origin} gives {p}"


@pytest.mark.parametrize("quote", QUOTES + PAGE_QUOTES, ids=lambda q: f"{q.notebook}:{q.phrase[:30]}")
def test_quoted_number_is_the_printed_one(quote):
    problem = mismatch(load(quote.notebook), quote)
    assert problem is None, problem


def test_every_notebook_has_its_quotes_checked():
    notebooks = sorted(name[:-6] for name in os.listdir(os.path.join(ROOT, "notebooks")) if name.endswith(".ipynb"))
    assert sorted({quote.notebook for quote in QUOTES}) == notebooks


def test_a_changed_number_fails():
    """The check can fail: the same table against a notebook whose quoted figure was edited in memory."""
    quote = next(q for q in QUOTES if q.phrase == "G = 2 leaves" and "(\\d+)%\\)" in q.quoted)
    nb = load(quote.notebook)
    index, text = markdown_cell(nb, quote.phrase)
    assert mismatch(nb, quote) is None
    nb["cells"][index]["source"] = [text.replace("nothing to learn (69%)", "nothing to learn (25%)")]
    assert "quotes ('25',)" in mismatch(nb, quote)
    assert not same_number("0.72", "0.735") and same_number("0.72", "0.724") and same_number("−0.014", "-0.0142")
    assert same_number("2.5e-02", "2.5e-02") and not same_number("2.5e-02", "2.6e-02")


def check_slips(nb: dict):
    """Notebook 01's account of the trained model's slips quotes the greedy completions printed right below it:
    every code span in the prose is in those completions (and in the one of the question its sentence names),
    every answer it gives is that completion's <answer>, and every wrong subtraction is described."""
    index, text = markdown_cell(nb, "What the trained model writes")
    output = printed_text(nb["cells"][index + 1])
    for span in re.findall(r"`([^`]+)`", text):
        assert span in output, f"01 cell {index} quotes `{span}`, which cell {index + 1}'s completions do not contain"
    lines = {m.group(1): line for line in output.splitlines() if (m := re.search(r"What is (\d+ [+-] \d+)\?", line))}
    additions = [line for question, line in lines.items() if "+" in question]
    subtractions = [line for question, line in lines.items() if "-" in question]
    counts = re.search(r"here all (\w+) additions\s+are right and all (\w+) subtractions wrong", text).groups()
    assert [WORDS[c] for c in counts] == [len(additions), len(subtractions)]
    assert all(line.startswith("right") for line in additions)
    assert all(line.startswith("WRONG") for line in subtractions)
    described = set()
    for a, b, sentence, answer in re.findall(r"For (\d+) − (\d+)(.*?)answer (−?\d+)\)", text, re.DOTALL):
        assert f"{a} - {b}" in lines, f"01 cell {index} describes {a} − {b}, which cell {index + 1} does not print"
        line = lines[f"{a} - {b}"]
        described.add(f"{a} - {b}")
        for span in re.findall(r"`([^`]+)`", sentence):
            assert span in line, f"01 cell {index} quotes `{span}` for {a} − {b}; cell {index + 1} prints {line!r}"
        assert f"<answer>{clean(answer)}</answer>" in line, f"01 cell {index}: answer {answer} for {a} − {b}: {line!r}"
    wrong = {question for question, line in lines.items() if line.startswith("WRONG")}
    assert described == wrong, f"01 cell {index} describes the slips of {sorted(described)}; {sorted(wrong)} are wrong"


def test_01_slips_are_what_the_greedy_answers_print():
    check_slips(load("01_sft"))


def test_a_changed_slip_fails():
    """The slips' check can fail: a code span or an answer the completions do not contain."""
    nb = load("01_sft")
    index, text = markdown_cell(nb, "What the trained model writes")
    for old, new in (("`9-2=7`", "`8-2=7`"), ("(answer −8)", "(answer −7)")):
        assert old in text
        nb["cells"][index]["source"] = [text.replace(old, new)]
        with pytest.raises(AssertionError):
            check_slips(nb)


def test_every_notebook_uses_the_checkpoints_01_and_02_made():
    """Notebooks 01 to 08's committed outputs come from one SFT checkpoint and one reward model: notebook 01's
    output trains out/notebooks/sft and 02's trains out/notebooks/rm, no later notebook's output trains either
    again, and notebook 08, which quotes 01's and 02's printed accuracies as its own checkpoints', reuses both."""
    notebooks = sorted(name[:-6] for name in os.listdir(os.path.join(ROOT, "notebooks")) if name.endswith(".ipynb"))
    printed = {name: [printed_text(c) for c in load(name)["cells"] if c["cell_type"] == "code"] for name in notebooks}
    assert re.search(SFT_SAVED, printed_text(load("01_sft")["cells"][15]))
    assert re.search(RM_SAVED, printed_text(load("02_reward_model")["cells"][13]))
    for name, outputs in printed.items():
        trained = [d for d in ("sft", "rm") if any(f"saved to out/notebooks/{d};" in text for text in outputs)]
        assert trained == {"01_sft": ["sft"], "02_reward_model": ["rm"]}.get(name, []), \
            f"{name}'s committed outputs train {trained}: its numbers come from checkpoints of their own"
    setup = printed_text(load("08_best_of_n")["cells"][1])
    assert "reusing out/notebooks/sft " in setup and "reusing out/notebooks/rm " in setup
    _, text = markdown_cell(load("08_best_of_n"), "Best-of-N and pass@k")
    assert "another machine" not in text


def test_the_exercise_sheet_is_the_notebooks_experiments():
    """docs/exercises.md is what docs/exercises.py writes from the notebooks' "What if you change it?" cells."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("exercises", os.path.join(ROOT, "docs", "exercises.py"))
    exercises = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exercises)
    with open(exercises.OUT, encoding="utf-8") as f:
        assert f.read() == exercises.page(), "docs/exercises.md is out of date: run python docs/exercises.py"
    assert sum(len(exercises.experiments(os.path.join(ROOT, "notebooks", f"{name}.ipynb")))
               for name in ("01_sft", "04_grpo")) == 5  # two in 01, three in 04
