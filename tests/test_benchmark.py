"""benchmarks/run.py's arithmetic: medians over every round's steps, completions/s and tokens/s."""
import importlib.util
import os

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("benchmark_run", os.path.join(ROOT, "benchmarks", "run.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_summary_takes_medians_over_all_rounds():
    rounds = [  # two runs of grpo.py: 128 completions per step
        {"wall_s": 10.0, "peak_rss_mb": 900.0, "step": [1.0, 3.0], "length": [20.0, 30.0],
         "generation": [0.4, 0.6], "forward": [0.3, 0.3], "backward": [0.3, 0.5]},
        {"wall_s": 12.0, "peak_rss_mb": 950.0, "step": [2.0], "length": [25.0],
         "generation": [0.5], "forward": [0.4], "backward": [0.2]},
    ]
    row = bench.summary("grpo.py", rounds)
    assert row["step_s"] == 2.0 and row["steps_measured"] == 3
    assert row["generation"] == 0.5 and row["forward"] == 0.3 and row["backward"] == 0.3
    assert row["completions_per_s"] == pytest.approx(128 / 2.0)
    assert row["tokens_per_s"] == pytest.approx(25.0 * 128 / 2.0)  # mean completion length x completions / s
    assert row["peak_rss_mb"] == 950.0 and row["wall_s"] == 22.0


def test_trl_row_has_no_split_and_mix_counts_only_generated_rows():
    trl = bench.summary("TRL GRPOTrainer", [{"wall_s": 1.0, "peak_rss_mb": 1.0, "step": [2.0], "length": [10.0]}])
    assert "generation" not in trl and trl["completions_per_s"] == pytest.approx(64.0)
    mix = bench.summary("mix.py", [{"wall_s": 1.0, "peak_rss_mb": 1.0, "step": [1.0], "length": [10.0],
                                    "generation": [0.1], "forward": [0.1], "backward": [0.1]}])
    assert mix["completions_per_s"] == 96.0  # 12 prompts x 8 samples; the 32 expert rows are not generated
