"""Gradient accumulation (--gradient_accumulation_steps) in grpo.py, mix.py and ppo.py: it changes memory,
not the result. (The micro-batches of every loss type add up to the step's loss: tests/test_grpo_variants.py.)"""


import pytest
import torch

import ppo
from conftest import assert_same_update, read_metrics, run_main
from floats import assert_close


def _rollout(seed=0, B=8, T=7):
    """logprobs [B, T] as leaf tensors, old / ref log-probs, advantages [B] and completions of very
    different lengths."""
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(B, T, generator=g) - 0.1).requires_grad_(True)
    old = logprobs.detach() + 0.2 * torch.randn(B, T, generator=g)
    ref = logprobs.detach() + 0.2 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, generator=g)
    lengths = torch.tensor([1, 7, 2, 7, 3, 5, 1, 6])[:B]
    mask = (torch.arange(T) < lengths[:, None]).long()
    return logprobs, old, ref, advantages, mask


@pytest.mark.slow
@pytest.mark.parametrize("script, loss_type", [("grpo.py", "grpo"), ("grpo.py", "dapo"), ("mix.py", "grpo"),
                                               ("mix.py", "dapo")])
def test_accumulation_4_equals_one_pass_end_to_end(sft_checkpoint, tmp_path, script, loss_type):
    """One GRPO (or MIX) step of 32 rows, as 1 micro-batch of 32 or 4 of 8: the same rollout and
    rewards (sampled once for the step), the same loss and gradient norm to float rounding, and
    the same weights (as norms: conftest.assert_same_update)."""
    common_args = ["--model", sft_checkpoint, "--max_steps", "1", "--num_generations", "4", "--loss_type", loss_type,
                   "--eval_steps", "100", "--num_eval_examples", "4", "--warmup_steps", "0"]
    one, four = str(tmp_path / "one"), str(tmp_path / "four")
    run_main(script, *common_args, "--per_device_train_batch_size", "32", "--output_dir", one)
    run_main(script, *common_args, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4",
             "--output_dir", four)
    (a,), (b,) = ([row for row in read_metrics(d) if "loss" in row] for d in (one, four))
    assert a["reward"] == b["reward"] and a["completion_length"] == b["completion_length"]  # the same rollout
    terms = 32 * 64  # completions x max_completion_length: the tokens summed into the loss and each gradient entry
    assert_close(b["loss"], a["loss"], terms=terms, scale=2.25)  # advantages and rewards are O(1)
    assert_close(b["grad_norm"], a["grad_norm"], terms=terms)
    assert_same_update(sft_checkpoint, one, four)


def test_ppo_micro_batch_losses_add_up_to_the_mini_batch_loss():
    """PPO's actor and critic losses are token means over a mini-batch: with the mini-batch's token
    count as denominator, its micro-batches add up to the one-pass losses and gradients."""
    logprobs, old, _, _, mask = _rollout()
    g = torch.Generator().manual_seed(1)
    advantages, returns = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g).requires_grad_(True)
    old_values = values.detach() + 0.3 * torch.randn(mask.shape, generator=g)
    for loss_fn, x, args in ((ppo.ppo_actor_loss, logprobs, (old, advantages, mask, 0.2)),
                             (ppo.ppo_critic_loss, values, (old_values, returns, mask, 0.2))):
        whole = loss_fn(x, *args)
        (expected,) = torch.autograd.grad(whole, x)
        total, grad = 0.0, torch.zeros_like(x)
        for rows in torch.arange(len(mask)).split(3):
            micro = loss_fn(x[rows], *(a[rows] for a in args[:3]), args[3], mask.sum())
            total = total + micro.detach()
            grad += torch.autograd.grad(micro, x)[0]
        assert_close(total, whole.detach(), terms=int(mask.sum()), scale=4.0)  # terms of size |A| ratio, (v - R)^2
        assert_close(grad, expected, terms=int(mask.sum()))


@pytest.mark.slow
def test_ppo_accumulation_2_equals_one_pass_end_to_end(sft_checkpoint, tmp_path):
    """One PPO step on 16 prompts as 1 micro-batch of 16 or 2 of 8: the same rollout and score,
    the same actor and critic losses to float rounding, and the same actor and critic weights (as
    norms, for AdamW's first step: see above)."""
    common_args = ["--model", sft_checkpoint, "--reward_model", "rule", "--max_steps", "1", "--eval_steps", "100",
                   "--num_eval_examples", "4", "--warmup_steps", "0"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_main("ppo.py", *common_args, "--per_device_train_batch_size", "16", "--output_dir", one)
    run_main("ppo.py", *common_args, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2",
             "--output_dir", two)
    (a,), (b,) = ([row for row in read_metrics(d) if "score" in row] for d in (one, two))
    assert a["score"] == b["score"] and a["completion_length"] == b["completion_length"]
    terms = 16 * 64
    assert_close(b["loss/actor"], a["loss/actor"], terms=terms, scale=4.0)  # whitened advantages x ratio
    assert_close(b["loss/critic"], a["loss/critic"], terms=terms)
    for sub in ("", "critic"):  # the critic is the SFT transformer with a new value head: compare the transformer
        assert_same_update(sft_checkpoint, one, two, sub)
