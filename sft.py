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
optimizer step; the calls on `run` are harness.py's machinery, which changes no number.
"""
from dataclasses import dataclass

import torch

import common
import harness
import rollout
from common import setting


@dataclass
class Config:
    model: str = "tiny"
    """'tiny' builds the embedded ~1M-parameter model from scratch; else a local folder or hub id"""
    dataset: str = "data/demos"
    """a folder with train.jsonl / test.jsonl, or a hub dataset: GSM8K's schema (openai/gsm8k) or prompt/chosen
    (Dahoas/rm-static)"""
    output_dir: str = "out/sft"
    """where the checkpoint, metrics.jsonl, eval.json and the PNG go"""
    overwrite_output_dir: bool = False
    """replace the run already in --output_dir: the new run writes into <output_dir>/.next_run and moves in when it
    finishes, so a run that fails or is killed leaves the old one whole"""
    system_prompt: str = ""
    """optional system message before each question (a hub model may need the format explained)"""
    max_steps: int = setting(700, lambda v: v >= 1, "at least 1")
    """optimizer steps"""
    per_device_train_batch_size: int = setting(32, lambda v: v >= 1, "at least 1")
    """examples per forward pass (a micro-batch), per process"""
    gradient_accumulation_steps: int = setting(1, lambda v: v >= 1, "at least 1")
    """micro-batches per optimizer step: a step's batch is per_device_train_batch_size x gradient_accumulation_steps
    (x processes); accumulation changes memory, not the result"""
    learning_rate: float = setting(2e-3, lambda v: v > 0, "positive")
    """peak learning rate of AdamW (use ~1e-5 for a pretrained model)"""
    warmup_steps: int = setting(30, lambda v: v >= 0, "0 or more")
    """linear warmup steps from 0 to learning_rate, then a cosine decay"""
    min_lr_rate: float = setting(0.1, lambda v: 0 <= v <= 1, "in [0, 1]")
    """the cosine ends at min_lr_rate * learning_rate"""
    weight_decay: float = setting(0.01, lambda v: v >= 0, "0 or more")
    """AdamW weight decay"""
    max_grad_norm: float = setting(1.0, lambda v: v > 0, "positive (the gradient's norm is clipped to it)")
    """gradient clipping norm"""
    max_completion_length: int = setting(64, lambda v: v >= 1, "at least 1 token")
    """max new tokens when evaluating (and the longest training answer kept)"""
    eval_steps: int = setting(350, lambda v: v >= 1, "at least 1")
    """evaluate held-out accuracy every this many steps"""
    num_eval_examples: int = setting(500, lambda v: v >= 0, "0 or more (0: every held-out example)")
    """held-out problems per evaluation (0 = the whole test split)"""
    eval_samples_per_problem: int = setting(4, lambda v: v >= 1, "at least 1")
    """sampled completions per held-out problem (temperature 1): sampled accuracy is their mean"""
    per_device_eval_batch_size: int = setting(512, lambda v: v >= 1, "at least 1")
    """completions generated at once during evaluation (lower it for a large model)"""
    eval_on_start: bool = False
    """evaluate before the first step too (the starting model's accuracy)"""
    logging_steps: int = setting(10, lambda v: v >= 1, "at least 1")
    """write a metrics.jsonl line every this many steps"""
    seed: int = setting(0, lambda v: 0 <= v < 2**32, "in [0, 2^32)")
    """random seed"""
    lora_r: int | None = setting(None, lambda v: v is None or v >= 1,
                                 "a positive rank (leave it out to train every weight)")
    """LoRA rank: train low-rank adapters instead of every weight (needs a pretrained --model);
    unset = full fine-tuning"""
    lora_alpha: float = setting(16.0, lambda v: v > 0, "positive")
    """LoRA scale: the adapter's output is multiplied by lora_alpha / lora_r"""
    lora_dropout: float = setting(0.0, lambda v: 0 <= v < 1, "in [0, 1)")
    """dropout on the adapter's input"""
    lora_target_modules: str = "all-linear"
    """linear layers that get adapters: 'all-linear' or names such as q_proj,v_proj"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, more time (large models)"""
    fsdp: bool = False
    """under torchrun: shard the model's weights, gradients and AdamW states over the processes (FSDP2), instead
    of a full copy on each (data parallelism); the saved model is whole, resumable checkpoints are sharded"""
    save_steps: int = setting(100, lambda v: v >= 1, "at least 1")
    """write a resumable checkpoint (weights, optimizer, random generators) every this many steps, and at the end"""
    resume: bool = False
    """continue from the checkpoint in --output_dir, exactly where it stopped (same result as an unbroken run)"""
    trust_remote_code: bool = False
    """let a hub model run its own Python code (off: only its weights and config are loaded)"""
    merge_lora: bool = False
    """with --lora_r, also save the adapter merged into its base model, in <output_dir>/merged"""


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Token-mean negative log-likelihood of the answer tokens (stage 1 of note 000):

        loss = -sum(logprobs * mask) / num_tokens,      num_tokens = sum(mask) by default

    logprobs [N, T] are log pi(answer token | prompt, earlier answer tokens); mask [N, T] is 1 on
    real answer tokens (EOS included) and 0 on padding, so prompt and padding never count.
    Note 000's DeepSpeed-Chat trains its SFT stage on prompt + answer alike; we mask the prompt, as
    TRL's SFTTrainer does with completion_only_loss: the model is not asked to predict the user's
    question, and every gradient goes to the answers it will be asked to write.
    With gradient accumulation, num_tokens is the answer-token count of the whole step (all its
    micro-batches): each micro-batch's loss is then its share of the step's token mean, and the
    micro-batches' losses and gradients add up to those of one pass over the step's batch.
    (Under torchrun the count is the global batch's, per process: see common.token_count.)"""
    mask = mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / (common.token_count(mask) if num_tokens is None else num_tokens)


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
    examples = []
    for question, answer in pairs:
        prompt = common.make_prompt(tokenizer, question, system_prompt)
        target = answer + tokenizer.eos_token
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
        if len(target_ids) <= max_completion_length:
            examples.append((prompt_ids, target_ids))
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
    if cfg.model == "tiny":
        if cfg.lora_r is not None:
            common.fail(
                "--lora_r needs a pretrained --model: the tiny model starts from random weights, so train all of them"
            )
        tokenizer = common.build_tokenizer()
        model = common.build_tiny_model(tokenizer)
    else:
        model, tokenizer = common.load_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
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
        num_tokens = common.token_count(torch.cat([answer_mask.flatten() for *_, answer_mask in micro_batches]))

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
        run.log({"loss": loss.item(), "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0]})

    run.finish(tokenizer, {"": model}, {"loss": ["loss", "eval/loss"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"]}, "SFT")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
