"""A process reward model (PRM): the reward model's transformer, scored at the end of each step (docs/process.md).

reward_model.py reads one score at the answer's last token and learns it from preferences (an outcome reward
model, ORM). A PRM reads a score at every step's last token (lib/steps.py: a step is one line of the worked
answer, then the answer itself) and learns from a label per step, as a classifier (Lightman et al. 2023,
"Let's Verify Step by Step"; Math-Shepherd, Wang et al. 2024):

    p_j  = sigmoid(w . h(end of step j))                      the chance that step j's label is 1 (exact labels: the
                                                              lines so far are the solver's; hard estimate: one of N
                                                              continuations from there ends right; soft: the share)
    loss = mean over the labelled steps of  BCE(p_j, y_j)   = -[y_j log p_j + (1 - y_j) log(1 - p_j)]

The answers are the policy's own samples (as reward_model.py's --policy_prompts); their labels come two ways:

    --labels exact      lib/steps.py's exact_labels: every line so far is the solver's line; the answer step is
                        the checker's outcome. Only a task with a rule has them.
    --labels estimated  Math-Shepherd's, with no rule for the steps: from the end of step j, --completions_per_step
                        continuations are sampled; y_j = 1 when one of them ends right ('hard'), or the share that
                        do ('soft'). The answer step's label is the checker's, as in the paper.

Held out, the PRM is read three ways: step accuracy against the exact labels (p_j > 0.5), by kind of step; the
answer's score as the minimum over its steps (Math-Shepherd) or their product (Lightman et al.), as a
classifier of right and wrong answers (accuracy at 0.5, and AUROC); with --outcome_model, the ORM's score
of the same answers beside it (AUROC: its score has no threshold of its own).

    python prm.py                                       # out/sft samples, exact labels -> out/prm
    python prm.py --labels estimated --output_dir out/prm_estimated    # Math-Shepherd's labels (slower)
    python prm.py --outcome_model out/rm                # the ORM's AUROC on the same held-out answers
    python best_of_n.py --model out/sft --judge out/prm              # best-of-N by the PRM
    python grpo_process.py --process_reward_model out/prm            # GRPO with process supervision

Left out, and why: PRM800K-style human labels (none offline); a PRM that generates its verdict (a generative
verifier); several processes (the labelling and training of the tiny model take a few minutes on one CPU).
"""
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
import reward_model
from common import setting
from lib import harness, rollout, steps

LABELS = ("exact", "estimated")


@dataclass
class Config(harness.RunConfig):
    """The PRM's settings; the run's (model, data, batch, AdamW, evaluation, ...) are harness.RunConfig's."""
    labels: str = setting("exact", lambda v: v in LABELS, "one of " + ", ".join(LABELS))
    """where the step labels come from: 'exact' (the rule, lib/steps.py) or 'estimated' (Math-Shepherd: sampled
    continuations from each step)"""
    estimate: str = setting("hard", lambda v: v in ("hard", "soft"), "hard or soft")
    """with --labels estimated: 'hard' y = 1 when any continuation ends right (Math-Shepherd's HE), 'soft' the
    share that do (SE)"""
    completions_per_step: int = setting(4, lambda v: v >= 1, "at least 1")
    """with --labels estimated: continuations sampled from each step's end (Math-Shepherd's N)"""
    policy_prompts: int = setting(1000, lambda v: v >= 1, "at least 1")
    """training prompts on which the --model policy samples the answers to label"""
    samples_per_prompt: int = setting(4, lambda v: v >= 1, "at least 1")
    """policy samples per training prompt (held out: 2 per test prompt)"""
    outcome_model: str = ""
    """a reward model folder (reward_model.py's, on the same tokenizer): its AUROC on the same held-out answers"""
    # the run's settings (lib/harness.py) at this script's defaults
    model: str = "out/sft"
    """the policy whose samples are labelled; the PRM starts from it, its LM head replaced by a scalar head"""
    output_dir: str = "out/prm"
    max_steps: int = 300
    per_device_train_batch_size: int = 64
    """a row is one sampled answer, with all its steps"""
    learning_rate: float = 6e-4
    warmup_steps: int = 20
    eval_steps: int = 100
    eval_on_start: bool = False
    save_steps: int = 100

    def check_together(self):
        for name in ("estimate", "completions_per_step"):
            if self.changed(name) and self.labels != "estimated":
                common.fail(f"--{name} belongs to --labels estimated")


# ---------------------------------------------------------------------------------------------
# The PRM: a score at each step's end, and its loss
# ---------------------------------------------------------------------------------------------
def step_logits(model, input_ids, attention_mask, positions: torch.Tensor) -> torch.Tensor:
    """The PRM's logit at each step's end: the scalar head on the hidden state at positions [N, S] (indices into
    input_ids [N, L], padded with any index where there is no step) -> [N, S]. sigmoid gives p_j."""
    hidden = rollout.last_hidden_states(model, input_ids, attention_mask)  # [N, L, H]
    at_ends = hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [N, S, H]
    return model.score(at_ends).squeeze(-1)  # [N, S]


@torch.no_grad()
def step_probs(model, input_ids, attention_mask, num_completion_tokens: int, ends: list[list[int]],
               batch_size: int) -> list[list[float]]:
    """The PRM's p_j = sigmoid(logit) at each step's end, for rows laid out as [left-padded prompt | completion]
    (input_ids, attention_mask [N, P+T]); ends [N]: each row's step ends, token indices into its completion
    (lib/steps.py's end_tokens). Read batch_size rows at a time. Returns [N] lists of p_j."""
    P, S = input_ids.shape[1] - num_completion_tokens, max(len(e) for e in ends)
    positions = torch.tensor([[P + k for k in e] + [P] * (S - len(e)) for e in ends], device=input_ids.device)
    probs = torch.cat([torch.sigmoid(step_logits(model, input_ids[rows], attention_mask[rows], positions[rows]))
                       for rows in torch.arange(len(input_ids), device=input_ids.device).split(batch_size)])
    return [probs[i, : len(e)].tolist() for i, e in enumerate(ends)]


def is_prm(folder: str) -> bool:
    """Whether a model folder was written by prm.py (its run.json says so): a judge read at each step's end."""
    try:
        with open(os.path.join(folder, "run.json"), encoding="utf-8") as f:
            return json.load(f).get("script") == "prm.py"
    except (OSError, ValueError):
        return False


def prm_loss(logits, labels, step_mask, num_steps: int | None = None) -> torch.Tensor:
    """Binary cross-entropy of each real step's logit [N, S] against its label (0, 1, or a share for soft
    estimates), summed over the steps where step_mask [N, S] is 1 and divided by num_steps (how many steps
    the whole optimizer step's batch labels, so that micro-batches add up; their own count by default)."""
    losses = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")  # [N, S]
    return (losses * step_mask).sum() / (step_mask.sum() if num_steps is None else num_steps)


def answer_score(probs: list[float], aggregate: str = "min") -> float:
    """One score for an answer from its steps' p_j: their minimum (Math-Shepherd) or their product (Lightman et al.)."""
    return min(probs) if aggregate == "min" else math.prod(probs)


# ---------------------------------------------------------------------------------------------
# The data: the policy's answers, split into steps and labelled
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def sample_answers(policy, tokenizer, questions: list[str], n: int, cfg) -> list[str]:
    """n samples of each question from the policy (temperature 1), question-major: [len(questions) x n]."""
    completions = []
    for start in range(0, len(questions), max(1, cfg.per_device_eval_batch_size // n)):
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt)
                   for q in questions[start : start + max(1, cfg.per_device_eval_batch_size // n)] for _ in range(n)]
        *_, completion_ids, _ = rollout.generate(policy, tokenizer, prompts, cfg.max_completion_length)
        completions += tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return completions


@torch.no_grad()
def estimated_labels(policy, tokenizer, questions, completions, answers, cfg) -> list[list[float]]:
    """Math-Shepherd's labels: for each line step j of each answer, --completions_per_step continuations
    sampled from the prompt + the answer up to step j's end; y_j = 1 when any ends right (hard) or the share
    that do (soft). The answer step's label is the outcome itself (lib/steps.py's outcome_label)."""
    K = cfg.completions_per_step
    prefixes = [(i, common.make_prompt(tokenizer, q, cfg.system_prompt) + c[:end])
                for i, (q, c) in enumerate(zip(questions, completions)) for _, end in steps.steps(c)[:-1]]
    rights = []
    for start in range(0, len(prefixes), max(1, cfg.per_device_eval_batch_size // K)):
        part = prefixes[start : start + max(1, cfg.per_device_eval_batch_size // K)]
        prompts = [text for _, text in part for _ in range(K)]
        *_, completion_ids, _ = rollout.generate(policy, tokenizer, prompts, cfg.max_completion_length)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        for j, (i, text) in enumerate(part):
            done = [text[len(common.make_prompt(tokenizer, questions[i], cfg.system_prompt)):] + t
                    for t in texts[j * K : (j + 1) * K]]  # the whole answer: the prefix and a continuation
            rights.append(sum(steps.outcome_label(d, answers[i]) for d in done))
    labels, k = [], 0
    for c, a in zip(completions, answers):
        n = len(steps.steps(c)) - 1
        found = rights[k : k + n]
        k += n
        labels.append([float(r > 0) if cfg.estimate == "hard" else r / K for r in found] +
                      [float(steps.outcome_label(c, a))])
    return labels


def encode(tokenizer, questions, completions, labels, system_prompt: str) -> list[dict]:
    """Each answer as the PRM reads it: prompt ids, completion ids (+ EOS), the token ending each step, labels.
    The text is tokenized again, so a tokenizer that merges characters may give other ids than the policy sampled
    (the tiny model's one byte per token gives the same), and every answer gets an EOS, also one the policy cut
    off at --max_completion_length (rare at these lengths: the SFT policy's answers are about 25 tokens of 64)."""
    rows = []
    for q, c, y in zip(questions, completions, labels):
        prompt_ids = tokenizer(common.make_prompt(tokenizer, q, system_prompt), add_special_tokens=False)["input_ids"]
        ids = tokenizer(c + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ends = steps.end_tokens(tokenizer, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                                [[end for _, end in steps.steps(c)]])[0]  # the answer step's: the EOS
        rows.append({"prompt": prompt_ids, "completion": ids, "ends": ends, "labels": [float(v) for v in y]})
    return rows


def collate(rows: list[dict], pad_id: int):
    """[left-padded prompt | right-padded completion] and the steps: input_ids, attention_mask [N, P+T], positions
    (into input_ids), labels, step_mask [N, S]."""
    prompt_ids, prompt_mask = rollout.pad_left([r["prompt"] for r in rows], pad_id)
    completion_ids, completion_mask = rollout.pad_right([r["completion"] for r in rows], pad_id)
    P, S = prompt_ids.shape[1], max(len(r["ends"]) for r in rows)
    positions, labels, step_mask = (torch.zeros(len(rows), S, dtype=dtype) for dtype in (torch.long, torch.float,
                                                                                        torch.float))
    for i, r in enumerate(rows):
        positions[i, : len(r["ends"])] = P + torch.tensor(r["ends"])
        labels[i, : len(r["labels"])] = torch.tensor(r["labels"])
        step_mask[i, : len(r["ends"])] = 1
    return (torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), positions,
            labels, step_mask)


# ---------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------
def auroc(scores: list[float], positives: list[int]) -> float:
    """The chance that a random right answer outscores a random wrong one (ties count 1/2); nan with one class."""
    right = [s for s, y in zip(scores, positives) if y]
    wrong = [s for s, y in zip(scores, positives) if not y]
    if not right or not wrong:
        return float("nan")
    return sum((r > w) + 0.5 * (r == w) for r in right for w in wrong) / (len(right) * len(wrong))


@torch.no_grad()
def held_out(model, rows, kinds, outcome_model, pad_id: int, batch_size: int) -> dict:
    """Step accuracy against the exact labels (all, and by kind of step), and the answer's score (min, product;
    an outcome model's) as a classifier of right answers: accuracy at 0.5 and AUROC."""
    model.eval()
    probs, orm = [], []
    for start in range(0, len(rows), batch_size):
        input_ids, attention_mask, positions, _, step_mask = collate(rows[start : start + batch_size], pad_id)
        input_ids, attention_mask, positions = (x.to(model.device) for x in (input_ids, attention_mask, positions))
        p = torch.sigmoid(step_logits(model, input_ids, attention_mask, positions)).cpu()  # [n, S]
        probs += [p[i, : int(step_mask[i].sum())].tolist() for i in range(len(p))]
        if outcome_model is not None:
            orm += reward_model.sequence_scores(outcome_model, input_ids, attention_mask).tolist()
    model.train()
    results, by_kind = {}, {}
    for p, r, k in zip(probs, rows, kinds):
        for pj, yj, kj in zip(p, r["labels"], k):
            by_kind.setdefault(kj, []).append(float((pj > 0.5) == (yj > 0.5)))
    every = [v for values in by_kind.values() for v in values]
    results["step_accuracy"] = sum(every) / len(every)
    results.update({f"step_accuracy/{kind}": sum(v) / len(v) for kind, v in sorted(by_kind.items())})
    outcomes = [int(r["labels"][-1]) for r in rows]
    for name in ("min", "product"):
        scores = [answer_score(p, name) for p in probs]
        results[f"answer_accuracy/{name}"] = sum((s > 0.5) == y for s, y in zip(scores, outcomes)) / len(rows)
        results[f"answer_auroc/{name}"] = auroc(scores, outcomes)
    if orm:
        results["answer_auroc/outcome_model"] = auroc(orm, outcomes)
    results["right_answers"] = sum(outcomes) / len(rows)
    results["n"] = len(rows)
    return results


def agreement(estimated: list[list[float]], exact: list[list[int]], kinds: list[list[str]]) -> dict:
    """How often Math-Shepherd's estimate (above 1/2) agrees with the exact label over the training answers' line
    steps, by kind of step, with its two errors: a broken prefix estimated right ('wrong_called_right', a reward
    the PRM will learn to give to a slip) and a right one estimated wrong ('right_called_wrong': no
    continuation ended right). {'label_agreement/carry': share, ..., 'label_steps/carry': count, ...}"""
    table = {}
    for est, ex, kd in zip(estimated, exact, kinds):
        for e, x, k in zip(est[:-1], ex[:-1], kd[:-1]):
            row = table.setdefault(k, [0, 0, 0, 0])  # steps, agree, wrong called right, right called wrong
            row[0] += 1
            row[1] += int((e > 0.5) == bool(x))
            row[2] += int(e > 0.5 and not x)
            row[3] += int(e <= 0.5 and bool(x))
    every = [sum(row[i] for row in table.values()) for i in range(4)]
    return {f"label_{name}/{kind}": (row[i] / row[0] if i else row[0])
            for kind, row in sorted({**table, "all": every}.items()) if row[0]
            for i, name in enumerate(("steps", "agreement", "wrong_called_right", "right_called_wrong"))}


def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset,
                                   **({"--outcome_model": cfg.outcome_model} if cfg.outcome_model else {})})
    train_data, test_data = common.load_splits(cfg.dataset, ("question", "answer"), cfg.num_eval_examples)
    model, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first", scalar_head=True,
                                         trust_remote_code=cfg.trust_remote_code, flag="--model")
    model.config.pad_token_id = tokenizer.pad_token_id
    model = run.prepare(model, scalar_head=True)
    if steps.parse_question(train_data[0]["question"]) is None:
        common.fail(f"prm.py labels steps by the shipped arithmetic's rule and judges them held out against it; "
                    f"{cfg.dataset}'s questions are not of it")
    outcome_model = None
    if cfg.outcome_model:
        outcome_model = reward_model_on(cfg, tokenizer).to(run.device).eval()

    # The policy's answers, split into steps and labelled: held-out ones (exact labels) and training ones, sampled
    # in that order before any label is estimated, so that --labels exact and estimated read the same answers.
    policy = common.load_model(cfg.model, trust_remote_code=cfg.trust_remote_code, flag="--model")[0].to(run.device)
    test_questions = [q for q in test_data["question"] for _ in range(2)]
    test_answers = [a for a in test_data["answer"] for _ in range(2)]
    test_completions = sample_answers(policy, tokenizer, test_data["question"], 2, cfg)
    train_prompts = train_data.select(range(min(cfg.policy_prompts, len(train_data))))
    questions = [q for q in train_prompts["question"] for _ in range(cfg.samples_per_prompt)]
    answers = [a for a in train_prompts["answer"] for _ in range(cfg.samples_per_prompt)]
    completions = sample_answers(policy, tokenizer, train_prompts["question"], cfg.samples_per_prompt, cfg)
    exact = [steps.exact_labels(q, c, a) for q, c, a in zip(questions, completions, answers)]
    kinds = [steps.step_kinds(q, c) for q, c in zip(questions, completions)]
    labels, label_agreement = exact, {}
    if cfg.labels == "estimated":
        labels = estimated_labels(policy, tokenizer, questions, completions, answers, cfg)
        label_agreement = agreement(labels, exact, kinds)  # logged with each evaluation
    del policy
    test_labels = [steps.exact_labels(q, c, a) for q, c, a in zip(test_questions, test_completions, test_answers)]
    test_kinds = [steps.step_kinds(q, c) for q, c in zip(test_questions, test_completions)]
    train_rows = encode(tokenizer, questions, completions, labels, cfg.system_prompt)
    test_rows = encode(tokenizer, test_questions, test_completions, test_labels, cfg.system_prompt)
    batch_size = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    if len(train_rows) < batch_size:
        common.fail(f"--policy_prompts x --samples_per_prompt ({len(train_rows)} answers) must be at least "
                    f"--per_device_train_batch_size x --gradient_accumulation_steps ({batch_size})")
    line_steps, right = sum(len(y) - 1 for y in labels), sum(sum(y[:-1]) for y in labels)
    common.log(f"PRM: {len(train_rows)} answers ({line_steps} line steps, {right / max(1, line_steps):.0%} "
               f"labelled right, {cfg.labels} labels), {len(test_rows)} held-out answers, device {run.device}")
    common.check_fits_context(model, max(len(r["prompt"]) + len(r["completion"]) for r in train_rows + test_rows),
                              "the longest answer")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_rate)

    def evaluate():  # held-out step and answer accuracy; the estimate's agreement with the exact labels
        return {**held_out(model, test_rows, test_kinds, outcome_model, tokenizer.pad_token_id,
                           cfg.per_device_eval_batch_size), **label_agreement}

    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        batch, size = run.rng.sample(train_rows, batch_size), cfg.per_device_train_batch_size
        num_steps = sum(len(r["ends"]) for r in batch)  # the step's labelled steps: each micro-batch divides by it
        optimizer.zero_grad(set_to_none=True)
        loss, right, counted = 0.0, 0.0, 0.0
        for i in range(0, batch_size, size):
            input_ids, attention_mask, positions, labels_, step_mask = (
                x.to(run.device) for x in collate(batch[i : i + size], tokenizer.pad_token_id))
            logits = step_logits(model, input_ids, attention_mask, positions)  # [n, S]
            micro_loss = prm_loss(logits, labels_, step_mask, num_steps)
            micro_loss.backward()  # gradients add up over the micro-batches
            loss = loss + micro_loss.detach()
            right += (((logits > 0) == (labels_ > 0.5)) * step_mask).sum().item()
            counted += step_mask.sum().item()
        grad_norm = run.clip_gradients(model, loss)  # a NaN or inf stops here
        optimizer.step()
        scheduler.step()
        run.end_step({"loss": loss.item(), "step_accuracy": right / counted, "grad_norm": grad_norm.item(),
                      "learning_rate": scheduler.get_last_lr()[0]})

    run.finish(tokenizer, {"": model}, {"loss": ["loss"], "step accuracy": ["step_accuracy", "eval/step_accuracy"],
                                        "answer AUROC": ["eval/answer_auroc/min", "eval/answer_auroc/product"]},
               "Process reward model")
    return model


def reward_model_on(cfg, tokenizer):
    """--outcome_model, on --model's tokenizer (its score is read on the same ids)."""
    model, own = common.load_model(cfg.outcome_model, missing_hint="run `python reward_model.py` first",
                                   scalar_head=True, reward_model=True, trust_remote_code=cfg.trust_remote_code,
                                   flag="--outcome_model")
    if not common.same_tokenizer(own, tokenizer):
        common.fail(f"--outcome_model {cfg.outcome_model} has a tokenizer of its own, not --model's: train it from "
                    f"this policy (python reward_model.py --model {cfg.model})")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
