"""Every relative link and image of README.md and docs/*.md points at a file that exists, and a link
to a heading (file.md#heading) at a heading that exists (GitHub's anchors: lower case, punctuation
dropped, spaces as hyphens)."""
import glob
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


def test_the_readme_is_a_half_hour_read():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 400
