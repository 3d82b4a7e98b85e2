"""On-policy distillation (GKD): the student samples, and a teacher grades every token of what it wrote.

Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes"); TRL's DistillationTrainer and GKDTrainer.generalized_jsd_loss
(trl/experimental/distillation and trl/experimental/gkd at commit f2cd577). A student trained by SFT
imitates a teacher's text, then answers from its own prefixes, which it was never trained on; here it
learns on its own samples: at each position of its completion the teacher's whole next-token
distribution says what it should have put there. One step:

  1. rollout: one completion for each of B prompts, from the student      completion_ids, completion_mask [B, T]
  2. teacher: its log-probs of every token of the vocabulary at each of the student's positions,
     no gradient                                                            teacher_logprobs [B, T, V]
  3. student: the same from the student, with gradient                      student_logprobs [B, T, V]
  4. loss: the divergence at each completion token (beta 1: the reverse KL), its mean over the step's
     completion tokens; backward(), one AdamW step

    loss_t = KL(student || teacher) = sum_v p_s(v) (log p_s(v) - log p_t(v))                 (--beta 1)

where p_s and p_t are the two models' distributions at --temperature (softmax of logits / T).

Reverse KL, with the student's own samples, is mode-seeking: the student is pushed off the tokens the
teacher finds unlikely, at the places it actually goes. --beta 0 is the forward KL(teacher || student),
mass-covering; between them the generalized Jensen-Shannon divergence of GKD (generalized_jsd).
Against RL (grpo.py): no reward, no group, no advantage; every token gets a graded target, where RL
gives one number to a whole completion. The price: a teacher whose log-probs at the student's
prefixes mean something, with the student's tokenizer.

    python sft.py && python grpo.py && python distill.py     # student out/sft, teacher out/grpo -> out/distill
    python distill.py --beta 0                               # the forward KL on the student's samples
    python sft.py --model tiny-small --output_dir out/sft_small && \\
        python distill.py --model out/sft_small --output_dir out/distill_small   # a student of half the width

Left out, and why: GKD's lmbda (the share of steps on the student's own samples, the rest on fixed text, the dataset's
or the teacher's: here every step is the student's, lmbda 1; TRL 1.9 removed it from DistillationTrainer; off-policy
distillation, SFT on the teacher's samples, is sft.py on a file the teacher wrote, benchmarks/distill_runs.py); a
teacher with another tokenizer (the two distributions would first have to be aligned token by token); top-k teacher
logits (the tiny vocabulary has 264 tokens, so the whole distribution is cheap); a reward on top (GKD + RL, their
section 5).
"""
from dataclasses import dataclass

import torch

import common
from common import setting
from lib import harness, rollout


@dataclass
class Config(harness.RLConfig):
    teacher_model_name_or_path: str = "out/grpo"
    """the teacher: a folder written by sft.py, grpo.py, ... (or a hub id, a .gguf file) with the student's
    tokenizer (TRL's name)"""
    beta: float = setting(1.0, lambda v: 0 <= v <= 1, "between 0 and 1")
    """the divergence of each token (TRL's): 1 the reverse KL(student || teacher), 0 the forward KL(teacher ||
    student), between them GKD's generalized Jensen-Shannon divergence with this weight on the teacher"""
    # the run's settings (lib/harness.py) at this script's defaults
    output_dir: str = "out/distill"
    per_device_train_batch_size: int = 128
    """a row is one prompt + the student's one completion: a step samples as many completions as grpo.py's"""


# ---------------------------------------------------------------------------------------------
# The loss of step 4
# ---------------------------------------------------------------------------------------------
def generalized_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence at each position (GKD, Agarwal et al. 2024, eq. 1; TRL's generalized_jsd_loss):
    student_logprobs, teacher_logprobs [N, T, V] (log-softmaxed) -> [N, T].

        beta = 1:  KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v))      reverse KL, mode-seeking
        beta = 0:  KL(p_t || p_s) = sum_v p_t(v) (log p_t(v) - log p_s(v))      forward KL, mass-covering
        else:      beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = beta p_t + (1 - beta) p_s

    The endpoints are the KLs themselves, not the limit of the middle formula (which goes to 0 at both)."""
    def kl(log_p, log_q):  # KL(p || q) at each position
        return (log_p.exp() * (log_p - log_q)).sum(dim=-1)

    if beta == 1:
        return kl(student_logprobs, teacher_logprobs)
    if beta == 0:
        return kl(teacher_logprobs, student_logprobs)
    beta_t = torch.tensor(beta, dtype=student_logprobs.dtype, device=student_logprobs.device)
    log_m = torch.logsumexp(torch.stack([teacher_logprobs + beta_t.log(), student_logprobs + (-beta_t).log1p()]), 0)
    return beta * kl(teacher_logprobs, log_m) + (1 - beta) * kl(student_logprobs, log_m)


def distill_loss(student_logprobs, teacher_logprobs, mask, beta: float, step_mask=None) -> torch.Tensor:
    """Step 4: the token mean of generalized_jsd over the completion tokens (mask [N, T], 1 on real ones,
    the EOS included), as TRL's: the sum divided by the count of step_mask's tokens, the step's completion
    mask [B, T] (this micro-batch's mask by default), so the micro-batches' losses add up to the step's."""
    mask = mask.bool()
    per_token = torch.where(mask, generalized_jsd(student_logprobs, teacher_logprobs, beta), 0.0)  # [N, T]
    return per_token.sum() / common.mean_denominator(mask if step_mask is None else step_mask)


def token_logprobs(model, input_ids, attention_mask, T: int, temperature: float) -> torch.Tensor:
    """log p(v | prefix) for every token v at each of the last T positions' predictions: input_ids [N, P+T]
    -> [N, T, V]. rollout.completion_logprobs keeps only the sampled token's column of this; distillation
    needs the whole row, for the teacher and the student alike."""
    positions = rollout.position_ids(attention_mask)  # [N, P+T]: a left-padded row's real tokens count from 0
    with rollout.autocast(model):  # Speed: bf16 matrix products on a GPU; nothing on the CPU
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                       logits_to_keep=T + 1).logits[:, :-1]  # [N, T, V]: position t predicts completion token t
        return torch.log_softmax(logits.float() / temperature, dim=-1)


def load_teacher(cfg, tokenizer, student, device):
    """The teacher, frozen, in eval mode. Refused in one sentence: a teacher that does not read the student's
    ids or predict over the same vocabulary, and the student itself (every weight equal, wherever it was loaded
    from): equal distributions are every divergence's minimum (any --beta), so its loss and gradient are 0 at
    every token and the student would learn nothing (checked before LoRA's adapters are added)."""
    teacher, teacher_tokenizer = common.load_model(cfg.teacher_model_name_or_path,
                                                   missing_hint="train one first (e.g. `python grpo.py`)",
                                                   trust_remote_code=cfg.trust_remote_code,
                                                   flag="--teacher_model_name_or_path")
    if not common.same_tokenizer(teacher_tokenizer, tokenizer):
        common.fail(f"the teacher {cfg.teacher_model_name_or_path} has another tokenizer than the student {cfg.model}: "
                    "distillation compares their distributions token by token, so both need the same vocabulary")
    rows, teacher_rows = (m.get_output_embeddings().weight.shape[0] for m in (student, teacher))
    if rows != teacher_rows:
        common.fail(f"the teacher predicts over {teacher_rows} tokens and the student over {rows}: use models with "
                    "the same vocabulary size")
    if same_weights(teacher, student):
        common.fail(f"the teacher {cfg.teacher_model_name_or_path} holds the same weights as the student {cfg.model}: "
                    "equal distributions are the divergence's minimum, so its loss and gradient are 0 at every token "
                    "and there is nothing to learn; pass a teacher trained beyond the student as "
                    "--teacher_model_name_or_path (e.g. out/grpo)")
    return teacher.to(device).eval().requires_grad_(False)


def same_weights(a, b) -> bool:
    """Whether two models hold tensors of the same names, each equal to the other's in shape and every value:
    one model, even when its two copies were loaded from two folders."""
    weights_a, weights_b = a.state_dict(), b.state_dict()
    return weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def step_log(loss, answers, completion_mask, grad_norm, scheduler, prompts, completions, logprobs,
             sampler_logprobs) -> tuple[dict, dict]:
    """run.end_step's two arguments: the step's metrics (loss: the mean divergence per token; accuracy:
    the checker's verdict on the student's samples against the answers, read only to watch; the sampler's
    gap to the trainer's log-probs of the sampled tokens, [B, T] each) and what the student wrote."""
    accuracy = torch.tensor([float(common.is_correct(c, a)) for c, a in zip(completions, answers)])  # [B]
    metrics = {"loss": loss.item(), "accuracy": accuracy.mean().item(),
               "completion_length": completion_mask.sum(1).float().mean().item(),
               "sampled_tokens": int(completion_mask.sum()), "grad_norm": grad_norm.item(),
               "learning_rate": scheduler.get_last_lr()[0],
               **rollout.sampler_mismatch(logprobs, sampler_logprobs, completion_mask)}
    return metrics, {"prompt": prompts, "completion": completions, "right": accuracy.tolist()}


def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--teacher_model_name_or_path": cfg.teacher_model_name_or_path,
                                   "--dataset": cfg.dataset})  # settings, output folder, torchrun
    num_prompts = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # B, one completion each
    train_data, test_data, model, tokenizer, longest = common.load_policy_and_prompts(cfg, num_prompts)
    teacher = load_teacher(cfg, tokenizer, model, run.device)
    model = run.prepare(model)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    run.shard(model, teacher)  # --fsdp: each process keeps 1/N of every weight, gradient and AdamW state
    run.log_memory([model], [teacher], rows=cfg.per_device_train_batch_size,
                   sequence_length=longest + cfg.max_completion_length, completion_length=cfg.max_completion_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_rate)

    def evaluate():  # held-out accuracy, greedy and sampled: run.steps calls it every --eval_steps
        return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                               cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # 1. Rollout: the student's own completion of each of B prompts.
        step_data = train_data[run.rng.sample(range(len(train_data)), num_prompts)]  # {column: [B values]}
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in step_data["question"]]
        prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs = rollout.generate(
            model, tokenizer, prompts, cfg.max_completion_length, cfg.temperature,
            return_logprobs=True)  # [B, P] x 2, [B, T] x 3
        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        T = completion_ids.shape[1]

        optimizer.zero_grad(set_to_none=True)
        loss, logprobs = 0.0, torch.zeros_like(sampler_logprobs)  # logprobs [B, T]: the sampled tokens', for the log
        for rows in torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size):  # gradient accumulation
            # 2. The teacher's distribution at each of the student's positions.
            with torch.no_grad():
                teacher_logprobs = token_logprobs(teacher, input_ids[rows], attention_mask[rows], T, cfg.temperature)
            # 3. + 4. The student's, and the divergence: its share of the step's token mean.
            student_logprobs = token_logprobs(model, input_ids[rows], attention_mask[rows], T, cfg.temperature)
            micro_loss = distill_loss(student_logprobs, teacher_logprobs, completion_mask[rows], cfg.beta,
                                      step_mask=completion_mask)
            micro_loss.backward()
            loss = loss + micro_loss.detach()
            logprobs[rows] = student_logprobs.detach().gather(2, completion_ids[rows, :, None]).squeeze(2)
        grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
        optimizer.step()
        scheduler.step()

        run.end_step(*step_log(loss, step_data["answer"], completion_mask, grad_norm, scheduler, prompts, completions,
                               logprobs, sampler_logprobs))  # when due: evaluate, save

    run.finish(tokenizer, {"": model}, {"divergence to the teacher (per token)": ["loss"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"],
                                        "the student's samples right": ["accuracy"]}, "distillation")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
