"""Write docs/exercises.md, the exercise sheet, from the notebooks' "What if you change it?" sections.

Each experiment there is a markdown cell that names a change and predicts its effect ("Prediction: ..."),
a code cell that runs it, and, after it, the notebook's reading of the result, or only what the code
printed. The sheet asks each question, then gives the prediction and the answer behind a fold. It is
read from the notebooks' committed outputs, whose quoted numbers tests/test_notebook_numbers.py holds to
what the cells print; tests/test_docs_links.py checks the sheet is what this script writes.

    python docs/exercises.py            # rewrite docs/exercises.md
    python docs/exercises.py --check    # exit 1 if it is out of date
"""
import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "exercises.md")
PRINTED_LINES = 12  # of a code cell's output, where the notebook gives no reading of its own


def text(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def printed(cell: dict) -> str:
    out = []
    for output in cell.get("outputs", []):
        value = output.get("text") or output.get("data", {}).get("text/plain", "")
        out.append("".join(value) if isinstance(value, list) else value)
    return "".join(out)


def experiments(path: str) -> list[dict]:
    """[{title, question, prediction, answer, printed}] of one notebook's "What if you change it?" section."""
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    start = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and text(c).startswith("## What if you change it?")), None)
    found = []
    for i in range(start if start is not None else len(cells), len(cells)):
        cell = cells[i]
        if cell["cell_type"] != "markdown" or "Prediction:" not in text(cell):
            continue
        body = text(cell)
        body = body[body.index("**"):]  # the experiment itself, after the section's heading and introduction
        question, prediction = body.split("Prediction:", 1)
        title = re.match(r"\*\*(.+?)\*\*", question).group(1).rstrip(".")
        code = next((c for c in cells[i + 1:] if c["cell_type"] == "code"), None)
        after = cells[cells.index(code) + 1] if code is not None and cells.index(code) + 1 < len(cells) else None
        reading = (text(after) if after is not None and after["cell_type"] == "markdown"
                   and "Prediction:" not in text(after) and not text(after).startswith("#") else None)
        lines = printed(code).strip().splitlines() if code is not None else []
        found.append({"title": title, "question": " ".join(question.split()),
                      "prediction": " ".join(prediction.split()), "answer": reading and " ".join(reading.split()),
                      "printed": "\n".join(lines[:PRINTED_LINES] + (["..."] if len(lines) > PRINTED_LINES else []))})
    return found


def page() -> str:
    out = ["# Exercises: predict, then check", "",
           "Each notebook ends with experiments that change one thing and predict what happens. Here they are as",
           "questions: write your prediction down, then open the fold for the notebook's own prediction and what",
           "the run showed (the notebooks' committed outputs; rerun the cell to see it yourself). Written by",
           "`python docs/exercises.py` from the notebooks.", ""]
    number = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        name = os.path.basename(path)
        for e in experiments(path):
            number += 1
            out += [f"## {number}. {e['title']} (notebook {name[:2]})", "", e["question"], "",
                    "<details><summary>The prediction, and what the run showed</summary>", "",
                    f"**Prediction.** {e['prediction'][:1].upper()}{e['prediction'][1:]}", ""]
            if e["answer"]:
                out += [f"**What the run showed** ([{name}](../notebooks/{name})). {e['answer']}", ""]
            if e["printed"] and not e["answer"]:  # the notebook's own reading, else what the cell printed
                out += [f"**What it printed** ([{name}](../notebooks/{name})):", "", "```text", e["printed"], "```", ""]
            out += ["</details>", ""]
    return "\n".join(out).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != page():
                sys.exit("docs/exercises.md is out of date: run python docs/exercises.py")
        print("docs/exercises.md is up to date")
        return
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(page())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
