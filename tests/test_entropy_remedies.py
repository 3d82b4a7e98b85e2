"""Remedies for a collapsing entropy: grpo_entropy.py's Clip-Cov and KL-Cov (Cui et al. 2025) against a hand
computation and verl's code, and grpo.py's entropy bonus."""
import pytest
import torch

import common
import grpo
import grpo_entropy
from lib import rollout
from floats import assert_close

# Two completions of two tokens: A = +1 and -1, so mean A = 0 over the four tokens, and
# mean logp = (-0.1 - 2.0 - 0.5 - 1.0) / 4 = -0.9; cov_i = A_i (logp_i + 0.9):
LOGP = torch.tensor([[-0.1, -2.0], [-0.5, -1.0]])
ADV = torch.tensor([1.0, -1.0])
COV = [[0.8, -1.1], [-0.4, 0.1]]  # (+1)(0.8), (+1)(-1.1), (-1)(0.4), (-1)(-0.1)


def test_token_covariance_by_hand():
    assert_close(grpo_entropy.token_covariance(LOGP, ADV, torch.ones(2, 2)), COV, terms=8)
    padded = grpo_entropy.token_covariance(LOGP, ADV, torch.tensor([[1, 1], [1, 0]]))
    assert padded[1, 1] == float("-inf")  # padding: never picked


def test_kl_cov_picks_the_tokens_of_highest_covariance():
    """ratio 0.5 of 4 tokens: the 2 of highest covariance, 0.8 and 0.1."""
    picked = grpo_entropy.covariance_tokens(LOGP, ADV, torch.ones(2, 2, dtype=torch.bool), "kl_cov", 0.5)
    assert picked.tolist() == [[True, False], [False, True]]
    one = grpo_entropy.covariance_tokens(LOGP, ADV, torch.ones(2, 2, dtype=torch.bool), "kl_cov", 1e-4)
    assert one.tolist() == [[True, False], [False, False]]  # at least one token, however small the ratio


def test_clip_cov_picks_at_random_inside_the_bounds():
    """Bounds (0.05, 1): the candidates are the tokens of covariance 0.8 and 0.1; ratio 0.25 of 4 picks one of them."""
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        picked = grpo_entropy.covariance_tokens(LOGP, ADV, torch.ones(2, 2, dtype=torch.bool), "clip_cov", 0.25,
                                                (0.05, 1.0))
        assert picked.sum() == 1 and (picked[0, 0] or picked[1, 1])
        seen.add(tuple(picked.flatten().tolist()))
    assert len(seen) == 2  # both candidates get drawn


def test_kl_cov_loss_by_hand():
    """Token (0, 0) has the top covariance and ratio exp(0.4) = 1.4918, outside the clip: KL-Cov clips nothing, so
    its loss is -A ratio + coef |log ratio| = -1.4918 + 1.0 x 0.4 = -1.0918; the others -A ratio."""
    old = LOGP - torch.tensor([[0.4, 0.0], [0.1, -0.2]])
    cfg = grpo_entropy.Config(loss_mode="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=1.0, beta=0.0)
    loss = grpo_entropy.cov_per_token_loss(LOGP, old, None, ADV, torch.ones(2, 2), cfg)
    ratio = torch.exp(LOGP - old)
    expected = [[-ratio[0, 0] + 0.4, -ratio[0, 1]], [ratio[1, 0], ratio[1, 1]]]
    assert_close(loss, expected, terms=10)
    assert_close(loss[0, 0], -1.0918247, terms=10)


def test_clip_cov_zeroes_the_picked_tokens_value_and_gradient():
    """Every token but the picked one has the vanilla loss and gradient; the picked one has neither."""
    torch.manual_seed(0)
    logp = LOGP.clone().requires_grad_(True)
    torch.manual_seed(5)
    cfg = grpo_entropy.Config(loss_mode="clip_cov", clip_cov_ratio=0.25, clip_cov_lb=0.05, clip_cov_ub=1.0, beta=0.0)
    loss = grpo_entropy.cov_per_token_loss(logp, logp.detach(), None, ADV, torch.ones(2, 2), cfg)
    torch.manual_seed(5)
    picked = grpo_entropy.covariance_tokens(LOGP, ADV, torch.ones(2, 2, dtype=torch.bool), "clip_cov", 0.25,
                                            (0.05, 1.0))
    loss.sum().backward()
    vanilla = LOGP.clone().requires_grad_(True)
    plain = grpo.per_token_loss(vanilla, vanilla.detach(), None, ADV, torch.ones(2, 2), 0.2, 0.0)
    plain.sum().backward()
    assert (loss[picked] == 0).all() and (logp.grad[picked] == 0).all()
    assert torch.equal(loss[~picked], plain[~picked]) and torch.equal(logp.grad[~picked], vanilla.grad[~picked])


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, cliprange, clip_cov_ratio, lb, ub):
    """verl's compute_policy_loss_clip_cov (verl/trainer/ppo/core_algos.py at commit b178a3c), its per-token losses
    before aggregation; advantages per token [N, T] as verl has them."""
    def masked_mean(values, mask):
        return (values * mask).sum() / mask.sum()
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < ub) & (cov_all > lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return torch.maximum(pg_losses1, pg_losses2) * corr


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    """verl's compute_policy_loss_kl_cov (same file and commit), its per-token losses before aggregation."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large_cov_idxs = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
    rows, columns = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
    pg_losses[rows, columns] = pg_losses_kl[rows, columns]
    return pg_losses


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_remedies_equal_verls_code(seed):
    """On random completions with padding, several updates off pi_old, 8% of 150 real tokens picked: the same per-token
    losses as verl's functions (Clip-Cov's random pick drawn from the same generator state)."""
    torch.manual_seed(seed)
    N, T = 10, 20
    lengths = torch.randint(5, T + 1, (N,))
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    logp = -torch.rand(N, T) * 3
    old = logp + torch.randn(N, T) * 0.3
    adv = torch.randn(N)
    adv_tokens = adv.unsqueeze(1).expand(N, T).clone()
    cfg = grpo_entropy.Config(loss_mode="kl_cov", kl_cov_ratio=0.08, ppo_kl_coef=1.0, beta=0.0)
    ours = grpo_entropy.cov_per_token_loss(logp, old, None, adv, mask, cfg)
    theirs = verl_kl_cov(torch.where(mask.bool(), old, 0.0), torch.where(mask.bool(), logp, 0.0), adv_tokens, mask,
                         0.08, 1.0)
    assert_close(ours[mask.bool()], theirs[mask.bool()], terms=N * T)
    torch.manual_seed(100 + seed)
    cfg = grpo_entropy.Config(loss_mode="clip_cov", clip_cov_ratio=0.08, clip_cov_lb=0.1, clip_cov_ub=5.0, beta=0.0)
    ours = grpo_entropy.cov_per_token_loss(logp, old, None, adv, mask, cfg)
    torch.manual_seed(100 + seed)
    theirs = verl_clip_cov(torch.where(mask.bool(), old, 0.0), torch.where(mask.bool(), logp, 0.0), adv_tokens, mask,
                           0.2, 0.08, 0.1, 5.0)
    assert_close(ours[mask.bool()], theirs[mask.bool()], terms=N * T)
    assert (ours[mask.bool()] == 0).sum() >= int(0.08 * mask.sum())  # the picked tokens are there


def entropy_bonus_loss(logp, old, adv, mask, entropy, cfg):
    """main()'s loss line in grpo.py: grpo_loss minus entropy_coeff x the entropy averaged as the token losses are."""
    return (grpo.grpo_loss(logp, old, None, adv, mask, cfg, mask)
            - cfg.entropy_coeff * grpo.aggregate(torch.where(mask.bool(), entropy, 0.0), mask, cfg.loss_type, mask,
                                                 cfg.max_completion_length))


def test_the_entropy_bonus_subtracts_the_averaged_entropy():
    """main's loss line is grpo_loss - entropy_coeff x the entropy averaged as the token losses are, for each
    loss_type; at the default entropy_coeff 0 it is grpo_loss itself, to the bit."""
    import inspect
    assert "- cfg.entropy_coeff * aggregate(torch.where(loss_mask[rows].bool(), micro_entropy, 0.0)" in " ".join(
        inspect.getsource(grpo.main).split())
    torch.manual_seed(3)
    logp, entropy, mask = -torch.rand(4, 6), torch.rand(4, 6), (torch.rand(4, 6) > 0.2).float()
    adv = torch.randn(4)
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        cfg = grpo.Config(loss_type=loss_type, max_completion_length=6, beta=0.0)
        base = grpo.grpo_loss(logp, logp.detach(), None, adv, mask, cfg)
        assert torch.equal(entropy_bonus_loss(logp, logp.detach(), adv, mask, entropy, cfg), base)
        cfg.entropy_coeff = 0.3
        bonus = entropy_bonus_loss(logp, logp.detach(), adv, mask, entropy, cfg)
        averaged = grpo.aggregate(torch.where(mask.bool(), entropy, 0.0), mask, loss_type, max_completion_length=6)
        assert_close(bonus, base - 0.3 * averaged, terms=24 * 4)


def test_a_step_on_the_bonus_raises_the_policys_entropy(saved_tiny):
    """The entropy's gradient reaches the weights (entropy_grad): a few steps on the bonus alone (zero advantages)
    raise the policy's entropy, and without entropy_grad the entropy carries no gradient."""
    _, tokenizer, _ = saved_tiny
    torch.manual_seed(0)
    model = common.build_tiny_model(tokenizer)
    input_ids, mask = torch.randint(0, 256, (4, 12)), torch.ones(4, 12, dtype=torch.long)
    _, no_grad = rollout.completion_logprobs_and_entropy(model, input_ids, mask, 6)
    assert not no_grad.requires_grad
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    entropies = []
    for _ in range(3):
        logp, entropy = rollout.completion_logprobs_and_entropy(model, input_ids, mask, 6, entropy_grad=True)
        loss = entropy_bonus_loss(logp, logp.detach(), torch.zeros(4), mask[:, -6:], entropy,
                                  grpo.Config(entropy_coeff=1.0, beta=0.0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        entropies.append(entropy.mean().item())
    assert entropies[-1] > entropies[0] + 1e-3, entropies


@pytest.mark.parametrize("args, words", [
    (["--loss_mode", "kl_cov"], "--num_iterations 2"),
    (["--kl_cov_ratio", "0.1"], "belongs to --loss_mode kl_cov"),
    (["--loss_mode", "clip_cov", "--clip_cov_lb", "6"], "must be below --clip_cov_ub"),
    (["--loss_mode", "clip_cov", "--loss_type", "cispo", "--epsilon_high", "5"], "other than cispo"),
])
def test_settings_that_cannot_act_are_refused(args, words, capsys):
    """One sentence, before anything is loaded, for a remedy that would do nothing or cannot apply."""
    from lib import checks

    with pytest.raises(SystemExit) as stop:
        checks.check_settings(common.parse_config(grpo_entropy.Config, args))
    assert words in str(stop.value.code) + capsys.readouterr().err
