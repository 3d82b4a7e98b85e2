"""Regenerate the line ranges of the concept map, docs/concept_map.md ("From the lecture notes to the code").

Each Where cell names a file, a function and optionally a part of it (`step 3`, `creates `critic``);
its line range follows from the code. After code moves, run

    python docs/concept_map.py          # rewrite docs/concept_map.md's ranges in place
    python docs/concept_map.py --check  # exit 1 if a range is out of date (what the test checks)

The rules that compute a range live in tests/test_concept_map.py, which CI runs: a row whose
range this script would change fails there, with the range to write.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import test_concept_map as concept_map  # noqa: E402  (the rules, read from the test that enforces them)


def regenerate(readme: str) -> tuple[str, list[str]]:
    """(the map's text with every Where range recomputed, the rows that cannot be fixed by a range)."""
    with open(readme, encoding="utf-8") as f:
        lines = f.read().split("\n")
    _, rows = concept_map.read_table()
    unfixable = []
    for number, cells in rows:
        if len(cells) != 4 or not (problem := concept_map.check_where(cells[2])):
            continue
        suggestion = re.search(r": write (\[`.*)$", problem)
        if suggestion is None:  # a missing function, a bad cell: a person must decide
            unfixable.append(f"line {number}: {problem}")
            continue
        lines[number - 1] = lines[number - 1].replace(cells[2], suggestion[1], 1)
    return "\n".join(lines), unfixable


if __name__ == "__main__":
    readme = concept_map.MAP
    with open(readme, encoding="utf-8") as f:
        before = f.read()
    after, unfixable = regenerate(readme)
    if "--check" in sys.argv[1:]:
        stale = after != before
        print(f"{readme}: concept map {'out of date: run python docs/concept_map.py' if stale else 'up to date'}")
        sys.exit(1 if stale or unfixable else 0)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(after)
    changed = sum(a != b for a, b in zip(before.split("\n"), after.split("\n")))
    print(f"{readme}: {changed} row(s) rewritten")
    for problem in unfixable:
        print(problem)
    sys.exit(1 if unfixable else 0)
