"""Generate the shipped arithmetic data in GSM8K's schema (deterministic).

Each row is {"question": ..., "answer": <worked reasoning> "\n#### <number>"}, exactly the
columns of openai/gsm8k, so every script reads it with the same loader as the hub dataset.
The reasoning works column by column from the right, the way a person adds or subtracts on
paper; that chain of thought is what lets a 1M-parameter model get the sums right.

    python data/make_data.py                          # the shipped set: 2-digit + and -
    python data/make_data.py --digits 3 --ops +-      # harder: 3-digit, mixed
    python data/make_data.py --out data/my_task       # write somewhere else

Difficulty knobs: --digits (operand size) and --ops (which of + and - appear).
Train and test problems are disjoint (no (a, op, b) appears in both).
"""
import argparse
import json
import os
import random


def add_steps(a: int, b: int) -> list[str]:
    """Column addition, ones first: '7+5=12' then '4+8+1=13' (the +1 is the carry).

    The result reads off the lines: the last line's sum, then each earlier line's last digit
    (47 + 85 -> '13' '2' -> 132)."""
    steps, carry = [], 0
    for _ in range(len(str(max(a, b)))):  # one line per column
        da, db = a % 10, b % 10
        s = da + db + carry
        steps.append(f"{da}+{db}" + (f"+{carry}" if carry else "") + f"={s}")
        carry, a, b = s // 10, a // 10, b // 10
    return steps


def sub_steps(a: int, b: int) -> list[str]:
    """Column subtraction of a >= b, ones first: '12-7=5' borrows ten, the next column pays '-1'."""
    steps, borrow = [], 0
    for _ in range(len(str(a))):  # one line per column of the larger number
        da, db = a % 10, b % 10
        top = da - borrow
        borrow = 1 if top < db else 0
        line = f"{da + 10 * borrow}-{db}" + ("-1" if top != da else "") + f"={top + 10 * borrow - db}"
        steps.append(line)
        a, b = a // 10, b // 10
    return steps


def solve(a: int, op: str, b: int) -> tuple[str, int]:
    """Worked reasoning (one line per column) and the result of `a op b`."""
    if op == "+":
        return "\n".join(add_steps(a, b)), a + b
    if a >= b:
        return "\n".join(sub_steps(a, b)), a - b
    # a < b: say so, then subtract the other way round and negate.
    return f"{a}<{b} so -({b}-{a})\n" + "\n".join(sub_steps(b, a)), a - b


def make_row(a: int, op: str, b: int) -> dict:
    reasoning, result = solve(a, op, b)
    return {"question": f"What is {a} {op} {b}?", "answer": f"{reasoning}\n#### {result}"}


def all_problems(digits: int, ops: str) -> list[tuple[int, str, int]]:
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits
    return [(a, op, b) for op in ops for a in range(lo, hi) for b in range(lo, hi)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--digits", type=int, default=2, help="digits per operand")
    p.add_argument("--ops", default="+-", help="operations to draw from, any of '+-'")
    p.add_argument("--n_train", type=int, default=6000, help="training problems")
    p.add_argument("--n_test", type=int, default=500, help="held-out test problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "arithmetic"))
    args = p.parse_args()
    if not set(args.ops) <= set("+-") or not args.ops:
        p.error("--ops takes a non-empty mix of '+' and '-'")

    problems = all_problems(args.digits, args.ops)
    random.Random(args.seed).shuffle(problems)
    if args.n_train + args.n_test > len(problems):
        p.error(f"only {len(problems)} distinct problems exist for --digits {args.digits} --ops {args.ops}")
    splits = {"test": problems[: args.n_test], "train": problems[args.n_test : args.n_test + args.n_train]}

    os.makedirs(args.out, exist_ok=True)
    for name, rows in splits.items():
        path = os.path.join(args.out, f"{name}.jsonl")
        with open(path, "w") as f:
            for a, op, b in rows:
                f.write(json.dumps(make_row(a, op, b)) + "\n")
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
