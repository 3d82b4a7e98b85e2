"""Every relative link and image of README.md and docs/*.md points at a file that exists, and a link
to a heading (file.md#heading) at a heading that exists (GitHub's anchors: lower case, punctuation
dropped, spaces as hyphens)."""
import glob
import json
import os
import re

from conftest import ROOT

PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: str) -> set:
    headings, in_code = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            in_code ^= line.startswith("```")  # a `# comment` in a code block is not a heading
            if not in_code and re.match(r"#{1,6} ", line):
                headings.append(line.lstrip("#").strip())
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_and_anchor_exists():
    broken = []
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            name = os.path.relpath(page, ROOT)
            if not os.path.exists(resolved):
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_course_entry_point():
    """A half-hour read that opens with the reading path: its first section is "Start here"."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 300
    assert [line for line in lines if line.startswith("## ")][0] == "## Start here"


# Words about how the project was made, not about what it is: a reader cannot know what "the issue" or
# "the aim" was, and a dated aside ("down from 2050 s the day before") is a lab notebook, not a course.
PROCESS = re.compile(r"\bthe issue\b|\bissue's\b|\bthe aim\b|as this repo had|the day before|\btoday\b|"
                     r"\bsession\b|\bhoped\b|\btarget was\b|\bdown from\b|\bissue \d|"
                     r"\bbefore the change\b", re.IGNORECASE)


def reader_texts():
    """(name, text) of every page and notebook markdown cell a reader sees."""
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            yield os.path.relpath(page, ROOT), f.read()
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        with open(path, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "markdown":
                yield f"{os.path.relpath(path, ROOT)} cell {i}", "".join(cell["source"])


def test_no_project_process_language_where_a_reader_sees_it():
    found = [f"{name}: {match.group()!r} in ...{text[max(0, match.start() - 40):match.end() + 40]!r}..."
             for name, text in reader_texts() for match in PROCESS.finditer(text)]
    assert not found, "\n".join(found)


def test_the_process_check_can_fail():
    assert PROCESS.search("the issue's target was 5 minutes") and PROCESS.search("down from 2050 s the day before")
    assert not PROCESS.search("the critic's target R_t, a known issue")
