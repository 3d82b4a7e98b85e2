"""benchmarks/run.py's arithmetic: medians over every round's steps, completions/s and tokens/s."""
import json
import os
import sys
import types

import pytest
import torch

from conftest import ROOT, load_benchmark, run
import common  # conftest put the repo on sys.path

bench = load_benchmark("run")


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


# benchmarks/gpu.py, the GPU track: what runs without a GPU (its helpers, and its refusal to start)
gpu = load_benchmark("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU, and the script would run")
def test_gpu_track_stops_with_one_sentence_without_cuda():
    result = run("benchmarks/gpu.py", check=False)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip() == gpu.NO_CUDA and "Traceback" not in result.stderr
    assert gpu.NO_CUDA.startswith("error: no CUDA GPU here") and "\n" not in gpu.NO_CUDA


def test_bf16_bound_is_2_sigmas_u_sqrt_roundings_times_the_logit_spread():
    # 4 layers: 3 x (6 x 4 + 1) = 75 roundings; 2 x 4 x 2^-8 x sqrt(75) x 1.0 = 0.03125 x 8.6603 = 0.27063
    assert gpu.bf16_logprob_bound(4, 1.0) == pytest.approx(0.270633, abs=1e-6)
    # 24 layers: 3 x 145 = 435 roundings; 0.03125 x sqrt(435) x 2.0 = 0.03125 x 20.8567 x 2 = 1.30354
    assert gpu.bf16_logprob_bound(24, 2.0) == pytest.approx(1.303540, abs=1e-6)
    spread = torch.tensor([[1.0, 2.0]])  # per position, as precision_check passes it
    # sigmas 1: 2 x 2^-8 x sqrt(75) = 0.067658 per unit of spread
    assert gpu.bf16_logprob_bound(4, spread, sigmas=1.0)[0].tolist() == pytest.approx([0.067658, 0.135316], abs=1e-6)


def test_token_agreement_counts_the_first_runs_tokens_and_whole_rows():
    a, mask_a = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.ones(2, 3, dtype=torch.long)
    b, mask_b = torch.tensor([[1, 2, 9], [4, 5, 6]]), torch.ones(2, 3, dtype=torch.long)
    assert gpu.token_agreement(a, mask_a, b, mask_b) == pytest.approx((5 / 6, 1 / 2))
    # b stopped a token early (narrower, and its row shorter): 2 of a's 3 tokens, no whole row
    assert gpu.token_agreement(a[:1], mask_a[:1], b[:1, :2], mask_b[:1, :2]) == pytest.approx((2 / 3, 0.0))
    # padding after EOS (mask 0) is not compared
    padded_a, padded_b = torch.tensor([[7, 8, 0]]), torch.tensor([[7, 8, 5]])
    assert gpu.token_agreement(padded_a, torch.tensor([[1, 1, 0]]), padded_b, torch.tensor([[1, 1, 0]])) == (1.0, 1.0)


def test_gpu_track_reads_step_times_and_the_predicted_total():
    rows = [{"step": 0, "eval/accuracy_greedy": 0.1}, {"step": 1, "time/step": 5.0},
            {"step": 2, "time/step": 1.0}, {"step": 3, "time/step": 2.0}]
    assert gpu.median_step_seconds(rows) == 1.5  # step 1, the warm-up, left out
    assert gpu.median_step_seconds(rows[:2]) == 5.0  # unless it is the only one
    assert gpu.median_step_seconds([{"step": 1}]) is None
    printed = ("memory estimate (note 002):\n  frozen copies (reference, reward model)      0.004 GiB\n"
               "  activations of one micro-batch (16 x 51 tokens)      0.037 GiB\n"
               "  total                                                             0.058 GiB\n")
    assert gpu.predicted_gib(printed) == 0.058 and gpu.predicted_gib("no table") is None


def test_gpu_track_tables():
    assert gpu.markdown_table(["setting", "s/step"], [["LoRA r=16", "1.25 s"]]) == (
        "| setting | s/step |\n| --- | --- |\n| LoRA r=16 | 1.25 s |")
    assert gpu.show(None, " GiB") == "-" and gpu.show(12.345, " GiB") == "12.3 GiB"
    assert gpu.show_scores({"accuracy_greedy": 0.0}, {"accuracy_greedy": 0.902, "margin": 1.5}) == (
        "accuracy_greedy 0.0% -> 90.2%, margin 1.500")


def test_datasets_stand_in_gives_what_datasets_gives(monkeypatch):
    """The GPU machine may lack `datasets`: gpu.py then hands common.py a stand-in. Each way the
    scripts read their data gives the same with it as with datasets.Dataset."""
    real = {path: common.load_splits(os.path.join(ROOT, path), columns, 5) for path, columns in
            [("data/arithmetic", ("question", "answer")), ("data/preference", ("prompt", "chosen", "rejected"))]}
    monkeypatch.setattr(common, "datasets", gpu.datasets_stand_in())
    for path, (train, test) in real.items():
        columns = train.column_names
        stand_train, stand_test = common.load_splits(os.path.join(ROOT, path), columns, 5)
        assert type(stand_train).__module__ != type(train).__module__  # the stand-in, not datasets
        assert stand_train.column_names == columns and len(stand_train) == len(train) and len(stand_test) == 5
        assert stand_train[columns[0]] == list(train[columns[0]]) and stand_test.to_list() == test.to_list()
        assert stand_train[3] == train[3] and stand_train[2:6] == train[2:6]
        assert stand_train[[9, 1, 4]] == train[[9, 1, 4]]
        assert stand_train.select(range(3)).to_list() == train.select(range(3)).to_list()
        assert list(stand_test) == list(test) and stand_train.select([]).to_list() == []


def test_gpu_track_imports_the_repo_again_once_the_stand_in_is_in_place(monkeypatch):
    """Parts (a), (b) and (c) each call import_repo; after the first has put the stand-in in
    sys.modules (it has no __spec__, which importlib.util.find_spec refuses), the next must not fail."""
    monkeypatch.setitem(sys.modules, "datasets", gpu.datasets_stand_in())
    imported_common, _ = gpu.import_repo()
    assert imported_common is common and sys.modules["datasets"].__doc__.startswith("benchmarks/gpu.py's stand-in")


def test_lora_adds_two_matrix_products_a_scale_and_an_add_per_layer_and_token():
    """benchmarks/lora_ops.py's count, which docs/scaling.md uses to explain LoRA's slower rollout on
    the H100: per decoded token, each of the 168 adapted linear layers runs x A^T and (.)B^T, a
    scaling by alpha / r and the add to the base layer's output, on top of the base model's own."""
    lora_ops = load_benchmark("lora_ops")
    full = lora_ops.model_of_qwen_layout()
    lora = common.add_lora(lora_ops.model_of_qwen_layout(), lora_ops.Lora)
    ops_full, ops_lora = lora_ops.one_token(full, bf16=False), lora_ops.one_token(lora, bf16=False)
    layers = 24 * 7  # q, k, v, o, gate, up, down
    assert ops_lora["mm"] - ops_full["mm"] == 2 * layers
    assert ops_lora["mul"] - ops_full["mul"] == layers and ops_lora["add"] - ops_full["add"] == layers
    assert sum(ops_lora.values()) > 1.5 * sum(ops_full.values())


def test_gpu_track_saves_after_every_run_and_checks_precision_right_after_sft(monkeypatch):
    """A GPU machine may be lent for minutes: part (a) checks bf16 on the SFT model before the RL runs
    and hands its figures to save() after every run, so a chain cut short keeps what came before."""
    calls = []
    monkeypatch.setattr(gpu, "run_script", lambda script, args, output_dir: calls.append(script) or
                        {"steps": 1, "s_per_step": 0.1, "peak_gib": 0.5, "before": {}, "after": {}})
    monkeypatch.setattr(gpu, "precision_check", lambda model: calls.append("precision") or {"skipped": "test"})
    saved = []
    args = types.SimpleNamespace(sft_steps=1, rl_steps=1, rm_steps=1)
    figures = gpu.part_a(args, lambda so_far: saved.append((len(so_far["runs"]), "precision" in so_far)))
    assert calls == ["sft.py", "precision", "grpo.py", "reward_model.py", "ppo.py"]
    assert saved == [(1, False), (2, True), (3, True), (4, True)]
    assert [run["script"] for run in figures["runs"]] == ["sft.py", "grpo.py", "reward_model.py", "ppo.py"]
    assert figures["precision"] == {"skipped": "test"}


def test_by_kind_reads_the_shipped_questions_and_refuses_others():
    by_kind = load_benchmark("by_kind")
    assert [by_kind.kind_of(q) for q in ("What is 47 + 85?", "What is 28 - 75?", "What is 93 - 42?")] == \
        ["carry", "negative", "no borrow"]
    for question in ("What is 4 * 5?", "Natalia sold clips to 48 of her friends. How many?", "What is x + 1?"):
        with pytest.raises(ValueError):
            by_kind.kind_of(question)


@pytest.mark.slow  # the SFT run it evaluates takes about a minute
def test_accuracy_by_kind_splits_the_training_scripts_evaluation(sft_checkpoint):
    """benchmarks/by_kind.py runs common.evaluate on each kind's problems: the kinds partition the held-out
    problems, and the greedy answers they get right add up to the SFT run's own last evaluation of all
    of them (greedy does not depend on the other rows of a batch beyond float rounding: here, not at all)."""
    by_kind = load_benchmark("by_kind")
    model, tokenizer = common.load_model(sft_checkpoint)
    _, test = common.load_splits("data/arithmetic", num_eval_examples=64)
    result = by_kind.accuracy_by_kind(model, tokenizer, test, max_new_tokens=64, seed=0)
    kinds = [k for k in result if k != "all"]
    assert kinds == by_kind.KINDS and sum(result[k]["n"] for k in kinds) == result["all"]["n"] == 64
    with open(os.path.join(sft_checkpoint, "metrics.jsonl"), encoding="utf-8") as f:
        last_eval = [row for row in map(json.loads, f) if "eval/accuracy_greedy" in row][-1]
    correct = sum(round(result[k]["accuracy_greedy"] * result[k]["n"]) for k in kinds)
    assert correct == round(64 * last_eval["eval/accuracy_greedy"]) and 0 < correct < 64
    assert "| carry | 11 |" in by_kind.table({"SFT": result})
