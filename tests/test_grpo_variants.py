"""The GRPO family as options of grpo.py (TRL's names): each changes only what it names, each is
checked on a hand-computed example, and the defaults give today's loss bit for bit."""

import json
import math
import os

import pytest
import torch

import common
import rollout
import grpo
import mix
import ppo
from conftest import read_metrics, run_main
from floats import approx, assert_close


def old_grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps, beta, loss_type):
    """grpo_loss as it was before the variants (commit 9172d7b), for the bit-for-bit default check."""
    mask = mask.bool()
    logprobs, old_logprobs = torch.where(mask, logprobs, 0.0), torch.where(mask, old_logprobs, 0.0)
    ratio = torch.exp(logprobs - old_logprobs)
    A = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * A)
    if beta != 0:
        per_token = per_token + beta * grpo.kl_k3(logprobs, torch.where(mask, ref_logprobs, 0.0))
    per_token = torch.where(mask, per_token, 0.0)
    if loss_type == "grpo":
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / len(mask)
    return per_token.sum() / common.token_count(mask)


def batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g) * 3
    old = logprobs + 0.3 * torch.randn(B, T, generator=g)  # ratios well away from 1: clipping matters
    ref = logprobs + 0.2 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    for row, length in enumerate([5, 3, 1, 4, 2, 5][:B]):
        mask[row, length:] = 0
    return logprobs, old, ref, torch.randn(B, generator=g), mask


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_defaults_give_todays_loss_and_gradient_bit_for_bit(loss_type):
    logprobs, old, ref, A, mask = batch()
    a, b = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    new = grpo.grpo_loss(a, old, ref, A, mask, 0.2, 0.04, loss_type)
    before = old_grpo_loss(b, old, ref, A, mask, 0.2, 0.04, loss_type)
    new.backward()
    before.backward()
    assert torch.equal(new, before) and torch.equal(a.grad, b.grad)
    rewards = torch.tensor([1.0, -1.0, 2.25, 0.25, 2.25, 2.25, 2.25, 2.25])
    grouped = rewards.view(-1, 4)
    todays = ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    assert torch.equal(grpo.group_advantages(rewards, 4), todays)


def test_scale_rewards_hand_computed():
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 6.0])  # three groups of 2
    assert grpo.group_advantages(rewards, 2, "none").tolist() == [-1.0, 1.0, 0.0, 0.0, -2.0, 2.0]
    group = grpo.group_advantages(rewards, 2, "group")  # each group's std: sqrt(2), 0, sqrt(8)
    assert group.tolist() == approx([-1 / (2**0.5 + 1e-4), 1 / (2**0.5 + 1e-4), 0, 0, -2 / (8**0.5 + 1e-4),
                                     2 / (8**0.5 + 1e-4)])
    std = math.sqrt(sum((r - 2.0) ** 2 for r in rewards.tolist()) / 5)  # the whole batch: mean 2, unbiased std
    batch_scaled = grpo.group_advantages(rewards, 2, "batch")
    assert batch_scaled.tolist() == approx([c / (std + 1e-4) for c in (-1.0, 1.0, 0.0, 0.0, -2.0, 2.0)])


def test_dr_grpo_divides_by_a_constant_and_bnpo_by_the_micro_batch_tokens():
    logprobs, old, ref, A, mask = batch()
    per_token_sum = old_grpo_loss(logprobs, old, ref, A, mask, 0.2, 0.04, "dapo") * mask.sum()  # the token sum
    dr = grpo.grpo_loss(logprobs, old, ref, A, mask, 0.2, 0.04, "dr_grpo", max_completion_length=8)
    assert_close(dr, per_token_sum / (6 * 8), terms=30)
    # one micro-batch on one process: bnpo is dapo
    assert torch.equal(grpo.grpo_loss(logprobs, old, ref, A, mask, 0.2, 0.04, "bnpo"),
                       grpo.grpo_loss(logprobs, old, ref, A, mask, 0.2, 0.04, "dapo"))
    # two micro-batches of unequal token counts (rows 0-2: 9 tokens, rows 3-5: 11): bnpo is the mean of the
    # two micro-batch means, dapo the mean over all 20 tokens
    parts = [slice(0, 3), slice(3, 6)]
    bnpo = sum(grpo.grpo_loss(logprobs[p], old[p], ref[p], A[p], mask[p], 0.2, 0.04, "bnpo", 6, None) for p in parts)
    means = [old_grpo_loss(logprobs[p], old[p], ref[p], A[p], mask[p], 0.2, 0.04, "dapo") for p in parts]
    assert_close(bnpo, sum(means) / 2, terms=20)
    dapo = sum(grpo.grpo_loss(logprobs[p], old[p], ref[p], A[p], mask[p], 0.2, 0.04, "dapo", 6,
                              mask.sum()) for p in parts)
    assert_close(dapo, old_grpo_loss(logprobs, old, ref, A, mask, 0.2, 0.04, "dapo"), terms=20)
    assert abs(float(bnpo - dapo)) > 1e-3  # they are different losses


def test_epsilon_high_moves_only_the_upper_clip():
    """Ratio 1.25 with A = +1: clipped at 1.2 by epsilon 0.2 (no gradient), free under epsilon_high 0.28.
    Ratio 0.75 with A = -1: clipped at 0.8 either way (epsilon_high leaves the lower bound alone)."""
    old = torch.zeros(2, 1)
    logprobs = torch.log(torch.tensor([[1.25], [0.75]])).requires_grad_()
    A, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    loss = grpo.grpo_loss(logprobs, old, None, A, mask, 0.2, 0.0)
    assert loss.item() == approx((-1.2 + 0.8) / 2)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0], [0.0]]
    logprobs.grad = None
    loss = grpo.grpo_loss(logprobs, old, None, A, mask, 0.2, 0.0, epsilon_high=0.28)
    assert loss.item() == approx((-1.25 + 0.8) / 2)
    loss.backward()
    assert logprobs.grad.flatten().tolist() == approx([-1.25 / 2, 0.0])  # d(-ratio)/dlogp = -ratio, / 2 sequences
    assert grpo.clip_fraction(logprobs.detach(), old, A, mask, 0.2) == 1.0
    assert grpo.clip_fraction(logprobs.detach(), old, A, mask, 0.2, epsilon_high=0.28) == 0.5


def test_sequence_level_ratio_is_the_geometric_mean_of_the_token_ratios():
    logprobs = torch.tensor([[0.1, 0.3, 0.0], [0.2, 0.0, 0.0]])
    old, mask = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ratio = grpo.importance_ratio(logprobs, old, mask, "sequence")
    assert ratio.shape == (2, 1) and ratio.flatten().tolist() == approx([math.exp(0.2), math.exp(0.2)])
    # GSPO's clip acts on the whole completion: ratio exp(0.2) = 1.22 > 1 + 0.2, A > 0:
    # both its tokens lose their gradient
    A = torch.tensor([1.0, -1.0])
    lp = logprobs.clone().requires_grad_()
    grpo.grpo_loss(lp, old, None, A, mask, 0.2, 0.0, importance_sampling_level="sequence").backward()
    assert lp.grad[0].tolist() == [0.0, 0.0, 0.0]
    # when every token of a completion has the same ratio, the sequence level changes nothing
    same = torch.tensor([[0.1, 0.1, 0.0], [0.2, 0.0, 0.0]])
    for loss_type in ("grpo", "dapo"):
        token = grpo.grpo_loss(same, old, None, A, mask, 0.2, 0.0, loss_type)
        sequence = grpo.grpo_loss(same, old, None, A, mask, 0.2, 0.0, loss_type, importance_sampling_level="sequence")
        assert_close(sequence, token, terms=4)


def test_the_shared_functions_are_the_same_in_mix():
    for name in ("group_advantages", "importance_ratio", "grpo_loss", "clip_fraction"):
        assert getattr(mix, name).__code__.co_code == getattr(grpo, name).__code__.co_code, name


def test_mix_sft_term_follows_the_loss_type():
    logprobs, _, _, _, mask = batch()
    nll_sum = float(torch.where(mask.bool(), -logprobs, 0.0).sum())
    loss = mix.sft_loss(logprobs, mask, "dr_grpo", max_completion_length=8)
    assert loss.item() == approx(nll_sum / (6 * 8), terms=20)
    assert torch.equal(mix.sft_loss(logprobs, mask, "bnpo"), mix.sft_loss(logprobs, mask, "dapo"))


def test_adaptive_kl_hand_computed():
    assert ppo.adaptive_kl_coef(0.1, 2.0, 1.0, 100, 10) == approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped to +0.2
    assert ppo.adaptive_kl_coef(0.1, 0.95, 1.0, 100, 10) == approx(0.1 * (1 - 0.05 * 10 / 100))
    assert ppo.adaptive_kl_coef(0.1, 0.0, 1.0, 100, 10) == approx(0.1 * (1 - 0.2 * 10 / 100))


# --- the options in the scripts ----------------------------------------------------------------------
SHORT = ["--max_steps", "2", "--eval_steps", "100", "--num_eval_examples", "8", "--per_device_train_batch_size", "32",
         "--num_generations", "4", "--eval_on_start", "false", "--warmup_steps", "1"]


@pytest.mark.slow
def test_grpo_completions_jsonl_holds_what_was_trained_on(sft_checkpoint, tmp_path):
    """Every completion of each logged step, with its rewards and the advantage the loss used, and
    frac_reward_zero_std agrees with the groups it shows."""
    out = str(tmp_path / "grpo")
    run_main("grpo.py", "--model", sft_checkpoint, "--output_dir", out, *SHORT, "--log_completions_steps", "1")
    with open(os.path.join(out, "completions.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [1] * 32 + [2] * 32
    metrics = [row for row in read_metrics(out) if "reward" in row]
    logged_digits = 1e-5  # metrics.jsonl and completions.jsonl keep 6 significant digits
    for step, logged in zip((1, 2), metrics):
        step_rows = [row for row in rows if row["step"] == step]
        rewards = torch.tensor([row["rewards/correctness_reward"] + row["rewards/format_reward"] for row in step_rows])
        expected = grpo.group_advantages(rewards, 4).tolist()
        assert [row["advantage"] for row in step_rows] == pytest.approx(expected, rel=logged_digits, abs=logged_digits)
        assert logged["reward"] == pytest.approx(rewards.mean().item(), rel=logged_digits)
        zero_std = (rewards.view(-1, 4).std(dim=1) == 0).float().mean().item()
        assert logged["frac_reward_zero_std"] == pytest.approx(zero_std, rel=logged_digits)
        for row in step_rows:
            assert row["prompt"].endswith("assistant\n") and isinstance(row["completion"], str)


@pytest.mark.slow
def test_mix_and_ppo_write_completions_jsonl(sft_checkpoint, tmp_path):
    run_main("mix.py", "--model", sft_checkpoint, "--output_dir", str(tmp_path / "mix"), *SHORT,
             "--log_completions_steps", "2")
    run_main("ppo.py", "--model", sft_checkpoint, "--reward_model", "rule", "--output_dir", str(tmp_path / "ppo"),
             *SHORT[:6], "--per_device_train_batch_size", "16", "--eval_on_start", "false",
             "--log_completions_steps", "1")
    with open(tmp_path / "mix" / "completions.jsonl") as f:
        mix_rows = [json.loads(line) for line in f]
    assert len(mix_rows) == 24 and {row["step"] for row in mix_rows} == {2}  # the 24 rollouts, not the 8 expert rows
    with open(tmp_path / "ppo" / "completions.jsonl") as f:
        ppo_rows = [json.loads(line) for line in f]
    assert len(ppo_rows) == 32 and all(row["score"] in (1.0, -1.0) for row in ppo_rows)  # the rule's scores
    assert all(row["completion"].strip().endswith("</answer>") for row in ppo_rows if row["score"] == 1.0)


def test_drop_truncated_hand_computed():
    eos = 9
    ids = torch.tensor([[5, 9, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0], [5, 6, 9, 9]])
    mask = rollout.mask_after_eos(ids, eos)  # [[1,1,0,0], [1,1,1,1], [1,0,0,0], [1,1,1,0]]
    assert grpo.drop_truncated(ids, mask, eos).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]


@pytest.mark.slow
def test_mask_truncated_completions_changes_the_loss_only(sft_checkpoint, tmp_path):
    """Same seed, same first rollout (the option acts after it): the rewards and lengths of step 1
    are the same, and its loss differs, because at 24 new tokens part of the completions are cut off."""
    first_steps = []
    for flag in ("true", "false"):
        out = tmp_path / flag
        run_main("grpo.py", "--model", sft_checkpoint, "--output_dir", str(out), *SHORT, "--max_steps", "1",
                 "--max_completion_length", "24", "--mask_truncated_completions", flag, "--log_completions_steps", "1")
        first_steps.append(read_metrics(out)[0])
    masked, unmasked = first_steps
    for key in ("reward", "completion_length", "frac_reward_zero_std", "accuracy"):
        assert masked[key] == unmasked[key], key
    assert masked["loss"] != unmasked["loss"]
