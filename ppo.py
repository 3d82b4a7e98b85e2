"""Stage 3 of classic RLHF: PPO with four models (note 000, DeepSpeed-Chat; note 003, OpenRLHF).

    actor      pi_theta: the policy being trained             starts as the SFT model (out/sft)
    reference  pi_ref: a frozen copy of the starting actor    anchors the KL penalty
    critic     V(s_t): one value per token, trained           starts as the reward model (out/rm)
    reward     r(x, y): one score per completion, frozen      the reward model (out/rm)

    python sft.py && python reward_model.py && python ppo.py
    python ppo.py --reward_model rule       # the rule-based checker instead of the reward model
    torchrun --nproc_per_node 2 ppo.py      # data parallel over 2 GPUs (or CPU processes)
    python ppo.py --lora_r 8                # LoRA actor and critic; the reference is the actor with its adapter off

Only the actor decodes ("rollout"); the reference, critic and reward model just read the finished
sequences in one forward pass each ("inference", prefill only). One step:
  1. rollout:    the actor samples one completion per prompt    completion_ids, mask    [B, T]
  2. inference:  the actor's (old) and the reference's log-probs, the critic's values  [B, T]
                 and the reward model's score at each completion's EOS                 [B]
  3. rewards:    per token -kl_coef * (logp - ref_logp); the clipped score added on the last token
  4. GAE:        advantages and returns, computed backwards over the tokens             [B, T]
  5. PPO epochs: num_ppo_epochs passes over mini-batches of this experience; the clipped actor
                 loss steps the actor, the clipped critic loss steps the critic
"""
import copy
import os
import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import common


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
    max_steps: int = 80
    """training steps (each: one rollout batch, then num_ppo_epochs passes over it)"""
    per_device_train_batch_size: int = 128
    """prompts per micro-batch, one completion each; a step samples per_device_train_batch_size x
    gradient_accumulation_steps prompts"""
    num_mini_batches: int = 1
    """mini-batches the experience is split into, per PPO epoch (one update of actor and critic each)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per mini-batch: the passes and the backward run one micro-batch at a time (less memory), and
    their gradients add up to the mini-batch's (the same result)"""
    num_ppo_epochs: int = 1
    """passes over each batch of experience (DeepSpeed-Chat's ppo_epochs)"""
    max_completion_length: int = 64
    """max new tokens per completion"""
    temperature: float = 1.0
    """sampling temperature of the rollout"""
    kl_coef: float = 0.1
    """beta of the per-token KL reward -beta * (logp - ref_logp) (the starting value with --target_kl)"""
    target_kl: float | None = None
    """adapt kl_coef after each step so that the KL to the reference moves toward this value (Ziegler et al.'s
    adaptive controller; unset = kl_coef stays fixed)"""
    kl_horizon: int = 10000
    """the adaptive controller's horizon: larger = slower changes of kl_coef"""
    clip_score: float = 5.0
    """the reward model's score is clamped to [-clip_score, clip_score] (DeepSpeed-Chat's clip_reward_value)"""
    cliprange: float = 0.2
    """clip range of the actor's ratio pi/pi_old"""
    cliprange_value: float = 0.2
    """clip range of the critic's values around the old values"""
    gamma: float = 1.0
    """discount factor of GAE"""
    lam: float = 0.95
    """lambda of GAE: 0 = one-step TD error, 1 = Monte Carlo return minus value"""
    whiten_advantages: bool = True
    """normalise the advantages of each batch to mean 0, std 1 over the real tokens"""
    learning_rate: float = 2e-5
    """peak learning rate of the actor's AdamW"""
    critic_learning_rate: float = 1e-4
    """peak learning rate of the critic's AdamW"""
    warmup_steps: int = 10
    """linear warmup steps from 0 to the learning rates, then a cosine decay"""
    min_lr_rate: float = 0.1
    """the cosine ends at min_lr_rate * learning rate"""
    max_grad_norm: float = 1.0
    """gradient clipping norm (actor and critic separately)"""
    eval_steps: int = 40
    """evaluate held-out accuracy every this many steps"""
    num_eval_examples: int = 500
    """held-out problems per evaluation (0 = the whole test split)"""
    eval_samples_per_problem: int = 4
    """sampled completions per held-out problem (temperature 1): sampled accuracy is their mean"""
    per_device_eval_batch_size: int = 512
    """completions generated at once during evaluation (lower it for a large model)"""
    eval_on_start: bool = True
    """evaluate before the first step too (the 'before' of the run's before -> after)"""
    seed: int = 0
    """random seed"""
    lora_r: int | None = None
    """LoRA rank: adapters on actor and critic (pi_ref = the actor with its adapter off); unset = full fine-tuning"""
    lora_alpha: float = 16.0
    """LoRA scale: the adapter's output is multiplied by lora_alpha / lora_r"""
    lora_dropout: float = 0.0
    """dropout on the adapter's input"""
    lora_target_modules: str = "all-linear"
    """linear layers that get adapters: 'all-linear' or names such as q_proj,v_proj"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, more time (large models)"""
    log_completions_steps: int = 10
    """every this many steps, write the step's prompts, completions, scores, rewards and mean advantages to
    completions.jsonl (0 = never)"""
    save_steps: int = 20
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
    hidden = common.last_hidden_states(critic, input_ids, attention_mask)[:, -num_completion_tokens - 1 : -1]  # [B, T, H]
    return critic.score(hidden).squeeze(-1)


def reward_scores(reward_model, input_ids, attention_mask):
    """r(x, y) [B]: the reward model's score at each sequence's last real token, the EOS (note 003:
    an outcome reward model computes a score at every position, only the EOS one is used).
    The same as reward_model.sequence_scores."""
    hidden = common.last_hidden_states(reward_model, input_ids, attention_mask)  # [B, L, H]
    last = attention_mask.shape[1] - 1 - attention_mask.flip(dims=[1]).argmax(dim=1)  # [B] index of the last 1
    return reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1)


@torch.no_grad()
def held_out_score(actor, reward_model, tokenizer, questions, max_new_tokens: int, system_prompt: str, batch_size=64) -> dict:
    """Held-out evaluation when the data has no answers to check (prompts only, e.g. Dahoas/rm-static):
    the reward model's mean score of the actor's greedy completions. Only as trustworthy as the
    reward model (see the README's reward-hacking example)."""
    actor.eval()
    total = 0.0
    for start in range(0, len(questions), batch_size):
        prompts = [common.make_prompt(tokenizer, q, system_prompt) for q in questions[start : start + batch_size]]
        prompt_ids, prompt_mask, completion_ids, mask = common.generate(actor, tokenizer, prompts, max_new_tokens, greedy=True)
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
    TRL's AdaptiveKLController: a proportional controller that steers the KL to the reference
    (the mean over completions of the summed log pi / pi_ref) toward target_kl:

        e = clip(KL / target_kl - 1, -0.2, 0.2),    kl_coef <- kl_coef * (1 + e * batch_size / horizon)

    The penalty grows while the policy drifts too far and shrinks while it stays too close."""
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * batch_size / horizon)


def compute_rewards(score, logprobs, ref_logprobs, mask, kl_coef, clip_score):
    """Per-token rewards [B, T] (note 000, DeepSpeed-Chat's compute_rewards):

        r_t = -kl_coef * (logp_t - ref_logp_t)                     on every real token
        r_T += clamp(score, -clip_score, clip_score)               on each row's last real token

    The KL term pays the policy, token by token, for staying close to the reference; the reward
    model's verdict on the whole completion arrives only at its end. Padding gets 0.
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

    lam = 1 gives A_t = (sum of rewards from t on) - V_t (Monte Carlo, high variance); lam = 0
    gives the one-step TD error (low variance, biased by the critic). Values and rewards on
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
    in theta, gives no gradient, so one batch cannot push the policy far (note 003's figure).
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

    The critic is fitted to the returns R, but, like the actor, not allowed to move its values
    further than c from those it gave when the experience was made. values, old_values, returns,
    mask [B, T]; step_tokens: see masked_mean."""
    mask = mask.bool()
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values, 0.0)
    returns = torch.where(mask, returns, 0.0)
    clipped = torch.clamp(values, old_values - clip_value, old_values + clip_value)
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask, step_tokens)


def clip_fraction(ratio_or_values, lower, upper, mask) -> float:
    """Fraction of real tokens outside [lower, upper] (where the clipped term takes over)."""
    outside = (ratio_or_values < lower) | (ratio_or_values > upper)
    return (outside & mask.bool()).sum().item() / mask.sum().item()


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
def main(cfg: Config):
    common.check_settings(cfg)
    inputs = {"--model": cfg.model, "--reward_model": cfg.reward_model, "--dataset": cfg.dataset}  # never written to
    run_dir = common.prepare_output_dir(cfg, inputs)  # --output_dir, or <output_dir>/.next_run
    step_batch = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # prompts per step
    if cfg.per_device_train_batch_size % cfg.num_mini_batches:
        common.fail(f"--per_device_train_batch_size ({cfg.per_device_train_batch_size}) must be a multiple of "
                    f"--num_mini_batches ({cfg.num_mini_batches})")
    rank, world_size = common.setup_distributed()  # DDP: rank 0 of 1 without torchrun
    common.set_seed(cfg.seed + rank)  # each process samples its own prompts and completions
    device = common.get_device()

    # data and the four models
    # GSM8K's schema (question, answer: rule-based accuracy is measured too), or prompts only (the
    # `prompt` column of a preference dataset such as Dahoas/rm-static: the reward model is the only judge).
    has_answers = "prompt" not in common.load_split(cfg.dataset, "train", columns=()).column_names
    columns = ("question", "answer") if has_answers else ("prompt",)
    train_data = common.load_split(cfg.dataset, "train", columns)
    test_data = common.load_split(cfg.dataset, "test", columns)
    if not has_answers and cfg.reward_model == "rule":
        common.fail(f"--reward_model rule checks answers, and {cfg.dataset} has prompts only: pass a reward model")
    if cfg.num_eval_examples:
        test_data = test_data.select(range(min(cfg.num_eval_examples, len(test_data))))
    if len(train_data) < step_batch:
        common.fail(f"{cfg.dataset} has {len(train_data)} training prompts, fewer than the {step_batch} a step samples")
    actor, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first", trust_remote_code=cfg.trust_remote_code)
    common.check_system_prompt(actor, tokenizer, cfg.system_prompt)  # before any prompt is made with it
    longest = common.longest_prompt(tokenizer, list(train_data[columns[0]]) + list(test_data[columns[0]]), cfg.system_prompt)
    common.check_fits_context(actor, longest + cfg.max_completion_length, f"the longest prompt of {cfg.dataset} plus --max_completion_length")
    if cfg.gradient_checkpointing:
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r is not None:  # LoRA: the actor is frozen, adapters are trained
        actor = common.add_lora(actor, cfg)
    actor.to(device).train()
    common.broadcast_weights(actor)  # DDP: every process starts from rank 0's weights (LoRA's A is random)
    # pi_ref: a frozen copy of the starting actor, or with LoRA none (the actor with its adapter off).
    reference = copy.deepcopy(actor).eval().requires_grad_(False) if cfg.lora_r is None else None
    if cfg.reward_model == "rule":
        reward_model, critic = None, common.load_model(cfg.model, scalar_head=True, trust_remote_code=cfg.trust_remote_code)[0]  # critic: fresh value head
    else:
        hint = "run `python reward_model.py` first (or pass --reward_model rule)"
        reward_model = common.load_model(cfg.reward_model, missing_hint=hint, scalar_head=True, trust_remote_code=cfg.trust_remote_code,
                                         reward_model=True)[0]
        reward_model.to(device).eval().requires_grad_(False)
        critic = copy.deepcopy(reward_model).requires_grad_(True)  # the critic starts as the reward model
    if cfg.gradient_checkpointing:
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r is not None:  # LoRA critic: adapters and its value head are trained
        critic = common.add_lora(critic, cfg, scalar_head=True)
    critic.to(device).train()
    common.broadcast_weights(critic)  # DDP: the same starting weights everywhere (a fresh value head is random)
    common.log(common.memory_estimate([actor, critic], [m for m in (reference, reward_model) if m is not None]))

    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_learning_rate, weight_decay=0.0)
    num_updates = cfg.max_steps * cfg.num_ppo_epochs * cfg.num_mini_batches
    schedulers = [common.warmup_cosine_schedule(opt, cfg.warmup_steps * num_updates // cfg.max_steps, num_updates, cfg.min_lr_rate)
                  for opt in (actor_optimizer, critic_optimizer)]
    rng = random.Random(cfg.seed + rank)  # DDP: each process its own prompts

    started = time.perf_counter()  # wall clock of the run, for accuracy-vs-time plots (carried across --resume)

    def evaluate(step):
        if not has_answers:
            scores = held_out_score(actor, reward_model, tokenizer, test_data["prompt"], cfg.max_completion_length, cfg.system_prompt)
            common.log_metrics(run_dir, {"step": step, "eval/score": scores["score"]})
            common.log(f"step {step}: held-out reward-model score of greedy completions {scores['score']:.3f}")
            return scores
        scores = common.evaluate(actor, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                            cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)
        common.log_metrics(run_dir, {"step": step, "eval/accuracy_greedy": scores["accuracy_greedy"],
                                     "eval/accuracy_sampled": scores["accuracy_sampled"],
                                     "time/elapsed": time.perf_counter() - started})
        common.log(f"step {step}: held-out accuracy greedy {scores['accuracy_greedy']:.1%}, "
                   f"sampled {scores['accuracy_sampled']:.1%}")
        return scores

    # Resumable checkpoints (--save_steps, --resume): all that training needs to continue exactly.
    training_state = dict(models=[actor, critic], optimizers=[actor_optimizer, critic_optimizer], schedulers=schedulers, rng=rng)
    if cfg.resume:  # continue exactly where the last checkpoint stopped
        first_step, results = common.load_training_state(run_dir, **training_state)
        started -= results.get("elapsed", 0.0)
        initial, scores, kl_coef = results["initial"], results["scores"], results["kl_coef"]
    else:
        common.start_output_dir(run_dir)
        kl_coef = cfg.kl_coef  # changes only with --target_kl
        first_step, initial = 0, evaluate(0) if cfg.eval_on_start else None
        scores = initial
    progress = tqdm(range(first_step + 1, cfg.max_steps + 1), initial=first_step, total=cfg.max_steps, desc="ppo",
                    dynamic_ncols=True, disable=not common.show_progress())
    for step in progress:
        # 1. Rollout: the actor decodes one completion per prompt.
        t0 = time.perf_counter()
        step_data = train_data[rng.sample(range(len(train_data)), step_batch)]  # {column: [B values]}
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in step_data[columns[0]]]
        prompt_ids, prompt_mask, completion_ids, mask = common.generate(
            actor, tokenizer, prompts, cfg.max_completion_length, cfg.temperature
        )  # [B, P], [B, P], [B, T], [B, T]
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([prompt_mask, mask], dim=1)  # [B, P+T]
        T = completion_ids.shape[1]
        t1 = time.perf_counter()

        # 2. Inference (prefill only, no gradient): the experience the PPO epochs will reuse, one
        # micro-batch of rows at a time (gradient accumulation: the logits of one micro-batch in memory).
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # row indices
        old_logprobs, ref_logprobs, old_values = (torch.zeros(mask.shape, device=device) for _ in range(3))  # [B, T]
        with torch.no_grad():
            for rows in micro_batches:
                # pi_old's log-probs: the KL reward needs them before any update, so unlike grpo.py this pass
                # stays even with one epoch and one mini-batch (where the training pass recomputes them).
                old_logprobs[rows] = common.completion_logprobs(actor, input_ids[rows], attention_mask[rows], T, cfg.temperature)
                with common.reference_model(actor, reference) as pi_ref:  # the frozen copy, or LoRA switched off
                    ref_logprobs[rows] = common.completion_logprobs(pi_ref, input_ids[rows], attention_mask[rows], T, cfg.temperature)
                old_values[rows] = critic_values(critic, input_ids[rows], attention_mask[rows], T)
            if reward_model is None:
                score = rule_scores(completions, step_data["answer"]).to(device)  # [B]
            else:
                score = torch.cat([reward_scores(reward_model, input_ids[rows], attention_mask[rows]) for rows in micro_batches])  # [B]
            # 3. + 4. Per-token rewards (KL to the reference + the score at EOS), then GAE.
            rewards = compute_rewards(score, old_logprobs, ref_logprobs, mask, kl_coef, cfg.clip_score)  # [B, T]
            advantages, returns = gae(old_values, rewards, mask, cfg.gamma, cfg.lam)  # [B, T], [B, T]
            if cfg.whiten_advantages:
                advantages = whiten(advantages, mask)
        t2 = time.perf_counter()

        # 5. PPO epochs over mini-batches of the experience: one actor and one critic update per mini-batch.
        time_forward = time_backward = 0.0
        stats = {key: [] for key in ("actor_loss", "critic_loss", "actor_clip", "critic_clip", "entropy")}
        for _ in range(cfg.num_ppo_epochs):
            for idx in torch.randperm(len(prompts)).chunk(cfg.num_mini_batches):
                actor_optimizer.zero_grad(set_to_none=True)
                critic_optimizer.zero_grad(set_to_none=True)
                # Gradient accumulation: the mini-batch in micro-batches, each loss divided by the mini-batch's tokens.
                step_tokens = common.token_count(mask[idx])
                logprobs, entropy, values = (torch.zeros(len(idx), T, device=device) for _ in range(3))  # [b, T], detached
                actor_loss = critic_loss = 0.0
                for part in torch.arange(len(idx)).chunk(cfg.gradient_accumulation_steps):
                    rows = idx[part]
                    t3 = time.perf_counter()
                    micro_logprobs, entropy[part] = common.completion_logprobs(
                        actor, input_ids[rows], attention_mask[rows], T, cfg.temperature, with_entropy=True)  # [b', T]
                    micro_actor_loss = ppo_actor_loss(micro_logprobs, old_logprobs[rows], advantages[rows], mask[rows],
                                                      cfg.cliprange, step_tokens)
                    micro_values = critic_values(critic, input_ids[rows], attention_mask[rows], T)  # [b', T]
                    micro_critic_loss = ppo_critic_loss(micro_values, old_values[rows], returns[rows], mask[rows],
                                                        cfg.cliprange_value, step_tokens)
                    t4 = time.perf_counter()
                    micro_actor_loss.backward()  # gradients add up over the micro-batches
                    micro_critic_loss.backward()
                    logprobs[part], values[part] = micro_logprobs.detach(), micro_values.detach()
                    actor_loss, critic_loss = actor_loss + micro_actor_loss.detach(), critic_loss + micro_critic_loss.detach()
                    time_forward, time_backward = time_forward + t4 - t3, time_backward + time.perf_counter() - t4
                t4 = time.perf_counter()
                for loss, model, optimizer in ((actor_loss, actor, actor_optimizer), (critic_loss, critic, critic_optimizer)):
                    common.average_gradients(model)  # DDP: the same update on every process
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    common.check_finite(step, run_dir, grad_norm=grad_norm, loss=loss)  # NaN/inf: stop before the update
                    optimizer.step()
                for scheduler in schedulers:
                    scheduler.step()
                time_backward += time.perf_counter() - t4
                with torch.no_grad():
                    ratio = torch.exp(torch.where(mask[idx].bool(), logprobs - old_logprobs[idx], 0.0))
                    stats["actor_loss"].append(actor_loss.item())
                    stats["critic_loss"].append(critic_loss.item())
                    stats["actor_clip"].append(clip_fraction(ratio, 1 - cfg.cliprange, 1 + cfg.cliprange, mask[idx]))
                    stats["critic_clip"].append(clip_fraction(values - old_values[idx], -cfg.cliprange_value,
                                                              cfg.cliprange_value, mask[idx]))
                    stats["entropy"].append(masked_mean(entropy, mask[idx]).item())

        # 6. Logging: the reward model's score and, on the same completions, the rule-based truth.
        with torch.no_grad():
            kl = torch.where(mask.bool(), old_logprobs - ref_logprobs, 0.0).sum(dim=1).mean().item()
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        metrics = {
            "step": step,
            "score": score.mean().item(),
            **({"accuracy": mean([float(common.is_correct(c, a)) for c, a in zip(completions, step_data["answer"])])}
               if has_answers else {}),
            "kl": kl,  # sum over a completion's tokens of log pi/pi_ref, mean over completions
            "kl_coef": kl_coef,
            "loss/actor": mean(stats["actor_loss"]),
            "loss/critic": mean(stats["critic_loss"]),
            "clip_fraction/actor": mean(stats["actor_clip"]),
            "clip_fraction/critic": mean(stats["critic_clip"]),
            "value_error": masked_mean((old_values - returns) ** 2, mask).item(),
            "entropy": mean(stats["entropy"]),
            "completion_length": mask.sum(dim=1).float().mean().item(),
            "learning_rate": schedulers[0].get_last_lr()[0],
            "time/generation": t1 - t0,
            "time/logprobs": t2 - t1 + time_forward,  # the inference passes + the training forward passes
            "time/backward": time_backward,
            "time/step": time.perf_counter() - t0,  # the whole step: rollout, rewards, passes, update
        }
        metrics = common.reduce_metrics(metrics)  # DDP: the mean over processes
        common.log_metrics(run_dir, metrics)
        if cfg.target_kl is not None:  # the KL of all processes (metrics are reduced), so every process agrees
            kl_coef = adaptive_kl_coef(kl_coef, metrics["kl"], cfg.target_kl, cfg.kl_horizon, len(prompts) * world_size)
        if cfg.log_completions_steps and step % cfg.log_completions_steps == 0:  # what the policy wrote (rank 0's share)
            common.log_completions(run_dir, step, prompts, completions, score=score.tolist(),
                                   reward=torch.where(mask.bool(), rewards, 0.0).sum(dim=1).tolist(),
                                   advantage=(advantages.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).tolist())
        progress.set_postfix(score=f"{metrics['score']:.2f}", acc=f"{metrics.get('accuracy', float('nan')):.2f}", kl=f"{kl:.2f}")
        if step % cfg.eval_steps == 0 or step == cfg.max_steps:
            scores = evaluate(step)
            common.log(f"  sample: {prompts[0]!r} -> {completions[0]!r} (score {score[0]:.2f})")
        if step % cfg.save_steps == 0 or step == cfg.max_steps:  # after this step's evaluation: a resume repeats nothing
            common.save_training_state(run_dir, cfg, step, {"initial": initial, "scores": scores, "kl_coef": kl_coef,
                                                               "elapsed": time.perf_counter() - started}, **training_state)

    def change(key):  # "before -> after", or "after" alone without --eval_on_start
        return (f"{initial[key]:.1%} -> " if initial else "") + f"{scores[key]:.1%}"

    common.save_checkpoint(actor, tokenizer, run_dir, cfg.merge_lora)
    os.makedirs(os.path.join(run_dir, "critic"), exist_ok=True)
    common.save_checkpoint(critic, tokenizer, os.path.join(run_dir, "critic"))
    common.write_json(os.path.join(run_dir, "eval.json"), scores)
    png = common.plot_metrics(
        run_dir,
        {"reward model score": ["score", "eval/score"], "accuracy (rule-based)": ["accuracy", "eval/accuracy_greedy", "eval/accuracy_sampled"],
         "kl to reference": ["kl"], "losses": ["loss/actor", "loss/critic"]},
        "PPO",
    )
    common.finish_output_dir(run_dir, cfg)  # a run that replaces an old one moves in now, whole
    if has_answers:
        common.log(f"saved model to {cfg.output_dir}; held-out sampled accuracy {change('accuracy_sampled')}, "
                   f"greedy {change('accuracy_greedy')} (n={scores['n']}); curves in {os.path.join(cfg.output_dir, png)}")
    else:
        common.log(f"saved model to {cfg.output_dir}; held-out reward-model score "
                   f"{initial['score'] if initial else float('nan'):.3f} -> {scores['score']:.3f} (n={scores['n']}); curves in {os.path.join(cfg.output_dir, png)}")
    return actor


if __name__ == "__main__":
    main(common.parse_config(Config))
