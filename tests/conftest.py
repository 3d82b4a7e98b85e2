import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # import the scripts (sft, grpo, common, ...) as modules


def run(script, *args, check=True):
    result = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory):
    """A short SFT run (~1 min): the answer format is learned, the sums are right ~40% of the time."""
    out = str(tmp_path_factory.mktemp("sft"))
    run("sft.py", "--output_dir", out, "--max_steps", "300", "--learning_rate", "2e-3",
        "--eval_steps", "300", "--num_eval_examples", "64")
    return out
