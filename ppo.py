"""Stage 3 of classic RLHF: PPO with four models (note 000, DeepSpeed-Chat; note 003, OpenRLHF).

    actor      pi_theta: the policy being trained             starts as the SFT model (out/sft)
    reference  pi_ref: a frozen copy of the starting actor    anchors the KL penalty
    critic     V(s_t): one value per token, trained           starts as the reward model (out/rm)
    reward     r(x, y): one score per completion, frozen      the reward model (out/rm)

    python sft.py && python reward_model.py && python ppo.py
    python ppo.py --reward_model rule       # the rule-based checker instead of the reward model
    torchrun --nproc_per_node 2 ppo.py      # data parallel over 2 GPUs (or CPU processes)
    torchrun --nproc_per_node 2 ppo.py --fsdp true  # sharded: each process holds half the weights and states
    python ppo.py --lora_r 8                # LoRA actor and critic; the reference is the actor with its adapter off
    python ppo.py --vllm_importance_sampling_correction true  # TIS: weigh tokens by pi_train / pi_sampler, capped

Only the actor decodes ("rollout"); the reference, critic and reward model just read the finished
sequences in one forward pass each ("inference", prefill only). One step:
  1. rollout:    the actor samples one completion per prompt    completion_ids, mask    [B, T]
  2. inference:  the actor's (old) and the reference's log-probs, the critic's values  [B, T]
                 and the reward model's score at each completion's EOS                 [B]
                 (with one update per step, the update's own pass gives the actor's and critic's)
  3. rewards:    per token -kl_coef * (logp - ref_logp); the clipped score added on the last token
  4. GAE:        advantages and returns, computed backwards over the tokens             [B, T]
  5. PPO epochs: num_ppo_epochs passes over mini-batches of this experience; the clipped actor
                 loss steps the actor, the clipped critic loss steps the critic

At the defaults (num_ppo_epochs 1, num_mini_batches 1: one update per batch) the ratio is exactly 1 and
V = V_old, so neither clip acts and step 5 is an actor-critic policy-gradient step with GAE; the clips act
with several updates per batch.

The numbered steps are the numbered comments of main()'s loop. The rollout and the log-prob pass
are lib/rollout.py's (generate, completion_logprobs: read their plain paths first); the calls on `run`
are lib/harness.py's machinery (resume, evaluation, checkpoints, the NaN stop, logging), which changes
no number the algorithm computes.
"""
import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch

import common
from common import setting
import prm
from lib import harness, rollout, steps


@dataclass
class Config(harness.PolicyGradientConfig):
    """PPO's settings; the run's (model, data, batch, AdamW, evaluation, LoRA, the sampler's correction, ...) are
    harness.PolicyGradientConfig's."""
    LOSS_SCALES = ("kl_coef",)  # settings that scale a loss term: named in the advice after a NaN or inf (harness)
    reward_model: str = "out/rm"
    """reward model (and critic initialisation) written by reward_model.py; 'rule' = the rule-based checker"""
    value_model: str = ""
    """where the critic starts, if not from --reward_model: a reward model folder (its trained scalar head). Unset:
    the reward model itself, or with --reward_model rule a fresh value head on --model. With rule, --value_model
    keeps the critic's start of a reward-model run, so that the two runs differ in the reward alone (TRL 0.x's
    PPOTrainer took value_model apart from reward_model: trl/trainer/ppo_trainer.py)"""
    num_mini_batches: int = setting(1, lambda v: v >= 1, "at least 1")
    """mini-batches the experience is split into, per PPO epoch (one update of actor and critic each)"""
    num_ppo_epochs: int = setting(1, lambda v: v >= 1, "at least 1")
    """passes over each batch of experience (DeepSpeed-Chat's ppo_epochs)"""
    kl_coef: float = setting(0.1, lambda v: v >= 0, "0 or more")
    """beta of the per-token KL reward -beta * (logp - ref_logp) (the starting value with --target_kl)"""
    target_kl: float | None = setting(None, lambda v: v is None or v > 0, "positive (leave it out for a fixed kl_coef)")
    """adapt kl_coef after each step so that the KL to the reference moves toward this value (Ziegler et al.'s
    adaptive controller; unset = kl_coef stays fixed)"""
    kl_horizon: int = setting(10000, lambda v: v >= 1, "at least 1")
    """the adaptive controller's horizon: larger = slower changes of kl_coef"""
    clip_score: float = setting(5.0, lambda v: v > 0, "positive")
    """the reward model's score is clamped to [-clip_score, clip_score] (DeepSpeed-Chat's clip_reward_value)"""
    process_rewards: bool = False
    """a reward at each step's end (lib/steps.py: a line of the worked answer, then the answer), not one at the last
    token: with --reward_model rule each step's exact label, +1 when every line so far is right (the answer step:
    the checker's) else -1; with a PRM folder (prm.py's), 2 p_j - 1 on the same scale (process_scores). The critic
    then has rewards to predict before the last token"""
    cliprange: float = setting(0.2, lambda v: v > 0, "positive (the clip range of the ratio)")
    """clip range of the actor's ratio pi/pi_old"""
    cliprange_value: float = setting(0.2, lambda v: v > 0, "positive")
    """clip range of the critic's values around the old values"""
    gamma: float = setting(1.0, lambda v: 0 <= v <= 1, "in [0, 1]")
    """discount factor of GAE"""
    lam: float = setting(0.95, lambda v: 0 <= v <= 1, "in [0, 1]")
    """lambda of GAE: 0 = one-step TD error, 1 = Monte Carlo return minus value"""
    whiten_advantages: bool = True
    """normalise the advantages of each batch to mean 0, std 1 over the real tokens"""
    critic_learning_rate: float = setting(1e-4, lambda v: v > 0, "positive")
    """peak learning rate of the critic's AdamW"""
    # the run's settings (lib/harness.py) at this script's defaults
    model: str = "out/sft"
    """the actor (and the reference)"""
    dataset: str = "data/arithmetic"
    """prompts in GSM8K's schema (openai/gsm8k)"""
    output_dir: str = "out/ppo"
    """the critic goes in critic/"""
    per_device_train_batch_size: int = 128
    """a row is one prompt + one completion (PPO samples one per prompt): a step samples
    per_device_train_batch_size x gradient_accumulation_steps prompts; the training passes split each of the
    num_mini_batches mini-batches into gradient_accumulation_steps micro-batches of per_device_train_batch_size /
    num_mini_batches rows"""
    learning_rate: float = 2e-5
    """the actor's (the critic's: --critic_learning_rate)"""

    def check_together(self):
        super().check_together()  # the sampler's correction (harness.PolicyGradientConfig)
        if self.process_rewards and self.reward_model != "rule" and not prm.is_prm(self.reward_model):
            common.fail("--process_rewards reads a score at each step's end: pass --reward_model rule (the exact "
                        "labels) or a process reward model folder written by prm.py (--reward_model out/prm)")
        if self.per_device_train_batch_size % self.num_mini_batches:
            common.fail(f"--per_device_train_batch_size ({self.per_device_train_batch_size}) must be a multiple of "
                        f"--num_mini_batches ({self.num_mini_batches})")


# ---------------------------------------------------------------------------------------------
# Inference: values from the critic, scores from the reward model (prefill only)
# ---------------------------------------------------------------------------------------------
def critic_values(critic, input_ids, attention_mask, num_completion_tokens: int):
    """V(s_t) [B, T]: the critic's value of the state in which completion token t is chosen.

    That state is everything before token t, whose last position is the one that predicts t (note
    003): the first state ends at the prompt's last token, the last at the token before the last
    one. So, like the log-probs, the values come from positions P-1 .. P+T-2."""
    # [B, T, H]
    hidden = rollout.last_hidden_states(critic, input_ids, attention_mask)[:, -num_completion_tokens - 1 : -1]
    return critic.score(hidden).squeeze(-1)


def reward_scores(reward_model, input_ids, attention_mask):
    """r(x, y) [B]: the reward model's score at each row's last real token, as reward_model.sequence_scores (note
    003: an outcome reward model scores every position, only the last is used). input_ids, attention_mask [B, L].
    A completion cut off without EOS: docs/classic_rlhf.md#a-cut-off-completions-score"""
    hidden = rollout.last_hidden_states(reward_model, input_ids, attention_mask)  # [B, L, H]
    last = attention_mask.shape[1] - 1 - attention_mask.flip(dims=[1]).argmax(dim=1)  # [B] index of the last 1
    return reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1)


@torch.no_grad()
def held_out_score(actor, reward_model, tokenizer, questions, max_new_tokens: int, system_prompt: str,
                   batch_size=64) -> dict:
    """Held-out evaluation when the data has no answers to check (prompts only, e.g. Dahoas/rm-static):
    the reward model's mean score of the actor's greedy completions. Only as trustworthy as the
    reward model (see docs/classic_rlhf.md, the seeds and reward hacking)."""
    actor.eval()
    total = 0.0
    for start in range(0, len(questions), batch_size):
        prompts = [common.make_prompt(tokenizer, q, system_prompt) for q in questions[start : start + batch_size]]
        prompt_ids, prompt_mask, completion_ids, mask = rollout.generate(actor, tokenizer, prompts, max_new_tokens,
                                                                         greedy=True)
        input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1)
        total += reward_scores(reward_model, input_ids, attention_mask).sum().item()
    actor.train()
    return {"score": total / len(questions), "n": len(questions)}


def rule_scores(completions: list[str], answers: list[str]) -> torch.Tensor:
    """The rule-based alternative to a reward model (--reward_model rule): +1 for a correct
    number in the right format, -1 otherwise. [B]"""
    return torch.tensor([1.0 if common.is_correct(c, a) and c.strip().endswith("</answer>") else -1.0
                         for c, a in zip(completions, answers)])


# ---------------------------------------------------------------------------------------------
# The math of PPO for language models
# ---------------------------------------------------------------------------------------------
def adaptive_kl_coef(kl_coef: float, kl: float, target_kl: float, horizon: int, batch_size: int) -> float:
    """Ziegler et al. 2019, section 2.2 (TRL's AdaptiveKLController up to 0.11), steering the KL toward target_kl:
        e = clip(KL / target_kl - 1, -0.2, 0.2),    kl_coef <- kl_coef * (1 + e * batch_size / horizon)
    KL: the mean over completions of the summed log pi / pi_ref. docs/classic_rlhf.md#the-adaptive-kl-controller"""
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * batch_size / horizon)


def compute_rewards(score, logprobs, ref_logprobs, mask, kl_coef, clip_score):
    """Per-token rewards [B, T] (note 000, DeepSpeed-Chat's compute_rewards), 0 on padding; score [B], the rest [B, T]:
        r_t = -kl_coef * (logp_t - ref_logp_t)                     on every real token
        r_T += clamp(score, -clip_score, clip_score)               on each row's last real token
    With --process_rewards, score is [B, T], each step's reward on the token that ends it (process_scores), added
    where it stands. The KL term's sign: docs/foundations.md#1-generation-as-reinforcement-learning-notes-000-003"""
    mask = mask.bool()
    rewards = torch.where(mask, -kl_coef * (logprobs - ref_logprobs), 0.0)  # [B, T]
    if score.dim() == 2:  # process rewards, on their steps' last tokens
        return rewards + torch.where(mask, torch.clamp(score, -clip_score, clip_score), 0.0)
    last = (mask.sum(dim=1) - 1).clamp(min=0)  # [B] index of the last real token (right padding)
    rows = torch.arange(len(last), device=rewards.device)
    rewards[rows, last] += torch.clamp(score, -clip_score, clip_score).to(rewards.dtype)
    return rewards


def process_scores(reward_model, tokenizer, questions, completions, answers, input_ids, attention_mask, mask,
                   batch_size: int) -> torch.Tensor:
    """--process_rewards: each step's reward on the token that ends it (lib/steps.py's steps and end_tokens), 0 on
    the other tokens, [B, T]: without a reward model (--reward_model rule) the exact label y_j as 2 y_j - 1 (+1: every
    line so far is the solver's; the answer step's is the checker's outcome, rule_scores' score); with a process
    reward model its 2 p_j - 1 (prm.step_probs). input_ids, attention_mask [B, P+T]; mask [B, T]."""
    B, T = mask.shape
    ends = steps.end_tokens(tokenizer, input_ids[:, -T:], mask,
                            [[end for _, end in steps.steps(c)] for c in completions])  # [B][S_i]
    if reward_model is None:
        labels = [steps.exact_labels(q, c, a) for q, c, a in zip(questions, completions, answers)]
    else:
        labels = prm.step_probs(reward_model, input_ids, attention_mask, T, ends, batch_size)
    scores = torch.zeros(B, T)
    for i, (row_labels, row_ends) in enumerate(zip(labels, ends)):
        for y, k in zip(row_labels, row_ends):
            scores[i, k] += 2 * y - 1
    return scores.to(mask.device)


def gae(values, rewards, mask, gamma, lam):
    """Generalised Advantage Estimation (Schulman et al. 2016; note 003), backwards over tokens:

        delta_t = r_t + gamma * V_{t+1} - V_t            (the value after the last token is 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                               (the critic's target: the return)

    lam = 1 gives A_t = (sum over k of gamma^k r_{t+k}) - V_t, the reward-to-go at the default gamma = 1
    (Monte Carlo, high variance); lam = 0 gives the one-step TD error (low variance, biased by the
    critic). Values and rewards on
    padding are treated as 0, so a row ends at its last real token. Returns (advantages, returns)
    [B, T], detached: they are targets, not functions of the parameters."""
    mask = mask.bool()
    values = torch.where(mask, values, 0.0).detach()
    rewards = torch.where(mask, rewards, 0.0).detach()
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = next_advantage
    advantages = torch.where(mask, advantages, 0.0)
    return advantages, torch.where(mask, advantages + values, 0.0)


def whiten(advantages, mask, eps=1e-8):
    """(A - mean) / std over the real tokens of the batch; padding stays 0. Keeps the size of the
    actor's update the same whatever the scale of the reward. (Under torchrun, mean and std are
    those of the global batch.)"""
    mask = mask.bool()
    n = common.global_sum(mask.sum().float())
    mean = common.global_sum(torch.where(mask, advantages, 0.0).sum()) / n
    var = common.global_sum(torch.where(mask, (advantages - mean) ** 2, 0.0).sum()) / (n - 1)  # unbiased, as torch.std
    return torch.where(mask, (advantages - mean) / (var.sqrt() + eps), 0.0)


def masked_mean(values, mask, step_tokens=None):
    """Mean of values over the real tokens of the whole batch (a token mean; under torchrun the
    denominator is the global batch's, see common.mean_denominator). When these rows are one
    micro-batch of an update, step_tokens (mean_denominator of the update's mask) is the denominator,
    so the micro-batch means add up to the update's mean (gradient accumulation)."""
    mask = mask.bool()
    tokens = step_tokens if step_tokens is not None else common.mean_denominator(mask)
    return torch.where(mask, values, 0.0).sum() / tokens


def ppo_actor_loss(logprobs, old_logprobs, advantages, mask, clip_eps, step_tokens=None, sampler_weights=None):
    """PPO's clipped surrogate, as a loss (note 000's actor_loss_fn), token mean over the batch:
        ratio = exp(logp - old_logp)
        l_t   = max(-A_t * ratio, -A_t * clip(ratio, 1 - eps, 1 + eps))      (times w_t with sampler_weights)
    logprobs, old_logprobs, advantages, mask [B, T]; step_tokens: see masked_mean; sampler_weights [B, T] or
    [B, 1]: the sampler's correction w (--vllm_importance_sampling_correction: rollout.sampler_importance_weights).
    What the clip limits, and what not: docs/foundations.md#what-the-clip-limits"""
    mask = mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # junk on padding never reaches exp
    ratio = torch.exp(log_ratio)
    A = torch.where(mask, advantages, 0.0)
    loss = torch.max(-A * ratio, -A * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    if sampler_weights is not None:  # the tokens came from a sampler that is not the actor's pass
        loss = loss * sampler_weights
    return masked_mean(loss, mask, step_tokens)


def ppo_critic_loss(values, old_values, returns, mask, clip_value, step_tokens=None):
    """Clipped value loss (note 000's critic_loss_fn), token mean over the batch; R the returns, c in reward units:
        v_clip = clip(v, old_v - c, old_v + c)
        l_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)
    values, old_values, returns, mask [B, T]; step_tokens: see masked_mean.
    What the clip does, and why it stays: docs/classic_rlhf.md#the-clipped-value-loss"""
    mask = mask.bool()
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values, 0.0)
    returns = torch.where(mask, returns, 0.0)
    clipped = torch.clamp(values, old_values - clip_value, old_values + clip_value)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask, step_tokens)


def clip_fraction(unclipped_loss, clipped_loss, mask) -> float:
    """Fraction of real tokens where the clipped term of max(unclipped, clipped) is strictly the larger (TRL's
    clipfrac): the tokens that get no gradient from this update. unclipped_loss, clipped_loss, mask [B, T].
    Which tokens, for the actor and the critic: docs/classic_rlhf.md#the-clip-fractions"""
    taken_over = (clipped_loss > unclipped_loss) & mask.bool()
    return taken_over.sum().item() / mask.sum().item()


@torch.no_grad()
def update_stats(actor_loss, critic_loss, logprobs, values, entropy, exp, idx, cfg) -> dict:
    """What one update of actor and critic logs: its two losses, the share of tokens where each clip
    took over (clip_fraction), and the policy's entropy, on the update's rows idx [b] of the experience
    exp (logprobs, values, entropy [B, T]: the update's own, on those rows)."""
    logprobs, values, entropy, old_logprobs, old_values, advantages, returns, mask = (
        x[idx] for x in (logprobs, values, entropy, exp.old_logprobs, exp.old_values, exp.advantages, exp.returns,
                         exp.mask))
    ratio = torch.exp(torch.where(mask.bool(), logprobs - old_logprobs, 0.0))  # [b, T]
    clipped_ratio = torch.clamp(ratio, 1 - cfg.cliprange, 1 + cfg.cliprange)
    clipped_values = torch.clamp(values, old_values - cfg.cliprange_value, old_values + cfg.cliprange_value)
    return {"loss/actor": actor_loss.item(), "loss/critic": critic_loss.item(),
            "clip_fraction/actor": clip_fraction(-advantages * ratio, -advantages * clipped_ratio, mask),
            "clip_fraction/critic": clip_fraction((values - returns) ** 2, (clipped_values - returns) ** 2, mask),
            "entropy": masked_mean(entropy, mask).item()}


def completions_to_log(exp) -> dict:
    """completions.jsonl's columns: each completion with its score, its summed reward and its mean advantage."""
    return {"prompt": exp.prompts, "completion": exp.completions, "score": exp.score.tolist(),
            "reward": torch.where(exp.mask.bool(), exp.rewards, 0.0).sum(dim=1).tolist(),
            "advantage": (exp.advantages.sum(dim=1) / exp.mask.sum(dim=1).clamp(min=1)).tolist()}


@torch.no_grad()
def step_metrics(exp, answers, updates, kl_coef: float, scheduler) -> dict:
    """What a step logs: the reward model's score and, when the data has answers, the rule-based
    accuracy of the same completions (do they rise together?); the KL to the reference; the mean of
    the updates' update_stats; how well the critic's values fit the returns; the step's KL coefficient
    and learning rate. exp: the Experience."""
    score, completions, mask, old_logprobs, ref_logprobs, old_values, returns = (
        exp.score, exp.completions, exp.mask, exp.old_logprobs, exp.ref_logprobs, exp.old_values, exp.returns)
    return {
        "score": score.mean().item(),
        **({"accuracy": sum(float(common.is_correct(c, a)) for c, a in zip(completions, answers)) / len(completions)}
           if answers is not None else {}),
        **(steps.slip_errors(exp.prompts, completions, answers) if answers is not None else {}),  # the slip's line
        # k1 summed over a completion's tokens, mean over completions (TRL's objective/kl); not grpo.py's
        # kl, a k3 mean per token: hence another name
        "kl_sum": torch.where(mask.bool(), old_logprobs - ref_logprobs, 0.0).sum(dim=1).mean().item(),
        **{key: sum(u[key] for u in updates) / len(updates) for key in updates[0]},  # the mean over updates
        "value_error": masked_mean((old_values - returns) ** 2, mask).item(),
        "completion_length": mask.sum(dim=1).float().mean().item(),
        "kl_coef": kl_coef, "learning_rate": scheduler.get_last_lr()[0],
        **rollout.sampler_mismatch(old_logprobs, exp.sampler_logprobs, mask, exp.sampler_weights),  # pi_old's gap
    }


# ---------------------------------------------------------------------------------------------
# Steps 1 to 4: one batch of experience, which the PPO epochs reuse
# ---------------------------------------------------------------------------------------------
class Pass(NamedTuple):
    """The training pass over some rows, [b, T] each, with gradients: what the two losses differentiate."""
    logprobs: torch.Tensor  # the actor's log-probs of the completion tokens
    entropy: torch.Tensor  # the actor's entropy at each position (no gradient)
    values: torch.Tensor  # the critic's values V(s_t)

    def of(self, rows) -> "Pass":
        """These rows of a pass over more. Speed: when a step makes one update (makes_one_update),
        make_experience runs its pass already, and the update reads its rows from it."""
        return Pass(*(x[rows] for x in self))


def training_pass(actor, critic, input_ids, attention_mask, num_completion_tokens: int, temperature: float) -> Pass:
    logprobs, entropy = rollout.completion_logprobs_and_entropy(actor, input_ids, attention_mask,
                                                                num_completion_tokens, temperature)
    return Pass(logprobs, entropy, critic_values(critic, input_ids, attention_mask, num_completion_tokens))


def makes_one_update(cfg) -> bool:
    """True when a step makes a single update (one PPO epoch of one mini-batch, in one micro-batch).
    Speed: its training pass, run first and detached, gives old_logprobs and old_values: two forward passes
    fewer a step, the same numbers (docs/speed.md#the-speed-ups)."""
    return cfg.num_ppo_epochs == 1 and cfg.num_mini_batches == 1 and cfg.gradient_accumulation_steps == 1


@dataclass
class Experience:
    """One batch of experience: B prompts, one completion each."""
    prompts: list  # [B] chat prompts
    completions: list  # [B] the completions' text
    input_ids: torch.Tensor  # [B, P+T] left-padded prompt | right-padded completion
    attention_mask: torch.Tensor  # [B, P+T]
    mask: torch.Tensor  # [B, T] 1 on each completion's real tokens
    score: torch.Tensor  # [B] the reward model's score (or the checker's); --process_rewards: the sum of its steps'
    old_logprobs: torch.Tensor  # [B, T] pi_old, the actor that sampled
    sampler_logprobs: torch.Tensor  # [B, T] the same tokens' log-probs as the sampler computed them
    sampler_weights: torch.Tensor | None  # [B, T] or [B, 1]: --vllm_importance_sampling_correction's w, or None
    ref_logprobs: torch.Tensor  # [B, T] pi_ref
    old_values: torch.Tensor  # [B, T] V_old
    rewards: torch.Tensor  # [B, T] -kl_coef * (logp - ref_logp), plus the clipped score on the last token
    # (with --process_rewards, each step's reward on the token that ends the step)
    advantages: torch.Tensor  # [B, T] GAE's, whitened with --whiten_advantages
    returns: torch.Tensor  # [B, T] the critic's targets
    first_pass: Pass | None  # the only update's training pass, run already (makes_one_update), or None


def make_experience(actor, reference, critic, reward_model, tokenizer, questions: list, answers: list | None, cfg,
                    kl_coef: float) -> Experience:
    """Steps 1 to 4 of the module docstring for B prompts (answers: None on prompt-only data)."""
    # 1. Rollout: the actor decodes one completion per prompt.
    prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in questions]
    prompt_ids, prompt_mask, completion_ids, mask, sampler_logprobs = rollout.generate(
        actor, tokenizer, prompts, cfg.max_completion_length, cfg.temperature, return_logprobs=True
    )  # [B, P], [B, P], [B, T], [B, T], [B, T]
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+T]
    attention_mask = torch.cat([prompt_mask, mask], dim=1)  # [B, P+T]
    T = completion_ids.shape[1]

    # 2. Inference (prefill only, no gradient; one micro-batch of rows at a time): pi_ref's log-probs
    # and the score, then pi_old's log-probs and V_old, which the KL reward and GAE need before any update.
    micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # row indices
    with common.reference_model(actor, reference) as pi_ref:  # the frozen copy, or LoRA switched off
        ref_logprobs = rollout.inference(rollout.completion_logprobs, pi_ref, input_ids, attention_mask, T,
                                         cfg.temperature, micro_batches=micro_batches)  # [B, T]
    if reward_model is None:
        score = rule_scores(completions, answers).to(input_ids.device)  # [B]
    else:
        score = rollout.inference(reward_scores, reward_model, input_ids, attention_mask,
                                  micro_batches=micro_batches)  # [B]
        common.check_finite_scores(score, f"--reward_model {cfg.reward_model}")
    step_scores = None  # --process_rewards: [B, T], each step's reward on its last token
    if cfg.process_rewards:
        step_scores = process_scores(reward_model, tokenizer, questions, completions, answers, input_ids,
                                     attention_mask, mask, cfg.per_device_train_batch_size)
        score = step_scores.sum(dim=1)  # [B], for the logs
    first_pass = None
    if makes_one_update(cfg):  # Speed: the only update's own pass runs now; detached, it is pi_old and V_old
        first_pass = training_pass(actor, critic, input_ids, attention_mask, T, cfg.temperature)
        old_logprobs, old_values = first_pass.logprobs.detach(), first_pass.values.detach()
    else:
        old_logprobs = rollout.inference(rollout.completion_logprobs, actor, input_ids, attention_mask, T,
                                         cfg.temperature, micro_batches=micro_batches)  # [B, T]
        old_values = rollout.inference(critic_values, critic, input_ids, attention_mask, T,
                                       micro_batches=micro_batches)  # [B, T]

    sampler_weights = (rollout.sampler_importance_weights(  # TIS: w = pi_old / pi_sampler, bounded [B, T] or [B, 1]
        old_logprobs, sampler_logprobs, mask, cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max,
        cfg.vllm_importance_sampling_clip_min) if cfg.vllm_importance_sampling_correction else None)
    with torch.no_grad():
        # 3. Per-token rewards: the KL to the reference, and the clipped score on the last token.
        rewards = compute_rewards(score if step_scores is None else step_scores, old_logprobs, ref_logprobs, mask,
                                  kl_coef, cfg.clip_score)  # [B, T]
        # 4. GAE: advantages and returns, backwards over the tokens.
        advantages, returns = gae(old_values, rewards, mask, cfg.gamma, cfg.lam)  # [B, T], [B, T]
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
    return Experience(prompts, completions, input_ids, attention_mask, mask, score, old_logprobs, sampler_logprobs,
                      sampler_weights, ref_logprobs, old_values, rewards, advantages, returns, first_pass)


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
def load_reward_model_and_critic(cfg, tokenizer, device):
    """The frozen reward model, and the critic it initialises (note 000); with --reward_model rule no
    reward model (the checker scores) and a critic with a fresh value head on the --model policy;
    --value_model starts the critic from another reward model folder instead.
    The critic values each of the policy's tokens, so a reward model must share the policy's tokenizer."""
    reward_model = None
    if cfg.reward_model != "rule":
        reward_model = load_scalar_model(cfg, "--reward_model", cfg.reward_model, tokenizer,
                                         "run `python reward_model.py` first (or pass --reward_model rule)")
        reward_model.to(device).eval().requires_grad_(False)
    if cfg.value_model:
        return reward_model, load_scalar_model(cfg, "--value_model", cfg.value_model, tokenizer,
                                               "it takes a folder written by reward_model.py")
    if reward_model is None:
        return None, common.load_model(cfg.model, scalar_head=True, trust_remote_code=cfg.trust_remote_code,
                                       flag="--model")[0]
    return reward_model, copy.deepcopy(reward_model).requires_grad_(True)  # the critic starts as the reward model


def load_scalar_model(cfg, flag: str, folder: str, tokenizer, hint: str):
    """A reward model folder (reward_model.py's), on the policy's tokenizer: one sentence otherwise."""
    model, own_tokenizer = common.load_model(folder, missing_hint=hint, scalar_head=True, reward_model=True,
                                             trust_remote_code=cfg.trust_remote_code, flag=flag)
    if not common.same_tokenizer(own_tokenizer, tokenizer):
        common.fail(f"{flag} {folder} has a tokenizer of its own, not --model's: ppo.py's critic starts as a "
                    "reward model and values each of the policy's tokens, so the two must share one "
                    f"(train the reward model from this policy: python reward_model.py --model {cfg.model})")
    return model


def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--reward_model": cfg.reward_model, "--dataset": cfg.dataset,
                                   **({"--value_model": cfg.value_model} if cfg.value_model else {})})
    rows_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # B prompts, one sample each

    # data: GSM8K's schema (question, answer: rule-based accuracy is measured too), or prompts only (the
    # `prompt` column of a preference dataset such as Dahoas/rm-static: the reward model is the only judge).
    has_answers = "prompt" not in common.load_split(cfg.dataset, "train", columns=()).column_names
    columns = ("question", "answer") if has_answers else ("prompt",)
    if not has_answers and cfg.reward_model == "rule":
        common.fail(f"--reward_model rule checks answers, and {cfg.dataset} has prompts only: pass a reward model")

    # the four models
    train_data, test_data, actor, tokenizer, _ = common.load_policy_and_prompts(cfg, rows_per_step, columns)
    actor = run.prepare(actor)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    # pi_ref: a frozen copy of the starting actor, or with LoRA none (the actor with its adapter off).
    reference = copy.deepcopy(actor).eval().requires_grad_(False) if cfg.lora_r is None else None
    reward_model, critic = load_reward_model_and_critic(cfg, tokenizer, run.device)
    critic = run.prepare(critic, scalar_head=True)  # LoRA critic: adapters and its value head are trained
    run.shard(actor, reference, critic, reward_model)  # --fsdp: each process keeps 1/N of each model
    run.log_memory([actor, critic], [reference, reward_model])
    actor_optimizer = torch.optim.AdamW(actor.parameters(), cfg.learning_rate, weight_decay=cfg.weight_decay)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), cfg.critic_learning_rate, weight_decay=cfg.weight_decay)
    num_updates = cfg.max_steps * cfg.num_ppo_epochs * cfg.num_mini_batches
    schedulers = [common.warmup_cosine_schedule(optimizer, cfg.warmup_steps * num_updates // cfg.max_steps,
                                                num_updates, cfg.min_lr_rate)
                  for optimizer in (actor_optimizer, critic_optimizer)]

    def evaluate():  # held-out accuracy; on prompt-only data, the reward model's score of greedy completions
        if has_answers:
            return common.evaluate(actor, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                                   cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)
        return held_out_score(actor, reward_model, tokenizer, test_data["prompt"], cfg.max_completion_length,
                              cfg.system_prompt)

    state = {"kl_coef": cfg.kl_coef}  # changes only with --target_kl; kept in every checkpoint
    for step in run.steps([actor, critic], [actor_optimizer, critic_optimizer], schedulers, evaluate, state):
        # 1.-4. One batch of experience (make_experience): rollout, inference, per-token rewards, GAE.
        step_data = train_data[run.rng.sample(range(len(train_data)), rows_per_step)]  # {column: [B values]}
        exp = make_experience(actor, reference, critic, reward_model, tokenizer, step_data[columns[0]],
                              step_data.get("answer"), cfg, state["kl_coef"])
        B, T = exp.mask.shape

        # 5. PPO epochs over mini-batches of the experience: one actor and one critic update per mini-batch.
        updates = []  # what each update logs (update_stats)
        for _ in range(cfg.num_ppo_epochs):
            for idx in torch.randperm(B).chunk(cfg.num_mini_batches):
                step_tokens = common.mean_denominator(exp.mask[idx])  # every micro-batch's loss divides by it
                logprobs, entropy, values = (torch.zeros(B, T, device=run.device) for _ in range(3))  # detached
                actor_loss = critic_loss = 0.0
                for rows in idx.chunk(cfg.gradient_accumulation_steps):  # gradient accumulation: the micro-batches
                    micro = (training_pass(actor, critic, exp.input_ids[rows], exp.attention_mask[rows], T,
                                           cfg.temperature) if exp.first_pass is None  # [b', T] each
                             else exp.first_pass.of(rows))  # Speed: makes_one_update's pass, run already
                    weights = exp.sampler_weights[rows] if exp.sampler_weights is not None else None  # the correction
                    micro_actor_loss = ppo_actor_loss(micro.logprobs, exp.old_logprobs[rows], exp.advantages[rows],
                                                      exp.mask[rows], cfg.cliprange, step_tokens, weights)
                    micro_critic_loss = ppo_critic_loss(micro.values, exp.old_values[rows], exp.returns[rows],
                                                        exp.mask[rows], cfg.cliprange_value, step_tokens)
                    micro_actor_loss.backward()  # gradients add up over the micro-batches
                    micro_critic_loss.backward()
                    logprobs[rows], entropy[rows], values[rows] = (x.detach() for x in micro)  # Pass's order
                    actor_loss = actor_loss + micro_actor_loss.detach()
                    critic_loss = critic_loss + micro_critic_loss.detach()
                for loss, model, optimizer in ((actor_loss, actor, actor_optimizer),
                                               (critic_loss, critic, critic_optimizer)):
                    run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)  # now: the next step's first pass may need the memory
                for scheduler in schedulers:
                    scheduler.step()
                updates.append(update_stats(actor_loss, critic_loss, logprobs, values, entropy, exp, idx, cfg))

        metrics = run.log(step_metrics(exp, step_data.get("answer"), updates, state["kl_coef"], schedulers[0]),
                          completions_to_log(exp))  # the score and, on the same completions, the rule-based truth
        if cfg.target_kl is not None:  # the KL of all processes (metrics are reduced), so every process agrees
            state["kl_coef"] = adaptive_kl_coef(state["kl_coef"], metrics["kl_sum"], cfg.target_kl, cfg.kl_horizon,
                                                B * run.world_size)
        run.end_step()  # when due: evaluate, write the metrics line, save a checkpoint

    run.finish(tokenizer, {"": actor, "critic": critic},
               {"reward model score": ["score", "eval/score"],
                "accuracy (rule-based)": ["accuracy", "eval/accuracy_greedy", "eval/accuracy_sampled"],
                "kl to reference (k1 sum per completion)": ["kl_sum"], "losses": ["loss/actor", "loss/critic"]}, "PPO")
    return actor


if __name__ == "__main__":
    main(common.parse_config(Config))
