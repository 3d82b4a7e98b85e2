"""Generate the shipped arithmetic data in GSM8K's schema (deterministic).

Each row is {"question": ..., "answer": <worked reasoning> "\n#### <number>"}, exactly the
columns of openai/gsm8k, so every script reads it with the same loader as the hub dataset.
The reasoning works column by column from the right, the way a person adds or subtracts on
paper; that chain of thought is what lets a 1M-parameter model get the sums right.

Two folders, as in a real RLHF pipeline where demonstrations and RL prompts are different data:

    data/demos/       SFT demonstrations written by a careless teacher: in a fraction
                      (--careless) of them the teacher forgets the first carry or borrow (the
                      final number follows the slip) and, on a negative result, the minus sign.
                      SFT imitates the teacher, slips included.
    data/arithmetic/  problems with their true answers: RL prompts and the reward's ground truth.
    data/preference/  reward-model pairs in Dahoas/rm-static's schema (prompt, chosen, rejected):
                      chosen is right, rejected a plausible mistake (see make_pair).
    data/expert.jsonl MIX's expert data (note 001): correct worked solutions, as a strong model
                      would write them, in the chat `messages` format (see expert_row).
    data/tool_demos/  agent.py's SFT demonstrations: data/demos with a share (--tool_share) of its
                      rows replaced by a transcript that calls the calculator, <calc>a op b</calc>
                      <result>c</result> (see calculator_row); the other rows slip as before.

The folders hold train.jsonl and a held-out test.jsonl on the same test problems; no problem
appears in two of {demos train, arithmetic train, preference train, expert, test}.

    python data/make_data.py                          # the shipped set: 2-digit + and -
    python data/make_data.py --digits 3               # harder: 3-digit operands
    python data/make_data.py --careless 0 --out /tmp/data   # a perfect teacher, elsewhere

Difficulty knobs: --digits (operand size) and --ops (which of + and - appear).
"""
import argparse
import json
import os
import random


def off_by_one(digit: int) -> int:
    """A slipped digit: one more, or one less for a 9 (so a slip never creates a carry)."""
    return digit + 1 if digit % 10 != 9 else digit - 1


def add_steps(a: int, b: int, careless=False, wrong_column=None) -> tuple[list[str], int]:
    """Column addition, ones first: '7+5=12' then '4+8+1=13' (the +1 is the carry).

    The result reads off the lines: the last line's sum, then each earlier line's last digit
    (47 + 85 -> '13' '2' -> 132). A careless writer forgets the first carry ('4+8=12' -> 122);
    `wrong_column` (0 = ones) gets a sum off by one ('7+5=13' -> 133)."""
    steps, sums, carry = [], [], 0
    for column in range(len(str(max(a, b)))):  # one line per column
        if carry and careless:
            carry, careless = 0, False
        da, db = a % 10, b % 10
        s = da + db + carry
        if column == wrong_column:
            s = off_by_one(s)
        steps.append(f"{da}+{db}" + (f"+{carry}" if carry else "") + f"={s}")
        sums.append(s)
        carry, a, b = s // 10, a // 10, b // 10
    return steps, int(str(sums[-1]) + "".join(str(s % 10) for s in reversed(sums[:-1])))


def sub_steps(a: int, b: int, careless=False, wrong_column=None) -> tuple[list[str], int]:
    """Column subtraction of a >= b, ones first: '12-7=5' borrows ten, the next column pays '-1'.

    A careless writer forgets to pay the first borrow back ('7-2=5' instead of '7-2-1=4');
    `wrong_column` (0 = ones) gets a difference off by one."""
    steps, digits, borrow = [], [], 0
    for column in range(len(str(a))):  # one line per column of the larger number
        if borrow and careless:
            borrow, careless = 0, False
        da, db = a % 10, b % 10
        top = da - borrow
        borrow = 1 if top < db else 0
        digits.append(top + 10 * borrow - db)
        if column == wrong_column:
            digits[-1] = off_by_one(digits[-1])
        steps.append(f"{da + 10 * borrow}-{db}" + ("-1" if top != da else "") + f"={digits[-1]}")
        a, b = a // 10, b // 10
    return steps, int("".join(str(d) for d in reversed(digits)))


def solve(a: int, op: str, b: int, careless=False, wrong_column=None) -> tuple[str, int]:
    """Worked reasoning (one line per column) and the result of `a op b` it arrives at: the true
    result, unless `careless` made it drop the first carry or borrow, or the minus sign, or
    `wrong_column` slipped a digit."""
    if op == "+":
        steps, result = add_steps(a, b, careless, wrong_column)
        return "\n".join(steps), result
    if a >= b:
        steps, result = sub_steps(a, b, careless, wrong_column)
        return "\n".join(steps), result
    # a < b: say so, then subtract the other way round and negate (a careless writer forgets to).
    steps, result = sub_steps(b, a, careless, wrong_column)
    return f"{a}<{b} so -({b}-{a})\n" + "\n".join(steps), result if careless else -result


def problem_kind(a: int, op: str, b: int) -> str:
    """Which slip of the careless teacher a problem leaves room for: 'carry' or 'no carry' (a sum
    that carries, so that forgetting it changes the result, or not), 'negative' (a < b: the minus
    sign), 'borrow' or 'no borrow' (a difference a >= b that borrows, or not)."""
    if op == "-" and a < b:
        return "negative"
    slips = solve(a, op, b, careless=True)[1] != solve(a, op, b)[1]
    return ("" if slips else "no ") + ("carry" if op == "+" else "borrow")


def make_row(a: int, op: str, b: int, careless=False) -> dict:
    reasoning, result = solve(a, op, b, careless)
    return {"question": f"What is {a} {op} {b}?", "answer": f"{reasoning}\n#### {result}"}


def completion(reasoning: str, result) -> str:
    """What the policy writes (note 002's format): <think>reasoning</think><answer>number</answer>."""
    return f"<think>{reasoning}</think><answer>{result}</answer>"


def calculator_row(a: int, op: str, b: int) -> dict:
    """A demonstration in which the teacher calls the calculator instead of working the columns:
    the call, the calculator's reply (the transcript holds it, as agent.py's rollout appends it),
    and the result copied into the answer. The calculator does not slip, so neither does this row."""
    result = a + b if op == "+" else a - b
    return {"question": f"What is {a} {op} {b}?",
            "answer": f"<calc>{a}{op}{b}</calc><result>{result}</result>\n#### {result}"}


def expert_row(a: int, op: str, b: int) -> dict:
    """One expert demonstration in note 001's chat format: the user's question and the assistant's
    correct worked answer. There is no system message because the tiny model's prompts have none;
    a file for a hub model would start each row with {"role": "system", "content": ...}."""
    return {"messages": [{"role": "user", "content": f"What is {a} {op} {b}?"},
                         {"role": "assistant", "content": completion(*solve(a, op, b))}]}


REJECTED_KINDS = {"careless": 0.35, "digit": 0.25, "final": 0.25, "format": 0.15}


def make_pair(a: int, op: str, b: int, kind: str, rng: random.Random) -> dict:
    """A preference pair in Dahoas/rm-static's schema: prompt, chosen (right), rejected (a
    plausible wrong answer of the given kind, the mistakes a policy makes):

        careless  the careless teacher's slip: a forgotten carry, borrow or minus sign
        digit     one column's result off by one; the final number follows the slip
        final     every line right, but the final number has one digit changed (a hard negative:
                  only reading the reasoning tells it from the chosen answer)
        format    the right number in a broken format (a missing tag, or text after the answer)
    """
    reasoning, result = solve(a, op, b)
    chosen = completion(reasoning, result)
    if kind == "careless" and solve(a, op, b, careless=True)[1] == result:
        kind = "digit"  # no carry, borrow or sign to forget in this problem
    if kind == "careless":
        rejected = completion(*solve(a, op, b, careless=True))
    elif kind == "digit":
        rejected = completion(*solve(a, op, b, wrong_column=rng.randrange(len(str(max(a, b))))))
    elif kind == "final":
        digits = list(str(abs(result)))
        i = rng.randrange(len(digits))
        digits[i] = str(off_by_one(int(digits[i])) % 10)
        rejected = completion(reasoning, ("-" if result < 0 else "") + "".join(digits))
    else:
        rejected = rng.choice([
            f"<think>{reasoning}<answer>{result}</answer>",  # no </think>
            f"<think>{reasoning}</think>{result}",  # no <answer> tags
            f"{reasoning}</think><answer>{result}</answer>",  # no <think>
            f"<think>{reasoning}</think><answer>{result}</answer>{result}",  # text after the answer
        ])
    return {"prompt": f"What is {a} {op} {b}?", "chosen": chosen, "rejected": rejected}


def all_problems(digits: int, ops: str) -> list[tuple[int, str, int]]:
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits
    return [(a, op, b) for op in ops for a in range(lo, hi) for b in range(lo, hi)]


def write_jsonl(path: str, rows: list[dict]):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--digits", type=int, default=2, help="digits per operand")
    p.add_argument("--ops", default="+-", help="operations to draw from, any of '+-'")
    p.add_argument("--careless", type=float, default=0.35,
                   help="fraction of demonstrations with a forgotten carry/borrow/minus sign")
    p.add_argument("--n_demos", type=int, default=6000, help="SFT demonstrations (data/demos/train.jsonl)")
    p.add_argument("--n_train", type=int, default=4000, help="RL problems (data/arithmetic/train.jsonl)")
    p.add_argument("--n_pairs", type=int, default=3000, help="reward-model pairs (data/preference/train.jsonl)")
    p.add_argument("--n_expert", type=int, default=2000, help="MIX expert demonstrations (data/expert.jsonl)")
    p.add_argument("--n_test", type=int, default=500, help="held-out test problems (both folders' test.jsonl)")
    p.add_argument("--tool_share", type=float, default=0.5,
                   help="fraction of data/tool_demos rows in which the teacher calls the calculator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                   help="folder for demos/, arithmetic/, preference/ and expert.jsonl")
    args = p.parse_args()
    if not set(args.ops) <= set("+-") or not args.ops:
        p.error("--ops takes a non-empty mix of '+' and '-'")
    if not 0 <= args.careless <= 1:
        p.error("--careless is a fraction in [0, 1]")
    if not 0 <= args.tool_share <= 1:
        p.error("--tool_share is a fraction in [0, 1]")

    problems = all_problems(args.digits, args.ops)
    random.Random(args.seed).shuffle(problems)
    sizes = [args.n_test, args.n_demos, args.n_train, args.n_pairs, args.n_expert]
    if sum(sizes) > len(problems):
        p.error(f"only {len(problems)} distinct problems exist for --digits {args.digits} --ops {args.ops}")
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    test, demos, train, pairs, expert = (problems[end - size : end] for size, end in zip(sizes, ends))

    slips = random.Random(args.seed + 1)
    test_rows = [make_row(a, op, b) for a, op, b in test]
    demo_rows = [make_row(a, op, b, careless=slips.random() < args.careless) for a, op, b in demos]
    write_jsonl(os.path.join(args.out, "demos", "train.jsonl"), demo_rows)
    write_jsonl(os.path.join(args.out, "demos", "test.jsonl"), test_rows)
    calls = random.Random(args.seed + 3)  # its own draws: every other file is the same with or without it
    write_jsonl(os.path.join(args.out, "tool_demos", "train.jsonl"), [
        calculator_row(*abc) if calls.random() < args.tool_share else row for abc, row in zip(demos, demo_rows)])
    write_jsonl(os.path.join(args.out, "tool_demos", "test.jsonl"), test_rows)
    write_jsonl(os.path.join(args.out, "arithmetic", "train.jsonl"), [make_row(a, op, b) for a, op, b in train])
    write_jsonl(os.path.join(args.out, "arithmetic", "test.jsonl"), test_rows)

    kinds = random.Random(args.seed + 2)
    draw = lambda: kinds.choices(list(REJECTED_KINDS), weights=list(REJECTED_KINDS.values()))[0]  # noqa: E731
    write_jsonl(os.path.join(args.out, "preference", "train.jsonl"), [make_pair(*abc, draw(), kinds) for abc in pairs])
    write_jsonl(os.path.join(args.out, "preference", "test.jsonl"), [make_pair(*abc, draw(), kinds) for abc in test])
    write_jsonl(os.path.join(args.out, "expert.jsonl"), [expert_row(a, op, b) for a, op, b in expert])


if __name__ == "__main__":
    main()
