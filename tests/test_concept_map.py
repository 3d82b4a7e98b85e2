"""The concept map (docs/concept_map.md, the README's lecture companion) stays true.

Under the heading `## From the lecture notes to the code`, docs/concept_map.md maps every concept of
the lecture notes to the code, one row each (links relative to docs/, the link text the file's path
from the repository's root):

    | Concept | Note | Where (file, function, lines) | Test |
    | GAE: ... | 000, 003 | [`ppo.py`](../ppo.py#L174-L197) `gae` | `tests/test_rlhf_math.py::test_gae_hand_computed` |

The Where cell is a link to a file with a line range, then the function (or class) in backticks,
then optionally what part of it the range is:

    `gae`                       the whole function: the range is its span (def line to last line)
    `main` step 3               a step of a loop: from its comment `# 3. ...` to the line before
                                the next step's comment (blank lines left out), or to the end of
                                the block that holds the comment
    `main` creates `critic`     where `critic` is made: from the first statement that assigns it
                                (with the comments and the `if` line just above) through the last
                                one, and the lines right after it that use it

Each range is computed from the code, so it has exactly one right value, and a row that has
drifted after an edit fails even when its old range still falls inside the function.

The ranges are generated, not typed: after moving code, `python docs/concept_map.py` rewrites
every range from these rules. This file reads source files with ast only (no torch, no script is
imported), so it runs in a second. When it fails, its message names the row and the line range to
write. CONCEPT_MAP=path points it at another copy of the map (to check a draft).
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAP = os.environ.get("CONCEPT_MAP") or os.path.join(ROOT, "docs", "concept_map.md")
LINKS_FROM = os.path.join(ROOT, "docs")  # where the map's links start
HEADING = "## From the lecture notes to the code"
COLUMNS = ["Concept", "Note", "Where", "Test"]

# Concepts the table must cover: (what, regex searched in the Concept column, case-insensitive).
REQUIRED_CONCEPTS = [
    ("the three stages", r"three stages"),
    ("SFT", r"\bSFT\b"),
    ("the reward model's pairwise loss", r"pairwise loss"),
    ("-log sigmoid(r_chosen - r_rejected)", r"log sigmoid\(r_chosen - r_rejected\)"),
    ("the actor", r"\bactor\b"),
    ("the critic", r"\bcritic\b"),
    ("the reward model (PPO's model)", r"PPO model \d, reward model"),
    ("the reference", r"\breference\b"),
    ("rollout", r"\brollout\b"),
    ("inference", r"\binference\b"),
    ("the per-token KL reward", r"per-token KL reward"),
    ("the score at the last token", r"last token"),
    ("GAE", r"\bGAE\b"),
    ("the clipped actor loss", r"clipped actor loss"),
    ("the clipped critic (value) loss", r"clipped critic \(value\) loss"),
    ("group-relative advantages", r"group-relative advantages"),
    ("the k3 KL estimator", r"\bk3\b"),
    ("loss aggregation 'grpo' vs 'dapo'", r"aggregation.*'grpo'.*'dapo'"),
    ("MIX's mu", r"\bmu\b"),
    ("MIX's expert ratio", r"expert ratio"),
    ("expert rows per batch", r"expert rows"),
    ("expert_mask", r"expert_mask"),
    ("LoRA", r"\bLoRA\b"),
    ("the LoRA reference (adapter disabled)", r"LoRA reference"),
    ("the memory estimate", r"\bmemory\b"),
    ("reward functions", r"reward functions"),
    ("rule-based rewards", r"rule-based reward"),
    ("whitening", r"whitening"),
    ("entropy", r"\bentropy\b"),
    ("clip fraction", r"clip fraction"),
    ("data formats", r"data format"),
    ("DDP", r"\bDDP\b"),
    ("nccl vs gloo", r"nccl.*gloo"),
]

# Functions the table must point at: file -> names that some Where cell names in that file.
REQUIRED_FUNCTIONS = {
    "sft.py": ["sft_loss", "main"],
    "reward_model.py": ["preference_loss", "sequence_scores", "main"],
    "ppo.py": ["compute_rewards", "gae", "whiten", "ppo_actor_loss", "ppo_critic_loss", "critic_values",
               "reward_scores", "main"],
    "grpo.py": ["group_advantages", "kl_k3", "grpo_loss", "correctness_reward", "format_reward", "main"],
    "mix.py": ["mix_loss", "sft_loss", "load_expert_examples", "append_rows", "main"],
    "dpo.py": ["sigmoid_loss", "ipo_loss", "simpo_loss", "implicit_rewards", "rank_pairs", "main"],
    "lib/rollout.py": ["generate", "completion_logprobs", "gather_logprobs", "mask_after_eos"],
    "common.py": ["reference_model", "add_lora", "mean_denominator"],
    "lib/distributed.py": ["memory_estimate", "setup", "average_gradients", "shard_model", "gathered"],
}

WHERE = re.compile(
    r"^\[`(?P<text>[^`]+)`\]\((?P<link>[^)#\s]+)#L(?P<start>\d+)-L(?P<end>\d+)\)"  # [`ppo.py`](../ppo.py#L1-L9)
    r"\s+`(?P<name>[A-Za-z_][\w.]*)`"  # `main`, or a dotted path such as `main.evaluate`
    r"(?P<part>.*)$"  # nothing (the whole function), `step 3`, `creates `x``
)
TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
STEP = re.compile(r"^\s*#\s*(\d+[a-z]?)\.(\s|$)")  # a step comment in a loop: "# 3. Group-relative advantages"


# --- reading the map ---------------------------------------------------------------------------
def split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [cell.strip() for cell in cells[1:-1]]  # drop what is outside the first and last |


def read_table():
    """(header cells, [(the map's line number, cells)]) of the table under HEADING."""
    with open(MAP, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == HEADING)
    except StopIteration:
        pytest.fail(f"{MAP} has no section '{HEADING}' (the lecture companion table)")
    table = []
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if re.match(r"#{1,2}\s", line):  # the next section
            break
        if line.lstrip().startswith("|"):
            table.append((number, split_row(line)))
        elif table and line.strip():  # text after the table ends it
            break
    assert len(table) >= 3, f"the section '{HEADING}' of {MAP} has no table with rows"
    (_, header), (_, rule), rows = table[0], table[1], table[2:]
    assert all(set(cell) <= set(":- ") for cell in rule), f"line 2 of the table should be | --- | ... |, not {rule}"
    return header, rows


def fail_if(problems, title=""):
    if problems:
        pytest.fail("\n".join(([title] if title else []) + [f"  {p}" for p in problems]), pytrace=False)


def label(number: int, cells) -> str:
    return f"line {number} ({cells[0][:70]!r})" if cells else f"line {number}"


# --- reading the code --------------------------------------------------------------------------
_trees = {}


def source(path: str):
    """(lines, ast tree) of a file of the repository, cached."""
    if path not in _trees:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        _trees[path] = (text.splitlines(), ast.parse(text, filename=path))
    return _trees[path]


def definitions(tree, name: str):
    """Every function or class called `name` (a dotted name: nested in that order), top level first."""
    found = []

    def walk(node, qualified, depth):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                dotted = f"{qualified}.{child.name}" if qualified else child.name
                if dotted == name or ("." not in name and child.name == name):
                    found.append((depth, child))
                walk(child, dotted, depth + 1)
            else:
                walk(child, qualified, depth)

    walk(tree, "", 0)
    return [node for _, node in sorted(found, key=lambda pair: pair[0])]


def step_range(lines, node, step: str):
    """(first, last) line of step `# <step>. ...` of node, or None: up to the next step comment,
    or to the end of the innermost block that holds the comment; trailing blank lines left out."""
    comments = [(i, m.group(1)) for i in range(node.lineno, node.end_lineno + 1)
                if (m := STEP.match(lines[i - 1]))]
    for k, (line, name) in enumerate(comments):
        if name != step:
            continue
        blocks = [
            n
            for n in ast.walk(node)
            if isinstance(n, ast.stmt) and hasattr(n, "body") and n.lineno < line <= n.end_lineno
        ]
        last = max(blocks, key=lambda n: n.lineno).end_lineno
        following = [i for i, other in comments[k + 1 :] if other != step]
        if following:
            last = min(last, following[0] - 1)
        while last > line and not lines[last - 1].strip():
            last -= 1
        return line, last
    return None


def _own_statements(node):
    """The statements of a function, not those of functions or classes defined inside it."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        yield from _own_statements(child)


def _targets(statement) -> set:
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AugAssign, ast.AnnAssign)):
        targets = [statement.target]
    else:
        return set()
    return {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}


def creates_range(lines, node, names):
    """(first, last) line where `names` are made in node, or None if node never assigns one."""
    assignments = [s for s in _own_statements(node) if _targets(s) & set(names)]
    if not assignments:
        return None
    first, last = min(s.lineno for s in assignments), max(s.end_lineno for s in assignments)
    headers = {s.lineno for s in _own_statements(node)
               if isinstance(s, ast.stmt) and hasattr(s, "body") and s.lineno < first <= s.end_lineno}
    while first - 1 > node.lineno and (lines[first - 2].strip().startswith("#") or first - 1 in headers):
        first -= 1  # the comment or the `if` line just above
    code = lambda i: lines[i - 1].split("#")[0]  # noqa: E731
    while last + 1 <= node.end_lineno and any(re.search(rf"\b{n}\b", code(last + 1)) for n in names):
        last += 1  # the lines right after that use it
    return first, last


def check_where(cell: str):
    """None if the Where cell is true, else what is wrong and what to write."""
    match = WHERE.match(cell)
    if not match:
        return (f"the Where cell {cell!r} is not of the form [`file.py`](../file.py#L<start>-L<end>) `function` "
                "(optionally followed by `step N` or `creates `name``)")
    link, text, name, part = match["link"], match["text"], match["name"], match["part"].strip()
    path = os.path.relpath(os.path.normpath(os.path.join(LINKS_FROM, link)), ROOT)  # from the repository's root
    start, end = int(match["start"]), int(match["end"])
    if text != path:
        return f"the link text `{text}` and its target {link} ({path}) name different files"
    if not os.path.isfile(os.path.join(ROOT, path)):
        return f"{path} does not exist"
    if start > end:
        return f"L{start}-L{end} is an empty range"
    lines, tree = source(path)
    nodes = definitions(tree, name)
    if not nodes:
        return f"{path} has no function or class `{name}`"
    spans = " or ".join(f"L{n.lineno}-L{n.end_lineno}" for n in nodes)
    if not part:  # the whole function: its span exactly
        if any((n.lineno, n.end_lineno) == (start, end) for n in nodes):
            return None
        node = nodes[0]
        return (f"`{name}` spans {path} {spans}, not L{start}-L{end}: write "
                f"[`{path}`]({link}#L{node.lineno}-L{node.end_lineno}) `{name}`")
    step, creates = re.fullmatch(r"step\s+(\d+[a-z]?)", part), re.fullmatch(r"creates\s+((?:`\w+`[,\s]*)+)", part)
    if not (step or creates):
        return f"after `{name}` write nothing (the whole function), `step N` or `creates `name``, not {part!r}"
    ranges = []  # (node, first, last) for every definition of `name` that has this part
    for node in nodes:
        found = step_range(lines, node, step[1]) if step else creates_range(lines, node, re.findall(r"`(\w+)`", part))
        if found:
            ranges.append((node, *found))
    what = f"step {step[1]}" if step else part
    if not ranges:
        missing = f"no step comment `# {step[1]}. ...`" if step else f"no assignment of {creates[1].strip()}"
        return f"`{name}` ({path} {spans}) has {missing}"
    if any((first, last) == (start, end) for _, first, last in ranges):
        return None
    _, first, last = ranges[0]
    return (f"{what} of `{name}` is {path} L{first}-L{last}, not L{start}-L{end}: write "
            f"[`{path}`]({link}#L{first}-L{last}) `{name}` {part}")


def test_table_has_the_four_columns():
    header, rows = read_table()
    assert len(header) == len(COLUMNS) and all(h.lower().startswith(c.lower()) for h, c in zip(header, COLUMNS)), (
        f"the table's header should be | Concept | Note | Where (file, function, lines) | Test |, not {header}")
    wrong = [label(number, cells) + f" has {len(cells)} cells, not 4" for number, cells in rows if len(cells) != 4]
    fail_if(wrong)


def test_every_note_cell_names_a_note():
    _, rows = read_table()
    wrong = [label(number, cells) + f": Note {cells[1]!r} should list notes 000 to 004, or be '—' (not in the notes)"
             for number, cells in rows if len(cells) == 4
             and not (re.fullmatch(r"00[0-4](,\s*00[0-4])*", cells[1]) or cells[1] in ("—", "-"))]
    fail_if(wrong)


def test_every_where_cell_points_at_its_function_and_lines():
    _, rows = read_table()
    wrong = []
    for number, cells in rows:
        if len(cells) == 4 and (problem := check_where(cells[2])):
            wrong.append(f"{label(number, cells)}: {problem}")
    fail_if(wrong, f"{len(wrong)} row(s) of '{HEADING}' in {MAP} are out of date "
                   "(python docs/concept_map.py rewrites the ranges):")


def test_every_named_test_exists():
    _, rows = read_table()
    wrong = []
    for number, cells in rows:
        if len(cells) != 4:
            continue
        named = TEST.findall(cells[3])
        if not named and cells[3].strip("`' ") not in ("", "—", "-"):
            wrong.append(f"{label(number, cells)}: the Test cell {cells[3]!r} names no tests/<file>.py::<test>")
        for path, name in named:
            if not os.path.isfile(os.path.join(ROOT, path)):
                wrong.append(f"{label(number, cells)}: {path} does not exist")
            elif not definitions(source(path)[1], name):
                wrong.append(f"{label(number, cells)}: {path} has no test `{name}` (renamed or removed?)")
    fail_if(wrong)


def test_the_table_covers_the_notes():
    _, rows = read_table()
    concepts = [cells[0] for _, cells in rows if cells]
    missing = [what for what, pattern in REQUIRED_CONCEPTS
               if not any(re.search(pattern, concept, re.IGNORECASE) for concept in concepts)]
    fail_if(missing, "no row's Concept covers:")
    cited = {(m["text"], m["name"]) for _, cells in rows if len(cells) == 4 and (m := WHERE.match(cells[2]))}
    uncited = [f"{path} `{name}`" for path,
               names in REQUIRED_FUNCTIONS.items() for name in names if (path, name) not in cited]
    fail_if(uncited, "no row's Where cell points at:")
