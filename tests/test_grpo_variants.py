"""The GRPO family as options of grpo.py (TRL's names): each changes only what it names, each is
checked on a hand-computed example, and the defaults give today's loss bit for bit."""

import json
import math
import os

import pytest
import torch

import common
from lib import rollout
import grpo
import mix
import ppo
from conftest import read_metrics, run_main
from floats import approx, assert_close, tolerance


def old_grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps, beta, loss_type):
    """The plain GRPO loss with no variant (the clipped ratio, the k3 KL, the grpo/dapo means), written out in full:
    grpo_loss at its defaults must give it bit for bit."""
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
    return per_token.sum() / common.mean_denominator(mask)


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
    new = grpo.grpo_loss(a, old, ref, A, mask, grpo.Config(beta=0.04, loss_type=loss_type))
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
    dr = grpo.grpo_loss(logprobs, old, ref, A, mask, grpo.Config(beta=0.04, loss_type="dr_grpo",
                                                                 max_completion_length=8))
    assert_close(dr, per_token_sum / (6 * 8), terms=30)
    # one micro-batch on one process: bnpo is dapo
    assert torch.equal(grpo.grpo_loss(logprobs, old, ref, A, mask, grpo.Config(beta=0.04, loss_type="bnpo")),
                       grpo.grpo_loss(logprobs, old, ref, A, mask, grpo.Config(beta=0.04, loss_type="dapo")))
    # two micro-batches of unequal token counts (rows 0-2: 9 tokens, rows 3-5: 11): bnpo is the mean of the
    # two micro-batch means, dapo the mean over all 20 tokens
    parts = [slice(0, 3), slice(3, 6)]
    bnpo = sum(grpo.grpo_loss(logprobs[p], old[p], ref[p], A[p], mask[p], grpo.Config(beta=0.04, loss_type="bnpo"),
                              mask) for p in parts)
    means = [old_grpo_loss(logprobs[p], old[p], ref[p], A[p], mask[p], 0.2, 0.04, "dapo") for p in parts]
    assert_close(bnpo, sum(means) / 2, terms=20)
    dapo = sum(grpo.grpo_loss(logprobs[p], old[p], ref[p], A[p], mask[p], grpo.Config(beta=0.04, loss_type="dapo"),
                              mask) for p in parts)
    assert_close(dapo, old_grpo_loss(logprobs, old, ref, A, mask, 0.2, 0.04, "dapo"), terms=20)
    assert abs(float(bnpo - dapo)) > 1e-3  # they are different losses


def accumulation_rollout(seed=1, N=8, T=7):
    """A step of N rows as main() holds it: logprobs [N, T] as a leaf (the pass that carries the gradient), pi_old
    and pi_ref that differ from it (ratios up to ~2.5: clipped and unclipped tokens), advantages [N], and completions
    of very different lengths, one of them empty (--mask_truncated_completions drops a cut-off one whole), so the
    micro-batches of 2 rows hold 3, 3, 12, 13 of the 31 tokens and those of 4 rows 6 and 25."""
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(N, T, generator=g) * 2 - 0.1).requires_grad_(True)
    old = logprobs.detach() + 0.4 * torch.randn(N, T, generator=g)
    ref = logprobs.detach() + 0.3 * torch.randn(N, T, generator=g)
    advantages = torch.randn(N, generator=g)
    lengths = torch.tensor([1, 2, 0, 3, 7, 5, 6, 7])[:N]
    mask = (torch.arange(T) < lengths[:, None]).long()
    return logprobs, old, ref, advantages, mask


def summed_as_main_sums(loss_of_rows, logprobs, rows_per_micro_batch):
    """grpo.py's and mix.py's step 5: one loss per micro-batch of rows_per_micro_batch rows (each divided by the
    step's counts), loss = the sum of their values, the gradient the sum of their backward passes."""
    total, grad = 0.0, torch.zeros_like(logprobs)
    for rows in torch.arange(len(logprobs)).split(rows_per_micro_batch):
        micro = loss_of_rows(rows)
        total = total + micro.detach()
        grad += torch.autograd.grad(micro, logprobs)[0]
    return total, grad


@pytest.mark.parametrize("rows_per_micro_batch", [2, 4, 8])
@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_every_loss_types_micro_batches_add_up_to_the_steps_loss_and_gradient(loss_type, rows_per_micro_batch):
    """--gradient_accumulation_steps changes memory, not the step: for each --loss_type, grpo.grpo_loss on each
    micro-batch with the step's whole mask (as main() calls it), summed as main() sums them, is the loss of the step
    and its gradient. The step's loss is grpo_loss on all 8 rows at once, except for 'bnpo', whose step is by
    definition the mean over the step's (equal) micro-batches of each one's own token mean: the mean of grpo_loss
    on each micro-batch alone (which is its token mean, checked first)."""
    logprobs, old, ref, A, mask = accumulation_rollout()
    T = mask.shape[1]
    cfg = grpo.Config(loss_type=loss_type, beta=0.04, max_completion_length=T,
                      epsilon_high=5.0 if loss_type == "cispo" else None)  # cispo caps its weight at epsilon_high
    cfg.check_together()

    def loss_of(rows, step_mask):
        return grpo.grpo_loss(logprobs[rows], old[rows], ref[rows], A[rows], mask[rows], cfg, step_mask)

    every = torch.arange(len(mask))
    parts = every.split(rows_per_micro_batch)
    if loss_type == "bnpo":
        per_token = grpo.per_token_loss(logprobs, old, ref, A, mask, cfg.epsilon, cfg.beta)  # [N, T]
        for rows in parts:  # one micro-batch alone: its token mean (the sum over its tokens / their count)
            assert_close(loss_of(rows, None), per_token[rows].sum() / mask[rows].sum(), terms=int(mask.sum()))
        step = sum(loss_of(rows, None) for rows in parts) / len(parts)
    else:
        step = loss_of(every, mask)
    (expected_grad,) = torch.autograd.grad(step, logprobs)
    total, grad = summed_as_main_sums(lambda rows: loss_of(rows, mask), logprobs, rows_per_micro_batch)
    # Tolerance: the step's loss is a sum of one term per token (n = the step's 31 tokens), each at most max|l_it|
    # after its division, added in another order by the micro-batches: n x eps x max|l_it| (floats.py); each
    # gradient entry is one token's derivative divided by a count (a few roundings), within the same n x eps x its
    # size. A micro-batch's own rows or tokens in a denominator move the loss by > 1000 such bounds (the control).
    terms = int(mask.sum())
    scale = grpo.per_token_loss(logprobs, old, ref, A, mask, cfg.epsilon, cfg.beta, cfg.epsilon_high,
                                cispo=loss_type == "cispo").abs().max().item()
    assert_close(total, step.detach(), terms=terms, scale=scale, msg=f"{loss_type} loss")
    assert_close(grad, expected_grad, terms=terms, msg=f"{loss_type} gradient")
    if len(parts) > 1:  # the control: each micro-batch divided by its own counts is another loss, far off
        wrong, _ = summed_as_main_sums(lambda rows: loss_of(rows, None), logprobs, rows_per_micro_batch)
        assert abs(float(wrong - step.detach())) > 1000 * tolerance(terms, scale), loss_type


@pytest.mark.parametrize("rows_per_micro_batch", [2, 4])
@pytest.mark.parametrize("loss_type", mix.LOSS_TYPES)
def test_mix_micro_batches_add_up_to_the_steps_loss_for_every_loss_type(loss_type, rows_per_micro_batch):
    """mix.py's loss (grpo.aggregate in both terms): the same check for its loss, 5 usual rows and 3 expert rows,
    so that micro-batches hold usual rows only, both kinds, or expert rows only. For 'bnpo' each term's step is the
    mean of its micro-batches' token means, each weighted by its share of the term's rows (a micro-batch with
    none of them adds nothing): mix_loss on each micro-batch alone, its terms so weighted."""
    logprobs, old, ref, A, mask = accumulation_rollout()
    expert = torch.tensor([False, False, False, False, False, True, True, True])
    T, mu = mask.shape[1], 0.3

    def mix_loss(rows, step_masks, mu=mu):
        return mix.mix_loss(logprobs[rows], old[rows], ref[rows], A[rows], mask[rows], expert[rows],
                            mix.Config(mu=mu, beta=0.04, loss_type=loss_type, max_completion_length=T), step_masks)

    every = torch.arange(len(mask))
    parts = every.split(rows_per_micro_batch)
    if loss_type == "bnpo":
        def share(rows, kind):
            return (expert[rows] == kind).sum() / (expert == kind).sum()

        step = sum((share(rows, False) * mix_loss(rows, None, mu=0.0) * (1 - mu)
                    + share(rows, True) * mix_loss(rows, None, mu=1.0) * mu) for rows in parts)
    else:
        step = mix_loss(every, (mask, expert))
    (expected_grad,) = torch.autograd.grad(step, logprobs)
    total, grad = summed_as_main_sums(lambda rows: mix_loss(rows, (mask, expert)), logprobs, rows_per_micro_batch)
    # as in the test above: n = the step's tokens, each term's size at most max(|l_it|, |log p|) < 3 + 0.04 x k3
    terms = int(mask.sum())
    scale = max(grpo.per_token_loss(logprobs, old, ref, A, mask, 0.2, 0.04).abs().max().item(),
                logprobs.abs().max().item())
    assert_close(total, step.detach(), terms=terms, scale=scale, msg=f"{loss_type} loss")
    assert_close(grad, expected_grad, terms=terms, msg=f"{loss_type} gradient")
    wrong, _ = summed_as_main_sums(lambda rows: mix_loss(rows, None), logprobs, rows_per_micro_batch)
    assert abs(float(wrong - step.detach())) > 1000 * tolerance(terms, scale), loss_type


def test_epsilon_high_moves_only_the_upper_clip():
    """Ratio 1.25 with A = +1: clipped at 1.2 by epsilon 0.2 (no gradient), free under epsilon_high 0.28.
    Ratio 0.75 with A = -1: clipped at 0.8 either way (epsilon_high leaves the lower bound alone)."""
    old = torch.zeros(2, 1)
    logprobs = torch.log(torch.tensor([[1.25], [0.75]])).requires_grad_()
    A, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    loss = grpo.grpo_loss(logprobs, old, None, A, mask, grpo.Config(beta=0.0))
    assert loss.item() == approx((-1.2 + 0.8) / 2)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0], [0.0]]
    logprobs.grad = None
    loss = grpo.grpo_loss(logprobs, old, None, A, mask, grpo.Config(beta=0.0, epsilon_high=0.28))
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
    grpo.grpo_loss(lp, old, None, A, mask, grpo.Config(beta=0.0, importance_sampling_level="sequence")).backward()
    assert lp.grad[0].tolist() == [0.0, 0.0, 0.0]
    # when every token of a completion has the same ratio, the sequence level changes nothing
    same = torch.tensor([[0.1, 0.1, 0.0], [0.2, 0.0, 0.0]])
    for loss_type in ("grpo", "dapo"):
        token = grpo.grpo_loss(same, old, None, A, mask, grpo.Config(beta=0.0, loss_type=loss_type))
        sequence = grpo.grpo_loss(same, old, None, A, mask, grpo.Config(beta=0.0, loss_type=loss_type,
                                                                         importance_sampling_level="sequence"))
        assert_close(sequence, token, terms=4)


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


def test_rloo_on_a_four_sample_group_by_hand():
    """Rewards 1, 0, 0, 1: each baseline is the mean of the other three, A = r - (sum - r) / 3:
    1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3, which is 4/3 x (r - mean); a group of equal rewards gets 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    A = grpo.rloo_advantages(rewards, 4)
    assert A.tolist() == approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])
    centred = rewards.view(-1, 4) - rewards.view(-1, 4).mean(dim=1, keepdim=True)
    assert_close(A, 4 / 3 * centred.view(-1), terms=4)
    assert torch.equal(grpo.advantages_of(rewards, 4, "rloo"), A)


def test_reinforce_pp_divides_the_centred_rewards_by_the_batchs_std():
    """Rewards (1, 0, 0, 1) and (3, 3, 3, 3) and (0, 4, 0, 0): centred per group (+-0.5; 0; -1, 3, -1, -1),
    then the batch's mean (0) and std over all 12, divided by 12 as OpenRLHF's: sqrt((4 x 0.25 + 12) / 12)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0, 0.0, 4.0, 0.0, 0.0])
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0, -1.0, 3.0, -1.0, -1.0]
    std = math.sqrt((4 * 0.25 + 1 + 9 + 1 + 1) / 12)
    A = grpo.reinforce_pp_advantages(rewards, 4)
    assert_close(A, [c / std for c in centred], terms=12)
    # unlike the group std, the batch std keeps a 1-of-4 group's advantages larger than a 2-of-4 group's
    assert A[9] > A[0] and grpo.group_advantages(rewards, 4)[9] < 2 * grpo.group_advantages(rewards, 4)[0]
    assert torch.equal(grpo.advantages_of(rewards, 4, "reinforce_pp"), A)
    assert torch.equal(grpo.advantages_of(rewards, 4), grpo.group_advantages(rewards, 4))  # the default


def test_cispo_keeps_every_tokens_gradient_through_a_detached_capped_weight():
    """Ratios 1.25 (A = +1), 0.75 (A = -1), 8.0 (A = +1) with epsilon_high 5: PPO's clip zeroes the first two
    tokens' gradients at epsilon 0.2; CISPO's loss is -min(ratio, 5).detach() x A x logp, mean over the 3
    tokens, so d/dlogp = -min(ratio, 5) x A / 3 for every token: -1.25/3, +0.75/3, -5/3."""
    old = torch.zeros(3, 1)
    logprobs = torch.log(torch.tensor([[1.25], [0.75], [8.0]])).requires_grad_()
    A, mask = torch.tensor([1.0, -1.0, 1.0]), torch.ones(3, 1)
    loss = grpo.grpo_loss(logprobs, old, None, A, mask, grpo.Config(beta=0.0, loss_type="cispo", epsilon_high=5.0))
    expected = -(1.25 * math.log(1.25) - 0.75 * math.log(0.75) + 5.0 * math.log(8.0)) / 3
    assert_close(loss, expected, terms=6)
    loss.backward()
    assert_close(logprobs.grad.flatten(), [-1.25 / 3, 0.75 / 3, -5.0 / 3], terms=6)
    logprobs.grad = None
    grpo.grpo_loss(logprobs, old, None, A, mask, grpo.Config(beta=0.0, loss_type="grpo")).backward()
    assert logprobs.grad.flatten().tolist() == [0.0, 0.0, 0.0]  # PPO's clip: outside [0.8, 1.2], no gradient
    assert grpo.clip_fraction(logprobs.detach(), old, A, mask, 0.2, 5.0, loss_type="cispo") == approx(1 / 3)
    # on-policy (ratio 1) CISPO's gradient is the plain policy gradient, the same as grpo's dapo aggregation
    a, b = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]], requires_grad=True), torch.tensor([[-0.5, -1.0], [-2.0, -0.1]],
                                                                                        requires_grad=True)
    A2, mask2 = torch.tensor([1.0, -2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    grpo.grpo_loss(a, a.detach(), None, A2, mask2,
                   grpo.Config(beta=0.0, loss_type="cispo", epsilon_high=5.0)).backward()
    grpo.grpo_loss(b, b.detach(), None, A2, mask2, grpo.Config(beta=0.0, loss_type="dapo")).backward()
    assert_close(a.grad, b.grad, terms=4)


def test_the_new_settings_refuse_what_cannot_work(tmp_path):
    """Checked with the other settings, before any model is loaded or folder made."""
    for args, message in ((["--loss_type", "cispo"], "set it"),
                          (["--loss_type", "cispo", "--epsilon_high", "5", "--importance_sampling_level", "sequence"],
                           "keep --importance_sampling_level token"),
                          (["--advantage_estimator", "rloo", "--scale_rewards", "none"], "has its own scale")):
        with pytest.raises(AssertionError, match=message):  # run_main turns the one-sentence exit into this
            run_main("grpo.py", "--model", str(tmp_path / "never_loaded"), "--output_dir", str(tmp_path / "out"), *args)
        assert not os.path.exists(tmp_path / "out")


def fake_rollout(rewards: list[float], width: int, tag: str) -> grpo.Rollout:
    """sample_and_score's record for len(rewards) rows of prompts of the given width."""
    n = len(rewards)
    return grpo.Rollout(prompts=[f"{tag}{i}" for i in range(n)], completions=[f"c{tag}{i}" for i in range(n)],
                        prompt_ids=torch.full((n, width), 7), prompt_mask=torch.ones(n, width, dtype=torch.long),
                        completion_ids=torch.full((n, width + 1), 8),
                        completion_mask=torch.ones(n, width + 1, dtype=torch.long),
                        sampler_logprobs=-torch.arange(1.0, n + 1)[:, None].expand(n, width + 1),  # row i: -(i + 1)
                        rewards_per_func=torch.tensor(rewards).unsqueeze(1))


def test_dynamic_sampling_never_keeps_a_group_of_equal_rewards():
    """Groups of 2, 3 wanted. Round 1: (1, 1) dropped, (0, 1) kept; round 2 (wider rows): (0, 0) dropped,
    (1, 0), (2, 3) kept: 3 groups after 2 rounds, the third round never drawn. Rows are padded to the widest
    round (prompts on the left, completions on the right) with their masks 0 there."""
    rounds = iter([fake_rollout([0.0, 0.0, 1.0, 0.0, 2.0, 3.0], 3, "b"), fake_rollout([5.0, 5.0], 1, "never")])
    first = fake_rollout([1.0, 1.0, 0.0, 1.0], 2, "a")
    kept, used = grpo.dynamic_sampling(first, lambda: next(rounds), group_size=2, num_groups=3, max_rounds=4,
                                       pad_token_id=0)
    assert used == 2
    assert kept.prompts == ["a2", "a3", "b2", "b3", "b4", "b5"]
    grouped = kept.rewards_per_func.sum(dim=1).view(-1, 2)
    assert (grouped[:, 0] != grouped[:, 1]).all()  # every kept group has spread
    assert kept.prompt_ids.shape == (6, 3) and kept.prompt_mask[:2].tolist() == [[0, 1, 1]] * 2
    assert kept.completion_mask[:2].tolist() == [[1, 1, 1, 0]] * 2 and kept.prompt_ids[0, 0] == 0
    # the sampler's log-probs travel with their rows, right-padded with 0 as the completions are
    assert kept.sampler_logprobs[:2].tolist() == [[-3.0] * 3 + [0.0], [-4.0] * 3 + [0.0]]
    assert kept.sampler_logprobs[2:].tolist() == [[-(i + 1.0)] * 4 for i in (2, 3, 4, 5)]


def test_dynamic_sampling_stops_after_max_rounds_with_what_it_found():
    """Only equal groups, twice: after max_rounds = 2 nothing is kept (None: the step has nothing to learn)."""
    more = iter([fake_rollout([1.0, 1.0], 1, "b")])
    kept, used = grpo.dynamic_sampling(fake_rollout([0.0, 0.0, 3.0, 3.0], 1, "a"), lambda: next(more), 2, 2, 2, 0)
    assert used == 2 and kept is None


@pytest.mark.slow
def test_dynamic_sampling_and_the_new_estimators_run(sft_checkpoint, tmp_path):
    """Two steps each: rloo, reinforce_pp with cispo, and dynamic sampling (every kept group with spread)."""
    common_args = ["--model", sft_checkpoint, "--max_steps", "2", "--per_device_train_batch_size", "32",
                   "--eval_steps", "100", "--num_eval_examples", "8", "--eval_on_start", "false"]
    for name, args in (("rloo", ["--advantage_estimator", "rloo"]),
                       ("rpp", ["--advantage_estimator", "reinforce_pp", "--loss_type", "cispo", "--epsilon_high", "5",
                                "--num_iterations", "2"]),
                       ("ds", ["--dynamic_sampling", "true"])):
        out = str(tmp_path / name)
        run_main("grpo.py", "--output_dir", out, *common_args, *args)
        rows = [row for row in read_metrics(out) if "loss" in row]
        assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
        if name == "ds":
            assert all(row["frac_reward_zero_std"] == 0.0 and 1 <= row["dynamic_sampling/rounds"] <= 4 for row in rows)
