"""Hand-computed values and gradients for every contract function (sft, grpo, common)."""
import math

import pytest
import torch

import grpo
from lib import rollout
from floats import approx, assert_close
from grpo import clip_fraction, group_advantages, grpo_loss, kl_k3
from sft import sft_loss


def test_gather_logprobs_hand_computed():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # [1, 2, 3]
    labels = torch.tensor([[2, 1]])
    expected = [3 - math.log(math.e + math.e**2 + math.e**3), -math.log(3)]
    assert_close(rollout.gather_logprobs(logits, labels), [expected], terms=6)  # a logsumexp of 3 terms


def test_gather_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    reference = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(rollout.gather_logprobs(logits, labels), reference, terms=10)  # logsumexps of 7 terms


def plain_label_logprobs(logits, labels):
    """gather_logprobs' plain expression (fused=False), autograd's own backward."""
    return rollout.gather_logprobs(logits, labels, fused=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [rollout.LabelLogprob.CHUNK, 5 * 11])  # one chunk; one row of [5, 11] at a time
def test_gather_logprobs_equals_its_plain_expression_and_gradient(dtype, chunk, monkeypatch):
    """LabelLogprob (the speed-up behind gather_logprobs) computes the plain expression's float32
    operations in the same order, for each chunk of rows: values and gradients equal to the bit,
    whatever the chunk size. With bf16 logits (autocast on a GPU) the gradient is the float32 one
    rounded once to bf16 (autograd's plain chain rounds its two terms to bf16, then adds them)."""
    monkeypatch.setattr(rollout.LabelLogprob, "CHUNK", chunk)
    torch.manual_seed(0)
    logits, labels = (4 * torch.randn(3, 5, 11)).to(dtype), torch.randint(0, 11, (3, 5))
    weights = torch.randn(3, 5)  # d loss / d logprob
    results = []
    for function, leaf_dtype in ((plain_label_logprobs, torch.float32), (rollout.gather_logprobs, dtype)):
        leaf = logits.to(leaf_dtype).requires_grad_(True)
        logprobs = function(leaf, labels)
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), leaf.grad))
    (plain, plain_grad), (fast, fast_grad) = results
    assert fast.dtype == torch.float32 and torch.equal(fast, plain)
    assert fast_grad.dtype == dtype and torch.equal(fast_grad, plain_grad.to(dtype))
    if dtype == torch.float32:  # the gradient is (onehot(label) - softmax) x weight: it sums to 0 at each position
        assert_close(fast_grad.sum(-1), torch.zeros(3, 5), terms=11, scale=weights.abs().max().item())


def test_mask_after_eos_keeps_first_eos_only():
    eos = 9
    ids = torch.tensor([[1, 2, eos, 0, 0], [eos, 3, eos, 4, 5], [1, 2, 3, 4, 5]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(rollout.mask_after_eos(ids, eos), expected)


# --- sft_loss -------------------------------------------------------------------------------
def test_sft_loss_value_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss = sft_loss(logprobs, mask)
    assert loss.item() == approx((1 + 2 + 4) / 3)
    loss.backward()
    assert_close(logprobs.grad, -mask.float() / 3, terms=2)  # padding gets exactly zero gradient


def test_sft_loss_accepts_bool_mask():
    logprobs = torch.tensor([[-1.0, -3.0]])
    assert sft_loss(logprobs, torch.tensor([[True, False]])).item() == approx(1.0)


# --- kl_k3 ----------------------------------------------------------------------------------
def test_kl_k3_hand_computed_and_gradient():
    logp = torch.tensor([[math.log(0.5), math.log(0.3)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.3)]])
    kl = kl_k3(logp, ref)
    # r = ref - logp = log(0.5): k3 = 0.5 - log(0.5) - 1; identical log-probs give 0.
    assert_close(kl, [[0.5 - math.log(0.5) - 1, 0.0]], terms=8)
    kl.sum().backward()
    # d k3 / d logp = 1 - exp(ref - logp)
    assert_close(logp.grad, [[1 - 0.5, 0.0]], terms=8)


def test_kl_k3_is_nonnegative():
    torch.manual_seed(0)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


# --- group_advantages -----------------------------------------------------------------------
def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 0.0, 0.0, 0.0, 4.0])
    adv = group_advantages(rewards, group_size=4)
    # group 1: mean 2.75, unbiased std sqrt(((1.75)^2 + 0.75^2 + 0.25^2 + 2.25^2) / 3)
    std1 = math.sqrt((1.75**2 + 0.75**2 + 0.25**2 + 2.25**2) / 3)
    std2 = math.sqrt((1**2 * 3 + 3**2) / 3)  # group 2: mean 1
    expected = [(r - 2.75) / (std1 + 1e-4) for r in (1, 2, 3, 5)] + [(r - 1) / (std2 + 1e-4) for r in (0, 0, 0, 4)]
    assert_close(adv, expected, terms=16)  # sums of 4, a sqrt, a division


def test_identical_rewards_in_a_group_give_zero_advantage():
    adv = group_advantages(torch.tensor([3.0, 3.0, 3.0, -1.0, 2.0, 0.5]), group_size=3)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3:].abs().sum() > 0


def test_group_advantages_are_zero_mean_per_group():
    torch.manual_seed(0)
    adv = group_advantages(torch.randn(32), group_size=8).view(4, 8)
    assert_close(adv.mean(dim=1), torch.zeros(4), terms=16, scale=adv.abs().max().item())


# --- grpo_loss ------------------------------------------------------------------------------
def test_grpo_loss_ratio_one_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss = grpo_loss(logprobs, logprobs.detach(), None, advantages, mask, grpo.Config(beta=0.0))
    # ratio = 1: per-token loss -A; row means: -2 and +1; mean over rows -0.5
    assert loss.item() == approx(-0.5)
    loss.backward()
    # d/dlogp = -A / (tokens in row) / rows
    assert_close(logprobs.grad, [[-0.5, -0.5], [0.5, 0.0]], terms=8)


def test_grpo_loss_dapo_is_a_token_mean():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    advantages = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss = grpo_loss(logprobs, logprobs.detach(), None, advantages, mask, grpo.Config(beta=0.0, loss_type="dapo"))
    assert loss.item() == approx((-2 - 2 + 1) / 3)
    loss.backward()
    assert_close(logprobs.grad, [[-2 / 3, -2 / 3], [1 / 3, 0.0]], terms=8)


def test_ratio_one_and_beta_zero_is_the_policy_gradient():
    torch.manual_seed(0)
    logprobs = torch.randn(4, 6, requires_grad=True)
    advantages, mask = torch.randn(4), (torch.rand(4, 6) > 0.3).long()
    mask[:, 0] = 1
    grpo_loss(logprobs, logprobs.detach(), None, advantages, mask, grpo.Config(beta=0.0)).backward()
    pg = logprobs.detach().clone().requires_grad_(True)
    n = mask.sum(dim=1, keepdim=True)
    (-(advantages[:, None] * pg * mask / n).sum(dim=1).mean()).backward()  # -A * logp, same aggregation
    assert_close(logprobs.grad, pg.grad, terms=16)


def test_clipped_term_has_no_gradient_outside_trust_region():
    # ratio = e^0.5 = 1.65 > 1 + eps. With A > 0 the clipped branch (constant 1.2 * A) is the min:
    # value -1.2, zero gradient. With A < 0 the unclipped branch is the min: gradient flows.
    old = torch.tensor([[0.0]])
    logp_pos = torch.tensor([[0.5]], requires_grad=True)
    loss = grpo_loss(logp_pos, old, None, torch.tensor([1.0]), torch.tensor([[1]]), grpo.Config(beta=0.0))
    assert loss.item() == approx(-1.2)
    loss.backward()
    assert logp_pos.grad.item() == 0.0
    logp_neg = torch.tensor([[0.5]], requires_grad=True)
    loss = grpo_loss(logp_neg, old, None, torch.tensor([-1.0]), torch.tensor([[1]]), grpo.Config(beta=0.0))
    assert loss.item() == approx(math.exp(0.5))
    loss.backward()
    assert logp_neg.grad.item() == approx(math.exp(0.5))  # d(ratio)/d(logp) = ratio


def test_grpo_loss_kl_term_hand_computed():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    loss = grpo_loss(logp, logp.detach(), ref, torch.tensor([0.0]), torch.tensor([[1]]), grpo.Config(beta=0.1))
    assert loss.item() == approx(0.1 * (0.5 - math.log(0.5) - 1))
    loss.backward()
    assert logp.grad.item() == approx(0.1 * (1 - 0.5))


def test_padding_junk_does_not_leak_into_value_or_gradient():
    torch.manual_seed(0)
    clean = torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    advantages, ref = torch.randn(3), torch.randn(3, 5)
    junk = clean.clone()
    junk[mask == 0] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, float("nan"), 7.0,
                                    -3.0])[: int((mask == 0).sum())]
    results = []
    for values in (clean, junk):
        logprobs = values.clone().requires_grad_(True)
        old, ref_junk = values - 0.1, torch.where(mask.bool(), ref, float("nan"))
        loss = grpo_loss(logprobs, old, ref_junk, advantages, mask, grpo.Config(beta=0.04))
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    assert torch.isfinite(results[1][0])
    assert torch.equal(results[0][0], results[1][0])  # junk is replaced before any arithmetic: the same ops
    assert torch.equal(results[0][1], results[1][1])
    assert (results[1][1][mask == 0] == 0).all()


def test_clip_fraction_counts_only_active_clips():
    old = torch.zeros(1, 4)
    logprobs = torch.tensor([[0.5, 0.5, -0.5, 0.0]])  # ratios 1.65, 1.65, 0.61, 1
    fraction = clip_fraction(logprobs, old, torch.tensor([1.0]), torch.tensor([[1, 1, 1, 0]]), 0.2)
    assert fraction == 2 / 3  # A > 0: only ratios above 1.2 are clipped


def test_a_later_iteration_ratio_clip_loss_and_logged_clip_fraction_by_hand():
    """--num_iterations 2: the second update's pi has moved from pi_old (old_logprobs, computed once before the
    updates), so the ratio is not 1 and the clip acts. grpo.grpo_loss (main's call), importance_ratio, the gradient
    and step_log's logged loss and clip_fraction, by hand. Ratios pi / pi_old:
        row 0, A = +1:  1.5 (above 1.2: clipped, loss -1.2, no gradient), 0.9 (-0.9), 1.1 (-1.1)
        row 1, A = -2:  0.5 (below 0.8: clipped, min(-1.0, -1.6) = -1.6, loss +1.6, no gradient),
                        1.5 (min(-3.0, -2.4) = -3.0: the pessimistic branch is the unclipped one, loss +3.0), padding
    'grpo' loss: ((-1.2 - 0.9 - 1.1) / 3 + (1.6 + 3.0) / 2) / 2 = (-1.0666667 + 2.3) / 2 = 0.6166667
    gradient d/dlogp of -ratio x A is -ratio x A, / (the row's tokens) / (2 rows):
        row 0: [0, -0.9 / 3 / 2, -1.1 / 3 / 2] = [0, -0.15, -0.1833333];  row 1: [0, 3.0 / 2 / 2, 0] = [0, 0.75, 0]
    clip_fraction: 2 clipped tokens of 5 = 0.4."""
    ratio = torch.tensor([[1.5, 0.9, 1.1], [0.5, 1.5, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logprobs = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -1.2, float("nan")]], requires_grad=True)  # junk at padding
    old = torch.where(mask.bool(), logprobs.detach() - torch.log(ratio), 7.0)  # pi_old: pi / ratio, junk at padding
    A = torch.tensor([1.0, -2.0])
    cfg = grpo.Config(num_iterations=2, beta=0.0, num_generations=2)
    zeroed = torch.where(mask.bool(), logprobs.detach(), 0.0), torch.where(mask.bool(), old, 0.0)
    # each ratio: exp of a float32 difference of log-probs up to 2.4 in size, exp accurate to an ulp: 4 roundings
    assert grpo.importance_ratio(*zeroed, mask).tolist() == [approx([1.5, 0.9, 1.1], scale=1.5 * 2.4),
                                                             approx([0.5, 1.5, 1.0], scale=1.5 * 2.4)]
    loss = grpo.grpo_loss(logprobs, old, None, A, mask, cfg, mask)
    # the loss: 5 token terms, each a ratio (above) times |A| <= 2, two means: ~12 roundings at scale 3 x 2.4
    assert loss.item() == approx(0.6166667, terms=12, scale=3.0 * 2.4)
    loss.backward()
    assert_close(logprobs.grad, [[0.0, -0.15, -0.1833333], [0.0, 0.75, 0.0]], terms=12, scale=3.0 * 2.4)
    assert grpo.clip_fraction(logprobs.detach(), old, A, mask, cfg.epsilon) == 0.4  # 2 / 5, counts: exact
    # the same on the line the step logs (step_log: pi_old is old_logprobs, not the moving policy's own log-probs)
    ids, ones = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 1, dtype=torch.long)
    batch = grpo.Rollout(prompts=["p", "p"], completions=["a", "b"], prompt_ids=ones, prompt_mask=ones,
                         completion_ids=ids, completion_mask=mask, sampler_logprobs=zeroed[1],
                         rewards_per_func=torch.tensor([[1.0, 0.5], [0.0, 0.5]]))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics, _ = grpo.step_log(batch, A, zeroed[0], old, None, torch.zeros(2, 3), loss.detach(), torch.tensor(1.0),
                               scheduler, cfg)
    assert metrics["clip_fraction"] == 0.4 and metrics["loss"] == loss.item() and metrics["kl"] == 0.0
