"""The worked examples (docs/worked_examples.md) are the repo's functions' own numbers (docs/worked_examples.py)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs"))
import worked_examples  # noqa: E402


def test_the_tables_match_the_functions():
    with open(os.path.join(ROOT, "docs", "worked_examples.md"), encoding="utf-8") as f:
        section = worked_examples.generated_section(f.read())
    assert section == worked_examples.render(), "run python docs/worked_examples.py and commit docs/worked_examples.md"


def test_the_tables_say_what_the_hand_computation_says():
    """The claims of the prose: Bessel's sqrt(3/4), and the clip's 2x3 pattern."""
    text = worked_examples.render()
    assert "+0.8660" in text and "-0.8660" in text  # sqrt(3/4)
    clip = text[text.index("When the clip removes"):]
    assert clip.count("**no gradient**") == 2  # A > 0 above the band, A < 0 below it



def test_the_estimator_and_dpo_tables_say_what_the_hand_computation_says():
    """RLOO's 4/3 x (r - mean) with no std; DPO's weight beta sigmoid(-beta h) at h = 2, beta 0.1."""
    import math

    text = worked_examples.render()
    assert "+1.333" in text and "-2.000" in text  # 4/3 x 1 and 4/3 x -1.5
    weight = 0.1 / (1 + math.exp(0.1 * 2))
    assert f"+{weight:.4f}" in text and f"+{math.log1p(math.exp(-0.2)):.4f}" in text
