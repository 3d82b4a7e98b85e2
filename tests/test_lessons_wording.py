"""Every sentence that states a measured comparison is bound to its row of docs/lessons.md, and says no more
than the row's verdict.

A sentence of README.md, docs/*.md, a notebook's markdown or a script's --help that links a row ([L7](...) in
pages and notebooks, "docs/lessons.md, L27" in a script) must use its verdict's words (VOCABULARY) and no word
stronger than it (STRONG), whatever the verdict is today: rerun the seeds, and a sentence whose row weakened
fails here. A sentence that compares two things with a measured number (COMPARATIVE and a number of points or
%) must link a row, or be listed in NOT_LESSONS with the reason it teaches no lesson (a mechanism, a definition,
a single measurement, a table's description)."""
import glob
import json
import os
import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import lessons  # noqa: E402

ROWS = {row["id"]: row for row in lessons.lessons()}
lessons.holm(list(ROWS.values()))

ONE = r"\bone (\w+ )?(run|seed)"  # one run, one seed, one earlier seed
# the words (regular expressions) a sentence must use for its row's verdict (any one of them), and below, for the
# rows without a verdict
VOCABULARY = {
    "a lead": ("a lead", "not shown"),
    "not shown": ("not shown",),
    "the other way": ("the other way",),
    "not resolved": ("not resolved",),
    "a difference": ("a difference",),
    "one run": (ONE,),
    f"no difference within +-{lessons.MARGIN:g}": (rf"within (\+-|±){lessons.MARGIN:g}\b",),
}
KIND_VOCABULARY = {  # a row without a paired comparison, by the first words of its kind
    "one seed": (ONE,),
    "one run": (ONE,),
    "a reading": ("a reading", "hypothesis"),
    "a cause no run isolated": ("a reading", "hypothesis", "no run isolated"),
    "a correlation": ("did not", "cannot say", "not in the same order", "do not expect"),
    "results not committed": ("not committed", "no verdict"),
}
STRONG = re.compile(r"\b(clear(ly)?|proves?|proved|establish(es|ed)?|significant(ly)?|definitely|always)\b", re.I)
COMPARATIVE = re.compile(r"\b(above|below|higher|lower|more than|less than|better|worse|beats?|outperform\w*|"
                         r"gains? more|gains? less|ahead|behind|raises?|lowers?|more often|less often|fewer|"
                         r"exceeds?|than)\b", re.I)
NUMBER = re.compile(r"\d+(\.\d+)?\s*(points|%)")
LINK = re.compile(r"\[L(\d+)\]\([^)]*lessons\.md[^)]*\)")
HELP_REF = re.compile(r"lessons\.md,? L(\d+)")

NOT_LESSONS = {  # (page, the sentence's first words): why it is no lesson of the ledger
    ("docs/agent.md", "A call is worth its price when"): "arithmetic of the reward",
    ("docs/process.md", "Seed 3's PRM ranked answers worst"): "one seed's runs, described, not registered",
    ("docs/process.md", "The outcome twin, which has no step rewards, ended"): "the SmolLM2 twin's runs against the "
    "chain, described beside L95, not registered",
    ("docs/classic_rlhf.md", "One thread adds floats"): "the float order's effect on one SFT run, described",
    ("docs/classic_rlhf.md", "(Each sampled accuracy is a mean"): "one seed's training metrics, described",
    ("docs/classic_rlhf.md", "Its held-out accuracy rose to step 40"): "one run's curve (how the defaults were "
                                                                         "chosen), described",
    ("docs/dpo.md", "The grey band"): "what a figure's band means",
    ("docs/dpo.md", "Online DPO learns from fewer pairs"): "a mechanism: the share of tied pairs, measured",
    ("docs/dpo.md", "- **The seed moves the start more"): "the starts' spread, the reason each row is paired",
    ("docs/exercises.md", "A model trained on the prompt"): "arithmetic of the loss",
    ("docs/experiments.md", "The scripts are deterministic"): "the float order's effect on SFT, described",
    ("docs/real_models.md", "Of the 64 problems that every run above evaluates"): "arithmetic of the data",
    ("docs/real_models.md", "A reading these runs suggest"): "a hypothesis, stated as one, and its arithmetic",
    ("docs/real_models.md", "Why the ratio stays near 1.5x"): "a timing (docs/speed.md), not a lesson of learning",
    ("docs/speed.md", "Its peak memory is 5% higher"): "a timing and a memory figure, not a lesson of learning",
    ("docs/testing.md", "Learning checks compare a metric"): "the tests' own statistics",
    ("docs/testing.md", "With seeds 0, 1 and 2, one run each, of the short"): "the tests' own statistics",
    ("docs/troubleshooting.md", "A file with more than 1% of such rows"): "a rule of the data loader",
    ("notebooks/01_sft.ipynb", "A careless answer to a problem with no carry"): "arithmetic of the data",
    ("notebooks/01_sft.ipynb", "The loss sits on a plateau"): "the notebook's one run, described",
    ("notebooks/01_sft.ipynb", "A model trained on the prompt"): "arithmetic of the loss",
    ("notebooks/08_best_of_n.ipynb", "`best_of_n.py` computes both"): "the checkpoint the notebook reads, described",
}


def pages() -> list[tuple[str, str]]:
    """(name, text) of every page a reader reads: README, docs/*.md but the ledger, the notebooks' markdown
    cells, and the scripts' source (their docstrings and --help)."""
    found = []
    for path in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        name = os.path.relpath(os.path.join(ROOT, path), ROOT)
        if name != os.path.join("docs", "lessons.md"):
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                found.append((name, f.read()))
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        with open(path, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        found.append((os.path.relpath(path, ROOT), "\n\n".join("".join(c["source"]) for c in cells
                                                              if c["cell_type"] == "markdown")))
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py"))):
        with open(path, encoding="utf-8") as f:
            found.append((os.path.relpath(path, ROOT), f.read()))
    return found


def sentences(text: str) -> list[str]:
    """The text's sentences: code blocks, headings and table rows dropped, a list item or a paragraph joined
    across its lines, then cut after a full stop (or a question mark) that a capital or a bracket
    follows (not after a colon: this course's sentences run on past them)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks = []
    for line in text.split("\n"):
        stripped = line.strip()
        if not stripped or stripped.startswith(("|", "#")):
            blocks.append("")
        elif re.match(r"([-*]|\d+\.)\s", stripped) or not blocks:
            blocks.append(stripped)
        else:
            blocks[-1] += " " + stripped
    return [s for block in blocks if block for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(\[*`])", block)]


def references(page: str, sentence: str) -> list[str]:
    pattern = HELP_REF if page.endswith(".py") else LINK
    return [f"L{n}" for n in pattern.findall(sentence)]


def problems_of(page: str, sentence: str) -> list[str]:
    """What a sentence says beyond its rows' verdicts (empty when it is bound and no stronger)."""
    found, lowered = [], sentence.lower()
    for ref in references(page, sentence):
        row = ROWS.get(ref)
        if row is None:
            found.append(f"{ref} is no row of the ledger")
            continue
        if "verdict" in row:
            words = VOCABULARY.get(row["verdict"], ())
            strong = row["verdict"] != "shown"
        else:
            words = next((w for kind, w in KIND_VOCABULARY.items() if row["kind"].startswith(kind)), ())
            strong = not row["kind"].startswith(("mechanism", "mathematics"))
        if words and not any(re.search(w, lowered) for w in words):
            found.append(f"{ref} is '{row.get('verdict', row.get('kind'))}': say one of {words}")
        if strong and STRONG.search(sentence):
            found.append(f"{ref} is '{row.get('verdict', row.get('kind'))}': '{STRONG.search(sentence).group()}' "
                         "is stronger")
    return found


def test_every_sentence_that_links_a_row_says_no_more_than_its_verdict():
    wrong = [f"{page}: {problem}: {sentence[:160]}" for page, text in pages() for sentence in sentences(text)
             for problem in problems_of(page, sentence)]
    assert not wrong, "\n".join(wrong)


def test_a_comparison_with_a_measured_number_links_its_row_or_says_why_it_teaches_none():
    unbound, listed = [], set()
    for page, text in pages():
        if page.endswith(".py"):
            continue  # code: the scripts' help is held by its references above
        for sentence in sentences(text):
            if not (COMPARATIVE.search(sentence) and NUMBER.search(sentence)) or references(page, sentence):
                continue
            key = next(((p, start) for p, start in NOT_LESSONS if p == page and sentence.strip().startswith(start)),
                       None)
            if key is None:
                unbound.append(f"{page}: {sentence[:200]}")
            listed.add(key)
    assert not unbound, "comparisons with no row: link the row, or list the sentence in NOT_LESSONS:\n" + "\n".join(
        unbound)
    assert set(NOT_LESSONS) <= listed, f"NOT_LESSONS entries that match no sentence: {set(NOT_LESSONS) - listed}"


@pytest.mark.parametrize("sentence, verdict, expected", [
    ("MIX ended above GRPO on every seed ([L11](docs/lessons.md#l11)).", "a lead", 1),
    ("MIX ended above GRPO on every seed, a lead ([L11](docs/lessons.md#l11)).", "a lead", 0),
    ("MIX clearly beats GRPO, a lead ([L11](docs/lessons.md#l11)).", "a lead", 1),
    ("MIX clearly beats GRPO ([L11](docs/lessons.md#l11)).", "shown", 0),
    ("They end together ([L11](docs/lessons.md#l11)).", "not resolved", 1),
    ("They end together: not resolved ([L11](docs/lessons.md#l11)).", "not resolved", 0),
])
def test_the_wording_check_on_hand_sentences(monkeypatch, sentence, verdict, expected):
    monkeypatch.setitem(ROWS, "L11", {**ROWS["L11"], "verdict": verdict})
    assert len(problems_of("README.md", sentence)) == expected


def test_sentences_split_where_a_reader_would():
    text = "A first. Then [L1](x) a second: Here the same.\n- an item\n  goes on. Next one.\n| a | table |\n"
    assert sentences(text) == ["A first.", "Then [L1](x) a second: Here the same.", "- an item goes on.", "Next one."]
