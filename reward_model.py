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
from common import setting
from lib import distributed, harness, rollout


@dataclass
class Config(harness.RunConfig):
    """The reward model's settings; the run's (model, data, batch, AdamW, evaluation, LoRA, ...) are
    harness.RunConfig's."""
    policy_prompts: int = setting(3000, lambda v: v >= 0, "0 or more")
    """prompts on which the --model policy samples answers that the checker labels, for extra pairs
    (0 = the shipped pairs only; needs <answer> tags in the chosen answers). The default takes every shipped
    training prompt: pairs of the policy's own mistakes may make the reward model harder for PPO to game (one seed
    suggested it; at these defaults PPO still gamed one reward model of three: docs/lessons.md, L27)"""
    samples_per_prompt: int = setting(8, lambda v: v >= 2, "at least 2: a wrong sample is paired with a right one")
    """policy samples per prompt; each wrong one is paired with a right one"""
    max_length: int = setting(128, lambda v: v >= 2, "at least 2 tokens")
    """pairs whose prompt + response is longer than this many tokens are dropped"""
    # the run's settings (lib/harness.py) at this script's defaults
    model: str = "out/sft"
    """its LM head is replaced by a scalar head"""
    dataset: str = "data/preference"
    """of prompt / chosen / rejected (Dahoas/rm-static)"""
    output_dir: str = "out/rm"
    max_steps: int = 600
    per_device_train_batch_size: int = 32
    """a row is one preference pair (two sequences)"""
    max_completion_length: int = 64
    """here: of a policy sample (--policy_prompts)"""
    learning_rate: float = 6e-4
    warmup_steps: int = 20
    eval_steps: int = 100
    """held-out pairwise accuracy"""
    per_device_eval_batch_size: int = 256
    eval_on_start: bool = False
    logging_steps: int = 10
    save_steps: int = 100


def preference_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, num_pairs: int | None = None
                    ) -> torch.Tensor:
    """Pairwise (Bradley-Terry) loss of note 000, mean over pairs; chosen_scores, rejected_scores [M], one per pair:
        loss = -sum_i log sigmoid(r_chosen_i - r_rejected_i) / num_pairs,      num_pairs = M by default
    Details: docs/classic_rlhf.md#the-preference-loss"""
    losses = -F.logsigmoid(chosen_scores - rejected_scores)  # [M]
    return losses.sum() / (len(losses) if num_pairs is None else num_pairs)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """r(x, y) [N]: the scalar head on the hidden state of each row's last real token, the one that has read the
    whole answer (the EOS of every training pair; without EOS: docs/classic_rlhf.md#a-cut-off-completions-score).
    input_ids, attention_mask [N, L] laid out as [left-padded prompt | right-padded response]."""
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
    prompt_ids = common.token_ids(tokenizer, [common.make_prompt(tokenizer, p, system_prompt) for p in data["prompt"]])
    chosen_ids = common.token_ids(tokenizer, [chosen + tokenizer.eos_token for chosen in data["chosen"]])
    rejected_ids = common.token_ids(tokenizer, [rejected + tokenizer.eos_token for rejected in data["rejected"]])
    pairs = [(p, c, r) for p, c, r in zip(prompt_ids, chosen_ids, rejected_ids)
             if len(p) + max(len(c), len(r)) <= max_length]
    if name:
        common.check_length_drops(name, len(pairs), len(data["prompt"]), f"--max_length {max_length}")
    return pairs


def tokenize_samples(tokenizer, questions: list[str], completions: list[str], ended: torch.Tensor,
                     system_prompt: str):
    """A reward model with a tokenizer of its own reads the policy's samples as text, as TRL's GRPOTrainer
    feeds its reward_processing_class (grpo_trainer.py, `_calculate_rewards`): each question in the reward
    model's chat template, each completion's text, and its EOS where the policy's sample ended (ended [N]:
    the reward model learned its score at the EOS of its pairs). Returns input_ids, attention_mask [N, P+T]
    in the reward model's ids, laid out as [left-padded prompt | right-padded response]."""
    prompts = [tokenizer(common.make_prompt(tokenizer, q, system_prompt), add_special_tokens=False)["input_ids"]
               for q in questions]
    responses = [tokenizer(c + (tokenizer.eos_token if stop else ""), add_special_tokens=False)["input_ids"]
                 for c, stop in zip(completions, ended.tolist())]
    prompt_ids, prompt_mask = rollout.pad_left(prompts, tokenizer.pad_token_id)
    response_ids, response_mask = rollout.pad_right(responses, tokenizer.pad_token_id)
    return torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, response_mask], 1)


def judge_rows(judge_tokenizer, tokenizer, questions: list[str], completions: list[str], input_ids, attention_mask,
               T: int, system_prompt: str):
    """What a judge scores of the policy's samples input_ids, attention_mask [N, P+T] (T: the width of
    the completions, completions [N] their text, questions [N] the question of each row): the rows as
    they are when it shares the policy's tokenizer (judge_tokenizer None), else the same text in its
    own ids and chat template (tokenize_samples), with its EOS where the policy's sample ended."""
    if judge_tokenizer is None:
        return input_ids, attention_mask
    ended = ((input_ids[:, -T:] == tokenizer.eos_token_id) & attention_mask[:, -T:].bool()).any(dim=1)  # [N]
    ids, mask = tokenize_samples(judge_tokenizer, questions, completions, ended.cpu(), system_prompt)
    return ids.to(input_ids.device), mask.to(input_ids.device)


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
                                         trust_remote_code=cfg.trust_remote_code, flag="--model")
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
        policy = common.load_model(cfg.model, trust_remote_code=cfg.trust_remote_code, flag="--model")[0].to(run.device)
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
        # The step's metrics; when due: evaluate, write the metrics line, save a checkpoint.
        run.end_step({"loss": loss.item(), "accuracy": (margins > 0).float().mean().item(),
                      "margin": margins.mean().item(), "score/chosen": chosen_scores.mean().item(),
                      "score/rejected": rejected_scores.mean().item(), "grad_norm": grad_norm.item(),
                      "learning_rate": scheduler.get_last_lr()[0]})

    run.finish(tokenizer, {"": model}, {"loss": ["loss"], "pairwise accuracy": ["accuracy", "eval/pairwise_accuracy",
                                                                              "eval/policy_pairwise_accuracy"],
                                        "scores": ["score/chosen", "score/rejected"]}, "Reward model")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
