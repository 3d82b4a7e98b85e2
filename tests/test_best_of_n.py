"""best_of_n.py: pass@k against its definition and hand values, the best-of-N expectation against every
subset, the KL formula's values, and a short evaluation whose invariants hold."""
import dataclasses
import itertools
import json
import math
import os
import random

import pytest
import torch

import best_of_n
import common
from conftest import rotated_reward_model, rotated_tokenizer, run_main, tiny_reward_model


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
def test_the_settings_an_evaluation_shares_with_a_run_are_the_runs():
    """best_of_n.Config declares the run's settings through harness.run_setting: the run's check (a
    bad value is the same one sentence), its help text unless the evaluation writes its own, and the
    run's default unless it names another."""
    from lib import checks, harness

    with pytest.raises(SystemExit, match="--temperature must be at least 0.01"):
        checks.check_settings(best_of_n.Config(temperature=0.001))
    with pytest.raises(SystemExit, match="--max_completion_length must be at least 1 token, not 0"):
        checks.check_settings(best_of_n.Config(max_completion_length=0))
    run_help, help_ = common.field_help(harness.RLConfig), {}
    for field in dataclasses.fields(best_of_n.Config):
        if field.metadata.get("run_setting"):
            help_[field.name] = field.metadata["help"]
            assert field.metadata["help"] == "; ".join(run_help[field.name])
            assert field.metadata.get("usable") is harness.RLConfig.__dataclass_fields__[field.name].metadata.get(
                "usable"), field.name
    assert set(help_) == {"model", "dataset", "num_eval_examples", "temperature", "max_completion_length",
                          "system_prompt", "per_device_eval_batch_size", "seed", "output_dir", "overwrite_output_dir",
                          "trust_remote_code"}
    defaults = {f.name: f.default for f in dataclasses.fields(best_of_n.Config)}
    assert defaults["model"] == "out/grpo" and defaults["output_dir"] == "out/best_of_n"
    assert defaults["seed"] == harness.RunConfig.seed and defaults["temperature"] == harness.RLConfig.temperature


def test_a_judge_with_its_own_tokenizer_scores_the_samples_as_the_same_judge_with_the_policys():
    """best_of_n's samples, scored by a judge whose tokenizer gives other ids for the same text (our byte
    tokenizer rotated by 7, its embedding rows rotated with it), get the same scores to the bit as the
    same judge with the policy's tokenizer, both reading the samples' text re-tokenized in their own ids
    (reward_model.judge_rows)."""
    tokenizer, rotated_tok = common.build_tokenizer(), rotated_tokenizer()
    judge = tiny_reward_model(tokenizer).eval()
    policy = common.build_tiny_model(tokenizer).eval()
    cfg = common.parse_config(best_of_n.Config, ["--num_samples", "4", "--max_completion_length", "12",
                                                 "--judge", "out/rm"])
    results = []
    for judge_model, judge_tokenizer in ((judge, tokenizer), (rotated_reward_model(judge).eval(), rotated_tok)):
        torch.manual_seed(0)
        results.append(best_of_n.sample_and_judge(policy, tokenizer, judge_model, judge_tokenizer,
                                                  ["What is 2 + 3?", "What is 7 - 9?"], ["#### 5", "#### -2"], cfg))
    (gold_a, proxy_a), (gold_b, proxy_b) = results
    assert torch.equal(gold_a, gold_b) and torch.equal(proxy_a, proxy_b) and proxy_a.shape == (2, 4)


@pytest.mark.slow
def test_a_short_evaluation_holds_its_invariants(sft_checkpoint, tmp_path):
    """8 samples of 16 problems: pass@1 is the share of right samples, pass@k never falls with k, maj@1 is
    pass@1 and maj@k never above pass@k, best of N by the checker is pass@N, and the outputs are written."""
    out = str(tmp_path / "bon")
    run_main("best_of_n.py", "--model", sft_checkpoint, "--num_samples", "8", "--num_eval_examples", "16",
             "--output_dir", out)
    with open(os.path.join(out, "eval.json")) as f:
        result = json.load(f)
    assert os.path.isfile(os.path.join(out, "best_of_n.png")) and result["n"] == 16
    passes = [result["pass@k"][k] for k in ("1", "2", "4", "8")]
    assert passes == sorted(passes) and 0 < passes[0] < passes[-1] <= 1
    right = result["right_per_problem"]  # c of each problem: pass@1 is their mean over n, pass@n the share above 0
    assert len(right) == 16 and all(0 <= c <= 8 for c in right)
    assert passes[0] == pytest.approx(sum(right) / (16 * 8), abs=1e-12)
    assert passes[-1] == pytest.approx(sum(c > 0 for c in right) / 16, abs=1e-12)
    # one sample's vote is that sample: maj@1 is pass@1; and a vote is never right more often than some sample
    assert result["maj@k"]["1"] == pytest.approx(passes[0], abs=1e-6)
    assert all(result["maj@k"][k] <= result["pass@k"][k] + 1e-6 for k in result["maj@k"])
    for N, row in result["best_of_n"].items():
        assert row["gold"] == pytest.approx(result["pass@k"][N], abs=1e-12) == row["proxy"]
        assert row["kl"] == best_of_n.best_of_n_kl(int(N))
    with pytest.raises(SystemExit, match="already holds a run"):  # an evaluation is not replaced unasked
        best_of_n.main(common.parse_config(best_of_n.Config, ["--model", sft_checkpoint, "--output_dir", out]))


def test_the_page_quotes_the_committed_evaluations():
    """docs/best_of_n.md's table is what benchmarks/pass_at_k.py prints from docs/best_of_n.json, and each
    number its prose quotes is that file's."""
    import statistics

    from conftest import ROOT, load_benchmark

    bench = load_benchmark("pass_at_k")
    with open(os.path.join(ROOT, "docs", "best_of_n.json")) as f:
        results = json.load(f)
    with open(os.path.join(ROOT, "docs", "best_of_n.md")) as f:
        text = f.read()
    page = " ".join(text.split())
    assert bench.table(results) in text
    mean = lambda model, key, k: 100 * statistics.fmean(run[key][k] if key == "pass@k" else run[key][k]["gold"]  # noqa
                                                      for run in results[model])
    sft1, grpo1, sft64, grpo64 = (mean(m, "pass@k", k) for m, k in (("sft", "1"), ("grpo", "1"), ("sft", "64"),
                                                                       ("grpo", "64")))
    assert f"GRPO raised pass@1 by {grpo1 - sft1:.1f} points and left pass@64 where it was" in page
    assert f"pass@64 {grpo64 - sft64:+.1f} points, no difference within +-2" in page
    assert f"from {sft1:.1f}% to {grpo1:.1f}% right" in page
    assert f"already held a right answer {mean('sft', 'pass@k', '16'):.1f}% of the time" in page
    peak, last = mean("sft", "best_of_n", "4"), mean("sft", "best_of_n", "64")
    assert f"from {sft1:.1f}% to {peak:.1f}% at N = 4" in page and f"to {last:.1f}% at N = 64" in page
    assert f"{sft1 - last:.1f} points below a single sample" in page
    for run in results["sft"]:  # the gold peaks at N = 4 on every seed and falls after; the proxy rises at every N
        gold = [row["gold"] for row in run["best_of_n"].values()]
        proxy = [row["proxy"] for row in run["best_of_n"].values()]
        assert max(gold) == gold[2] and gold[2:] == sorted(gold[2:], reverse=True) and proxy == sorted(proxy)
    proxies = [statistics.fmean(run["best_of_n"][N]["proxy"] for run in results["sft"]) for N in ("1", "64")]
    assert f"rises at every N ({proxies[0]:.2f} to {proxies[1]:.2f})" in page
    assert f"the same samples give {mean('sft', 'pass@k', '64'):.1f}% at N = 64" in page
    seed0 = {m: 100 * results[m][0]["pass@k"]["64"] for m in ("sft", "grpo")}
    assert f"the SFT model reached {seed0['sft']:.1f}% and GRPO {seed0['grpo']:.1f}%" in page
    minutes = [run["wall_minutes"] for m in ("sft", "grpo") for run in results[m]]
    assert f"{min(minutes):.1f} to {max(minutes):.1f} minutes each" in page
    with open(os.path.join(ROOT, "docs", "syllabus.json")) as f:
        starts = json.load(f)["starts"]
    rm = [100 * starts[s]["rm"]["pairwise_accuracy"] for s in "012"]
    assert f"{min(rm):.1f}% to {max(rm):.1f}% of held-out pairs ranked right" in page


def test_the_page_quotes_the_runs_along_training():
    """The right panel's runs, as docs/best_of_n.md quotes them (KL, gold at steps 0, 20 and 40)."""
    import statistics

    from conftest import ROOT

    with open(os.path.join(ROOT, "docs", "best_of_n.json")) as f:
        results = json.load(f)
    with open(os.path.join(ROOT, "docs", "best_of_n.md")) as f:
        page = " ".join(f.read().split())
    ppo, dpo = results["along_training"]["rm_ppo"], results["along_training"]["dpo_online_rm"]

    def span(values, fmt):
        return f"{fmt.format(min(values))} to {fmt.format(max(values))}"

    assert (f"PPO's 40 steps moved its policy {span([run[2]['kl'] for run in ppo], '{:.3f}')} nats and gained "
            f"{span([100 * (run[2]['gold'] - run[0]['gold']) for run in ppo], '{:.1f}')} points") in page
    assert all(run[0]["gold"] < run[1]["gold"] < run[2]["gold"] for run in ppo)  # "still rising at step 40"
    two = statistics.fmean(run["best_of_n"]["2"]["gold"] - run["best_of_n"]["1"]["gold"] for run in results["sft"])
    assert f"at most {results['sft'][0]['best_of_n']['2']['kl']:.2f} nats (N = 2) gains {100 * two:.1f}" in page
    assert all(run[1]["gold"] > run[0]["gold"] and run[2]["gold"] < run[1]["gold"] for run in dpo)
    assert (f"{span([run[1]['kl'] for run in dpo], '{:.3f}')} nats at step 20, where its accuracy had risen on every "
            f"seed, and {span([run[2]['kl'] for run in dpo], '{:.3f}')} nats at step 40, where it had fallen to "
            f"{span([100 * run[2]['gold'] for run in dpo], '{:.1f}%')}") in page


# --- the output folder, as a training run has it ----------------------------------------------------------
def _evaluate(model, out, *flags, seed="0"):
    """A small best_of_n.py run (2 samples of 2 problems) in this process; what it printed."""
    return run_main("best_of_n.py", "--model", str(model), "--num_samples", "2", "--num_eval_examples", "2",
                    "--max_completion_length", "8", "--seed", seed, "--output_dir", str(out), *flags)


@pytest.mark.parametrize("case", ["empty", "a file", "a file's child"])
def test_the_output_folder_is_checked_before_any_sampling(saved_tiny, tmp_path, monkeypatch, case):
    """An --output_dir that cannot be written is one sentence before the minutes of sampling, not a
    traceback after them."""
    (tmp_path / "a_file").write_text("x")
    out = {"empty": "", "a file": str(tmp_path / "a_file"), "a file's child": str(tmp_path / "a_file" / "bon")}[case]
    monkeypatch.setattr(best_of_n, "sample_and_judge", lambda *a, **k: pytest.fail("sampled before the check"))
    with pytest.raises(SystemExit) as stop:
        best_of_n.main(common.parse_config(best_of_n.Config, ["--model", str(saved_tiny[0]), "--output_dir", out]))
    assert str(stop.value.code).startswith("error: --output_dir ") and "\n" not in str(stop.value.code)


def test_a_second_evaluation_into_a_folder_being_written_is_refused(saved_tiny, tmp_path):
    """Two evaluations started at once into one new folder: the first makes and locks it (here this
    process, as far as prepare_output_dir), the second stops with one sentence instead of both saying
    "written" and one result being lost."""
    from lib import harness
    from conftest import run

    out = str(tmp_path / "bon")
    first = best_of_n.Config(output_dir=out, model=str(saved_tiny[0]))
    assert harness.prepare_output_dir(first, {}) == out
    second = run("best_of_n.py", "--model", str(saved_tiny[0]), "--num_samples", "2", "--num_eval_examples", "2",
                 "--output_dir", out, check=False)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"error: another run is writing to {out}: wait for it to finish, or choose another --output_dir")
    assert os.listdir(out) == []


@pytest.mark.parametrize("failing", ["eval.json", "best_of_n.png"])
def test_a_failed_write_leaves_the_earlier_evaluation_whole(saved_tiny, tmp_path, monkeypatch, failing):
    """A write that fails half-way (a full disk) while an evaluation replaces an earlier one: one sentence,
    the earlier evaluation byte for byte as it was, no torn file and no temporary one left."""
    import errno

    import matplotlib.figure

    out = tmp_path / "bon"
    _evaluate(saved_tiny[0], out)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}

    def half_then_full(write):
        def wrapped(obj, target, *args, **kwargs):
            with open(target if isinstance(target, (str, os.PathLike)) else target.name, "ab") as f:
                f.write(b"{half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return wrapped

    if failing == "eval.json":
        monkeypatch.setattr(json, "dump", half_then_full(json.dump))
    else:
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, target, **k: half_then_full(None)(
            fig, target))
    with pytest.raises(AssertionError, match="could not write " + failing.replace(".", r"\.") + " to .*No space left"):
        _evaluate(saved_tiny[0], out, "--overwrite_output_dir", "true", seed="1")
    monkeypatch.undo()
    visible = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.startswith(".")}
    assert visible == before
    leftovers = [name for root, _, files in os.walk(out) for name in files if name.endswith(".tmp")]
    assert leftovers == []


def test_an_evaluation_over_another_scripts_run_replaces_it_whole(saved_tiny, sft_folder, tmp_path):
    """best_of_n.py over a folder that holds an sft.py run (--overwrite_output_dir true): the old run goes
    whole, and run.json lists exactly what the folder holds, not a file of each."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(sft_folder, out)
    _evaluate(saved_tiny[0], out, "--overwrite_output_dir", "true")
    record = json.loads((out / "run.json").read_text())
    assert record["script"] == "best_of_n.py"
    assert sorted(record["files"]) == sorted(os.listdir(out)) == ["best_of_n.png", "eval.json", "run.json"]


def test_majority_vote_by_hand():
    """Votes A, A, B with A right. maj@1 = 2/3 (pass@1). maj@2: {A, A} -> A (1), {A, B} twice -> a tie of two (1/2
    each): (1 + 1/2 + 1/2) / 3 = 2/3. maj@3 = 1. With B right instead: maj@2 = (0 + 1/2 + 1/2) / 3 = 1/3, maj@3 = 0.
    A sample with no answer does not vote: votes A, None with A right give maj@2 = 1."""
    vote = best_of_n.majority_vote_expectation
    assert [vote(["A", "A", "B"], [1, 1, 0], k) for k in (1, 2, 3)] == pytest.approx([2 / 3, 2 / 3, 1.0], abs=1e-7)
    assert [vote(["A", "A", "B"], [0, 0, 1], k) for k in (1, 2, 3)] == pytest.approx([1 / 3, 1 / 3, 0.0], abs=1e-7)
    assert vote(["A", None], [1, 0], 2) == 1.0 and vote([None, None], [0, 0], 2) == 0.0
    assert vote(["A", "B"], [0, 0], 1) == 0.0  # no sample right: never


def test_majority_vote_is_the_mean_over_every_subset_and_its_estimate_is_close():
    """Counted over every k-subset by a plain loop, with ties split evenly; for C(n, k) above max_subsets, the
    random-subset estimate lands within 4 standard errors (0.5 / sqrt(S)) of the exact value."""
    from collections import Counter

    rng = random.Random(1)
    for _ in range(30):
        n = rng.randint(1, 9)
        votes = [rng.choice(["1.0", "2.0", "3.0", None]) for _ in range(n)]
        right = [float(v == "2.0") for v in votes]
        for k in range(1, n + 1):
            credits = []
            for subset in itertools.combinations(range(n), k):
                counts = Counter(votes[j] for j in subset if votes[j] is not None)
                top = max(counts.values(), default=0)
                leaders = [v for v, c in counts.items() if c == top]
                credits.append(("2.0" in leaders) / len(leaders) if top else 0.0)
            exact = sum(credits) / len(credits)
            assert best_of_n.majority_vote_expectation(votes, right, k) == pytest.approx(exact, abs=1e-6)
            estimate = best_of_n.majority_vote_expectation(votes, right, k, max_subsets=2,
                                                           generator=torch.Generator().manual_seed(0))
            assert 0.0 <= estimate <= 1.0
    votes = ["1.0"] * 30 + ["2.0"] * 25 + [None] * 9  # n = 64: C(64, 8) subsets, far too many to count
    right = [float(v == "1.0") for v in votes]
    estimate = best_of_n.majority_vote_expectation(votes, right, 8, generator=torch.Generator().manual_seed(0))
    many = best_of_n.majority_vote_expectation(votes, right, 8, max_subsets=200_000,
                                               generator=torch.Generator().manual_seed(1))
    assert abs(estimate - many) < 4 * 0.5 / math.sqrt(4096) and 0.5 < many < 0.75


def test_vote_keys_read_numbers_as_the_checker_does():
    keys = [best_of_n.vote_key(f"<think>x</think><answer>{a}</answer>") for a in ("1,000", "1000", "1000.0", "$1000.")]
    assert len(set(keys)) == 1 and keys[0] is not None
    assert best_of_n.vote_key("no answer here") is None and best_of_n.vote_key("<answer> </answer>") is None
    assert best_of_n.vote_key("<answer>-7</answer>") != best_of_n.vote_key("<answer>7</answer>")
    assert best_of_n.vote_key("<answer>-0</answer>") == best_of_n.vote_key("<answer>0</answer>")  # both right for 0
