"""rft.py: which answers are kept, that its step points where REINFORCE with a 0/1 reward does (its size
scaled by what is kept), and that a short run learns."""
import json
import os

import pytest
import torch

import common
import rft
from lib import rollout
import sft
from conftest import run_main


def test_keep_mask_all_or_the_first_accepted_of_each_prompt():
    accepted = torch.tensor([1.0, 0, 1, 0, 0, 0, 0, 1, 1])  # three prompts, k = 3
    assert rft.keep_mask(accepted, 3, "all").tolist() == [True, False, True, False, False, False, False, True, True]
    assert rft.keep_mask(accepted, 3, "first").tolist() == [True, False, False, False, False, False, False, True,
                                                             False]


def test_the_sft_step_on_kept_answers_points_where_reinforce_does_with_a_0_1_reward():
    """REINFORCE with a 0/1 reward, -(1/N) sum_i r_i sum_t log pi(y_it) over the N samples, and the NLL of the
    kept answers, -(1/K) sum_kept sum_t log pi(y_it) over their K tokens, have gradients in the same
    direction; the NLL's is N / K times REINFORCE's, so an RFT step's size follows how much is kept."""
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    model = common.build_tiny_model(tokenizer)
    prompts = [common.make_prompt(tokenizer, q) for q in ("What is 1 + 2?", "What is 7 - 9?") for _ in range(2)]
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 8)
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0])
    kept = reward.bool()
    N, K = len(reward), completion_mask[kept].sum().item()
    gradients = []
    for loss_of in (lambda lp: sft.sft_loss(lp[kept], completion_mask[kept]),
                    lambda lp: -(reward[:, None] * lp * completion_mask).sum() / N):
        model.zero_grad()
        loss_of(rollout.completion_logprobs(model, input_ids, attention_mask, completion_ids.shape[1])).backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    nll, reinforce = gradients
    scale = nll.abs().max().item()
    assert scale > 0 and K != N  # a scale that could be told from 1
    assert torch.allclose(nll, reinforce * N / K, rtol=0, atol=1e-5 * scale)
    assert not torch.allclose(nll, reinforce, rtol=0, atol=1e-5 * scale)


@pytest.mark.slow
def test_a_short_run_changes_the_weights_and_keeps_what_the_checker_accepts(sft_checkpoint, tmp_path):
    out = str(tmp_path / "rft")
    run_main("rft.py", "--model", sft_checkpoint, "--max_steps", "3", "--per_device_train_batch_size", "32",
             "--eval_steps", "3", "--num_eval_examples", "16", "--output_dir", out)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [row for row in rows if "kept" in row]
    assert len(steps) == 3 and all(0 < row["kept"] == row["accuracy"] < 1 for row in steps)  # --keep all
    from test_sampler_mismatch import assert_float32_gap

    for row in steps:  # the kept answers: the sampler's log-probs against the SFT pass's
        assert_float32_gap(row, sft_checkpoint)
    before, after = (common.load_model(path)[0].state_dict() for path in (sft_checkpoint, out))
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert os.path.isfile(os.path.join(out, "rft.png")) and os.path.isfile(os.path.join(out, "eval.json"))
    # at another temperature the sampler's distribution is not the one the SFT loss reads: no gap is logged
    hot = str(tmp_path / "rft_hot")
    run_main("rft.py", "--model", sft_checkpoint, "--max_steps", "1", "--per_device_train_batch_size", "32",
             "--eval_steps", "1", "--num_eval_examples", "4", "--temperature", "1.3", "--output_dir", hot)
    rows = [json.loads(line) for line in open(os.path.join(hot, "metrics.jsonl"))]
    assert [row for row in rows if "kept" in row]
    assert not any(key.startswith("sampling/") for row in rows for key in row)


def test_the_pages_quote_the_committed_side_by_side():
    """docs/best_of_n.md and docs/dpo.md quote rft's gains as docs/syllabus.json has them."""
    import statistics

    from conftest import ROOT, load_benchmark

    syllabus = load_benchmark("syllabus")
    with open(os.path.join(ROOT, "docs", "syllabus.json")) as f:
        results = json.load(f)["results"]
    pages = {}
    for name in ("best_of_n.md", "dpo.md"):
        with open(os.path.join(ROOT, "docs", name)) as f:
            pages[name] = " ".join(f.read().split())
    rft, grpo = syllabus.gains(results["rft"]), syllabus.gains(results["grpo"])
    assert all(a > b for a, b in zip(rft, grpo))  # "more on every seed"
    assert (f"gained {statistics.fmean(rft):.1f} points of held-out sampled accuracy in 40 steps "
            f"({min(rft):.1f} to {max(rft):.1f} over the seeds) against GRPO's {statistics.fmean(grpo):.1f} "
            f"({min(grpo):.1f} to {max(grpo):.1f})") in pages["best_of_n.md"]
    per_seed = [f"{a - b:+.1f}" for a, b in zip(rft, grpo)]
    assert (f"{statistics.fmean(rft):.1f} points ({min(rft):.1f} to {max(rft):.1f}) against GRPO's "
            f"{statistics.fmean(grpo):.1f}, per seed {', '.join(per_seed[:-1])} and {per_seed[-1]} (shown"
            ) in pages["dpo.md"]
    minutes = [statistics.fmean(run["cost"]["cpu_minutes"] for run in results[m]) for m in ("rft", "grpo")]
    assert f"({minutes[0]:.1f} minutes against {minutes[1]:.1f})" in pages["dpo.md"]
    assert results["rft"][0]["settings"]["learning_rate"] == results["grpo"][0]["settings"]["learning_rate"] == 5e-5
