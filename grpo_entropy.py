"""GRPO with Cui et al. 2025's remedies for a collapsing entropy: Clip-Cov and KL-Cov (verl's loss_mode).

grpo.py plus one idea ("The Entropy Mechanism of RL for Reasoning LMs": the dynamics in section 3, the
remedies in section 4): a natural policy-gradient step on a softmax policy lowers its entropy by about
lr x Cov(log pi(a), A(a)) (a vanilla one by lr x Cov(log pi(a), pi(a) A(a))), and a few tokens carry most of
that covariance, so act on those tokens only. Each remedy is a per-token loss in place of grpo.py's, on the
tokens of a micro-batch picked by their covariance (covariance_tokens):

    clip_cov   a random few of the tokens whose covariance lies in (lb, ub), among those the PPO clip has
               not already clipped (as verl's), lose their loss and gradient
    kl_cov     no clip; the tokens of highest covariance pay ppo_kl_coef x |log pi - log pi_old|

Everything else is grpo.py's: its settings, its loop (grpo.main, given cov_loss), its metrics (clip_fraction
counts PPO's clip only: not the tokens Clip-Cov zeroes, and under KL-Cov tokens that still get a gradient). grpo.py's
own entropy remedies are clip-higher (--epsilon_high) and the entropy bonus (--entropy_coeff), one term of
its loss line.

    python grpo_entropy.py --loss_mode clip_cov --clip_cov_ratio 0.02      # out/sft -> out/grpo_entropy
    python grpo_entropy.py --loss_mode kl_cov --kl_cov_ratio 0.02 --num_iterations 2
    python benchmarks/entropy_remedies.py                                 # both against grpo.py's remedies

Where this differs from the code it follows (verl's compute_policy_loss_clip_cov and _kl_cov, commit
b178a3c; docs/grpo.md#an-aggressive-setting-and-four-remedies):
  - with --vllm_importance_sampling_correction, the sampler's weight w multiplies the policy term only:
    KL-Cov's penalty is not weighted, where verl multiplies its whole per-token loss, penalty included;
  - a token Clip-Cov picks loses its KL term too (beta x k3 is part of grpo.py's token loss), where verl
    keeps its KL loss apart and the token keeps it;
  - --kl_cov_ratio defaults to 2e-3, the paper's 7B script's (verl's recipe/entropy/7b_kl_cov.sh), where
    verl's config file has 2e-4.
"""
from dataclasses import dataclass

import torch

import common
import grpo
from common import setting

LOSS_MODES = ("vanilla", "clip_cov", "kl_cov")  # verl's names; 'vanilla' is grpo.py's loss


@dataclass
class Config(grpo.Config):
    """grpo.py's settings, and the remedy's."""
    LOSS_SCALES = (*grpo.Config.LOSS_SCALES, "ppo_kl_coef")  # scale a loss term: named in the advice after a NaN
    loss_mode: str = setting("vanilla", lambda v: v in LOSS_MODES, "one of " + ", ".join(LOSS_MODES))
    """the covariance remedies of Cui et al. 2025 (verl's policy_loss.loss_mode; see cov_per_token_loss): 'clip_cov'
    drops the gradient of a random --clip_cov_ratio of the tokens whose covariance of log-prob and advantage lies in
    (--clip_cov_lb, --clip_cov_ub) and the PPO clip has not clipped; 'kl_cov' adds --ppo_kl_coef x |log ratio| on the
    top --kl_cov_ratio of tokens by that covariance, and, as their code, clips no token; 'vanilla' neither"""
    clip_cov_ratio: float = setting(2e-4, lambda v: 0 < v <= 1, "in (0, 1]")
    """with --loss_mode clip_cov: the share of a micro-batch's tokens whose gradient is dropped (at least 1; the
    paper's 2e-4 picks 1 token of a tiny-model step's ~3,000)"""
    clip_cov_lb: float = setting(1.0, lambda v: True, "a finite number (a covariance may have either sign)")
    """with --loss_mode clip_cov: a token is a candidate when its covariance is above this (the paper's 1)"""
    clip_cov_ub: float = setting(5.0, lambda v: True, "a finite number, above --clip_cov_lb")
    """with --loss_mode clip_cov: ... and below this (the paper's 5)"""
    kl_cov_ratio: float = setting(2e-3, lambda v: 0 < v <= 1, "in (0, 1]")
    """with --loss_mode kl_cov: the share of a micro-batch's tokens, those of highest covariance, that pay the
    penalty (at least 1; 2e-3 in the paper's 7B script, verl's recipe/entropy/7b_kl_cov.sh)"""
    ppo_kl_coef: float = setting(1.0, lambda v: v > 0, "positive")
    """with --loss_mode kl_cov: the penalty's weight on |log pi - log pi_old| (the paper's scripts' 1; verl's
    config file has 0.1)"""
    output_dir: str = "out/grpo_entropy"

    def check_together(self):
        super().check_together()  # grpo.py's
        for name, mode in (("clip_cov_ratio", "clip_cov"), ("clip_cov_lb", "clip_cov"), ("clip_cov_ub", "clip_cov"),
                           ("kl_cov_ratio", "kl_cov"), ("ppo_kl_coef", "kl_cov")):
            if self.changed(name) and self.loss_mode != mode:
                common.fail(f"--{name} belongs to --loss_mode {mode}: add it, or leave --{name} out")
        if self.clip_cov_lb >= self.clip_cov_ub:
            common.fail(f"--clip_cov_lb ({self.clip_cov_lb}) must be below --clip_cov_ub ({self.clip_cov_ub})")
        if self.loss_mode != "vanilla" and (self.loss_type == "cispo" or self.importance_sampling_level != "token"):
            common.fail(f"--loss_mode {self.loss_mode} selects single tokens of the PPO objective: use it with a "
                        "--loss_type other than cispo and --importance_sampling_level token")
        if self.loss_mode == "kl_cov" and self.num_iterations == 1:
            common.fail("--loss_mode kl_cov penalises |log pi - log pi_old|, which is 0, with no gradient, at the "
                        "first update of a batch: it acts from the second on, so set --num_iterations 2 or more")


def token_covariance(logprobs, advantages, mask) -> torch.Tensor:
    """Each token's share of the covariance that drives the entropy (Cui et al. 2025, section 3): for a softmax
    policy, a natural policy-gradient step changes the entropy by about -lr x Cov(log pi(a), A(a)) (a vanilla
    one by -lr x Cov(log pi(a), pi(a) A(a))), so tokens the policy is already sure of (high logp) with a positive
    advantage, and unlikely ones with a negative advantage, drive it down. Per token i over the real tokens:

        cov_i = (A_i - mean A) (logp_i - mean logp)        (means over the micro-batch's real tokens)

    The paper's covariance is over the actions at one state, under pi; its code (and verl's, and this) centres
    over all the tokens of the batch instead, one sample each, which mixes states: a practical proxy.

    No gradient. logprobs, mask [N, T], advantages [N] -> [N, T], -inf at padding (never picked)."""
    mask = mask.bool()
    logp, A = logprobs.detach(), advantages.unsqueeze(1).expand_as(logprobs)
    cov = (A - A[mask].mean()) * (logp - logp[mask].mean())
    return torch.where(mask, cov, float("-inf"))


def covariance_tokens(logprobs, advantages, mask, mode: str, ratio: float, bounds=None, eligible=None) -> torch.Tensor:
    """The tokens the remedies act on, as verl's code picks them, n = max(1, int(ratio x the real tokens)):
        clip_cov   n tokens drawn at random from those with lb < cov_i < ub, bounds = (lb, ub) (and eligible:
                   not clipped already)
        kl_cov     the n tokens of highest cov_i
    mask [N, T]: the real tokens; eligible [N, T] bool or None (all). Returns [N, T] bool."""
    mask = mask.bool()
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if not mask.any():
        return picked.view_as(mask)
    values = token_covariance(logprobs, advantages, mask).flatten()  # [N*T]
    n = max(1, int(ratio * int(mask.sum())))
    if mode == "kl_cov":
        picked[values.topk(min(n, int(mask.sum()))).indices] = True
    else:
        low, high = bounds
        allowed = mask if eligible is None else mask & eligible
        candidates = ((values > low) & (values < high) & allowed.flatten()).nonzero().squeeze(1)
        picked[candidates[torch.randperm(len(candidates), device=mask.device)[:n]]] = True
    return picked.view_as(mask)


def policy_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, sampler_weights=None):
    """grpo.per_token_loss's l_it as the remedies take it, with the clip's decision, which they read:

        l_it = -( w_it min(ratio A_i, clip(ratio, 1 - eps, 1 + eps_high) A_i) - beta k3_it )   (clip_cov)
        l_it = -( w_it ratio A_i - beta k3_it )                                               (kl_cov: no clip)

    The arguments are grpo.per_token_loss's (old_logprobs pi_old, w_it sampler_weights or 1), the settings cfg's.
    Returns l [N, T] (0 at padding) and clipped [N, T] bool: the tokens whose clipped term is the min."""
    mask = mask.bool()
    logprobs, old_logprobs = torch.where(mask, logprobs, 0.0), torch.where(mask, old_logprobs, 0.0)  # padding: 0
    ratio, A = torch.exp(logprobs - old_logprobs), advantages.unsqueeze(1)  # [N, T], [N, 1]
    high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    unclipped, clipped = ratio * A, torch.clamp(ratio, 1 - cfg.epsilon, 1 + high) * A  # [N, T] each
    per_token = -unclipped if cfg.loss_mode == "kl_cov" else -torch.min(unclipped, clipped)  # [N, T]
    if sampler_weights is not None:  # the policy term only
        per_token = per_token * sampler_weights
    if cfg.beta != 0:
        per_token = per_token + cfg.beta * grpo.kl_k3(logprobs, torch.where(mask, ref_logprobs, 0.0))
    return torch.where(mask, per_token, 0.0), clipped < unclipped


def cov_per_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, sampler_weights=None):
    """The remedy of cfg.loss_mode on policy_token_loss, at the tokens covariance_tokens picks, as verl's code:

        clip_cov   l_it = 0 on the picked tokens, drawn from those the clip has not clipped already (no value, no
                   gradient; they still count in the mean): the tokens that drive the entropy down stop
        kl_cov     l_it + ppo_kl_coef |logp - old_logp| on the picked ones: a brake on exactly those tokens

    The arguments are policy_token_loss's. Returns [N, T], 0 at padding."""
    mask = mask.bool()
    logprobs, old_logprobs = torch.where(mask, logprobs, 0.0), torch.where(mask, old_logprobs, 0.0)  # padding: 0
    per_token, clipped = policy_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg,
                                           sampler_weights)  # [N, T], [N, T] bool
    if cfg.loss_mode == "kl_cov":
        picked = covariance_tokens(logprobs, advantages, mask, "kl_cov", cfg.kl_cov_ratio)  # [N, T] bool
        return per_token + torch.where(picked, cfg.ppo_kl_coef * (logprobs - old_logprobs).abs(), 0.0)
    picked = covariance_tokens(logprobs, advantages, mask, "clip_cov", cfg.clip_cov_ratio,
                               (cfg.clip_cov_lb, cfg.clip_cov_ub), eligible=~clipped)  # [N, T] bool
    return torch.where(picked, 0.0, per_token)


def cov_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, step_mask=None, sampler_weights=None):
    """grpo.grpo_loss with the remedy's token losses: cov_per_token_loss, averaged by --loss_type (grpo.aggregate).
    The arguments are grpo_loss's."""
    per_token = cov_per_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, sampler_weights)
    return grpo.aggregate(per_token, mask, cfg.loss_type, step_mask, cfg.max_completion_length)


def main(cfg: Config):
    """grpo.py's training loop, with cov_loss in place of grpo_loss (--loss_mode vanilla: grpo_loss itself)."""
    return grpo.main(cfg, grpo.grpo_loss if cfg.loss_mode == "vanilla" else cov_loss)


if __name__ == "__main__":
    main(common.parse_config(Config))
