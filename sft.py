"""Stage 1 of RLHF: supervised fine-tuning (SFT) on prompt + reference answer.

The model learns to imitate worked answers: the loss is the negative log-likelihood of the
answer tokens only (the prompt is context, not a target). With no --model it trains the
embedded ~1M-parameter model from scratch on the shipped demonstrations of a careless teacher
(data/demos: 20% of its answers are wrong, a forgotten first carry, borrow or minus sign), on a
laptop CPU; the RL scripts then reward the true answers (data/arithmetic), which the teacher did
not always write.

    python sft.py                                        # tiny model, data/demos -> out/sft
    python sft.py --max_steps 300 --eval_steps 300 --output_dir out/sft_weak   # docs/mix.md's weak start
    python sft.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --learning_rate 1e-5
    torchrun --nproc_per_node 2 sft.py ...               # data parallel over 2 GPUs (or CPU processes)
    torchrun --nproc_per_node 2 sft.py ... --fsdp true   # sharded: each process holds half the weights and states
    python sft.py --model out/sft --lora_r 8 ...         # LoRA adapters instead of every weight

Answers are formatted as <think>reasoning</think><answer>number</answer> (note 002), so the
RL scripts can reward the format and the number. One step, in main()'s loop: draw a batch, run the
log-prob pass over it (rollout.completion_logprobs, one plain pass), sft_loss, backward(), the
optimizer step; the calls on `run` are lib/harness.py's machinery, which changes no number.
"""
from dataclasses import dataclass

import torch

import common
from lib import harness, rollout


@dataclass
class Config(harness.PolicyConfig):
    """SFT's settings are the run's: harness.PolicyConfig's, at these defaults."""
    # the run's settings (lib/harness.py) at this script's defaults
    model: str = "tiny"
    """'tiny' builds the embedded ~1M-parameter model from scratch; 'tiny-small' one of half its width
    (~0.2M parameters: a smaller student for distill.py)"""
    dataset: str = "data/demos"
    """GSM8K's schema (openai/gsm8k) or prompt/chosen (Dahoas/rm-static)"""
    output_dir: str = "out/sft"
    max_steps: int = 700
    per_device_train_batch_size: int = 32
    """a row is one prompt + its answer"""
    max_completion_length: int = 64
    """training answers longer than this are dropped"""
    learning_rate: float = 2e-3
    """use ~1e-5 for a pretrained model"""
    warmup_steps: int = 30
    weight_decay: float = 0.01
    eval_steps: int = 350
    eval_on_start: bool = False
    logging_steps: int = 10
    save_steps: int = 100


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Token-mean NLL of the answer tokens (note 000's stage 1, the prompt masked as in TRL's completion_only_loss):
        loss = -sum(logprobs * mask) / num_tokens,      num_tokens = sum(mask) by default
    logprobs, mask [N, T], mask 1 on real answer tokens (EOS included). Details: docs/classic_rlhf.md#the-sft-loss"""
    mask = mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / (common.mean_denominator(mask) if num_tokens is None else num_tokens)


def tokenize_examples(tokenizer, data, system_prompt: str, max_completion_length: int, name: str | None = None):
    """Each row -> (prompt token ids, answer token ids ending in EOS); too-long answers are dropped
    (given the data's name, under the 1% rule of unusable rows: checks.check_length_drops).

    Two schemas: GSM8K's (question, answer = reasoning + '#### n', written as note 002's
    <think>reasoning</think><answer>n</answer>), or a preference dataset's such as
    Dahoas/rm-static (prompt, chosen: SFT imitates the chosen response, note 000)."""
    if "question" in (data.column_names if hasattr(data, "column_names") else data):  # a Dataset, or a dict of columns
        pairs = [(q, common.format_completion(*common.split_gsm8k_answer(a))) for q,
                 a in zip(data["question"], data["answer"])]
    else:
        pairs = [(prompt, chosen.strip()) for prompt, chosen in zip(data["prompt"], data["chosen"])]
    prompt_ids = common.token_ids(tokenizer, [common.make_prompt(tokenizer, q, system_prompt) for q, _ in pairs])
    target_ids = common.token_ids(tokenizer, [answer + tokenizer.eos_token for _, answer in pairs])
    examples = [(p, t) for p, t in zip(prompt_ids, target_ids) if len(t) <= max_completion_length]
    if name:
        common.check_length_drops(name, len(examples), len(pairs), f"--max_completion_length {max_completion_length}")
    return examples


def collate(examples, pad_id: int):
    """[left-padded prompt | right-padded answer], the same layout as an RL rollout.

    Returns input_ids [N, P+T], attention_mask [N, P+T], answer_mask [N, T]."""
    prompt_ids, prompt_mask = rollout.pad_left([p for p, _ in examples], pad_id)
    answer_ids, answer_mask = rollout.pad_right([a for _, a in examples], pad_id)
    return torch.cat([prompt_ids, answer_ids], 1), torch.cat([prompt_mask, answer_mask], 1), answer_mask


@torch.no_grad()
def held_out_loss(model, examples, pad_id: int, batch_size: int = 64) -> dict:
    """The token-mean NLL of held-out answers (for data without a number to check)."""
    model.eval()
    total = count = 0.0
    for start in range(0, len(examples), batch_size):
        input_ids, attention_mask, answer_mask = (
            x.to(model.device) for x in collate(examples[start : start + batch_size], pad_id)
        )
        logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, answer_mask.shape[1])
        total, count = total - (logprobs * answer_mask).sum().item(), count + answer_mask.sum().item()
    model.train()
    return {"loss": total / max(count, 1), "n": len(examples)}


def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset})  # settings, output folder, torchrun

    # data: GSM8K's schema (held-out accuracy is measured), or prompt / chosen (held-out loss only)
    has_answers = "prompt" not in common.load_split(cfg.dataset, "train", columns=()).column_names
    columns = ("question", "answer") if has_answers else ("prompt", "chosen")
    train_data, test_data = common.load_splits(cfg.dataset, columns, cfg.num_eval_examples)

    # model: the embedded tiny one from scratch, or a pretrained one
    if cfg.model in common.TINY_SIZES:
        if cfg.lora_r is not None:
            common.fail(
                "--lora_r needs a pretrained --model: the tiny model starts from random weights, so train all of them"
            )
        tokenizer = common.build_tokenizer()
        model = common.build_tiny_model(tokenizer, **common.TINY_SIZES[cfg.model])
    else:
        model, tokenizer = common.load_model(cfg.model, trust_remote_code=cfg.trust_remote_code, flag="--model")
    model = run.prepare(model)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    run.shard(model)  # --fsdp: each process keeps 1/N of every weight, gradient and AdamW state
    common.check_system_prompt(model, tokenizer, cfg.system_prompt)  # before any prompt is made with it
    examples = tokenize_examples(tokenizer, train_data, cfg.system_prompt, cfg.max_completion_length,
                                 f"{cfg.dataset} train")
    batch_size = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # examples per step, per process
    if len(examples) < batch_size:
        common.fail(f"{cfg.dataset} has {len(examples)} training answers that fit in --max_completion_length "
                    f"{cfg.max_completion_length}, fewer than a step's --per_device_train_batch_size "
                    f"{cfg.per_device_train_batch_size} x --gradient_accumulation_steps "
                    f"{cfg.gradient_accumulation_steps}")
    longest = max(len(p) + len(a) for p, a in examples)
    common.check_fits_context(model, longest, f"the longest example of {cfg.dataset}")
    common.log(f"sft: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(examples)} training "
               f"examples, device {run.device}, {run.world_size} process(es)")
    run.log_memory([model], rows=cfg.per_device_train_batch_size, sequence_length=longest,
                   completion_length=max(len(a) for _, a in examples))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_rate)

    def evaluate():  # held-out accuracy, greedy and sampled; without answers to check, the held-out loss
        if has_answers:
            return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                                   cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)
        test_examples = tokenize_examples(tokenizer, test_data, cfg.system_prompt, cfg.max_completion_length,
                                          f"{cfg.dataset} test")
        return held_out_loss(model, test_examples, tokenizer.pad_token_id)

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # The step's whole batch in one draw (the same draws whatever the accumulation), cut into
        # gradient_accumulation_steps consecutive micro-batches of per_device_train_batch_size examples.
        batch, size = run.rng.sample(examples, batch_size), cfg.per_device_train_batch_size
        micro_batches = [[x.to(run.device) for x in collate(batch[i : i + size], tokenizer.pad_token_id)]
                         for i in range(0, batch_size, size)]
        num_tokens = common.mean_denominator(torch.cat([answer_mask.flatten() for *_, answer_mask in micro_batches]))

        # Each micro-batch divides by the step's answer-token count, so the gradients that backward() adds up
        # are those of one pass over the step's batch (up to float rounding). One pass per micro-batch, no
        # length chunks: SFT's step is cheap, and reordering rows changes float rounding, which 700 steps
        # amplify into another run.
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for input_ids, attention_mask, answer_mask in micro_batches:
            logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, answer_mask.shape[1],
                                                   length_chunks=1)  # [N, T]
            micro_loss = sft_loss(logprobs, answer_mask, num_tokens)  # its share of the step's token mean
            micro_loss.backward()  # adds to the gradients of the earlier micro-batches
            loss = loss + micro_loss.detach()  # the step's loss: the sum of the shares
        grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
        optimizer.step()
        scheduler.step()
        # The step's metrics; when due: evaluate, write the metrics line, save a checkpoint.
        run.end_step({"loss": loss.item(), "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0]})

    run.finish(tokenizer, {"": model}, {"loss": ["loss", "eval/loss"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"]}, "SFT")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
