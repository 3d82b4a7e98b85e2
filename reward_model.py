"""Stage 2 of RLHF: a reward model trained on preference pairs (note 000, DeepSpeed-Chat step 2).

The SFT transformer with its LM head swapped for a linear N -> 1 head reads (prompt, response)
and outputs one number per token; the reward r(x, y) is the number at the response's last real
token (EOS). Trained on pairs (prompt, chosen, rejected) so that chosen outscores rejected:

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))      (Bradley-Terry)

    python reward_model.py                                # out/sft + data/preference -> out/rm
    python reward_model.py --dataset Dahoas/rm-static --model out/sft_qwen
    torchrun --nproc_per_node 2 reward_model.py           # data parallel over 2 GPUs (or CPU processes)
    torchrun --nproc_per_node 2 reward_model.py --fsdp true  # sharded: each process holds half the weights and states

The shipped pairs (data/make_data.py) have a right answer as chosen and a plausible mistake as
rejected: a forgotten carry, a slipped digit, a final number that does not follow the reasoning,
a broken format. ppo.py then uses this model as its frozen reward and to initialise its critic.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
import distributed
import harness
import rollout
from common import setting


@dataclass
class Config:
    model: str = "out/sft"
    """transformer to start from (its LM head is replaced by a scalar head): sft.py's output or a hub id"""
    dataset: str = "data/preference"
    """a folder with train.jsonl / test.jsonl of prompt / chosen / rejected, or a hub dataset (Dahoas/rm-static)"""
    output_dir: str = "out/rm"
    """where the checkpoint, metrics.jsonl, eval.json and the PNG go"""
    overwrite_output_dir: bool = False
    """replace the run already in --output_dir: the new run writes into <output_dir>/.next_run and moves in when it
    finishes, so a run that fails or is killed leaves the old one whole"""
    system_prompt: str = ""
    """optional system message before each prompt (use the same as for sft.py and ppo.py)"""
    max_steps: int = setting(600, lambda v: v >= 1, "at least 1")
    """optimizer steps"""
    per_device_train_batch_size: int = setting(32, lambda v: v >= 1, "at least 1")
    """preference pairs per forward pass (a micro-batch), per process (each pair is two sequences)"""
    gradient_accumulation_steps: int = setting(1, lambda v: v >= 1, "at least 1")
    """micro-batches per optimizer step: a step's batch is per_device_train_batch_size x gradient_accumulation_steps
    (x processes); accumulation changes memory, not the result"""
    learning_rate: float = setting(6e-4, lambda v: v > 0, "positive")
    """peak learning rate of AdamW"""
    warmup_steps: int = setting(20, lambda v: v >= 0, "0 or more")
    """linear warmup steps from 0 to learning_rate, then a cosine decay"""
    min_lr_rate: float = setting(0.1, lambda v: 0 <= v <= 1, "in [0, 1]")
    """the cosine ends at min_lr_rate * learning_rate"""
    weight_decay: float = setting(0.0, lambda v: v >= 0, "0 or more")
    """AdamW weight decay"""
    max_grad_norm: float = setting(1.0, lambda v: v > 0, "positive (the gradient's norm is clipped to it)")
    """gradient clipping norm"""
    policy_prompts: int = setting(3000, lambda v: v >= 0, "0 or more")
    """prompts on which the --model policy samples answers that the checker labels, for extra pairs
    (0 = the shipped pairs only; needs <answer> tags in the chosen answers). The default takes every shipped
    training prompt: the more of the policy's own mistakes the reward model has seen, the less PPO can game it"""
    samples_per_prompt: int = setting(8, lambda v: v >= 2, "at least 2: a wrong sample is paired with a right one")
    """policy samples per prompt; each wrong one is paired with a right one"""
    max_completion_length: int = setting(64, lambda v: v >= 1, "at least 1 token")
    """max new tokens of a policy sample"""
    max_length: int = setting(128, lambda v: v >= 2, "at least 2 tokens")
    """pairs whose prompt + response is longer than this many tokens are dropped"""
    eval_steps: int = setting(100, lambda v: v >= 1, "at least 1")
    """evaluate held-out pairwise accuracy every this many steps"""
    num_eval_examples: int = setting(500, lambda v: v >= 0, "0 or more (0: every held-out example)")
    """held-out pairs per evaluation (0 = the whole test split)"""
    per_device_eval_batch_size: int = setting(256, lambda v: v >= 1, "at least 1")
    """pairs scored at once during evaluation (lower it for a large model)"""
    logging_steps: int = setting(10, lambda v: v >= 1, "at least 1")
    """write a metrics.jsonl line every this many steps"""
    seed: int = setting(0, lambda v: 0 <= v < 2**32, "in [0, 2^32)")
    """random seed"""
    lora_r: int | None = setting(None, lambda v: v is None or v >= 1,
                                 "a positive rank (leave it out to train every weight)")
    """LoRA rank: train low-rank adapters (and the scalar head) instead of every weight; unset = full fine-tuning"""
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


def preference_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, num_pairs: int | None = None
                    ) -> torch.Tensor:
    """Pairwise (Bradley-Terry) loss of note 000: -log sigmoid(r_chosen - r_rejected), mean over pairs.
    (Note 000's DeepSpeed-Chat averages it over the tokens after the two answers diverge; we compare
    one score per answer, the one PPO reads: docs/concept_map.md.)

        loss = -sum_i log sigmoid(r_chosen_i - r_rejected_i) / num_pairs,      num_pairs = M by default

    chosen_scores, rejected_scores [M], one per pair. P(chosen preferred) = sigmoid(r_chosen - r_rejected), so
    this is the negative log-likelihood of the labelled choice. No person labels the pairs here: the shipped
    ones are synthetic (data/make_data.py), policy_pairs' are labelled by the rule-based checker. Only
    differences of scores matter.
    With gradient accumulation, num_pairs is the whole step's pair count: each micro-batch's loss
    is then its share of the step's mean, and the shares add up to the step's loss."""
    losses = -F.logsigmoid(chosen_scores - rejected_scores)  # [M]
    return losses.sum() / (len(losses) if num_pairs is None else num_pairs)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """r(x, y) [N]: the scalar head on the hidden state of each row's last real token (the EOS of
    every training pair; ppo.reward_scores says what happens to a completion cut off without one).

    input_ids, attention_mask [N, L] laid out as [left-padded prompt | right-padded response].
    Every position gets a hidden state, but only the last real one has read the whole answer."""
    hidden = rollout.last_hidden_states(model, input_ids, attention_mask)  # [N, L, H]
    last = attention_mask.shape[1] - 1 - attention_mask.flip(dims=[1]).argmax(dim=1)  # [N] index of the last 1
    return model.score(hidden[torch.arange(len(last)), last]).squeeze(-1)  # [N]


@torch.no_grad()
def policy_pairs(policy, tokenizer, data, samples_per_prompt: int, max_new_tokens: int, system_prompt: str) -> dict:
    """Preference pairs from the policy's own samples, labelled by the rule-based checker.

    Note 000: a reward model's data are one prompt answered by several different language models,
    the answers scored by people (or, for one's own domain, by ChatGPT). Here the rule-based checker
    scores, and the answers come from the policy PPO will train: synthetic mistakes teach the reward
    model the mistakes we thought of; the policy's samples show it the ones PPO will actually
    produce (and push on). For each prompt, every sample whose <answer> is not
    the chosen answer's number (or whose format is broken) becomes a rejected answer, paired
    with a right sample, or with the dataset's chosen answer if the policy got none right."""
    policy.eval()
    pairs = {"prompt": [], "chosen": [], "rejected": []}
    for start in range(0, len(data), 64):
        batch = data[start : start + 64]
        prompts = [common.make_prompt(tokenizer, p,
                                      system_prompt) for p in batch["prompt"] for _ in range(samples_per_prompt)]
        *_, completion_ids, _ = rollout.generate(policy, tokenizer, prompts, max_new_tokens)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        for i, (prompt, chosen) in enumerate(zip(batch["prompt"], batch["chosen"])):
            gold = common.extract_answer(chosen)
            samples = texts[i * samples_per_prompt : (i + 1) * samples_per_prompt]
            right = [t for t in samples if common.same_number(common.extract_answer(t),
                                                              gold) and t.strip().endswith("</answer>")]
            for wrong in dict.fromkeys(t for t in samples if t not in right):  # distinct wrong samples
                pairs["prompt"].append(prompt)
                pairs["chosen"].append(right[0] if right else chosen)
                pairs["rejected"].append(wrong)
    return pairs


def tokenize_pairs(tokenizer, data, system_prompt: str, max_length: int, name: str | None = None):
    """Each row -> (prompt ids, chosen ids + EOS, rejected ids + EOS); too-long pairs are dropped
    (given the data's name, under the 1% rule of unusable rows: checks.check_length_drops)."""
    pairs = []
    for prompt, chosen, rejected in zip(data["prompt"], data["chosen"], data["rejected"]):
        prompt_ids = tokenizer(common.make_prompt(tokenizer, prompt, system_prompt),
                               add_special_tokens=False)["input_ids"]
        chosen_ids, rejected_ids = (tokenizer(r + tokenizer.eos_token,
                                              add_special_tokens=False)["input_ids"] for r in (chosen, rejected))
        if len(prompt_ids) + max(len(chosen_ids), len(rejected_ids)) <= max_length:
            pairs.append((prompt_ids, chosen_ids, rejected_ids))
    if name:
        common.check_length_drops(name, len(pairs), len(data["prompt"]), f"--max_length {max_length}")
    return pairs


def collate(pairs, pad_id: int):
    """2M sequences (M pairs), the M chosen then the M rejected, as [left-padded prompt | right-padded response].

    Returns input_ids [2B, P+T], attention_mask [2B, P+T]."""
    prompts = [p for p, _, _ in pairs] * 2
    responses = [c for _, c, _ in pairs] + [r for _, _, r in pairs]
    prompt_ids, prompt_mask = rollout.pad_left(prompts, pad_id)
    response_ids, response_mask = rollout.pad_right(responses, pad_id)
    return torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)


@torch.no_grad()
def pairwise_accuracy(model, pairs, pad_id: int, batch_size: int = 256) -> dict:
    """Held-out pairwise accuracy (how often r(chosen) > r(rejected)) and the mean margin.
    Under torchrun each process scores its own share of the pairs and the counts are summed."""
    model.eval()
    margins = []
    with distributed.gathered(model):  # FSDP: the full weights once (processes may hold a different number of batches)
        for start in range(0, len(pairs), batch_size):
            batch = pairs[start : start + batch_size]
            input_ids, attention_mask = collate(batch, pad_id)
            chosen, rejected = sequence_scores(model, input_ids.to(model.device),
                                               attention_mask.to(model.device)).chunk(2)
            margins.append(chosen - rejected)
    model.train()
    margins = torch.cat(margins) if margins else torch.zeros(0)  # under torchrun a process's share may be empty
    n, correct, margin_sum = (common.global_sum(float(x)) for x in (len(margins), (margins > 0).sum(), margins.sum()))
    return {"pairwise_accuracy": correct / n, "margin": margin_sum / n, "n": int(n)}


def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset})  # settings, output folder, torchrun
    train_data, test_data = common.load_splits(cfg.dataset, ("prompt", "chosen", "rejected"), cfg.num_eval_examples)

    # The SFT model with a fresh N -> 1 head in place of its LM head.
    model, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first", scalar_head=True,
                                         trust_remote_code=cfg.trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    model = run.prepare(model, scalar_head=True)  # LoRA: adapters and the head trained; DDP: rank 0's head everywhere
    run.shard(model)  # --fsdp: each process keeps 1/N of every weight, gradient and AdamW state
    common.check_system_prompt(model, tokenizer, cfg.system_prompt)  # before any prompt is made with it
    train_pairs = tokenize_pairs(tokenizer, train_data, cfg.system_prompt, cfg.max_length, f"{cfg.dataset} train")
    test_pairs = tokenize_pairs(tokenizer, test_data, cfg.system_prompt, cfg.max_length, f"{cfg.dataset} test")
    batch_size = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # pairs per step, per process
    if len(train_pairs) < batch_size or not test_pairs:  # the same on every process (a share may be empty)
        common.fail(f"{cfg.dataset} has {len(train_pairs)} training and {len(test_pairs)} held-out pairs that fit in "
                    f"--max_length {cfg.max_length}: it needs --per_device_train_batch_size x "
                    f"--gradient_accumulation_steps ({batch_size}) and 1")
    test_pairs = test_pairs[run.rank::run.world_size]  # DDP: a share each
    # Extra pairs from the policy's own samples: for training (train prompts), and a held-out set
    # (test prompts) that measures what PPO needs: does the RM rank *this policy's* answers right?
    policy_test_pairs, num_shipped = [], len(train_pairs)
    if cfg.policy_prompts:
        if common.extract_answer(train_data[0]["chosen"]) is None:
            common.fail(f"--policy_prompts needs chosen answers with <answer> tags, and {cfg.dataset} has none: "
                        "pass --policy_prompts 0")
        policy = common.load_model(cfg.model, trust_remote_code=cfg.trust_remote_code)[0].to(run.device)
        train_prompts = train_data.select(range(min(cfg.policy_prompts, len(train_data))))
        # DDP: each process samples on its own share of the prompts
        extra = policy_pairs(policy, tokenizer, distributed.process_share(train_prompts),
                             cfg.samples_per_prompt, cfg.max_completion_length, cfg.system_prompt)
        held_out = policy_pairs(policy, tokenizer, distributed.process_share(test_data), 2,
                                cfg.max_completion_length, cfg.system_prompt)
        del policy
        train_pairs += tokenize_pairs(tokenizer, extra, cfg.system_prompt, cfg.max_length)
        policy_test_pairs = tokenize_pairs(tokenizer, held_out, cfg.system_prompt, cfg.max_length)
    run.log_memory([model])
    common.log(f"reward model: {len(train_pairs)} training pairs ({len(train_pairs) - num_shipped} from the policy), "
               f"{len(test_pairs)} held-out pairs (+{len(policy_test_pairs)} from the policy), device {run.device}, "
               f"{run.world_size} process(es)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_rate)
    common.check_fits_context(model, max(len(p) + max(len(c), len(r)) for p, c, r in train_pairs),
                              f"the longest pair of {cfg.dataset} (see --max_length)")

    def evaluate():  # held-out pairwise accuracy: the shipped pairs, and pairs of the policy's own samples
        scores = pairwise_accuracy(model, test_pairs, tokenizer.pad_token_id, cfg.per_device_eval_batch_size)
        if policy_test_pairs:
            scores["policy_pairwise_accuracy"] = pairwise_accuracy(
                model, policy_test_pairs, tokenizer.pad_token_id, cfg.per_device_eval_batch_size)["pairwise_accuracy"]
        return scores

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # The step's whole batch in one draw (the same draws whatever the accumulation), cut into
        # gradient_accumulation_steps consecutive micro-batches of per_device_train_batch_size pairs.
        batch, size = run.rng.sample(train_pairs, batch_size), cfg.per_device_train_batch_size
        micro_batches = [collate(batch[i : i + size], tokenizer.pad_token_id) for i in range(0, batch_size, size)]

        # Each micro-batch divides its pairs' loss sum by the step's pair count, so the gradients that
        # backward() adds up are those of one pass over the step's batch (up to float rounding).
        optimizer.zero_grad(set_to_none=True)
        loss, chosen_scores, rejected_scores = 0.0, [], []
        for input_ids, attention_mask in micro_batches:
            input_ids, attention_mask = input_ids.to(run.device), attention_mask.to(run.device)
            chosen, rejected = sequence_scores(model, input_ids, attention_mask).chunk(2)  # [M], [M]
            micro_loss = preference_loss(chosen, rejected, num_pairs=batch_size)  # its share of the step's mean
            micro_loss.backward()  # adds to the gradients of the earlier micro-batches
            loss = loss + micro_loss.detach()  # the step's loss: the sum of the shares
            chosen_scores.append(chosen.detach())
            rejected_scores.append(rejected.detach())
        grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
        optimizer.step()
        scheduler.step()
        chosen_scores, rejected_scores = torch.cat(chosen_scores), torch.cat(rejected_scores)  # the whole step's
        margins = chosen_scores - rejected_scores
        run.log({"loss": loss.item(), "accuracy": (margins > 0).float().mean().item(), "margin": margins.mean().item(),
                 "score/chosen": chosen_scores.mean().item(), "score/rejected": rejected_scores.mean().item(),
                 "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0]})

    run.finish(tokenizer, {"": model}, {"loss": ["loss"], "pairwise accuracy": ["accuracy", "eval/pairwise_accuracy",
                                                                              "eval/policy_pairwise_accuracy"],
                                        "scores": ["score/chosen", "score/rejected"]}, "Reward model")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
