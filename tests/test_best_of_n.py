"""best_of_n.py: pass@k against its definition and hand values, the best-of-N expectation against every
subset, the KL formula's values, and a short evaluation whose invariants hold."""
import itertools
import json
import math
import os
import random

import pytest

import best_of_n
import common
from conftest import run_main


def test_pass_at_k_by_hand_and_by_its_definition():
    # n = 5 samples, c = 2 right, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    assert best_of_n.pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert best_of_n.pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)  # pass@1 = c / n, the sampled accuracy
    assert best_of_n.pass_at_k(5, 0, 3) == 0.0 and best_of_n.pass_at_k(5, 3, 3) == 1.0  # n - c < k: always one
    for n, c, k in itertools.product(range(1, 9), range(0, 9), range(1, 9)):
        if c <= n and k <= n:  # the share of k-subsets holding a right sample, counted
            subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
            assert best_of_n.pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


def test_best_of_n_expectation_is_the_mean_over_every_subset():
    """sum_i v_(i) C(i-1, N-1) / C(n, N) equals keeping the top-scored sample of each N-subset, averaged;
    equal scores keep the earlier sample."""
    rng = random.Random(0)
    for n in range(1, 8):
        scores = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(n)]  # ties included
        values = [rng.random() for _ in range(n)]
        for N in range(1, n + 1):
            kept = [values[max(subset, key=lambda j: (scores[j], -j))]
                    for subset in itertools.combinations(range(n), N)]
            assert best_of_n.best_of_n_expectation(values, scores, N) == pytest.approx(
                sum(kept) / len(kept), abs=1e-12)
    values = [1.0, 0.0, 1.0, 0.0]
    assert best_of_n.best_of_n_expectation(values, values, 1) == 0.5  # N = 1: the mean
    assert best_of_n.best_of_n_expectation(values, values, 4) == 1.0  # N = n: the top-scored


def test_best_of_n_kl_values():
    assert best_of_n.best_of_n_kl(1) == 0.0
    assert best_of_n.best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5, abs=1e-15)  # 0.1931 nats
    assert best_of_n.best_of_n_kl(64) == pytest.approx(math.log(64) - 63 / 64, abs=1e-15)  # 3.17 nats
    assert best_of_n.powers_of_two(64) == [1, 2, 4, 8, 16, 32, 64] and best_of_n.powers_of_two(6) == [1, 2, 4, 6]


@pytest.mark.slow
def test_a_short_evaluation_holds_its_invariants(sft_checkpoint, tmp_path):
    """8 samples of 16 problems: pass@1 is the share of right samples, pass@k never falls with k, best of N
    by the checker is pass@N, and the outputs are written."""
    out = str(tmp_path / "bon")
    run_main("best_of_n.py", "--model", sft_checkpoint, "--num_samples", "8", "--num_eval_examples", "16",
             "--output_dir", out)
    with open(os.path.join(out, "eval.json")) as f:
        result = json.load(f)
    assert os.path.isfile(os.path.join(out, "best_of_n.png")) and result["n"] == 16
    passes = [result["pass@k"][k] for k in ("1", "2", "4", "8")]
    assert passes == sorted(passes) and 0 < passes[0] < passes[-1] <= 1
    for N, row in result["best_of_n"].items():
        assert row["gold"] == pytest.approx(result["pass@k"][N], abs=1e-12) == row["proxy"]
        assert row["kl"] == best_of_n.best_of_n_kl(int(N))
    with pytest.raises(SystemExit, match="already holds an evaluation"):  # an evaluation is not replaced unasked
        best_of_n.main(common.parse_config(best_of_n.Config, ["--model", sft_checkpoint, "--output_dir", out]))
