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
are rollout.py's (generate, completion_logprobs: read their plain paths first); the calls on `run`
are harness.py's machinery (resume, evaluation, checkpoints, the NaN stop, logging), which changes
no number the algorithm computes.
"""
import copy
from dataclasses import dataclass

import torch

import common
import harness
import rollout
from common import setting


@dataclass
class Config:
    model: str = "out/sft"
    """actor (and reference) to start from: a folder written by sft.py, or a hub id"""
    reward_model: str = "out/rm"
    """reward model (and critic initialisation) written by reward_model.py; 'rule' = the rule-based checker"""
    dataset: str = "data/arithmetic"
    """prompts: a folder with train.jsonl / test.jsonl in GSM8K's schema, or a hub dataset (openai/gsm8k)"""
    output_dir: str = "out/ppo"
    """where the actor checkpoint (critic in critic/), metrics.jsonl, eval.json and the PNG go"""
    overwrite_output_dir: bool = False
    """replace the run already in --output_dir: the new run writes into <output_dir>/.next_run and moves in when it
    finishes, so a run that fails or is killed leaves the old one whole"""
    system_prompt: str = ""
    """optional system message before each question (use the same as for sft.py)"""
    max_steps: int = setting(120, lambda v: v >= 1, "at least 1")
    """training steps (each: one rollout batch, then num_ppo_epochs passes over it)"""
    per_device_train_batch_size: int = setting(128, lambda v: v >= 1, "at least 1")
    """rows per micro-batch of the inference passes, as in grpo.py and mix.py: a row is one prompt + one
    completion (PPO samples one per prompt); a step samples per_device_train_batch_size x
    gradient_accumulation_steps prompts. The training passes split each of the num_mini_batches mini-batches
    into gradient_accumulation_steps micro-batches of per_device_train_batch_size / num_mini_batches rows"""
    num_mini_batches: int = setting(1, lambda v: v >= 1, "at least 1")
    """mini-batches the experience is split into, per PPO epoch (one update of actor and critic each)"""
    gradient_accumulation_steps: int = setting(1, lambda v: v >= 1, "at least 1")
    """micro-batches per mini-batch: the passes and the backward run one micro-batch at a time (less memory), and
    their gradients add up to the mini-batch's (the same result)"""
    num_ppo_epochs: int = setting(1, lambda v: v >= 1, "at least 1")
    """passes over each batch of experience (DeepSpeed-Chat's ppo_epochs)"""
    max_completion_length: int = setting(64, lambda v: v >= 1, "at least 1 token")
    """max new tokens per completion"""
    temperature: float = setting(1.0, lambda v: v > 0, "positive")
    """sampling temperature of the rollout"""
    kl_coef: float = setting(0.1, lambda v: v >= 0, "0 or more")
    """beta of the per-token KL reward -beta * (logp - ref_logp) (the starting value with --target_kl)"""
    target_kl: float | None = setting(None, lambda v: v is None or v > 0, "positive (leave it out for a fixed kl_coef)")
    """adapt kl_coef after each step so that the KL to the reference moves toward this value (Ziegler et al.'s
    adaptive controller; unset = kl_coef stays fixed)"""
    kl_horizon: int = setting(10000, lambda v: v >= 1, "at least 1")
    """the adaptive controller's horizon: larger = slower changes of kl_coef"""
    clip_score: float = setting(5.0, lambda v: v > 0, "positive")
    """the reward model's score is clamped to [-clip_score, clip_score] (DeepSpeed-Chat's clip_reward_value)"""
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
    learning_rate: float = setting(2e-5, lambda v: v > 0, "positive")
    """peak learning rate of the actor's AdamW"""
    critic_learning_rate: float = setting(1e-4, lambda v: v > 0, "positive")
    """peak learning rate of the critic's AdamW"""
    warmup_steps: int = setting(10, lambda v: v >= 0, "0 or more")
    """linear warmup steps from 0 to the learning rates, then a cosine decay"""
    min_lr_rate: float = setting(0.1, lambda v: 0 <= v <= 1, "in [0, 1]")
    """the cosine ends at min_lr_rate * learning rate"""
    max_grad_norm: float = setting(1.0, lambda v: v > 0, "positive (the gradient's norm is clipped to it)")
    """gradient clipping norm (actor and critic separately)"""
    eval_steps: int = setting(40, lambda v: v >= 1, "at least 1")
    """evaluate held-out accuracy every this many steps"""
    num_eval_examples: int = setting(500, lambda v: v >= 0, "0 or more (0: every held-out example)")
    """held-out problems per evaluation (0 = the whole test split)"""
    eval_samples_per_problem: int = setting(4, lambda v: v >= 1, "at least 1")
    """sampled completions per held-out problem (temperature 1): sampled accuracy is their mean"""
    per_device_eval_batch_size: int = setting(512, lambda v: v >= 1, "at least 1")
    """completions generated at once during evaluation (lower it for a large model)"""
    eval_on_start: bool = True
    """evaluate before the first step too (the 'before' of the run's before -> after)"""
    seed: int = setting(0, lambda v: 0 <= v < 2**32, "in [0, 2^32)")
    """random seed"""
    lora_r: int | None = setting(None, lambda v: v is None or v >= 1,
                                 "a positive rank (leave it out to train every weight)")
    """LoRA rank: adapters on actor and critic (pi_ref = the actor with its adapter off); unset = full fine-tuning"""
    lora_alpha: float = setting(16.0, lambda v: v > 0, "positive")
    """LoRA scale: the adapter's output is multiplied by lora_alpha / lora_r"""
    lora_dropout: float = setting(0.0, lambda v: 0 <= v < 1, "in [0, 1)")
    """dropout on the adapter's input"""
    lora_target_modules: str = "all-linear"
    """linear layers that get adapters: 'all-linear' or names such as q_proj,v_proj"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, more time (large models)"""
    fsdp: bool = False
    """under torchrun: shard the weights of all four models, and the gradients and AdamW states, over the processes
    (FSDP2), instead of a full copy on each (data parallelism); the saved models are whole, resumable checkpoints
    are sharded"""
    log_completions_steps: int = setting(10, lambda v: v >= 0, "0 or more (0: never)")
    """every this many steps, write the step's prompts, completions, scores, rewards and mean advantages to
    completions.jsonl (0 = never)"""
    save_steps: int = setting(20, lambda v: v >= 1, "at least 1")
    """write a resumable checkpoint (weights, optimizer, random generators) every this many steps, and at the end"""
    resume: bool = False
    """continue from the checkpoint in --output_dir, exactly where it stopped (same result as an unbroken run)"""
    trust_remote_code: bool = False
    """let a hub model run its own Python code (off: only its weights and config are loaded)"""
    merge_lora: bool = False
    """with --lora_r, also save the adapter merged into its base model, in <output_dir>/merged"""


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
    """r(x, y) [B]: the reward model's score at each sequence's last real token (note 003: an
    outcome reward model computes a score at every position, only the last one is used). That is
    the EOS of a finished completion; a completion cut off at max_completion_length has no EOS and
    is scored at its last token like the others, although the reward model was trained on answers
    that end with EOS. So a truncated answer gets a score from outside the RM's training
    distribution, which PPO may learn to exploit. Remedies elsewhere: a fixed penalty instead
    (TRL 1.16's online DPO trainer subtracts its missing_eos_penalty), or no loss at all on such
    completions (grpo.py's --mask_truncated_completions). The same as reward_model.sequence_scores."""
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
    """Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", section 2.2), as
    the AdaptiveKLController of TRL up to 0.11: a proportional controller that steers the KL to the reference
    (the mean over completions of the summed log pi / pi_ref) toward target_kl:

        e = clip(KL / target_kl - 1, -0.2, 0.2),    kl_coef <- kl_coef * (1 + e * batch_size / horizon)

    The penalty grows while the policy drifts too far and shrinks while it stays too close."""
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * batch_size / horizon)


def compute_rewards(score, logprobs, ref_logprobs, mask, kl_coef, clip_score):
    """Per-token rewards [B, T] (note 000, DeepSpeed-Chat's compute_rewards):

        r_t = -kl_coef * (logp_t - ref_logp_t)                     on every real token
        r_T += clamp(score, -clip_score, clip_score)               on each row's last real token

    Per token the KL term has either sign: it charges for raising a token above pi_ref and pays for
    lowering it; only its expectation over tokens from pi is a penalty, -kl_coef * KL(pi || pi_ref). The
    reward model's verdict on the whole completion arrives only at its end. Padding gets 0.
    score [B]; logprobs, ref_logprobs, mask [B, T]."""
    mask = mask.bool()
    rewards = torch.where(mask, -kl_coef * (logprobs - ref_logprobs), 0.0)  # [B, T]
    last = (mask.sum(dim=1) - 1).clamp(min=0)  # [B] index of the last real token (right padding)
    rows = torch.arange(len(last), device=rewards.device)
    rewards[rows, last] += torch.clamp(score, -clip_score, clip_score).to(rewards.dtype)
    return rewards


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
    denominator is the global batch's, see common.token_count). When these rows are one
    micro-batch of an update, step_tokens (token_count of the update's mask) is the denominator,
    so the micro-batch means add up to the update's mean (gradient accumulation)."""
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum() / (step_tokens if step_tokens is not None else common.token_count(mask))


def ppo_actor_loss(logprobs, old_logprobs, advantages, mask, clip_eps, step_tokens=None):
    """PPO's clipped surrogate, as a loss (note 000's actor_loss_fn), token mean over the batch:

        ratio = exp(logp - old_logp)
        l_t   = max(-A_t * ratio, -A_t * clip(ratio, 1 - eps, 1 + eps))

    The max of the two losses is the min of the two objectives: once the ratio has moved past
    1 + eps (A > 0) or 1 - eps (A < 0), the clipped term is the larger loss and, being constant
    in theta, gives no gradient (note 003's figure). The clip removes the incentive per token: it
    limits how hard one batch pushes each token, not how far the policy moves, since shared weights
    move other tokens too (Engstrom et al. 2020; Wang et al. 2020). With one update per batch (the
    defaults) the ratio is exactly 1 and the clip never acts.
    logprobs, old_logprobs, advantages, mask [B, T]; step_tokens: see masked_mean."""
    mask = mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # junk on padding never reaches exp
    ratio = torch.exp(log_ratio)
    A = torch.where(mask, advantages, 0.0)
    loss = torch.max(-A * ratio, -A * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    return masked_mean(loss, mask, step_tokens)


def ppo_critic_loss(values, old_values, returns, mask, clip_value, step_tokens=None):
    """Clipped value loss (note 000's critic_loss_fn), token mean over the batch:

        v_clip = clip(v, old_v - c, old_v + c)
        l_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)

    The critic is fitted to the returns R. The max keeps the larger error, so the gradient is gone
    only where V has moved more than c from old_v toward R (the clipped error, constant in theta,
    is then the larger); a V that left the band away from R keeps its gradient and is pulled back.
    So V is not kept within c of old_v: the clip only removes, token by token, the pull past c toward
    R. c is in reward units, like V and R, not a ratio. Andrychowicz et al. (2021, "What matters in
    on-policy RL") found value clipping often does not help; it stays here because note 000's
    DeepSpeed-Chat (and TRL's PPOTrainer, before TRL dropped it) use it. values, old_values, returns,
    mask [B, T]; step_tokens: see masked_mean."""
    mask = mask.bool()
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values, 0.0)
    returns = torch.where(mask, returns, 0.0)
    clipped = torch.clamp(values, old_values - clip_value, old_values + clip_value)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask, step_tokens)


def clip_fraction(unclipped_loss, clipped_loss, mask) -> float:
    """Fraction of real tokens where the clipped term of max(unclipped, clipped) is strictly the
    larger (TRL's clipfrac), i.e. the tokens that get no gradient from this update. For the actor:
    the ratio has moved past 1 + eps with A > 0, or past 1 - eps with A < 0 (grpo.py's clip_fraction
    counts the same tokens); for the critic: V has moved more than c from its old value toward the
    return, so the clipped error is the larger. unclipped_loss, clipped_loss, mask [B, T]."""
    taken_over = (clipped_loss > unclipped_loss) & mask.bool()
    return taken_over.sum().item() / mask.sum().item()


@torch.no_grad()
def update_stats(actor_loss, critic_loss, logprobs, old_logprobs, values, old_values, advantages, returns, entropy,
                 mask, cfg) -> dict:
    """What one update of actor and critic logs: its two losses, the share of tokens where each clip
    took over (clip_fraction), and the policy's entropy. Every tensor [b, T], for the update's rows."""
    ratio = torch.exp(torch.where(mask.bool(), logprobs - old_logprobs, 0.0))  # [b, T]
    clipped_ratio = torch.clamp(ratio, 1 - cfg.cliprange, 1 + cfg.cliprange)
    clipped_values = torch.clamp(values, old_values - cfg.cliprange_value, old_values + cfg.cliprange_value)
    return {"loss/actor": actor_loss.item(), "loss/critic": critic_loss.item(),
            "clip_fraction/actor": clip_fraction(-advantages * ratio, -advantages * clipped_ratio, mask),
            "clip_fraction/critic": clip_fraction((values - returns) ** 2, (clipped_values - returns) ** 2, mask),
            "entropy": masked_mean(entropy, mask).item()}


@torch.no_grad()
def step_metrics(score, completions, answers, mask, old_logprobs, ref_logprobs, old_values, returns, updates) -> dict:
    """What a step logs: the reward model's score and, when the data has answers, the rule-based
    accuracy of the same completions (do they rise together?); the KL to the reference; the mean of
    the updates' update_stats; how well the critic's values fit the returns. score [B]; the rest [B, T]."""
    return {
        "score": score.mean().item(),
        **({"accuracy": sum(float(common.is_correct(c, a)) for c, a in zip(completions, answers)) / len(completions)}
           if answers is not None else {}),
        # k1 summed over a completion's tokens, mean over completions (TRL's objective/kl); not grpo.py's
        # kl, a k3 mean per token: hence another name
        "kl_sum": torch.where(mask.bool(), old_logprobs - ref_logprobs, 0.0).sum(dim=1).mean().item(),
        **{key: sum(u[key] for u in updates) / len(updates) for key in updates[0]},  # the mean over updates
        "value_error": masked_mean((old_values - returns) ** 2, mask).item(),
        "completion_length": mask.sum(dim=1).float().mean().item(),
    }


# ---------------------------------------------------------------------------------------------
# The training pass, and when the inference step can take pi_old and V_old from it
# ---------------------------------------------------------------------------------------------
def training_pass(actor, critic, input_ids, attention_mask, num_completion_tokens: int, temperature: float):
    """The forward pass the two losses differentiate, over some rows: the actor's log-probs and
    entropy, and the critic's values [b, T] each, with gradients."""
    logprobs, entropy = rollout.completion_logprobs(actor, input_ids, attention_mask, num_completion_tokens,
                                                    temperature, with_entropy=True)
    return logprobs, entropy, critic_values(critic, input_ids, attention_mask, num_completion_tokens)


def makes_one_update(cfg) -> bool:
    """True when a step makes a single update (one PPO epoch of one mini-batch, in one micro-batch).

    Speed: then the update's training pass sees the weights that pi_old's and V_old's inference
    passes would see, so it runs first and its detached outputs serve as old_logprobs and old_values:
    two forward passes fewer per step (grpo.py does the same for pi_old), the same numbers on every
    real token (tests/test_rlhf_scripts.py runs a step both ways). With more updates per step the
    old values must stay fixed while the weights move, so they get passes of their own."""
    return cfg.num_ppo_epochs == 1 and cfg.num_mini_batches == 1 and cfg.gradient_accumulation_steps == 1


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--reward_model": cfg.reward_model,
                                   "--dataset": cfg.dataset})  # settings, output folder, torchrun
    rows_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # B prompts, one sample each
    if cfg.per_device_train_batch_size % cfg.num_mini_batches:
        common.fail(f"--per_device_train_batch_size ({cfg.per_device_train_batch_size}) must be a multiple of "
                    f"--num_mini_batches ({cfg.num_mini_batches})")

    # data: GSM8K's schema (question, answer: rule-based accuracy is measured too), or prompts only (the
    # `prompt` column of a preference dataset such as Dahoas/rm-static: the reward model is the only judge).
    has_answers = "prompt" not in common.load_split(cfg.dataset, "train", columns=()).column_names
    columns = ("question", "answer") if has_answers else ("prompt",)
    train_data, test_data = common.load_splits(cfg.dataset, columns, cfg.num_eval_examples, rows_per_step)
    if not has_answers and cfg.reward_model == "rule":
        common.fail(f"--reward_model rule checks answers, and {cfg.dataset} has prompts only: pass a reward model")

    # the four models
    actor, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first",
                                         trust_remote_code=cfg.trust_remote_code)
    questions = list(train_data[columns[0]]) + list(test_data[columns[0]])
    common.check_prompts_fit(actor, tokenizer, questions, cfg.system_prompt, cfg.max_completion_length, cfg.dataset)
    actor = run.prepare(actor)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    # pi_ref: a frozen copy of the starting actor, or with LoRA none (the actor with its adapter off).
    reference = copy.deepcopy(actor).eval().requires_grad_(False) if cfg.lora_r is None else None
    if cfg.reward_model == "rule":  # the rule-based checker scores; the critic starts with a fresh value head
        reward_model = None
        critic = common.load_model(cfg.model, scalar_head=True, trust_remote_code=cfg.trust_remote_code)[0]
    else:
        hint = "run `python reward_model.py` first (or pass --reward_model rule)"
        reward_model = common.load_model(cfg.reward_model, missing_hint=hint, scalar_head=True, reward_model=True,
                                         trust_remote_code=cfg.trust_remote_code)[0]
        reward_model.to(run.device).eval().requires_grad_(False)
        critic = copy.deepcopy(reward_model).requires_grad_(True)  # the critic starts as the reward model
    critic = run.prepare(critic, scalar_head=True)  # LoRA critic: adapters and its value head are trained
    run.shard(actor, reference, critic, reward_model)  # --fsdp: each process keeps 1/N of each model
    run.log_memory([actor, critic], [reference, reward_model])
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_learning_rate, weight_decay=0.0)
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
        # 1. Rollout: the actor decodes one completion per prompt.
        step_data = train_data[run.rng.sample(range(len(train_data)), rows_per_step)]  # {column: [B values]}
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in step_data[columns[0]]]
        prompt_ids, prompt_mask, completion_ids, mask = rollout.generate(
            actor, tokenizer, prompts, cfg.max_completion_length, cfg.temperature
        )  # [B, P], [B, P], [B, T], [B, T]
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([prompt_mask, mask], dim=1)  # [B, P+T]
        T = completion_ids.shape[1]

        # 2. Inference (prefill only, no gradient): the experience the PPO epochs will reuse, one
        # micro-batch of rows at a time (gradient accumulation: the logits of one micro-batch in memory).
        # With one update per step, pi_old's log-probs and V_old come from that update's own pass.
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # row indices
        old_logprobs, ref_logprobs, old_values = (torch.zeros(mask.shape, device=run.device) for _ in range(3))
        one_update = makes_one_update(cfg)
        with torch.no_grad():  # [B, T] each
            for rows in micro_batches:
                if not one_update:  # pi_old's log-probs and V_old: the KL reward and GAE need them before any update
                    old_logprobs[rows] = rollout.completion_logprobs(actor, input_ids[rows], attention_mask[rows], T,
                                                                     cfg.temperature)
                with common.reference_model(actor, reference) as pi_ref:  # the frozen copy, or LoRA switched off
                    ref_logprobs[rows] = rollout.completion_logprobs(pi_ref, input_ids[rows], attention_mask[rows], T,
                                                                     cfg.temperature)
                if not one_update:
                    old_values[rows] = critic_values(critic, input_ids[rows], attention_mask[rows], T)
            if reward_model is None:
                score = rule_scores(completions, step_data["answer"]).to(run.device)  # [B]
            else:
                score = torch.cat([reward_scores(reward_model, input_ids[rows], attention_mask[rows])
                                   for rows in micro_batches])  # [B]
        if one_update:  # Speed: the only update's own pass runs now, with gradients; detached, it is pi_old and V_old
            first_pass = training_pass(actor, critic, input_ids, attention_mask, T, cfg.temperature)  # 3 x [B, T]
            old_logprobs, old_values = first_pass[0].detach(), first_pass[2].detach()
        with torch.no_grad():
            # 3. + 4. Per-token rewards (KL to the reference + the score at EOS), then GAE.
            rewards = compute_rewards(score, old_logprobs, ref_logprobs, mask, state["kl_coef"], cfg.clip_score)
            advantages, returns = gae(old_values, rewards, mask, cfg.gamma, cfg.lam)  # [B, T], [B, T]
            if cfg.whiten_advantages:
                advantages = whiten(advantages, mask)

        # 5. PPO epochs over mini-batches of the experience: one actor and one critic update per mini-batch.
        updates = []  # what each update logs (update_stats)
        for _ in range(cfg.num_ppo_epochs):
            for idx in torch.randperm(len(prompts)).chunk(cfg.num_mini_batches):
                # Gradient accumulation: the mini-batch in micro-batches, each loss divided by the mini-batch's tokens.
                step_tokens = common.token_count(mask[idx])
                logprobs, entropy, values = (torch.zeros(len(idx), T, device=run.device) for _ in range(3))  # detached
                actor_loss = critic_loss = 0.0
                for part in torch.arange(len(idx)).chunk(cfg.gradient_accumulation_steps):
                    rows = idx[part]
                    micro_logprobs, entropy[part], micro_values = (  # [b', T] each
                        [x[rows] for x in first_pass] if one_update else
                        training_pass(actor, critic, input_ids[rows], attention_mask[rows], T, cfg.temperature))
                    micro_actor_loss = ppo_actor_loss(micro_logprobs, old_logprobs[rows], advantages[rows], mask[rows],
                                                      cfg.cliprange, step_tokens)
                    micro_critic_loss = ppo_critic_loss(micro_values, old_values[rows], returns[rows], mask[rows],
                                                        cfg.cliprange_value, step_tokens)
                    micro_actor_loss.backward()  # gradients add up over the micro-batches
                    micro_critic_loss.backward()
                    logprobs[part], values[part] = micro_logprobs.detach(), micro_values.detach()
                    actor_loss = actor_loss + micro_actor_loss.detach()
                    critic_loss = critic_loss + micro_critic_loss.detach()
                for loss, model, optimizer in ((actor_loss, actor, actor_optimizer),
                                               (critic_loss, critic, critic_optimizer)):
                    run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
                    optimizer.step()
                    # gradients freed at once, not kept until the next update: the next step's
                    # training pass may run before its update (makes_one_update) and needs the memory
                    optimizer.zero_grad(set_to_none=True)
                for scheduler in schedulers:
                    scheduler.step()
                updates.append(update_stats(actor_loss, critic_loss, logprobs, old_logprobs[idx], values,
                                            old_values[idx], advantages[idx], returns[idx], entropy, mask[idx], cfg))

        # 6. Metrics: the reward model's score and, on the same completions, the rule-based truth.
        metrics = run.log({**step_metrics(score, completions, step_data.get("answer"), mask, old_logprobs, ref_logprobs,
                                          old_values, returns, updates),
                           "kl_coef": state["kl_coef"], "learning_rate": schedulers[0].get_last_lr()[0]},
                          completions={"prompt": prompts, "completion": completions, "score": score.tolist(),
                                       "reward": torch.where(mask.bool(), rewards, 0.0).sum(dim=1).tolist(),
                                       "advantage": (advantages.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).tolist()})
        if cfg.target_kl is not None:  # the KL of all processes (metrics are reduced), so every process agrees
            state["kl_coef"] = adaptive_kl_coef(state["kl_coef"], metrics["kl_sum"], cfg.target_kl, cfg.kl_horizon,
                                                len(prompts) * run.world_size)

    run.finish(tokenizer, {"": actor, "critic": critic},
               {"reward model score": ["score", "eval/score"],
                "accuracy (rule-based)": ["accuracy", "eval/accuracy_greedy", "eval/accuracy_sampled"],
                "kl to reference (k1 sum per completion)": ["kl_sum"], "losses": ["loss/actor", "loss/critic"]}, "PPO")
    return actor


if __name__ == "__main__":
    main(common.parse_config(Config))
