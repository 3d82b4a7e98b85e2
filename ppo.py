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
    """rows per micro-batch, as in grpo.py and mix.py: a row is one prompt + one completion (PPO samples one
    per prompt); a step samples per_device_train_batch_size x gradient_accumulation_steps prompts"""
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
# Rollout and log-probs: the policy writes completions, then one pass scores every token of them.
# The same code in ppo.py, grpo.py, mix.py and common.py (which evaluates with it);
# tests/test_shared_code.py keeps the copies identical. Read it here first.
# ---------------------------------------------------------------------------------------------
@torch.no_grad()  # not inference_mode: the ids it returns go into forward passes that need grads
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0, greedy=False):
    """Rollout: the policy writes a completion for each prompt, one token at a time (KV cache).

    At each step: logits of the last position -> sample a token from softmax(logits / temperature)
    (or take the argmax when greedy) -> feed it back. Prompts are left padded, so all completions
    start at the same column P. A row that emits EOS stops there and is padded after it; its mask
    keeps the first EOS (the model chose to stop: that is an action too) and drops what follows.

    Returns prompt_ids [B, P], prompt_mask [B, P], completion_ids [B, T], completion_mask [B, T].
    """
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    # [B, max_new_tokens]
    completion_ids = torch.full((len(prompts), max_new_tokens), tokenizer.pad_token_id, device=device)
    was_training = model.training
    model.eval()  # no dropout while sampling; and gradient checkpointing would switch the KV cache off
    with common.autocast(model):
        cache, logits = prompt_cache(model, prompt_ids, prompt_mask)  # the prompts' keys/values; logits [B, 1, V]
        rows = torch.arange(len(prompts), device=device)  # the rows still writing
        # [b, P + t], [b]: the last token's position
        attention_mask, positions = prompt_mask, prompt_mask.sum(dim=1) - 1
        for t in range(max_new_tokens):
            next_logits = logits[:, -1].float()  # [b, V]
            if greedy:
                next_tokens = next_logits.argmax(dim=-1)  # [b]
            else:  # sample the raw policy: no top-k / top-p, so these are the log-probs we train on
                next_tokens = torch.multinomial(torch.softmax(next_logits / temperature, dim=-1), 1).squeeze(1)  # [b]
            completion_ids[rows, t] = next_tokens
            writing = next_tokens != tokenizer.eos_token_id  # [b]
            if t == max_new_tokens - 1 or not writing.any():
                break
            if not writing.all():  # Speed: rows that emitted EOS leave the batch, and their cache rows with them
                rows, next_tokens, positions = rows[writing], next_tokens[writing], positions[writing]
                attention_mask = attention_mask[writing]
                cache.batch_select_indices(writing.nonzero().squeeze(1))
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            positions = positions + 1
            logits = model(input_ids=next_tokens[:, None], attention_mask=attention_mask,
                           position_ids=positions[:, None],
                           past_key_values=cache, use_cache=True).logits  # [b, 1, V]
    model.train(was_training)
    completion_ids = completion_ids[:, : t + 1]  # [B, T]: up to the longest completion
    return prompt_ids, prompt_mask, completion_ids, common.mask_after_eos(completion_ids, tokenizer.eos_token_id)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                        with_entropy: bool = False, length_chunks: int = 2):
    """Per-token log-probs [B, T] of the last T tokens of input_ids [B, P+T] (the completion).

    The logit at position t predicts token t+1, so the T completion tokens are predicted by the
    positions P-1 .. P+T-2: we ask the model for the last T+1 positions only (logits_to_keep) and
    drop the final one. Logits are divided by the sampling temperature, so these are the
    log-probs of the distribution the completions were sampled from. Positions after a row's
    last real token (attention_mask 0) hold junk or 0: every loss masks them.

    with_entropy=True also returns the policy's entropy at each position [B, T] (no gradient),
    -sum_v p(v) log p(v): a falling entropy means the policy grows more certain.
    """
    T = num_completion_tokens
    if length_chunks == 1:  # one pass over the batch as it is
        logprobs, entropy = chunk_logprobs(model, input_ids, attention_mask, T, temperature, with_entropy)
        return (logprobs, entropy) if with_entropy else logprobs
    positions = torch.arange(1, T + 1, device=input_ids.device)
    lengths = (attention_mask[:, -T:] * positions).amax(dim=1)  # [B]: where each row's completion ends
    # Speed: rows sorted by completion length, in chunks cut to their own longest completion, so no
    # forward or backward work is spent on the padding after the shorter ones.
    logprobs = torch.zeros(len(input_ids), T, device=input_ids.device)  # [B, T]
    entropy = torch.zeros(len(input_ids), T, device=input_ids.device)  # [B, T]
    for rows in lengths.argsort().chunk(length_chunks):  # rows [b] of one chunk
        t = max(int(lengths[rows].max()), 1)
        width = input_ids.shape[1] - T + t  # prompt + this chunk's longest completion
        logprobs[rows, :t], entropy[rows, :t] = chunk_logprobs(  # [b, t] each; gradients flow into logprobs
            model, input_ids[rows, :width], attention_mask[rows, :width], t, temperature, with_entropy)
    return (logprobs, entropy) if with_entropy else logprobs


def chunk_logprobs(model, input_ids, attention_mask, T: int, temperature: float, with_entropy: bool):
    """completion_logprobs of rows that end together: (log-probs [b, T], entropy [b, T] or 0)."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: count real tokens
    with common.autocast(model):
        # Speed: rows that share a prompt (GRPO's groups) run it once, then only their completions.
        # One pass over prompt + completion; always so with gradient checkpointing, and under --fsdp,
        # where every process must run the same passes (each pass gathers weights from all of them).
        if model.is_activation_checkpointing or common.is_sharded(model) or not prompts_repeat(input_ids[:, :-T]):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           logits_to_keep=T + 1).logits[:, :-1]  # [b, T, V]
        else:  # the last prompt position predicts the first completion token; the completion the rest
            cache, last_prompt_logits = prompt_cache(model, input_ids[:, :-T], attention_mask[:, :-T])  # [b, 1, V]
            completion_logits = model(input_ids=input_ids[:, -T:], attention_mask=attention_mask,
                                      position_ids=position_ids[:, -T:], past_key_values=cache).logits
            logits = torch.cat([last_prompt_logits, completion_logits[:, :-1]], dim=1)  # [b, T, V]
    logits = logits / temperature
    logprobs = common.gather_logprobs(logits, input_ids[:, -T:])
    if not with_entropy:
        return logprobs, 0.0
    with torch.no_grad():
        log_p = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1)  # [b, T]
    return logprobs, entropy


def prompt_cache(model, prompt_ids, prompt_mask):
    """Run each distinct prompt once and hand every row its prompt's keys and values (a KV cache).

    GRPO samples G completions per prompt, so its B*G rows hold only B distinct prompts: running
    each once instead of G times removes (G-1)/G of the prompt work from the rollout and from
    every log-prob pass, with the same results (gradients flow back through the copies).
    Returns (the cache, one entry per row; the logits of each row's last prompt position [B, 1, V]).
    """
    distinct, row_to_prompt = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [U, P], [B]
    first_row = torch.zeros(len(distinct), dtype=torch.long, device=prompt_ids.device)
    first_row.scatter_(0, row_to_prompt, torch.arange(len(prompt_ids), device=prompt_ids.device))  # a row of each
    mask = prompt_mask[first_row]  # [U, P]
    out = model(input_ids=prompt_ids[first_row], attention_mask=mask,
                position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    out.past_key_values.reorder_cache(row_to_prompt)  # entry u -> each row whose prompt is u: [B, heads, P, head_dim]
    return out.past_key_values, out.logits[row_to_prompt]


def prompts_repeat(prompt_ids) -> bool:
    """True if some rows share a prompt (then prompt_cache saves work)."""
    return len(torch.unique(prompt_ids, dim=0)) < len(prompt_ids)


# ---------------------------------------------------------------------------------------------
# Inference: values from the critic, scores from the reward model (prefill only)
# ---------------------------------------------------------------------------------------------
def critic_values(critic, input_ids, attention_mask, num_completion_tokens: int):
    """V(s_t) [B, T]: the critic's value of the state in which completion token t is chosen.

    That state is everything before token t, whose last position is the one that predicts t (note
    003): the first state ends at the prompt's last token, the last at the token before the last
    one. So, like the log-probs, the values come from positions P-1 .. P+T-2."""
    # [B, T, H]
    hidden = common.last_hidden_states(critic, input_ids, attention_mask)[:, -num_completion_tokens - 1 : -1]
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
    hidden = common.last_hidden_states(reward_model, input_ids, attention_mask)  # [B, L, H]
    last = attention_mask.shape[1] - 1 - attention_mask.flip(dims=[1]).argmax(dim=1)  # [B] index of the last 1
    return reward_model.score(hidden[torch.arange(len(last)), last]).squeeze(-1)


@torch.no_grad()
def held_out_score(actor, reward_model, tokenizer, questions, max_new_tokens: int, system_prompt: str,
                   batch_size=64) -> dict:
    """Held-out evaluation when the data has no answers to check (prompts only, e.g. Dahoas/rm-static):
    the reward model's mean score of the actor's greedy completions. Only as trustworthy as the
    reward model (see the README's reward-hacking example)."""
    actor.eval()
    total = 0.0
    for start in range(0, len(questions), batch_size):
        prompts = [common.make_prompt(tokenizer, q, system_prompt) for q in questions[start : start + batch_size]]
        with common.gathered(actor):  # FSDP: the full weights, gathered once per batch
            prompt_ids, prompt_mask, completion_ids, mask = generate(actor, tokenizer, prompts, max_new_tokens,
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

    The critic is fitted to the returns R. The max keeps the larger error, so the gradient is gone
    only where V has moved more than c from old_v toward R (the clipped error, constant in theta,
    is then the larger); a V that left the band away from R keeps its gradient and is pulled back.
    So V is not kept within c of old_v: the clip only stops one batch from chasing R too far. c is
    in reward units, like V and R, not a ratio. Andrychowicz et al. (2021, "What matters in
    on-policy RL") found value clipping often does not help; it stays here because note 000's
    DeepSpeed-Chat (and TRL's PPOTrainer) use it. values, old_values, returns, mask [B, T];
    step_tokens: see masked_mean."""
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
    common.check_fsdp(cfg, world_size)
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
    actor, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first",
                                         trust_remote_code=cfg.trust_remote_code)
    common.check_system_prompt(actor, tokenizer, cfg.system_prompt)  # before any prompt is made with it
    longest = common.longest_prompt(tokenizer, list(train_data[columns[0]]) + list(test_data[columns[0]]),
                                    cfg.system_prompt)
    common.check_fits_context(actor, longest + cfg.max_completion_length,
                              f"the longest prompt of {cfg.dataset} plus --max_completion_length")
    if cfg.gradient_checkpointing:
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r is not None:  # LoRA: the actor is frozen, adapters are trained
        actor = common.add_lora(actor, cfg)
    actor.to(device).train()
    common.broadcast_weights(actor)  # DDP: every process starts from rank 0's weights (LoRA's A is random)
    # pi_ref: a frozen copy of the starting actor, or with LoRA none (the actor with its adapter off).
    reference = copy.deepcopy(actor).eval().requires_grad_(False) if cfg.lora_r is None else None
    if cfg.reward_model == "rule":
        reward_model, critic = None, common.load_model(cfg.model, scalar_head=True,
                                                       # critic: fresh value head
                                                       trust_remote_code=cfg.trust_remote_code)[0]
    else:
        hint = "run `python reward_model.py` first (or pass --reward_model rule)"
        reward_model = common.load_model(cfg.reward_model, missing_hint=hint, scalar_head=True,
                                         trust_remote_code=cfg.trust_remote_code,
                                         reward_model=True)[0]
        reward_model.to(device).eval().requires_grad_(False)
        critic = copy.deepcopy(reward_model).requires_grad_(True)  # the critic starts as the reward model
    if cfg.gradient_checkpointing:
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora_r is not None:  # LoRA critic: adapters and its value head are trained
        critic = common.add_lora(critic, cfg, scalar_head=True)
    critic.to(device).train()
    common.broadcast_weights(critic)  # DDP: the same starting weights everywhere (a fresh value head is random)
    if cfg.fsdp:  # FSDP: each process keeps 1/N of every weight, gradient and AdamW state (common.shard_model)
        for model in (actor, reference, critic, reward_model):
            if model is not None:
                common.shard_model(model)
    common.log(common.memory_estimate([actor, critic], [m for m in (reference, reward_model) if m is not None],
                                      shards=world_size if cfg.fsdp else 1))

    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_learning_rate, weight_decay=0.0)
    num_updates = cfg.max_steps * cfg.num_ppo_epochs * cfg.num_mini_batches
    schedulers = [common.warmup_cosine_schedule(opt, cfg.warmup_steps * num_updates // cfg.max_steps, num_updates,
                                                cfg.min_lr_rate)
                  for opt in (actor_optimizer, critic_optimizer)]
    rng = random.Random(cfg.seed + rank)  # DDP: each process its own prompts

    started = time.perf_counter()  # wall clock of the run, for accuracy-vs-time plots (carried across --resume)

    def evaluate(step):
        if not has_answers:
            scores = held_out_score(actor, reward_model, tokenizer, test_data["prompt"], cfg.max_completion_length,
                                    cfg.system_prompt)
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
    training_state = dict(models=[actor, critic], optimizers=[actor_optimizer, critic_optimizer],
                          schedulers=schedulers, rng=rng)
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
        with common.gathered(actor):  # FSDP: the full weights, gathered once for the whole rollout
            prompt_ids, prompt_mask, completion_ids, mask = generate(
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
                old_logprobs[rows] = completion_logprobs(actor, input_ids[rows], attention_mask[rows], T,
                                                         cfg.temperature)
                with common.reference_model(actor, reference) as pi_ref:  # the frozen copy, or LoRA switched off
                    ref_logprobs[rows] = completion_logprobs(pi_ref, input_ids[rows], attention_mask[rows], T,
                                                             cfg.temperature)
                old_values[rows] = critic_values(critic, input_ids[rows], attention_mask[rows], T)
            if reward_model is None:
                score = rule_scores(completions, step_data["answer"]).to(device)  # [B]
            else:
                score = torch.cat([reward_scores(reward_model, input_ids[rows],
                                                 attention_mask[rows]) for rows in micro_batches])  # [B]
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
                # [b, T], detached
                logprobs, entropy, values = (torch.zeros(len(idx), T, device=device) for _ in range(3))
                actor_loss = critic_loss = 0.0
                for part in torch.arange(len(idx)).chunk(cfg.gradient_accumulation_steps):
                    rows = idx[part]
                    t3 = time.perf_counter()
                    micro_logprobs, entropy[part] = completion_logprobs(
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
                    actor_loss = actor_loss + micro_actor_loss.detach()
                    critic_loss = critic_loss + micro_critic_loss.detach()
                    time_forward, time_backward = time_forward + t4 - t3, time_backward + time.perf_counter() - t4
                t4 = time.perf_counter()
                for loss, model, optimizer in ((actor_loss, actor, actor_optimizer),
                                               (critic_loss, critic, critic_optimizer)):
                    common.average_gradients(model)  # DDP: the same update on every process
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    # NaN/inf: stop before the update
                    common.check_finite(step, run_dir, grad_norm=grad_norm, loss=loss)
                    optimizer.step()
                for scheduler in schedulers:
                    scheduler.step()
                time_backward += time.perf_counter() - t4
                with torch.no_grad():
                    ratio = torch.exp(torch.where(mask[idx].bool(), logprobs - old_logprobs[idx], 0.0))  # [b, T]
                    A, R, old_v = advantages[idx], returns[idx], old_values[idx]  # [b, T] each
                    clipped_ratio = torch.clamp(ratio, 1 - cfg.cliprange, 1 + cfg.cliprange)
                    clipped_values = torch.clamp(values, old_v - cfg.cliprange_value, old_v + cfg.cliprange_value)
                    stats["actor_loss"].append(actor_loss.item())
                    stats["critic_loss"].append(critic_loss.item())
                    stats["actor_clip"].append(clip_fraction(-A * ratio, -A * clipped_ratio, mask[idx]))
                    stats["critic_clip"].append(clip_fraction((values - R) ** 2, (clipped_values - R) ** 2, mask[idx]))
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
            # k1 summed over a completion's tokens, mean over completions (TRL's objective/kl); not grpo.py's
            # kl, a k3 mean per token: hence another name
            "kl_sum": kl,
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
            kl_coef = adaptive_kl_coef(kl_coef, metrics["kl_sum"], cfg.target_kl, cfg.kl_horizon,
                                       len(prompts) * world_size)
        # what the policy wrote (rank 0's share)
        if cfg.log_completions_steps and step % cfg.log_completions_steps == 0:
            common.log_completions(run_dir, step, prompts, completions, score=score.tolist(),
                                   reward=torch.where(mask.bool(), rewards, 0.0).sum(dim=1).tolist(),
                                   advantage=(advantages.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).tolist())
        progress.set_postfix(score=f"{metrics['score']:.2f}", acc=f"{metrics.get('accuracy', float('nan')):.2f}",
                             kl=f"{kl:.2f}")
        if step % cfg.eval_steps == 0 or step == cfg.max_steps:
            scores = evaluate(step)
            common.log(f"  sample: {prompts[0]!r} -> {completions[0]!r} (score {score[0]:.2f})")
        # after this step's evaluation: a resume repeats nothing
        if step % cfg.save_steps == 0 or step == cfg.max_steps:
            elapsed = time.perf_counter() - started
            results = {"initial": initial, "scores": scores, "kl_coef": kl_coef, "elapsed": elapsed}
            common.save_training_state(run_dir, cfg, step, results, **training_state)

    def change(key):  # "before -> after", or "after" alone without --eval_on_start
        return (f"{initial[key]:.1%} -> " if initial else "") + f"{scores[key]:.1%}"

    common.save_checkpoint(actor, tokenizer, run_dir, cfg.merge_lora)
    os.makedirs(os.path.join(run_dir, "critic"), exist_ok=True)
    common.save_checkpoint(critic, tokenizer, os.path.join(run_dir, "critic"))
    common.write_json(os.path.join(run_dir, "eval.json"), scores)
    png = common.plot_metrics(
        run_dir,
        {"reward model score": ["score", "eval/score"],
         "accuracy (rule-based)": ["accuracy", "eval/accuracy_greedy", "eval/accuracy_sampled"],
         "kl to reference (k1 sum per completion)": ["kl_sum"], "losses": ["loss/actor", "loss/critic"]},
        "PPO",
    )
    common.finish_output_dir(run_dir, cfg)  # a run that replaces an old one moves in now, whole
    if has_answers:
        common.log(
            f"saved model to {cfg.output_dir}; held-out sampled accuracy {change('accuracy_sampled')}, "
            f"greedy {change('accuracy_greedy')} (n={scores['n']}); curves in {os.path.join(cfg.output_dir, png)}"
        )
    else:
        common.log(
            f"saved model to {cfg.output_dir}; held-out reward-model score "
            f"{initial['score'] if initial else float('nan'):.3f} -> {scores['score']:.3f} (n={scores['n']}); "
            f"curves in {os.path.join(cfg.output_dir, png)}"
        )
    return actor


if __name__ == "__main__":
    main(common.parse_config(Config))
