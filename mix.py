"""MIX: GRPO plus an SFT term on expert data (Trinity-RFT's MIX algorithm), note 001.

grpo.py plus one idea: part of every batch is answers a stronger model wrote, and the policy also
learns to imitate them. The objective (note 001) is

    J_MIX = (1 - mu) * J_GRPO(usual rows) + mu * (mean log-likelihood of the expert answers)

MIX's own code comes first (its settings, the expert rows, mix_loss, main); below one heading are
the functions of grpo.py that MIX runs, letter for letter. MIX runs GRPO's group advantages, loss
aggregations, clip-higher and updates per batch, as Trinity-RFT's MIX offers them (grpo.py's other
estimators, GSPO, CISPO and DAPO's filters stay there). Where it differs from Trinity: docs/mix.md.

    python sft.py && python mix.py                       # tiny model from out/sft -> out/mix
    python mix.py --mu 0 --expert_data_ratio 0           # plain GRPO again
    python mix.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --expert_dataset expert.jsonl \\
        --system_prompt "Think in <think></think>, then give the number in <answer></answer>."
    torchrun --nproc_per_node 2 mix.py                   # data parallel over 2 GPUs (or CPU processes)
    torchrun --nproc_per_node 2 mix.py --fsdp true       # sharded: each process holds half the weights and states

One training step:
  1. rollout: B prompts x G samples each          completion_ids, completion_mask  [B*G, T]
  2. rewards: sum of the reward functions         rewards      [B*G]
  3. advantages: (r - group mean) / (group std)   advantages   [B*G]
  3b. expert rows: E expert answers join the batch, expert_mask marks them     [B*G + E]
  4. inference: reference log-probs (beta > 0), old log-probs (num_iterations > 1)
  5. num_iterations gradient steps on (1 - mu) * GRPO loss (usual rows) + mu * SFT loss (expert rows)

main()'s loop numbers these steps; rollout.py and harness.py hold the rollout and the run's machinery.
"""
import copy
import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
import harness
import rollout
from common import setting

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")  # how the two terms average their token losses


@dataclass
class Config(harness.PolicyGradientConfig):
    """MIX's settings, then the GRPO settings it runs; the run's (model, data, batch, AdamW, evaluation,
    LoRA, the sampler's correction, ...) are harness.PolicyGradientConfig's."""
    LOSS_SCALES = ("beta",)  # settings that scale a loss term: named in the advice after a NaN or inf (harness)
    expert_dataset: str = "data/expert.jsonl"
    """expert data: a jsonl file of chat `messages` (system / user / assistant), the last one the expert's answer"""
    mu: float = setting(0.1, lambda v: 0 <= v <= 1, "in [0, 1]")
    """weight of the SFT term on expert rows: loss = (1 - mu) * GRPO loss + mu * SFT loss"""
    expert_data_ratio: float = setting(0.25, lambda v: 0 <= v <= 1, "in [0, 1]")
    """share of each batch's rows that are expert data, rounded up (note 001's example config; Trinity's is 0.5)"""
    num_generations: int = setting(8, lambda v: v >= 2, "at least 2: the advantage compares completions within a group")
    """G: completions sampled per prompt (the group)"""
    num_iterations: int = setting(1, lambda v: v >= 1, "at least 1")
    """gradient steps per rollout batch (> 1 needs the old log-probs; --mu is MIX's weight, not this)"""
    epsilon: float = setting(0.2, lambda v: v > 0, "positive (the clip range of the ratio)")
    """clip range of the ratio pi/pi_old: it is kept in [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = setting(None, lambda v: v is None or v > 0, "positive (leave it out to use --epsilon)")
    """upper clip range (DAPO's clip-higher, e.g. 0.28 with epsilon 0.2); unset = epsilon"""
    beta: float = setting(0.04, lambda v: v >= 0, "0 or more")
    """weight of the KL penalty to the reference policy on the usual rows (0 = no reference model; 0.04 as in
    grpo.py, DeepSeekMath's)"""
    loss_type: str = setting("grpo", lambda v: v in LOSS_TYPES, "one of " + ", ".join(LOSS_TYPES))
    """how token losses are averaged, in both terms (see grpo_loss and sft_loss): 'grpo' each answer's mean, then
    over answers (note 001's formula); 'bnpo' each micro-batch's token mean (Trinity's token-mean); 'dapo' one mean
    over the step's tokens; 'dr_grpo' the sum over answers x max_completion_length"""
    importance_sampling_level = "token"  # not a setting: MIX's GRPO term has a ratio per token (step_metrics reads it)
    # the run's settings (harness.py) at this script's defaults
    output_dir: str = "out/mix"
    per_device_train_batch_size: int = 128
    """a row is one prompt + one completion or expert answer: a step's per_device_train_batch_size x
    gradient_accumulation_steps rows are the usual rows (prompts per step x num_generations) + the expert rows"""

    def check_together(self):
        super().check_together()  # the sampler's correction (harness.PolicyGradientConfig)
        rows_per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
        num_usual = rows_per_step - math.ceil(self.expert_data_ratio * rows_per_step)  # B*G: the rollouts
        if num_usual < self.num_generations or num_usual % self.num_generations:
            common.fail(f"the {num_usual} usual rows of a step ({rows_per_step} minus the expert rows) must be a "
                        f"positive multiple of --num_generations ({self.num_generations})")


# ---------------------------------------------------------------------------------------------
# What MIX adds (note 001): expert data, the SFT term, and the mixed loss
# ---------------------------------------------------------------------------------------------
def load_expert_examples(path: str, tokenizer, max_completion_length: int):
    """Expert data, one chat per jsonl line {"messages": [system?, user, ..., assistant]} -> a list of
    (prompt ids: the chat template up to the assistant's turn, as a rollout prompt ends; answer ids:
    the last message + EOS). Longer answers than max_completion_length are dropped (the 1% rule)."""
    data = common.load_jsonl(path, columns=("messages",))
    examples = []
    for messages in data["messages"]:  # checked by load_jsonl: a chat that ends with the assistant's answer
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(messages[-1]["content"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        if len(answer_ids) <= max_completion_length:
            examples.append((prompt_ids, answer_ids))
    common.check_length_drops(path, len(examples), len(data), f"--max_completion_length {max_completion_length}")
    return examples


def load_expert_data(cfg, model, tokenizer, num_expert: int) -> list:
    """The expert examples a step draws its E rows from (none when E is 0): enough, and within the context."""
    examples = load_expert_examples(cfg.expert_dataset, tokenizer, cfg.max_completion_length) if num_expert else []
    if len(examples) < num_expert:
        common.fail(f"{cfg.expert_dataset} has {len(examples)} usable expert answers, fewer than the "
                    f"{num_expert} a step needs")
    if examples:
        common.check_fits_context(model, max(len(p) + len(a) for p, a in examples),
                                  f"the longest expert example of {cfg.expert_dataset}")
    common.log(f"mix: {num_expert} expert rows per step ({len(examples)} expert answers in {cfg.expert_dataset}), "
               f"mu {cfg.mu}")
    return examples


def append_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, examples, pad_id: int):
    """Stack `examples` (a list of (prompt ids, answer ids)) under a rollout batch, in its layout
    [left-padded prompt | right-padded completion], both parts widened to fit the longer one:
    [N, P], [N, P], [N, T], [N, T] -> [N+E, P'], [N+E, P'], [N+E, T'], [N+E, T']"""
    if not examples:
        return prompt_ids, prompt_mask, completion_ids, completion_mask
    device = prompt_ids.device  # [E, P2] below, then [E, T2]
    new_prompt_ids, new_prompt_mask = (x.to(device) for x in rollout.pad_left([p for p, _ in examples], pad_id))
    new_ids, new_mask = (x.to(device) for x in rollout.pad_right([a for _, a in examples], pad_id))  # [E, T2]
    P, T = max(prompt_ids.shape[1], new_prompt_ids.shape[1]), max(completion_ids.shape[1], new_ids.shape[1])
    left = lambda x, value: F.pad(x, (P - x.shape[1], 0), value=value)  # noqa: E731  pad on the left to width P
    right = lambda x, value: F.pad(x, (0, T - x.shape[1]), value=value)  # noqa: E731  pad on the right to width T
    return (torch.cat([left(prompt_ids, pad_id), left(new_prompt_ids, pad_id)]),
            torch.cat([left(prompt_mask, 0), left(new_prompt_mask, 0)]),
            torch.cat([right(completion_ids, pad_id), right(new_ids, pad_id)]),
            torch.cat([right(completion_mask, 0), right(new_mask, 0)]))


def sft_loss(logprobs, mask, loss_type="grpo", step_mask=None, max_completion_length=None):
    """Note 001's auxiliary objective as a loss: the negative log-likelihood of the expert tokens,
        'grpo': -(1/B') sum_b (1/T'_b) sum_t log pi(o'_bt | q'_b, o'_b<t)   (note 001's formula)
        'dapo': -sum_bt log pi(o'_bt | ...) / sum_b T'_b                   (sft.py's sft_loss)
        'bnpo', 'dr_grpo': grpo_loss's rules (a micro-batch's token mean; the token sum / (B' x T_max))
    averaged as GRPO's term is (aggregate). logprobs, mask [B', T]: the expert rows only; padding never
    counts. step_mask: the whole step's expert rows when these are one micro-batch of it."""
    nll = torch.where(mask.bool(), -logprobs, 0.0)  # [B', T]
    return aggregate(nll, mask, loss_type, step_mask, max_completion_length)


def mix_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, expert_mask, mu, clip_eps, beta, loss_type="grpo",
             step_masks=None, epsilon_high=None, max_completion_length=None, sampler_weights=None):
    """MIX's objective (note 001), as a loss to minimise:
        loss = (1 - mu) * grpo_loss(usual rows) + mu * sft_loss(expert rows)
    expert_mask [N] (bool) routes each row. A usual row (False) is a rollout of the policy: the
    clipped ratio times its group advantage, plus the KL penalty. An expert row (True) is an
    expert's answer, never sampled from pi: only its negative log-likelihood counts (no advantage,
    no ratio, and no KL: k3 estimates KL(pi || pi_ref) only on tokens pi sampled). A term with no
    rows is 0. logprobs, old_logprobs (None: pi_old = pi), ref_logprobs, mask [N, T]; advantages [N]. step_masks: the
    whole step's (mask, expert_mask) when these rows are one micro-batch of it, so each term is
    divided by the step's counts. sampler_weights [N, T] or [N, 1] (--vllm_importance_sampling_correction): the
    usual rows' weights w (per_token_loss). Where Trinity-RFT's MIXPolicyLossFn differs (the aggregation, the
    KL's place, the micro-batch weights): docs/mix.md."""
    usual = ~expert_mask
    step_mask, step_is_expert = step_masks if step_masks is not None else (mask, expert_mask)  # [N, T], [N]
    grpo_term = sft_term = logprobs.new_zeros(())
    if usual.any():
        old = old_logprobs[usual] if old_logprobs is not None else None  # None: pi_old = pi
        ref = ref_logprobs[usual] if ref_logprobs is not None else None
        weights = sampler_weights[usual] if sampler_weights is not None else None
        grpo_term = grpo_loss(logprobs[usual], old, ref, advantages[usual], mask[usual], clip_eps, beta, loss_type,
                              step_mask[~step_is_expert], epsilon_high, max_completion_length=max_completion_length,
                              sampler_weights=weights)
    if expert_mask.any():
        sft_term = sft_loss(logprobs[expert_mask], mask[expert_mask], loss_type, step_mask[step_is_expert],
                            max_completion_length)
    return (1 - mu) * grpo_term + mu * sft_term


@torch.no_grad()
def mix_metrics(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, expert_mask, cfg) -> dict:
    """MIX's terms under Trinity's usual/ and expert/ prefixes: usual/loss (GRPO's, with beta x k3: Trinity's
    usual/pg_loss has no KL), expert/sft_loss (the expert NLL; none without expert rows), the rows of each."""
    usual = ~expert_mask
    ref_usual = ref_logprobs[usual] if ref_logprobs is not None else None
    return {
        "usual/loss": grpo_loss(logprobs[usual], old_logprobs[usual], ref_usual, advantages[usual], loss_mask[usual],
                                cfg.epsilon, cfg.beta, cfg.loss_type, epsilon_high=cfg.epsilon_high,
                                max_completion_length=cfg.max_completion_length).item(),
        **({"expert/sft_loss": sft_loss(logprobs[expert_mask], loss_mask[expert_mask], cfg.loss_type,
                                        max_completion_length=cfg.max_completion_length).item()}
           if expert_mask.any() else {}),
        "usual/num_rows": int(usual.sum()),
        "expert/num_rows": int(expert_mask.sum()),
    }


def step_log(batch, expert_mask, advantages, logprobs, old_logprobs, ref_logprobs, entropy, completion_mask, loss,
             grad_norm, scheduler, cfg, sampler_logprobs) -> tuple[dict, dict]:
    """Step 6, run.end_step's two arguments: the metrics (the loss, grpo.py's step_metrics on the rollouts, the grad
    norm, the learning rate, mix_metrics, the sampler's gap to the trainer) and the rollouts' completions.jsonl
    columns. old_logprobs None: pi."""
    old, usual = old_logprobs if old_logprobs is not None else logprobs, ~expert_mask
    gap = (old[usual], sampler_logprobs[usual], completion_mask[usual])  # pi_old by the trainer, by the sampler
    metrics = {"loss": loss.item(),
               **step_metrics(batch.rewards_per_func, completion_mask[usual], logprobs[usual], old[usual],
                              ref_logprobs[usual] if ref_logprobs is not None else None, advantages[usual], cfg,
                              entropy[usual]),
               "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0],
               **mix_metrics(logprobs, old, ref_logprobs, advantages, completion_mask, expert_mask, cfg),
               **rollout.sampler_mismatch(*gap, cfg.sampler_weights(*gap))}
    completions = {"prompt": batch.prompts, "completion": batch.completions, "advantage": advantages[usual].tolist(),
                   **{f"rewards/{f.__name__}": batch.rewards_per_func[:, i].tolist()
                      for i, f in enumerate(REWARD_FUNCS)}}
    return metrics, completions


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset,
                                   "--expert_dataset": cfg.expert_dataset})  # settings, output folder, torchrun
    G, rows_per_step = cfg.num_generations, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    num_expert = math.ceil(cfg.expert_data_ratio * rows_per_step)  # E expert rows per step
    num_prompts = (rows_per_step - num_expert) // G  # B prompts, B*G rollout rows per step

    train_data, test_data, model, tokenizer, longest = common.load_policy_and_prompts(cfg, per_step=num_prompts)
    model = run.prepare(model)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    expert_examples = load_expert_data(cfg, model, tokenizer, num_expert)  # [(prompt ids, answer ids)]
    # pi_ref for the KL term: a frozen copy of the start, or with LoRA none (the adapter off: common.reference_model)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 and cfg.lora_r is None else None
    run.shard(model, ref_model)  # --fsdp: each process keeps 1/N of every weight, gradient and AdamW state
    run.log_memory([model], [ref_model], rows=cfg.per_device_train_batch_size,
                   sequence_length=longest + cfg.max_completion_length, completion_length=cfg.max_completion_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps * cfg.num_iterations,
                                              cfg.max_steps * cfg.num_iterations, cfg.min_lr_rate)

    def evaluate():  # held-out accuracy, greedy and sampled, every --eval_steps
        return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                               cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # 1. + 2. Rollout and rewards (sample_and_score): G samples of each of B prompts, groups contiguous.
        step_data = train_data[run.rng.sample(range(len(train_data)), num_prompts)]  # {column: [B values]}
        batch = sample_and_score(model, tokenizer, step_data, cfg)
        rewards = batch.rewards_per_func.sum(dim=1)  # [B*G]

        # 3. Group-relative advantages replace the critic.
        advantages = group_advantages(rewards, G).to(run.device)  # [B*G]

        # 3b. MIX: E expert answers join the batch below the rollouts; expert_mask marks them.
        expert_rows = [expert_examples[i] for i in run.rng.sample(range(len(expert_examples)), num_expert)]
        prompt_ids, prompt_mask, completion_ids, completion_mask = append_rows(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, expert_rows,
            tokenizer.pad_token_id)  # [B*G+E, P], [B*G+E, P], [B*G+E, T], [B*G+E, T]
        expert_mask = torch.arange(len(completion_ids), device=run.device) >= len(rewards)  # [B*G+E], True: expert
        advantages = F.pad(advantages, (0, num_expert))  # [B*G+E]; 0 on expert rows, which the SFT term ignores

        # 4. Inference passes (no gradient): the reference policy, and pi_old if it will differ from pi.
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B*G+E, P+T]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B*G+E, P+T]
        T = completion_ids.shape[1]
        # the rollouts' sampler log-probs, widened to T; 0 on the expert rows, which no sampler wrote: [B*G+E, T]
        sampler_logprobs = F.pad(batch.sampler_logprobs, (0, T - batch.completion_ids.shape[1], 0, num_expert))
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # gradient accumulation
        ref_logprobs = old_logprobs = None  # [B*G+E, T] each, where needed; None: not computed
        if cfg.beta > 0:
            with common.reference_model(model, ref_model) as reference:  # the frozen copy, or LoRA switched off
                ref_logprobs = rollout.inference(rollout.completion_logprobs, reference, input_ids, attention_mask, T,
                                                 cfg.temperature, micro_batches=micro_batches)
        if cfg.num_iterations > 1:  # with one update per batch, pi_old == pi: mix_loss uses pi's own log-probs
            old_logprobs = rollout.inference(rollout.completion_logprobs, model, input_ids, attention_mask, T,
                                             cfg.temperature, micro_batches=micro_batches)

        # 5. num_iterations gradient steps on (1 - mu) * GRPO loss (usual rows) + mu * SFT loss (expert rows).
        for _ in range(cfg.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0  # the step's: the micro-batches' losses, each divided by the step's counts, add up to it
            logprobs, entropy = (torch.zeros_like(completion_mask, dtype=torch.float) for _ in range(2))  # [B*G+E, T]
            for rows in micro_batches:  # one micro-batch of rows at a time (memory); the gradients add up
                micro_logprobs, entropy[rows] = rollout.completion_logprobs_and_entropy(
                    model, input_ids[rows], attention_mask[rows], T, cfg.temperature)  # [n, T] each
                micro_old = old_logprobs[rows] if old_logprobs is not None else micro_logprobs.detach()  # [n, T]
                micro_loss = mix_loss(
                    micro_logprobs, old_logprobs[rows] if old_logprobs is not None else None,
                    ref_logprobs[rows] if ref_logprobs is not None else None, advantages[rows], completion_mask[rows],
                    expert_mask[rows], mu=cfg.mu, clip_eps=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                    loss_type=cfg.loss_type, max_completion_length=cfg.max_completion_length,
                    step_masks=(completion_mask, expert_mask),
                    sampler_weights=cfg.sampler_weights(micro_old, sampler_logprobs[rows], completion_mask[rows]))
                micro_loss.backward()  # gradients add up over the micro-batches
                loss = loss + micro_loss.detach()
                logprobs[rows] = micro_logprobs.detach()
            grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
            optimizer.step()
            scheduler.step()

        # 6. Log grpo.py's metrics on the rollouts, MIX's terms and what the policy wrote; when due: evaluate, save.
        run.end_step(*step_log(batch, expert_mask, advantages, logprobs, old_logprobs, ref_logprobs, entropy,
                               completion_mask, loss, grad_norm, scheduler, cfg, sampler_logprobs))

    run.finish(tokenizer, {"": model}, {"reward": ["reward", "rewards/correctness_reward", "rewards/format_reward"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"],
                                        "kl to reference": ["kl"], "completion length": ["completion_length"],
                                        "loss terms": ["usual/loss", "expert/sft_loss"]}, "MIX")
    return model


# =============================================================================================
# grpo.py's functions that MIX runs, letter for letter (tests/test_mix.py keeps them equal):
# the reward functions, the group advantages, GRPO's loss and its metrics, steps 1 and 2.
# =============================================================================================
def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """+1 if the number inside <answer></answer> equals the dataset's (after '####'), else -1."""
    return [1.0 if common.is_correct(completion, gold) else -1.0 for completion, gold in zip(completions, answer)]


FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def format_reward(prompts, completions, **kwargs) -> list[float]:
    """+1.25 if the completion is exactly <think>...</think><answer>...</answer>, else -1."""
    return [1.25 if FORMAT.match(completion.strip()) else -1.0 for completion in completions]


REWARD_FUNCS = [correctness_reward, format_reward]


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


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) (Schulman's 'Approximating KL divergence'; notes 002 / 004):

        k3 = exp(ref - logp) - (ref - logp) - 1

    >= 0 everywhere; its mean over tokens sampled from pi is an unbiased estimate of the KL. In the
    loss (DeepSeekMath) its gradient is that of the forward KL(pi_ref || pi), not of KL(pi || pi_ref):
    docs/grpo.md#where-the-kl-estimate-goes derives it, and TRL's correction. [N, T] -> [N, T]."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level="token") -> torch.Tensor:
    """pi_theta / pi_old: per token, [N, T] (PPO, GRPO), or per completion, [N, 1] (GSPO, Zheng et
    al. 2025): exp of the mean over the completion's tokens of log pi_theta - log pi_old, i.e. the
    geometric mean of its token ratios; the sequence, not the token, is the unit the reward scored.
    Padding must hold 0 in both log-prob tensors."""
    log_ratio = logprobs - old_logprobs  # [N, T]
    if importance_sampling_level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
    elif importance_sampling_level != "token":
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}")
    return torch.exp(log_ratio)


def per_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps, beta, epsilon_high=None,
                   importance_sampling_level="token", cispo=False, sampler_weights=None) -> torch.Tensor:
    """The GRPO objective of notes 002 / 004 at each token, as a loss to minimise. Token t of completion i:

        ratio = exp(logp - old_logp)            (pi_theta / pi_old; see importance_ratio)
        l_it  = -( min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps_high) * A_i) - beta * k3_t )

    eps_high = epsilon_high, or eps when it is None (DAPO's clip-higher). cispo (MiniMax-M1): no clip,
    l_it = -min(ratio, epsilon_high).detach() * A_i * logp (+ the same KL term). old_logprobs None:
    pi_old = pi (one update per batch), so the ratio is 1 and the gradient is -A_i grad logp.
    sampler_weights [N, T] or [N, 1] (--vllm_importance_sampling_correction): w_it multiplies the policy term,
    not the KL term, l_it = -w_it min(...) + beta k3_t (rollout.sampler_importance_weights: TIS).
    logprobs, old_logprobs, ref_logprobs, mask: [N, T]; advantages: [N]; ref_logprobs may be None
    when beta == 0. Returns [N, T], 0 at padding: junk there (even inf/nan) never reaches the value
    or the gradient."""
    mask = mask.bool()
    logprobs = torch.where(mask, logprobs, 0.0)  # padding zeroed first
    old_logprobs = logprobs.detach() if old_logprobs is None else torch.where(mask, old_logprobs, 0.0)
    ratio = importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level)  # [N, T] or [N, 1]
    A = advantages.unsqueeze(1)  # [N, 1]
    high = clip_eps if epsilon_high is None else epsilon_high
    if cispo:  # a capped, detached weight on the plain policy gradient
        per_token = -torch.clamp(ratio, max=high).detach() * A * logprobs  # [N, T]
    else:
        per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - clip_eps, 1 + high) * A).expand_as(mask)  # [N, T]
    if sampler_weights is not None:  # the tokens came from a sampler that is not this policy's pass
        per_token = per_token * sampler_weights
    if beta != 0:
        per_token = per_token + beta * kl_k3(logprobs, torch.where(mask, ref_logprobs, 0.0))
    return torch.where(mask, per_token, 0.0)


def aggregate(per_token, mask, loss_type, step_mask=None, max_completion_length=None) -> torch.Tensor:
    """The loss from the losses of the real tokens (per_token, mask [N, T]), by loss_type (TRL's names;
    docs/grpo.md's table says what each weighs):
      'grpo'    mean over each completion's tokens, then over completions (DeepSeekMath)
      'bnpo'    one mean over this micro-batch's tokens
      'dapo'    one mean over all the step's tokens (DAPO; = 'bnpo' for one micro-batch, one process);
                'cispo' averages so too
      'dr_grpo' the token sum / (completions x max_completion_length) (Dr. GRPO)
    step_mask: the whole step's mask when these rows are one micro-batch of it (gradient accumulation):
    its counts divide, so the micro-batches' losses and gradients add up to the step's ('bnpo' divides
    by the number of micro-batches); under torchrun the tokens are those of every process."""
    mask = mask.bool()
    step_mask = mask if step_mask is None else step_mask
    sequences = len(step_mask)
    if loss_type == "grpo":
        per_sequence = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [N]
        return per_sequence.sum() / sequences
    if loss_type == "bnpo":  # each micro-batch's own token mean, averaged over the step's micro-batches
        return per_token.sum() / mask.sum().clamp(min=1) / (sequences / len(mask))
    if loss_type in ("dapo", "cispo"):
        return per_token.sum() / common.mean_denominator(step_mask)
    if loss_type == "dr_grpo":
        return per_token.sum() / (sequences * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps, beta, loss_type="grpo",
              step_mask=None, epsilon_high=None, importance_sampling_level="token", max_completion_length=None,
              sampler_weights=None):
    """GRPO's loss to minimise: the objective at each token (per_token_loss), averaged by loss_type
    (aggregate). The arguments are theirs."""
    per_token = per_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps, beta, epsilon_high,
                               importance_sampling_level, loss_type == "cispo", sampler_weights)  # [N, T]
    return aggregate(per_token, mask, loss_type, step_mask, max_completion_length)


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
    A = advantages.unsqueeze(1)
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


if __name__ == "__main__":
    main(common.parse_config(Config))
