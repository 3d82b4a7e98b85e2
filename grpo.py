"""GRPO: Group Relative Policy Optimization (DeepSeekMath; TRL's GRPOTrainer), notes 002 and 004.

PPO without a critic. For each prompt, sample a group of G completions, score each with
rule-based reward functions, and use its reward relative to the group as the advantage of
every one of its tokens. Update with PPO's clipped ratio plus a k3 KL penalty to a frozen
reference policy. At the default num_iterations 1 (one update per batch) the ratio is exactly 1
and the clip never acts: the step is a group-baseline REINFORCE step (the advantage divided by the
group's std) plus the k3 KL term's gradient. The clip acts with several
updates per batch.

    python sft.py && python grpo.py                      # tiny model from out/sft -> out/grpo
    python grpo.py --beta 0 --loss_type dapo             # no reference model, token-mean loss
    python grpo.py --loss_type dr_grpo --scale_rewards none              # Dr. GRPO
    python grpo.py --importance_sampling_level sequence --epsilon 3e-4 --epsilon_high 4e-4  # GSPO
    python grpo.py --advantage_estimator rloo            # RLOO (or reinforce_pp: REINFORCE++-baseline)
    python grpo.py --loss_type cispo --epsilon_high 5    # CISPO: a capped, detached ratio weight on every token
    python grpo.py --dynamic_sampling true               # DAPO: only groups whose rewards differ
    python grpo.py --vllm_importance_sampling_correction true   # TIS: weigh tokens by pi_train / pi_sampler, capped
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k \\
        --system_prompt "Think in <think></think>, then give the number in <answer></answer>."
    torchrun --nproc_per_node 2 grpo.py                  # data parallel over 2 GPUs (or CPU processes)
    torchrun --nproc_per_node 2 grpo.py --fsdp true      # sharded: each process holds half the weights and states
    python grpo.py --lora_r 8                            # LoRA; pi_ref = the model with its adapter off

One training step:
  1. rollout: B prompts x G samples each          completion_ids, completion_mask  [B*G, T]
  2. rewards: sum of the reward functions         rewards      [B*G]
  3. advantages: (r - group mean) / (group std)   advantages   [B*G]
  4. inference: reference log-probs (beta > 0), old log-probs (num_iterations > 1)
  5. num_iterations gradient steps on the clipped objective with the KL penalty

The numbered steps are the numbered comments of main()'s loop. The rollout and the log-prob pass
are lib/rollout.py's (generate, completion_logprobs: read their plain paths first); the calls on `run`
are lib/harness.py's machinery (resume, evaluation, checkpoints, the NaN stop, logging), which changes
no number the algorithm computes.
"""
import copy
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
from common import setting
from lib import harness, rollout

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo")  # how grpo_loss weighs and averages the token losses
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")  # step 3's baseline (see advantages_of)

# ---------------------------------------------------------------------------------------------
# Reward functions: plain callables f(prompts, completions, **dataset_columns) -> list[float],
# as in TRL. Note 002's rewards: answer +1 / -1, format +1.25 / -1. The total is their sum.
# ---------------------------------------------------------------------------------------------
def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """+1 if the number inside <answer></answer> equals the dataset's (after '####'), else -1."""
    return [1.0 if common.is_correct(completion, gold) else -1.0 for completion, gold in zip(completions, answer)]


FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """+1.25 if the completion is exactly <think>...</think><answer>...</answer>, else -1."""
    return [1.25 if FORMAT.match(completion.strip()) else -1.0 for completion in completions]


REWARD_FUNCS = [correctness_reward, format_reward]


@dataclass
class Config(harness.PolicyGradientConfig):
    """GRPO's settings (the run's, from the model to the sampler's correction, are harness.PolicyGradientConfig's)."""
    LOSS_SCALES = ("beta", "entropy_coeff")  # scale a loss term: named in the advice after a NaN
    num_generations: int = setting(8, lambda v: v >= 2, "at least 2: the advantage compares completions within a group")
    """G: completions sampled per prompt (the group)"""
    num_iterations: int = setting(1, lambda v: v >= 1, "at least 1")
    """gradient steps per rollout batch (TRL's name; DeepSeekMath's mu, a letter this repo keeps for MIX's weight)"""
    epsilon: float = setting(0.2, lambda v: v > 0, "positive (the clip range of the ratio)")
    """clip range of the ratio pi/pi_old: it is kept in [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = setting(None, lambda v: v is None or v > 0, "positive (leave it out to use --epsilon)")
    """upper clip range, unset = epsilon (DAPO's clip-higher: 0.28 with epsilon 0.2, room for rare tokens to grow)"""
    importance_sampling_level: str = setting("token", lambda v: v in ("token", "sequence"), "one of token, sequence")
    """'token': a ratio per token (PPO, GRPO); 'sequence': one per completion, the geometric mean of its tokens'
    ratios (GSPO; it wants a far smaller clip range, e.g. --epsilon 3e-4 --epsilon_high 4e-4)"""
    beta: float = setting(0.04, lambda v: v >= 0, "0 or more")
    """weight of the KL penalty to the reference policy (0 = no reference model); 0.04 is DeepSeekMath's (section 4.2),
    where TRL 1.16 defaults to 0.0, loss_type dapo, lr 1e-6 and use_bias_correction_kl True: set them to compare"""
    advantage_estimator: str = setting("grpo", lambda v: v in ADVANTAGE_ESTIMATORS,
                                       "one of " + ", ".join(ADVANTAGE_ESTIMATORS))
    """step 3, each reward against a baseline from its group (see advantages_of): 'grpo' (r - group mean) / std as
    --scale_rewards says; 'rloo' r minus the mean of the group's other G - 1 rewards, no std (RLOO); 'reinforce_pp' r -
    group mean, then normalised over the whole batch (REINFORCE++-baseline). OpenRLHF's rloo and reinforce_baseline"""
    loss_type: str = setting("grpo", lambda v: v in LOSS_TYPES, "one of " + ", ".join(LOSS_TYPES))
    """how token losses are averaged (see aggregate): 'grpo' each completion's mean, then over completions; 'bnpo' one
    mean over a micro-batch's tokens, weighted by its share of the step's rows; 'dapo' one mean over the step's
    tokens; 'dr_grpo' the sum / (completions x max_completion_length); 'cispo' (MiniMax-M1, as TRL 1.16) no clip of
    the objective: each token's A * logp weighted by its ratio capped at --epsilon_high (an absolute cap, e.g. 5) and
    detached, one mean over the step's tokens"""
    scale_rewards: str = setting("group", lambda v: v in ("group", "batch", "none"), "one of group, batch, none")
    """divide the centred rewards by the std of their 'group' (GRPO), of the step's raw rewards ('batch'), or 'none'"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop each group whose rewards are all equal (no signal), sample more prompts until the
    step has B groups with spread or --max_sampling_rounds rollouts were made (logs dynamic_sampling/rounds, /groups)"""
    max_sampling_rounds: int = setting(4, lambda v: v >= 1, "at least 1")
    """with --dynamic_sampling: rollouts per step at most (DAPO's max_num_gen_batches)"""
    mask_truncated_completions: bool = False
    """completions cut off at max_completion_length (no EOS) carry no loss (DAPO's overlong filtering)"""
    entropy_coeff: float = setting(0.0, lambda v: v >= 0, "0 or more")
    """an entropy bonus (verl's name and default): the loss minus entropy_coeff x the policy's entropy, averaged as the
    token losses are (see grpo_loss); its graph is kept for the backward, a [micro-batch rows, T, V] tensor more"""
    # the run's settings (lib/harness.py) at GRPO's defaults
    output_dir: str = "out/grpo"
    per_device_train_batch_size: int = 128
    """a row is one prompt + one completion: a step samples per_device_train_batch_size x
    gradient_accumulation_steps completions (prompts per step x num_generations)"""

    def check_together(self):
        super().check_together()  # the sampler's correction (harness.PolicyGradientConfig)
        rows_per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if rows_per_step % self.num_generations:
            common.fail(f"--per_device_train_batch_size x --gradient_accumulation_steps ({rows_per_step}) must be a "
                        f"multiple of --num_generations ({self.num_generations})")
        if self.loss_type == "cispo" and ((self.epsilon_high or 0) < 1 or self.importance_sampling_level != "token"):
            common.fail("--loss_type cispo weighs each token by its ratio capped at --epsilon_high, an absolute cap "
                        "of 1 or more (ScaleRL, arXiv 2510.13786, and TRL suggest 5.0; below 1 it lowers every weight, "
                        "even at ratio 1): set it, and keep --importance_sampling_level token")
        if self.changed("max_sampling_rounds") and not self.dynamic_sampling:
            common.fail("--max_sampling_rounds limits DAPO's dynamic sampling: add --dynamic_sampling true, or leave "
                        "it out")
        if self.advantage_estimator != "grpo" and self.scale_rewards != "group":
            common.fail(f"--scale_rewards belongs to --advantage_estimator grpo; {self.advantage_estimator} has its "
                        "own scale")


# ---------------------------------------------------------------------------------------------
# The math of GRPO
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(r_group)) / (std + eps) for each completion i (note 004), where std is
      'group': the std of the completion's own group (DeepSeekMath; the default, as TRL's);
      'batch': the std of every raw reward of the step, on all processes (TRL's 'batch': group mean,
               batch std, after Lite PPO, arXiv 2508.08221). REINFORCE++-baseline differs: it divides by
               the std of the group-centred rewards (reinforce_pp_advantages);
      'none':  no division at all (Dr. GRPO, Z. Liu et al. 2025). Divided by its std, every group with
               any spread has the same sum of squared advantages, G - 1 (eps aside), whatever its success rate:
               a prompt solved almost always or almost never weighs as much as a 50/50 one, i.e. its
               r - mean is scaled up relative to the others'. Dr. GRPO calls that a difficulty bias.

    rewards [B*G], the G completions of a prompt contiguous; std is the unbiased one (torch's
    default, as TRL). The group mean is the baseline a critic would otherwise learn. A group
    whose completions all score the same gives 0 advantage: no signal from that prompt."""
    grouped = rewards.view(-1, group_size)  # [B, G]
    mean = grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True)
    elif scale_rewards == "batch":  # under torchrun: the mean and std of the whole global batch
        count, total = common.global_sum(float(rewards.numel())), common.global_sum(rewards.sum())
        std = (common.global_sum(((rewards - total / count) ** 2).sum()) / (count - 1)).sqrt()
    elif scale_rewards == "none":
        return (grouped - mean).view(-1)
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return ((grouped - mean) / (std + eps)).view(-1)  # [B*G]


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (REINFORCE Leave-One-Out; Ahmadian et al. 2024, OpenRLHF's 'rloo'): the baseline of
    completion i is the mean of the *other* G - 1 rewards of its group, so it does not depend on
    r_i itself (an unbiased baseline, where the plain group mean holds a 1/G share of r_i):

        A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean(r_group))

    No division by a std. rewards [N], the G completions of a prompt contiguous -> [N]."""
    grouped = rewards.view(-1, group_size)  # [B, G]
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
    return (grouped - others_mean).view(-1)


def reinforce_pp_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, OpenRLHF's 'reinforce_baseline'): subtract the group
    mean, then normalise over the whole batch, all processes:

        a_i = r_i - mean(r_group);   A_i = (a_i - mean(a)) / (std(a) + eps)

    where mean and std (divided by n, as OpenRLHF's) run over every completion of the step. The
    group mean removes the prompt's difficulty; the batch std, unlike GRPO's group std, does not
    scale a nearly-always-solved prompt up to a 50/50 one. OpenRLHF adds a per-token KL reward
    before this and normalises over tokens; here the KL stays grpo_loss's beta * k3 term and each
    completion counts once. rewards [N], groups contiguous -> [N]."""
    grouped = rewards.view(-1, group_size)  # [B, G]
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # [N]
    count = common.global_sum(float(centred.numel()))
    mean = common.global_sum(centred.sum()) / count
    std = (common.global_sum(((centred - mean) ** 2).sum()) / count).sqrt()
    return (centred - mean) / (std + eps)


def advantages_of(rewards: torch.Tensor, group_size: int, estimator: str = "grpo",
                  scale_rewards: str = "group") -> torch.Tensor:
    """Step 3 by --advantage_estimator: group_advantages ('grpo'), rloo_advantages,
    reinforce_pp_advantages. rewards [N] -> advantages [N]."""
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_size)
    return group_advantages(rewards, group_size, scale_rewards)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) (Schulman's 'Approximating KL divergence'; notes 002 / 004):
    k3 = exp(ref - logp) - (ref - logp) - 1, >= 0, its mean over tokens sampled from pi unbiased. In the loss its
    gradient is the forward KL's, KL(pi_ref || pi): docs/grpo.md#where-the-kl-estimate-goes. [N, T] -> [N, T]."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def drop_truncated(completion_ids, completion_mask, eos_token_id: int) -> torch.Tensor:
    """DAPO's overlong filtering: completion_mask [N, T] with every row that never reached EOS (cut
    off at max_completion_length) set to 0, so that such a completion carries no loss."""
    ended = ((completion_ids == eos_token_id) & completion_mask.bool()).any(dim=1)  # [N]
    return completion_mask * ended.unsqueeze(1)


def importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level="token") -> torch.Tensor:
    """pi_theta / pi_old per token, [N, T], or per completion, [N, 1]: GSPO's (Zheng et al. 2025) exp of the mean of
    its tokens' log pi_theta - log pi_old, the geometric mean of their ratios. Padding must hold 0 in both."""
    log_ratio = logprobs - old_logprobs  # [N, T]
    if importance_sampling_level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
    return torch.exp(log_ratio)


def per_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps, beta, epsilon_high=None,
                   importance_sampling_level="token", cispo=False, sampler_weights=None) -> torch.Tensor:
    """The GRPO objective of notes 002 / 004 at token t of completion i, as a loss to minimise:
        l_it = -( w_it min(ratio A_i, clip(ratio, 1 - eps, 1 + eps_high) A_i) - beta k3_it ),  ratio = pi / pi_old
    eps_high = epsilon_high, or eps (DAPO's clip-higher); w_it = sampler_weights (TIS), else 1; cispo (MiniMax-M1):
    -w_it min(ratio, eps_high).detach() A_i logp in place of the min. logprobs, old_logprobs, ref_logprobs (None when
    beta is 0), mask [N, T]; advantages [N] (or [N, T], a token's own: grpo_process.py) -> [N, T], 0 at padding:
    junk there never reaches value or gradient."""
    mask = mask.bool()
    logprobs, old_logprobs = torch.where(mask, logprobs, 0.0), torch.where(mask, old_logprobs, 0.0)  # padding: 0
    ratio = importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level)  # [N, T] or [N, 1]
    A, high = token_advantages(advantages), clip_eps if epsilon_high is None else epsilon_high  # A [N, 1] or [N, T]
    if cispo:  # a capped, detached weight on the plain policy gradient
        per_token = -torch.clamp(ratio, max=high).detach() * A * logprobs  # [N, T]
    else:
        per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_eps, 1 + high) * A).expand_as(mask)  # [N, T]
    if sampler_weights is not None:  # the tokens came from a sampler that is not this policy's pass
        per_token = per_token * sampler_weights
    if beta != 0:
        per_token = per_token + beta * kl_k3(logprobs, torch.where(mask, ref_logprobs, 0.0))
    return torch.where(mask, per_token, 0.0)


def token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """A completion's advantage for each of its tokens: [N] -> [N, 1] (broadcast); [N, T] stays as it is."""
    return advantages.unsqueeze(1) if advantages.dim() == 1 else advantages


def aggregate(per_token, mask, loss_type, step_mask=None, max_completion_length=None) -> torch.Tensor:
    """The loss from the real tokens' losses (per_token, mask [N, T]) by loss_type (TRL's names; docs/grpo.md's table):
    'grpo' each completion's mean, then their mean; 'bnpo' one mean over the micro-batch's tokens; 'dapo', 'cispo' one
    mean over the step's tokens; 'dr_grpo' the sum / (completions x max_completion_length). step_mask: the step's mask
    (every process's), whose counts divide: the micro-batches' losses add up to the step's ('bnpo': each micro-batch's
    mean weighted by its share of the step's rows, a plain average of them when the micro-batches are equal)."""
    mask = mask.bool()
    step_mask = mask if step_mask is None else step_mask
    sequences = len(step_mask)
    if loss_type == "grpo":
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / sequences  # completions' means, averaged
    if loss_type == "bnpo":  # each micro-batch's own token mean, weighted by its share of the step's rows
        return per_token.sum() / mask.sum().clamp(min=1) / (sequences / len(mask))
    if loss_type in ("dapo", "cispo"):
        return per_token.sum() / common.mean_denominator(step_mask)
    return per_token.sum() / (sequences * max_completion_length)  # dr_grpo


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, step_mask=None, sampler_weights=None):
    """GRPO's loss: per_token_loss at cfg's settings, averaged by --loss_type (aggregate); main adds an entropy term."""
    per_token = per_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg.epsilon, cfg.beta,
                               cfg.epsilon_high, cfg.importance_sampling_level, cfg.loss_type == "cispo",
                               sampler_weights)  # [N, T]
    return aggregate(per_token, mask, cfg.loss_type, step_mask, cfg.max_completion_length)


def rows_or_none(values: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """A micro-batch's rows of a pass's log-probs; None (not computed: no reference) stays None."""
    return None if values is None else values[rows]


def masked_mean_per_sequence(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's real tokens, then over rows: the logged kl weighs each completion alike, as
    'grpo' weighs the loss (TRL 1.16 logs kl as one token mean over the global batch instead)."""
    mask = mask.to(values.dtype)
    return ((values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()


def clip_fraction(logprobs, old_logprobs, advantages, mask, clip_eps, epsilon_high=None,
                  importance_sampling_level="token", loss_type="grpo") -> float:
    """Fraction of real tokens whose ratio is clipped, i.e. that get no gradient this update; with
    'cispo' (no token loses its gradient) the share whose weight was capped at epsilon_high, counted
    where A > 0 as TRL 1.16's cispo_clip_ratio."""
    ratio = importance_ratio(torch.where(mask.bool(), logprobs, 0.0), torch.where(mask.bool(), old_logprobs, 0.0),
                             mask, importance_sampling_level)
    A = token_advantages(advantages)
    high = clip_eps if epsilon_high is None else epsilon_high
    if loss_type == "cispo":
        clipped = (ratio > high) & (A > 0)
    else:
        clipped = ((ratio > 1 + high) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))
    return (clipped & mask.bool()).sum().item() / mask.sum().item()


@torch.no_grad()
def step_metrics(rewards_per_func, completion_mask, logprobs, old_logprobs, ref_logprobs, advantages, cfg,
                 entropy) -> dict:
    """What a step logs besides its loss, with TRL 1.16's names where the quantity is the same
    (completion_length is its completions/mean_length, clip_fraction its clip_ratio/region_mean,
    entropy its entropy: the policy's -sum_v p(v) log p(v) at each position, a token mean; its kl is a
    token mean over the batch, ours a mean per completion). rewards_per_func [B*G, F]; the rest
    [B*G, T] or [B*G]; ref_logprobs None when beta is 0."""
    rewards = rewards_per_func.sum(dim=1)  # [B*G]
    group_std = rewards.view(-1, cfg.num_generations).std(dim=1)  # [B]
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else None  # [B*G, T]
    return {
        "reward": rewards.mean().item(),
        "reward_std": group_std.mean().item(),  # within-group spread: the signal
        "frac_reward_zero_std": (group_std == 0).float().mean().item(),  # groups with no reward signal (all A = 0)
        **{f"rewards/{f.__name__}": rewards_per_func[:, i].mean().item() for i, f in enumerate(REWARD_FUNCS)},
        "accuracy": (rewards_per_func[:, 0] > 0).float().mean().item(),  # column 0: correctness_reward
        "kl": masked_mean_per_sequence(kl, completion_mask).item() if kl is not None else 0.0,
        "completion_length": completion_mask.sum(dim=1).float().mean().item(),
        "clip_fraction": clip_fraction(logprobs, old_logprobs, advantages, completion_mask, cfg.epsilon,
                                       cfg.epsilon_high, cfg.importance_sampling_level, cfg.loss_type),
        "entropy": ((entropy * completion_mask).sum() / completion_mask.sum().clamp(min=1)).item(),
    }


def step_log(batch, advantages, logprobs, old_logprobs, ref_logprobs, entropy, loss, grad_norm, scheduler, cfg,
             rounds=None) -> tuple[dict, dict]:
    """run.end_step's two arguments: the step's metrics (its loss, step_metrics, the gradient's norm
    before clipping, the learning rate; with dynamic sampling its rounds and kept groups) and what the
    policy wrote (completions.jsonl's columns). old_logprobs None: pi_old = pi."""
    old = old_logprobs if old_logprobs is not None else logprobs
    weights = (rollout.sampler_importance_weights(  # TIS's w, from pi_old, as the loss took them
        old, batch.sampler_logprobs, batch.completion_mask, cfg.vllm_importance_sampling_mode,
        cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min)
        if cfg.vllm_importance_sampling_correction else None)
    metrics = {"loss": loss.item(),
               **step_metrics(batch.rewards_per_func, batch.completion_mask, logprobs, old, ref_logprobs, advantages,
                              cfg, entropy),
               "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0],
               **rollout.sampler_mismatch(old, batch.sampler_logprobs, batch.completion_mask,  # pi_old's gap
                                          weights),
               **({"dynamic_sampling/rounds": rounds, "dynamic_sampling/groups": len(batch.prompts) //
                   cfg.num_generations} if rounds is not None else {})}
    completions = {"prompt": batch.prompts, "completion": batch.completions,
                   "advantage": (advantages if advantages.dim() == 1 else advantages[:, 0]).tolist(),  # token 0's
                   **{f"rewards/{f.__name__}": batch.rewards_per_func[:, i].tolist()
                      for i, f in enumerate(REWARD_FUNCS)}}
    return metrics, completions


# ---------------------------------------------------------------------------------------------
# Steps 1 and 2, and DAPO's dynamic sampling
# ---------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """Steps 1 and 2 for N rows (B prompts x G samples, groups contiguous): the text, the token ids
    the passes read, and each reward function's reward."""
    prompts: list[str]  # [N]
    completions: list[str]  # [N], decoded
    prompt_ids: torch.Tensor  # [N, P], left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T], right-padded
    completion_mask: torch.Tensor  # [N, T]: 1 on the sampled tokens, the EOS included
    sampler_logprobs: torch.Tensor  # [N, T]: each sampled token's log-prob as the sampler computed it, 0 after EOS
    rewards_per_func: torch.Tensor  # [N, F]

    def select(self, keep: list[bool]) -> "Rollout":
        """The rows where keep is True."""
        return Rollout([p for p, k in zip(self.prompts, keep) if k], [c for c, k in zip(self.completions, keep) if k],
                       self.prompt_ids[keep], self.prompt_mask[keep], self.completion_ids[keep],
                       self.completion_mask[keep], self.sampler_logprobs[keep], self.rewards_per_func[keep])


def sample_and_score(model, tokenizer, step_data: dict, cfg) -> Rollout:
    """Steps 1 and 2 for the B prompts of step_data ({column: [B values]}): G completions of each,
    groups contiguous, then their rewards."""
    G = cfg.num_generations
    # 1. Rollout: G samples of each of B prompts, groups contiguous.
    prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in step_data["question"] for _ in range(G)]
    prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs = rollout.generate(
        model, tokenizer, prompts, cfg.max_completion_length, cfg.temperature, return_logprobs=True
    )  # [B*G, P], [B*G, P], [B*G, T], [B*G, T], [B*G, T]
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    # 2. Rewards: every dataset column is passed to the reward functions, repeated G times.
    columns = {name: [value for value in values for _ in range(G)] for name, values in step_data.items()}
    rewards_per_func = torch.tensor([f(prompts, completions, **columns) for f in REWARD_FUNCS]).T  # [B*G, F]
    return Rollout(prompts, completions, prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs,
                   rewards_per_func)


NO_SPREAD = ("dynamic sampling found no group whose rewards differ in --max_sampling_rounds rounds (more rounds, a "
             "higher --temperature, or problems the policy solves sometimes give some)")


def dynamic_sampling(batch: Rollout, sample_more, group_size: int, num_groups: int, max_rounds: int,
                     pad_token_id: int) -> tuple[Rollout | None, int]:
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a group whose G rewards are all equal
    has every advantage 0, so no policy gradient: drop it, and call sample_more() (steps 1 and 2 on
    new prompts) until num_groups groups with spread are found, at most max_rounds rollouts in all.
    Under torchrun every process runs as many rounds as the slowest needs and keeps as many groups
    as the poorest found, so their passes stay in step. Returns the kept rows (at most num_groups x
    G; None when no round had a group with spread: NO_SPREAD says so) and the number of rounds."""
    def with_spread(part: Rollout) -> Rollout:  # one round's groups whose rewards differ
        grouped = part.rewards_per_func.sum(dim=1).view(-1, group_size)  # [B, G]
        return part.select((grouped != grouped[:, :1]).any(dim=1).repeat_interleave(group_size).tolist())

    kept, rounds = [with_spread(batch)], 1
    groups = lambda: sum(len(part.prompts) for part in kept) // group_size  # noqa: E731
    while rounds < max_rounds and common.global_sum(int(groups() < num_groups)) > 0:
        kept.append(with_spread(sample_more()))
        rounds += 1
    num_rows = common.global_min(min(groups(), num_groups)) * group_size  # the same on every process
    if num_rows == 0:
        return None, rounds

    def stack(key: str, left: bool, value: int = 0) -> torch.Tensor:  # padded to the widest round, then cut
        width = max(getattr(part, key).shape[1] for part in kept)
        return torch.cat([F.pad(getattr(part, key), (width - getattr(part, key).shape[1], 0) if left else
                                (0, width - getattr(part, key).shape[1]), value=value) for part in kept])[:num_rows]

    return Rollout([p for part in kept for p in part.prompts][:num_rows],
                   [c for part in kept for c in part.completions][:num_rows],
                   stack("prompt_ids", True, pad_token_id), stack("prompt_mask", True),
                   stack("completion_ids", False, pad_token_id), stack("completion_mask", False),
                   stack("sampler_logprobs", False),
                   torch.cat([part.rewards_per_func for part in kept])[:num_rows]), rounds


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
def main(cfg: Config, policy_loss=grpo_loss, step_advantages=None, inputs: dict | None = None):
    """grpo_entropy.py passes its own policy_loss; grpo_process.py its step_advantages (step 3 from each step's
    reward) and, in inputs, the process reward model the run reads."""
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset,  # settings, output folder, torchrun
                                   **(inputs or {})})
    G = cfg.num_generations
    num_prompts = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G  # B

    # data and models
    train_data, test_data, model, tokenizer, longest = common.load_policy_and_prompts(cfg, per_step=num_prompts)
    model = run.prepare(model)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    # The reference policy pi_ref, only needed for the KL term: a frozen copy of the starting policy,
    # or with LoRA none at all (the policy with its adapter switched off, see common.reference_model).
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 and cfg.lora_r is None else None
    run.shard(model, ref_model)  # --fsdp: each process keeps 1/N of every weight, gradient and AdamW state
    run.log_memory([model], [ref_model], rows=cfg.per_device_train_batch_size,
                   sequence_length=longest + cfg.max_completion_length, completion_length=cfg.max_completion_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps * cfg.num_iterations,
                                              cfg.max_steps * cfg.num_iterations, cfg.min_lr_rate)

    def evaluate():  # held-out accuracy, greedy and sampled: run.steps calls it every --eval_steps
        return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                               cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)

    def draw_prompts():  # the step's B prompts, {column: [B values]}
        return train_data[run.rng.sample(range(len(train_data)), num_prompts)]

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # 1. + 2. Rollout and rewards (sample_and_score): G samples of each of B prompts, groups contiguous.
        step_data = draw_prompts()
        batch = sample_and_score(model, tokenizer, step_data, cfg)
        if cfg.dynamic_sampling:  # DAPO: keep the groups whose rewards differ, sampling more prompts to fill B
            batch, rounds = dynamic_sampling(batch, lambda: sample_and_score(model, tokenizer, draw_prompts(), cfg),
                                             G, num_prompts, cfg.max_sampling_rounds, tokenizer.pad_token_id)
            if batch is None:  # nothing to learn from this step
                run.nothing_to_learn(NO_SPREAD, {"dynamic_sampling/rounds": rounds, "dynamic_sampling/groups": 0})
                continue
        rewards = batch.rewards_per_func.sum(dim=1)  # [B*G]

        # 3. Group-relative advantages replace the critic.
        if step_advantages is None:
            advantages, process_log = advantages_of(rewards, G, cfg.advantage_estimator, cfg.scale_rewards), {}  # [B*G]
        else:  # grpo_process.py: each token's own [B*G, T], from the rewards of the steps at or after it
            advantages, process_log = step_advantages(batch, step_data, tokenizer)
        advantages = advantages.to(run.device)
        # The tokens that carry loss [B*G, T]: every real one, or (DAPO) none of a completion that was cut off.
        loss_mask = (drop_truncated(batch.completion_ids, batch.completion_mask, tokenizer.eos_token_id)
                     if cfg.mask_truncated_completions else batch.completion_mask)

        # 4. Inference passes (no gradient): the reference policy, and pi_old if it will differ from pi.
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [B*G, P+T]
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)  # [B*G, P+T]
        T = batch.completion_ids.shape[1]
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # gradient accumulation
        ref_logprobs = old_logprobs = None  # [B*G, T] each, where needed; None: not computed
        if cfg.beta > 0:
            with common.reference_model(model, ref_model) as reference:  # the frozen copy, or LoRA switched off
                ref_logprobs = rollout.inference(rollout.completion_logprobs, reference, input_ids, attention_mask, T,
                                                 cfg.temperature, micro_batches=micro_batches)
        if cfg.num_iterations > 1:  # with one update per batch pi_old is pi itself: step 5 takes pi's log-probs
            old_logprobs = rollout.inference(rollout.completion_logprobs, model, input_ids, attention_mask, T,
                                             cfg.temperature, micro_batches=micro_batches)

        # 5. num_iterations gradient steps on the clipped objective with the KL penalty.
        for _ in range(cfg.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0  # the step's: the micro-batches' losses, each divided by the step's counts, add up to it
            logprobs, entropy = (torch.zeros_like(loss_mask, dtype=torch.float) for _ in range(2))  # [B*G, T], metrics
            for rows in micro_batches:  # one micro-batch of rows at a time (memory); the gradients add up
                micro_logprobs, micro_entropy = rollout.completion_logprobs_and_entropy(
                    model, input_ids[rows], attention_mask[rows], T, cfg.temperature,
                    entropy_grad=cfg.entropy_coeff > 0)  # [n, T] each
                micro_old = micro_logprobs.detach() if old_logprobs is None else old_logprobs[rows]  # pi_old [n, T]
                weights = (rollout.sampler_importance_weights(  # TIS: w = pi_old / pi_sampler, bounded [n, T] or [n, 1]
                    micro_old, batch.sampler_logprobs[rows], loss_mask[rows], cfg.vllm_importance_sampling_mode,
                    cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min)
                    if cfg.vllm_importance_sampling_correction else None)
                micro_loss = (policy_loss(micro_logprobs, micro_old, rows_or_none(ref_logprobs, rows), advantages[rows],
                                          loss_mask[rows], cfg, loss_mask, weights)  # grpo_loss
                              - cfg.entropy_coeff * aggregate(torch.where(loss_mask[rows].bool(), micro_entropy, 0.0),
                                                              loss_mask[rows], cfg.loss_type, loss_mask,
                                                              cfg.max_completion_length))  # the entropy bonus
                micro_loss.backward()  # gradients add up over the micro-batches
                loss = loss + micro_loss.detach()
                logprobs[rows], entropy[rows] = micro_logprobs.detach(), micro_entropy.detach()
            grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
            optimizer.step()
            scheduler.step()

        metrics, completions = step_log(batch, advantages, logprobs, old_logprobs, ref_logprobs, entropy, loss,
                                        grad_norm, scheduler, cfg, rounds if cfg.dynamic_sampling else None)
        run.end_step({**metrics, **process_log}, completions)  # when due: evaluate, save

    run.finish(tokenizer, {"": model}, {"reward": ["reward", "rewards/correctness_reward", "rewards/format_reward"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"],
                                        "kl to reference": ["kl"], "completion length": ["completion_length"]},
               "GRPO")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
