"""The math of classic RLHF (reward_model.py, ppo.py): hand-computed values, gradients, invariants."""
import math

import torch

import common
from lib import rollout
import grpo
import ppo
import reward_model
from floats import approx, assert_close, forward_terms


# --- reward model ----------------------------------------------------------------------------
def test_preference_loss_hand_computed_and_gradient():
    chosen = torch.tensor([1.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0], requires_grad=True)
    loss = reward_model.preference_loss(chosen, rejected)
    # -(log sigmoid(1) + log sigmoid(0)) / 2 = (0.313262 + 0.693147) / 2
    assert loss.item() == approx(0.5 * (math.log1p(math.exp(-1)) + math.log(2)))
    loss.backward()
    # d/d chosen_i = -(1 - sigmoid(c_i - r_i)) / B
    assert chosen.grad.tolist() == approx([-(1 - 1 / (1 + math.exp(-1))) / 2, -0.25])
    assert rejected.grad.tolist() == (-chosen.grad).tolist()  # the same numbers, negated


def test_preference_loss_depends_only_on_the_margin():
    chosen, rejected = torch.tensor([2.0, -1.0]), torch.tensor([0.5, -3.0])
    assert reward_model.preference_loss(chosen + 7, rejected + 7).item() == approx(
        reward_model.preference_loss(chosen, rejected).item(), scale=10.0)  # rounding of the + 7


def _scalar_head_model():
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    config = common.build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2).config
    config.num_labels = 1
    model = common.AutoModelForSequenceClassification.from_config(config).eval()
    return model, tokenizer


def test_scores_read_the_last_real_token_whatever_the_padding():
    """A row's score and values equal those of the same row alone, without any padding."""
    model, tokenizer = _scalar_head_model()
    prompts = [[10, 11, 12], [13]]
    responses = [[20, 21, tokenizer.eos_token_id], [22, 23, 24, 25, tokenizer.eos_token_id]]
    prompt_ids, prompt_mask = rollout.pad_left(prompts, tokenizer.pad_token_id)
    response_ids, response_mask = rollout.pad_right(responses, tokenizer.pad_token_id)
    input_ids, attention_mask = torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)
    T = response_ids.shape[1]
    with torch.no_grad():
        scores = reward_model.sequence_scores(model, input_ids, attention_mask)
        # the same function of the same pass
        assert torch.equal(scores, ppo.reward_scores(model, input_ids, attention_mask))
        values = ppo.critic_values(model, input_ids, attention_mask, T)  # [2, T]
        for i, (p, r) in enumerate(zip(prompts, responses)):
            alone = torch.tensor([p + r])
            per_token = model.score(model.base_model(input_ids=alone).last_hidden_state).squeeze(-1)[0]  # [L]
            # head outputs are O(1)
            assert_close(scores[i], per_token[-1], terms=forward_terms(model.config), scale=1.0)
            # value of the state before response token t = the head at the position before it
            n = len(r)
            assert_close(values[i, :n], per_token[len(p) - 1 : len(p) + n - 1], terms=forward_terms(model.config),
                         scale=1.0)


def test_shipped_preference_pairs():
    train = common.load_split("data/preference", "train", ("prompt", "chosen", "rejected"))
    test = common.load_split("data/preference", "test", ("prompt", "chosen", "rejected"))
    answers = {q: a for q, a in zip(common.load_split("data/arithmetic", "test")["question"],
                                    common.load_split("data/arithmetic", "test")["answer"])}
    assert (len(train), len(test)) == (3000, 500)
    assert set(test["prompt"]) == set(answers)
    assert not set(train["prompt"]) & set(test["prompt"])
    for row in test:
        assert common.is_correct(row["chosen"], answers[row["prompt"]])
        assert row["chosen"] != row["rejected"]
        # rejected has a wrong number or a broken format (the format reward of grpo.py says which)
        wrong = not common.is_correct(row["rejected"], answers[row["prompt"]])
        assert wrong or not grpo.FORMAT.match(row["rejected"])


# --- PPO -------------------------------------------------------------------------------------
def test_compute_rewards_hand_computed():
    score = torch.tensor([2.0, 10.0])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref_logprobs = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = ppo.compute_rewards(score, logprobs, ref_logprobs, mask, kl_coef=0.1, clip_score=5.0)
    # row 0: -0.1 * (0.5, 0, -1) and the score 2 on the last token; row 1: score clipped to 5, padding 0
    assert_close(rewards, [[-0.05, 0.0, 2.1], [0.0, -0.1 + 5.0, 0.0]], terms=4)


def test_gae_hand_computed():
    values = torch.tensor([[0.5, 1.0, 2.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    advantages, returns = ppo.gae(values, rewards, mask, gamma=0.9, lam=0.5)
    # t=2: delta = 1 + 0 - 2 = -1;            A = -1
    # t=1: delta = 0 + 0.9*2 - 1 = 0.8;       A = 0.8 + 0.45*(-1) = 0.35
    # t=0: delta = 0 + 0.9*1 - 0.5 = 0.4;     A = 0.4 + 0.45*0.35 = 0.5575
    assert_close(advantages, [[0.5575, 0.35, -1.0]], terms=8)
    assert_close(returns, [[1.0575, 1.35, 1.0]], terms=8)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    torch.manual_seed(0)
    values, rewards = torch.randn(4, 6), torch.randn(4, 6)
    ids = torch.tensor([[1, 1, 9, 0, 0, 0], [1] * 6, [9, 0, 0, 0, 0, 0], [1, 1, 1, 1, 9, 0]])
    mask = rollout.mask_after_eos(ids, 9)
    advantages, returns = ppo.gae(values, rewards, mask, gamma=1.0, lam=1.0)
    masked_rewards = rewards * mask
    reward_to_go = masked_rewards.flip(1).cumsum(1).flip(1)
    scale = rewards.abs().sum(1).max().item() + values.abs().max().item()  # a sum of up to 6 rewards, minus a value
    assert_close(advantages, (reward_to_go - values) * mask, terms=8, scale=scale)
    assert_close(returns, reward_to_go * mask, terms=8, scale=scale)


def test_gae_lam_zero_is_the_one_step_td_error():
    torch.manual_seed(1)
    values, rewards = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5)
    advantages, _ = ppo.gae(values, rewards, mask, gamma=0.8, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1)], 1)
    assert_close(advantages, rewards + 0.8 * next_values - values, terms=4, scale=3 * values.abs().max().item())


def test_gae_ends_each_row_at_its_last_real_token_and_ignores_padding_junk():
    values = torch.tensor([[1.0, 2.0, float("nan"), 1e9]])
    rewards = torch.tensor([[0.0, 3.0, float("inf"), 5.0]])
    mask = torch.tensor([[1, 1, 0, 0]])
    advantages, returns = ppo.gae(values, rewards, mask, gamma=1.0, lam=1.0)
    assert advantages.tolist() == [[2.0, 1.0, 0.0, 0.0]]  # reward-to-go 3 minus values 1, 2
    assert returns.tolist() == [[3.0, 3.0, 0.0, 0.0]]


def test_whiten_gives_zero_mean_unit_std_on_real_tokens_and_keeps_padding_zero():
    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    white = ppo.whiten(advantages, mask)
    real = white[mask.bool()]
    assert real.mean().item() == approx(0.0, terms=8, scale=1.0) and real.std().item() == approx(1.0, terms=8)
    assert white[1, 1:].tolist() == [0.0, 0.0]


def test_ppo_actor_loss_hand_computed_and_gradient():
    # four tokens: ratio 1.5 / 0.5 / 1.5 / 0.5 against advantages +1 / -1 / -1 / +1, eps 0.2
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss = ppo.ppo_actor_loss(logprobs, old, advantages, torch.ones(1, 4), clip_eps=0.2)
    # max(-A r, -A clip(r)): -1.2 (clipped) 0.8 (clipped) 1.5 (unclipped) -0.5 (unclipped)
    assert loss.item() == approx((-1.2 + 0.8 + 1.5 - 0.5) / 4, scale=1.5)
    loss.backward()
    # outside the trust region in the direction the advantage pushes: no gradient; else -A * r / N
    assert_close(logprobs.grad, [[0.0, 0.0, 1.5 / 4, -0.5 / 4]], terms=4)


def test_ppo_actor_loss_at_ratio_one_is_the_policy_gradient():
    torch.manual_seed(0)
    logprobs = torch.randn(2, 3, requires_grad=True)
    advantages, mask = torch.randn(2, 3), torch.tensor([[1, 1, 1], [1, 0, 0]])
    ppo.ppo_actor_loss(logprobs, logprobs.detach(), advantages, mask, clip_eps=0.2).backward()
    assert_close(logprobs.grad, -advantages * mask / 4, terms=4)


def test_ppo_actor_loss_padding_junk_does_not_leak():
    logprobs = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("inf")]])
    loss = ppo.ppo_actor_loss(logprobs, old, torch.tensor([[2.0, float("nan")]]), torch.tensor([[1, 0]]), 0.2)
    loss.backward()
    assert loss.item() == -2.0 and logprobs.grad.tolist() == [[-2.0, 0.0]]


def test_ppo_critic_loss_hand_computed_and_gradient():
    values = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 2.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    loss = ppo.ppo_critic_loss(values, old_values, returns, torch.ones(1, 3), clip_value=0.2)
    # t0: clip to 0.7, max(1, 1.69) = 1.69; t1: clip to 0.3, max(0, 0.09) = 0.09; t2: unclipped, 1
    assert loss.item() == approx(0.5 * (1.69 + 0.09 + 1.0) / 3, scale=1.69)
    loss.backward()
    # the clipped terms win at t0 and t1 (constant in v: no gradient); t2: 0.5 * 2 (v - R) / 3
    assert_close(values.grad, [[0.0, 0.0, 1.0 / 3]], terms=4)


def test_ppo_critic_loss_is_half_mse_inside_the_clip_range():
    torch.manual_seed(0)
    old_values, returns = torch.randn(2, 4), torch.randn(2, 4)
    values = old_values + 0.01
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    expected = 0.5 * (((values - returns) ** 2) * mask).sum() / mask.sum()
    assert ppo.ppo_critic_loss(values, old_values, returns, mask, 0.2).item() == approx(expected.item(), terms=8)


def test_ppo_clip_fraction_counts_the_tokens_that_lose_their_gradient():
    """Actor: the ratio past 1 + eps with A > 0 counts; past 1 - eps with A > 0 does not (the
    unclipped loss is the larger, so the gradient pulls it back). Critic: V moved more than c
    toward the return counts; moved away from it does not. A padded token never counts."""
    from ppo import clip_fraction
    mask = torch.tensor([[1, 1, 1, 0]])
    ratio, A = torch.tensor([[1.5, 0.5, 1.0, 1.5]]), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    clipped_ratio = ratio.clamp(0.8, 1.2)
    assert clip_fraction(-A * ratio, -A * clipped_ratio, mask) == 1 / 3
    values, old_values, R = torch.tensor([[0.5, -0.5, 0.1, 0.5]]), torch.zeros(1, 4), torch.ones(1, 4)
    clipped_values = values.clamp(old_values - 0.2, old_values + 0.2)
    assert clip_fraction((values - R) ** 2, (clipped_values - R) ** 2, mask) == 1 / 3
