"""Rejection sampling fine-tuning (RFT): SFT on the policy's own answers that the checker accepts.

Expert iteration in its simplest form (RAFT, Dong et al. 2023; ReST-EM, Singh et al. 2023; STaR,
Zelikman et al. 2022): sample, keep what the judge accepts, imitate it, repeat. No reward model, no
advantage, no ratio, no reference model. One step:

  1. rollout: k answers to each of B prompts from the current policy     completion_ids [B*k, T]
  2. judge: the checker accepts or rejects each one (common.is_correct)   accepted [B*k]
  3. keep: every accepted answer (--keep all, ReST-EM's E-step), or the first accepted one of each
     prompt (--keep first: RAFT's best of k, with a judge that only says right or wrong; a prompt with
     no accepted answer keeps none, where RAFT keeps its top-reward sample whatever its reward)
  4. SFT step on the kept answers: the token-mean NLL of sft.py (sft.sft_loss); backward(), one AdamW step

ReST-EM derives it as EM (section 3: the E-step filters, the M-step is a weighted NLL). It is also a policy-gradient
step: with reward r(y) = 1 for an accepted answer and 0 otherwise, the REINFORCE estimate sum_y r(y) grad log pi(y|x)
over the samples is the gradient of the log-likelihood of the accepted samples: the SFT gradient on the kept answers
points the same way, scaled (sft_loss divides by the kept tokens, REINFORCE by the samples; tests/test_rft.py), and
with --keep first it is not REINFORCE's estimator (a kept answer stands for the others). What it leaves out against
GRPO: a baseline (a wrong answer is never pushed down, a right one is pulled up however easy its prompt), the clip,
and the KL term. Its only guard against drifting is that it imitates
answers the checker accepts.

    python sft.py && python rft.py                       # out/sft -> out/rft, 128 samples a step, as grpo.py
    python rft.py --keep first                           # RAFT: one accepted answer per prompt
    torchrun --nproc_per_node 2 rft.py                   # data parallel over 2 GPUs (or CPU processes)

Left out, and why: ReST-EM's rounds of a large fixed dataset with a fresh fine-tune from the base
model each round (here every step samples anew from the current policy, as RAFT does: the same
sample budget per step as grpo.py); a learned judge (a reward model's score needs a threshold or a
top fraction; the checker's verdict is exact on this task); STaR's rationalisation (hinting the
answer to a problem the policy fails); sample deduplication.
"""
from dataclasses import dataclass

import torch

import common
from lib import harness, rollout
import sft
from common import setting


@dataclass
class Config(harness.RLConfig):
    num_generations: int = setting(8, lambda v: v >= 1, "at least 1")
    """k: answers sampled per prompt (grpo.py's G)"""
    keep: str = setting("all", lambda v: v in ("all", "first"), "one of all, first")
    """which accepted answers to imitate: 'all' of them (ReST-EM), or the 'first' of each prompt (RAFT)"""
    # the run's settings (lib/harness.py) at this script's defaults: grpo.py's, so both sample as much per step
    output_dir: str = "out/rft"
    per_device_train_batch_size: int = 128
    """rows of one micro-batch: a step samples per_device_train_batch_size x gradient_accumulation_steps answers
    (prompts per step x num_generations), and its SFT step takes the kept ones this many rows at a time"""

    def check_together(self):
        rows_per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if rows_per_step % self.num_generations:
            common.fail(f"--per_device_train_batch_size x --gradient_accumulation_steps ({rows_per_step}) must be a "
                        f"multiple of --num_generations ({self.num_generations})")


NOTHING_KEPT = ("the checker accepted none of the samples (a policy that writes the answer format sometimes, or a "
                "higher --temperature, gives some)")


def keep_mask(accepted: torch.Tensor, num_generations: int, keep: str) -> torch.Tensor:
    """Step 3: which of the B*k answers to imitate. accepted [B*k] (1 or 0, groups of k contiguous) ->
    kept [B*k] bool: every accepted one ('all'), or the first accepted one of each group ('first')."""
    accepted = accepted.bool()
    if keep == "all":
        return accepted
    grouped = accepted.view(-1, num_generations)  # [B, k]
    first = grouped & (grouped.cumsum(dim=1) == 1)  # the first True of each row
    return first.flatten()


def step_log(loss, accepted, kept, completion_mask, grad_norm, scheduler, prompts: list, completions: list,
             gap: dict) -> tuple[dict, dict]:
    """run.end_step's two arguments: the step's metrics (accuracy: of the samples, as grpo.py's; kept:
    the share imitated; gap: rollout.sampler_mismatch over the kept answers, logged at --temperature 1 only,
    where the sampler's distribution is the one the SFT loss reads) and what the policy wrote
    (completions.jsonl's columns)."""
    metrics = {"loss": loss.item(), "accuracy": accepted.mean().item(), "kept": kept.float().mean().item(),
               "completion_length": completion_mask.sum(1).float().mean().item(), "grad_norm": grad_norm.item(),
               "learning_rate": scheduler.get_last_lr()[0], **gap}
    return metrics, {"prompt": prompts, "completion": completions, "accepted": accepted.tolist()}


def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset})  # settings, output folder, torchrun
    k = cfg.num_generations
    num_prompts = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // k  # B
    train_data, test_data, model, tokenizer, longest = common.load_policy_and_prompts(cfg, num_prompts)
    model = run.prepare(model)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    run.shard(model)  # --fsdp: each process keeps 1/N of every weight, gradient and AdamW state
    run.log_memory([model], rows=cfg.per_device_train_batch_size, sequence_length=longest + cfg.max_completion_length,
                   completion_length=cfg.max_completion_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_rate)

    def evaluate():  # held-out accuracy, greedy and sampled: run.steps calls it every --eval_steps
        return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                               cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # 1. Rollout: k answers to each of B prompts, groups contiguous.
        step_data = train_data[run.rng.sample(range(len(train_data)), num_prompts)]  # {column: [B values]}
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in step_data["question"] for _ in range(k)]
        prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs = rollout.generate(
            model, tokenizer, prompts, cfg.max_completion_length, cfg.temperature,
            return_logprobs=True)  # [B*k, P] x 2, [B*k, T] x 3
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        # 2. Judge: the checker accepts a right answer in the right format.
        answers = [a for a in step_data["answer"] for _ in range(k)]
        accepted = torch.tensor([float(common.is_correct(c, a)) for c, a in zip(completions, answers)])  # [B*k]
        # 3. Keep what the policy will imitate.
        kept = keep_mask(accepted, k, cfg.keep).to(run.device)  # [B*k] bool
        if common.global_sum(int(kept.sum())) == 0:  # (of every process) nothing accepted: nothing to imitate
            run.nothing_to_learn(NOTHING_KEPT, {"accuracy": accepted.mean().item(), "kept": 0.0})
            continue

        # 4. SFT step on the kept answers: the token-mean NLL over the step's kept tokens (of every process).
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)[kept]  # [K, P+T]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)[kept]
        answer_mask = completion_mask[kept]  # [K, T]: the answer's tokens, its EOS included
        num_tokens = common.mean_denominator(answer_mask)
        optimizer.zero_grad(set_to_none=True)
        loss, trained = 0.0, torch.zeros_like(answer_mask, dtype=torch.float)  # trained [K, T]: for the gap
        for rows in torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size):
            logprobs = rollout.completion_logprobs(model, input_ids[rows], attention_mask[rows],
                                                   answer_mask.shape[1])  # [n, T], the model's own distribution
            micro_loss = sft.sft_loss(logprobs, answer_mask[rows], num_tokens)  # its share of the step's token mean
            micro_loss.backward()
            loss = loss + micro_loss.detach()
            trained[rows] = logprobs.detach()
        grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
        optimizer.step()
        scheduler.step()

        # The sampler's gap: its log-probs against the trainer's, which are at temperature 1 (the NLL's distribution)
        gap = rollout.sampler_mismatch(trained, sampler_logprobs[kept], answer_mask) if cfg.temperature == 1 else {}
        run.end_step(*step_log(loss, accepted, kept, completion_mask, grad_norm, scheduler, prompts, completions, gap))

    run.finish(tokenizer, {"": model}, {"accepted and kept": ["accuracy", "kept"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"],
                                        "loss (NLL of the kept answers)": ["loss"]}, "RFT")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
