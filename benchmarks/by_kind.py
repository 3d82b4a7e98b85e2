"""Held-out accuracy by kind of problem: which sums a model gets right, and which it never does.

    python benchmarks/by_kind.py SFT=out/sft GRPO=out/grpo [--num_eval_examples 64] [--output by_kind.json]

A total accuracy hides where it comes from. The shipped problems fall into five kinds, one for each
slip of the careless teacher (data/make_data.py, problem_kind): sums that carry and sums that do not,
differences that borrow and differences that do not, and negative results. A model that never carries
still gets every sum without a carry right; docs/real_models.md shows SmolLM2's GRPO runs ending
exactly there. Each kind's held-out problems go through common.evaluate, the training scripts' own
evaluation (greedy, and the mean of 4 samples at temperature 1), at the same seed for every model.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "data")]
import common  # noqa: E402
from make_data import problem_kind  # noqa: E402

KINDS = ["no carry", "carry", "no borrow", "borrow", "negative"]


def kind_of(question: str) -> str:
    """The kind of a shipped question, 'What is 47 + 85?' -> 'carry'; ValueError for any other question."""
    a, op, b = question.removeprefix("What is ").removesuffix("?").split()
    if op not in "+-" or not (a.isdigit() and b.isdigit()):
        raise ValueError(question)
    return problem_kind(int(a), op, int(b))


def accuracy_by_kind(model, tokenizer, test, max_new_tokens: int, seed: int) -> dict:
    """{kind: {"n", "accuracy_greedy", "accuracy_sampled"}} for each kind present, and "all": the kinds'
    accuracies weighted by their counts (greedy: what one evaluation of every problem gives)."""
    kinds = [kind_of(q) for q in test["question"]]
    result = {}
    for kind in KINDS:
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if rows:
            common.set_seed(seed)
            result[kind] = common.evaluate(model, tokenizer, test.select(rows), max_new_tokens)
    n = sum(r["n"] for r in result.values())
    result["all"] = {"n": n, **{key: sum(r[key] * r["n"] for r in result.values()) / n
                                for key in ("accuracy_greedy", "accuracy_sampled")}}
    return result


def table(results: dict) -> str:
    """A markdown table: one row per kind, greedy / sampled accuracy (%) of each model."""
    labels = list(results)
    counts = next(iter(results.values()))
    lines = ["| kind | problems | " + " | ".join(f"{label}: greedy / sampled" for label in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for kind in counts:
        cells = [f"{100 * r[kind]['accuracy_greedy']:.1f} / {100 * r[kind]['accuracy_sampled']:.1f}"
                 for r in results.values()]
        lines.append(f"| {kind} | {counts[kind]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="LABEL=folder (or .gguf) of each model, e.g. SFT=out/sft")
    parser.add_argument("--dataset", default="data/arithmetic", help="folder with a test.jsonl of the shipped kind")
    parser.add_argument("--num_eval_examples", type=int, default=64, help="the first N test problems (0: all)")
    parser.add_argument("--max_completion_length", type=int, default=64, help="new tokens per answer at most")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled answers, the same for every model")
    parser.add_argument("--output", default="", help="also write the accuracies to this JSON file")
    args = parser.parse_args()
    if any("=" not in m for m in args.models):
        sys.exit("name each model as LABEL=folder, e.g. SFT=out/sft")
    labels = [m.split("=", 1)[0] for m in args.models]
    if len(set(labels)) < len(labels):
        sys.exit(f"each model needs a label of its own: {', '.join(labels)}")
    _, test = common.load_splits(args.dataset, num_eval_examples=args.num_eval_examples)
    for question in test["question"]:
        try:
            kind_of(question)
        except ValueError:
            sys.exit(f"by_kind.py reads problems like 'What is 47 + 85?'; {args.dataset} has {question!r}")
    results = {}
    for label, path in (m.split("=", 1) for m in args.models):
        model, tokenizer = common.load_model(path)
        results[label] = accuracy_by_kind(model, tokenizer, test, args.max_completion_length, args.seed)
    print(table(results))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
