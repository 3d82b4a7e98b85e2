"""MIX: GRPO plus an SFT term on expert data (Trinity-RFT's MIX algorithm), note 001.

grpo.py plus one idea: part of every batch is answers a stronger model wrote, and the policy also
learns to imitate them. The objective (note 001) is

    J_MIX = (1 - mu) * J_GRPO(usual rows) + mu * (mean log-likelihood of the expert answers)

This file holds MIX's own code (its settings, the expert rows, mix_loss, main); the GRPO it extends is
grpo.py's, imported (its reward functions, group advantages, grpo_loss, metrics, steps 1 and 2), as
agent.py and grpo_entropy.py import it. MIX runs GRPO's group advantages, loss aggregations,
clip-higher and updates per batch, as Trinity-RFT's MIX offers them (grpo.py's other estimators, GSPO,
CISPO and DAPO's filters stay there). Where it differs from Trinity: docs/mix.md.

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

main()'s loop numbers these steps; lib/rollout.py and lib/harness.py hold the rollout and the run's machinery.
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
import grpo
from common import setting
from lib import harness, rollout

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
    importance_sampling_level = "token"  # not a setting: MIX's GRPO term has a ratio per token (grpo_loss reads it)
    # the run's settings (lib/harness.py) at this script's defaults
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
    return grpo.aggregate(nll, mask, loss_type, step_mask, max_completion_length)


def mix_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, expert_mask, cfg, step_masks=None,
             sampler_weights=None):
    """MIX's objective (note 001), as a loss to minimise, at cfg's --mu and grpo.py's settings:
        loss = (1 - mu) * grpo_loss(usual rows) + mu * sft_loss(expert rows)
    expert_mask [N] (bool) routes each row. A usual row (False) is a rollout of the policy: the
    clipped ratio times its group advantage, plus the KL penalty. An expert row (True) is an
    expert's answer, never sampled from pi: only its negative log-likelihood counts (no advantage,
    no ratio, and no KL: k3 estimates KL(pi || pi_ref) only on tokens pi sampled). A term with no
    rows is 0. logprobs, old_logprobs (pi_old), ref_logprobs, mask [N, T]; advantages [N]. step_masks: the
    whole step's (mask, expert_mask) when these rows are one micro-batch of it, so each term is
    divided by the step's counts. sampler_weights [N, T] or [N, 1] (--vllm_importance_sampling_correction): the
    usual rows' weights w (grpo.per_token_loss). Where Trinity-RFT's MIXPolicyLossFn differs (the aggregation, the
    KL's place, the micro-batch weights): docs/mix.md."""
    usual = ~expert_mask
    step_mask, step_is_expert = step_masks if step_masks is not None else (mask, expert_mask)  # [N, T], [N]
    grpo_term = sft_term = logprobs.new_zeros(())
    if usual.any():
        grpo_term = grpo.grpo_loss(logprobs[usual], old_logprobs[usual], grpo.rows_or_none(ref_logprobs, usual),
                                   advantages[usual], mask[usual], cfg, step_mask[~step_is_expert],
                                   grpo.rows_or_none(sampler_weights, usual))
    if expert_mask.any():
        sft_term = sft_loss(logprobs[expert_mask], mask[expert_mask], cfg.loss_type, step_mask[step_is_expert],
                            cfg.max_completion_length)
    return (1 - cfg.mu) * grpo_term + cfg.mu * sft_term


@torch.no_grad()
def mix_metrics(logprobs, old_logprobs, ref_logprobs, advantages, loss_mask, expert_mask, cfg) -> dict:
    """MIX's terms under Trinity's usual/ and expert/ prefixes: usual/loss (GRPO's, with beta x k3: Trinity's
    usual/pg_loss has no KL), expert/sft_loss (the expert NLL; none without expert rows), the rows of each."""
    usual = ~expert_mask
    return {
        "usual/loss": grpo.grpo_loss(logprobs[usual], old_logprobs[usual], grpo.rows_or_none(ref_logprobs, usual),
                                     advantages[usual], loss_mask[usual], cfg).item(),
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
    weights = (rollout.sampler_importance_weights(  # TIS's w, from pi_old, as the loss took them
        *gap, cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max,
        cfg.vllm_importance_sampling_clip_min) if cfg.vllm_importance_sampling_correction else None)
    metrics = {"loss": loss.item(),
               **grpo.step_metrics(batch.rewards_per_func, completion_mask[usual], logprobs[usual], old[usual],
                                   grpo.rows_or_none(ref_logprobs, usual), advantages[usual], cfg, entropy[usual]),
               "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0],
               **mix_metrics(logprobs, old, ref_logprobs, advantages, completion_mask, expert_mask, cfg),
               **rollout.sampler_mismatch(*gap, weights)}
    completions = {"prompt": batch.prompts, "completion": batch.completions, "advantage": advantages[usual].tolist(),
                   **{f"rewards/{f.__name__}": batch.rewards_per_func[:, i].tolist()
                      for i, f in enumerate(grpo.REWARD_FUNCS)}}
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
        batch = grpo.sample_and_score(model, tokenizer, step_data, cfg)
        rewards = batch.rewards_per_func.sum(dim=1)  # [B*G]

        # 3. Group-relative advantages replace the critic.
        advantages = grpo.group_advantages(rewards, G).to(run.device)  # [B*G]

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
        sampler_logprobs = torch.cat([F.pad(batch.sampler_logprobs, (0, T - batch.completion_ids.shape[1])),  # to T
                                      batch.sampler_logprobs.new_zeros(num_expert, T)])  # [B*G+E, T]: 0 on expert rows
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # gradient accumulation
        ref_logprobs = old_logprobs = None  # [B*G+E, T] each, where needed; None: not computed
        if cfg.beta > 0:
            with common.reference_model(model, ref_model) as reference:  # the frozen copy, or LoRA switched off
                ref_logprobs = rollout.inference(rollout.completion_logprobs, reference, input_ids, attention_mask, T,
                                                 cfg.temperature, micro_batches=micro_batches)
        if cfg.num_iterations > 1:  # with one update per batch pi_old is pi itself: step 5 takes pi's log-probs
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
                micro_old = micro_logprobs.detach() if old_logprobs is None else old_logprobs[rows]  # pi_old [n, T]
                weights = (rollout.sampler_importance_weights(  # TIS: w = pi_old / pi_sampler, bounded
                    micro_old, sampler_logprobs[rows], completion_mask[rows], cfg.vllm_importance_sampling_mode,
                    cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min)
                    if cfg.vllm_importance_sampling_correction else None)
                micro_loss = mix_loss(micro_logprobs, micro_old, grpo.rows_or_none(ref_logprobs, rows),
                                      advantages[rows], completion_mask[rows], expert_mask[rows], cfg,
                                      (completion_mask, expert_mask), weights)
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


if __name__ == "__main__":
    main(common.parse_config(Config))
