"""DPO: Direct Preference Optimization (Rafailov et al. 2023; TRL's DPOTrainer), offline and online.

RLHF from preference pairs, offline without a reward model, online judged by the checker or a reward model:
the policy learns from pairs (prompt x, chosen y_c, rejected y_r) with the reward model's Bradley-Terry
loss, written with the policy's implicit reward
beta log(pi(y|x) / pi_ref(y|x)): the reward for which pi is the optimum of PPO's KL-regularised
objective, up to a term of x alone that cancels in a pair (docs/dpo.md#where-the-loss-comes-from):

    loss = -log sigmoid(beta [log pi(y_c|x)/pi_ref(y_c|x) - log pi(y_r|x)/pi_ref(y_r|x)])    (sigmoid_loss)

--loss_type ipo, simpo and kto take IPO's, SimPO's and KTO's loss instead; KTO scores each answer alone.

One training step, the numbered comments of main()'s loop:
  1. pairs: B pairs of --dataset; online (--online true), two samples of each of B prompts from the
     current policy, ranked by the judge (a tie weighs 0)   input_ids [2B, P+T]: B chosen rows, then B rejected
  2. reference: log pi_ref(y|x) of every row, summed over its tokens, no gradient         ref_logps [2B]
     (KTO also: its reference point z0)
  3. loss: the policy's log pi(y|x) of every row, with gradient; the loss of each pair, a mean over the
     step's counted pairs (KTO: of each answer, a mean over the answers); backward()
  4. update: gradients averaged over processes and clipped, one AdamW step
  5. metrics: TRL's rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
     logps/rejected, entropy

    python sft.py && python dpo.py                       # offline: out/sft + data/preference -> out/dpo
    python dpo.py --online true                          # online: pairs sampled from the policy, ranked by the checker
    python reward_model.py && python dpo.py --online true --judge out/rm   # ... ranked by a reward model
    python dpo.py --online true --loss_type kto          # KTO: each sample alone, labelled by the checker
    python dpo.py --online true --steps_per_generation 5 # iterative DPO: pairs sampled once every 5 steps
    torchrun --nproc_per_node 2 dpo.py                   # data parallel over 2 GPUs (or CPU processes)

KTO, iterative DPO, and what is left out and why: docs/dpo.md.
"""
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import common
import reward_model
from common import setting
from lib import distributed, harness, rollout

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "kto")  # TRL's names: DPOTrainer's sigmoid and ipo, CPOTrainer's simpo,
#                                                  KTOTrainer's kto


@dataclass
class Config(harness.RLConfig):
    """DPO's settings; the run's (model, data, batch, AdamW, evaluation, LoRA, ...) are harness.RLConfig's."""
    LOSS_SCALES = ("beta", "desirable_weight", "undesirable_weight")  # they scale a loss term: named after a NaN
    prompts: str = "data/arithmetic"
    """a folder in GSM8K's schema (question / answer): online DPO's prompts (train split) and every run's
    held-out accuracy (test split)"""
    online: bool = False
    """online DPO (Guo et al. 2024; TRL's OnlineDPOTrainer): each step's pairs are two samples of the current
    policy per prompt, ranked by --judge, instead of the fixed pairs of --dataset"""
    judge: str = "rule"
    """with --online true, what ranks the two samples: 'rule' (the task's checker: a right answer beats a wrong
    one; both right or both wrong is a tie) or a reward-model folder written by reward_model.py"""
    loss_type: str = setting("sigmoid", lambda v: v in LOSS_TYPES, "one of " + ", ".join(LOSS_TYPES))
    """'sigmoid': DPO; 'ipo': IPO's squared loss on the per-token log-ratio margin; 'simpo': SimPO, the
    length-normalised log-probs with a margin --simpo_gamma and no reference model; 'kto': KTO, each answer
    alone, desirable or undesirable, against a reference point (see the loss functions)"""
    beta: float = setting(0.1, lambda v: v > 0, "positive")
    """the KL weight of the objective the losses come from: larger keeps the policy closer to pi_ref (TRL's
    default 0.1; IPO's target margin is 1 / (2 beta); the SimPO paper uses 2 to 2.5)"""
    simpo_gamma: float = setting(0.5, lambda v: v >= 0, "0 or more")
    """SimPO's target margin gamma between the chosen and rejected length-normalised rewards (TRL's default)"""
    desirable_weight: float = setting(1.0, lambda v: v > 0, "positive")
    """KTO's weight lambda_D on the loss of a desirable answer (TRL's default 1)"""
    undesirable_weight: float = setting(1.0, lambda v: v > 0, "positive")
    """KTO's weight lambda_U on the loss of an undesirable answer (TRL's default 1)"""
    steps_per_generation: int = setting(1, lambda v: v >= 1, "at least 1")
    """with --online true: sample the pairs of this many steps at once, every this many steps (iterative DPO;
    TRL's GRPOConfig name for the same schedule); 1 is online DPO, each step's pairs from the current policy"""
    max_length: int = setting(128, lambda v: v >= 2, "at least 2 tokens")
    """offline pairs whose prompt + longer answer is longer than this many tokens are dropped"""
    # the run's settings (lib/harness.py) at this script's defaults
    model: str = "out/sft"
    """the policy, and the reference pi_ref"""
    dataset: str = "data/preference"
    """offline pairs of prompt / chosen / rejected (Dahoas/rm-static); not read with --online true"""
    output_dir: str = "out/dpo"
    max_steps: int = 150
    per_device_train_batch_size: int = 64
    """a row is one pair (two sequences; online: a prompt sampled twice)"""
    learning_rate: float | None = None
    """unset: 5e-5 with --online, 5e-6 offline (from out/sft, offline DPO at 5e-5
    collapses the policy: docs/dpo.md)"""
    eval_steps: int = 50
    save_steps: int = 50

    def check_together(self):
        if self.changed("judge") and not self.online:
            common.fail("--judge ranks online DPO's own samples: add --online true (offline DPO learns from the "
                        "pairs of --dataset)")
        if self.steps_per_generation > 1 and not self.online:
            common.fail("--steps_per_generation says how often online DPO samples new pairs: add --online true")
        if self.steps_per_generation > self.max_steps:
            common.fail(f"--steps_per_generation {self.steps_per_generation} samples the pairs of that many steps at "
                        f"once, more than the run's --max_steps {self.max_steps}: the rest would never be used")
        if self.save_steps % self.steps_per_generation:
            common.fail(f"--save_steps {self.save_steps} must be a multiple of --steps_per_generation "
                        f"{self.steps_per_generation}, so that a checkpoint falls where new pairs are sampled and "
                        "--resume starts there")
        for name in ("desirable_weight", "undesirable_weight"):
            if self.changed(name) and self.loss_type != "kto":
                common.fail(f"--{name} weighs KTO's loss: add --loss_type kto")
        if self.loss_type == "kto" and self.online and self.judge != "rule":
            common.fail("KTO needs each sample labelled desirable or undesirable, which the checker does: "
                        "--judge rule (a reward model scores, it does not label)")
        if self.loss_type == "kto" and self.per_device_train_batch_size * self.gradient_accumulation_steps < 2:
            common.fail("KTO's reference point pairs each prompt with another prompt's answer: a step needs at "
                        "least 2 pairs (--per_device_train_batch_size x --gradient_accumulation_steps)")


# ---------------------------------------------------------------------------------------------
# The losses. The pair losses take, per pair, the summed log-probs of the chosen and rejected answers
# under the policy (and the reference) and return one loss per pair [B]; KTO's, one loss per answer.
# ---------------------------------------------------------------------------------------------
def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(y|x) = sum over the answer's real tokens of log pi(y_t | x, y_<t): [B, T] -> [B]."""
    return torch.where(mask.bool(), logprobs, 0.0).sum(dim=1)


@torch.no_grad()
def answer_logps(model, input_ids, attention_mask, T: int, temperature: float, micro_batches) -> torch.Tensor:
    """log pi(y|x) of each row [N] (no gradient), a micro-batch at a time: the reference's pass, and
    KTO's mismatched rows."""
    return sequence_logprobs(rollout.inference(rollout.completion_logprobs, model, input_ids, attention_mask, T,
                                               temperature, micro_batches=micro_batches), attention_mask[:, -T:])


def implicit_rewards(logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward of an answer, r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)), up to
    the beta log Z(x) that every answer to x shares (docs/dpo.md#where-the-loss-comes-from). [B] -> [B].
    TRL logs its mean over chosen and rejected answers as rewards/chosen, rewards/rejected."""
    return beta * (logps - ref_logps)


def sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, eq. 7; TRL loss_type 'sigmoid'), per pair, all arguments [B] -> [B]:
        h    = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))
        loss = -log sigmoid(beta * h)
    Its gradient, and its value at the start: docs/dpo.md#dpo-the-sigmoid-loss"""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    return -F.logsigmoid(beta * h)


def ipo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths, rejected_lengths,
             beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17; TRL loss_type 'ipo'), per pair, all [B] -> [B]; |y| counts EOS:
        h    = (log pi(y_c) - log pi_ref(y_c)) / |y_c| - (log pi(y_r) - log pi_ref(y_r)) / |y_r|
        loss = (h - 1 / (2 beta))^2
    Why a finite target, and why per token: docs/dpo.md#ipo-a-target-margin"""
    h = (chosen_logps - ref_chosen_logps) / chosen_lengths - (rejected_logps - ref_rejected_logps) / rejected_lengths
    return (h - 1 / (2 * beta)) ** 2


def simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta: float,
               gamma: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024, eq. 6; TRL's CPOTrainer, loss_type 'simpo' with cpo_alpha 0), per pair, all [B] -> [B]:
        loss = -log sigmoid(beta * (log pi(y_c) / |y_c| - log pi(y_r) / |y_r|) - gamma)
    No reference model. What it changes from DPO: docs/dpo.md#simpo-no-reference-model"""
    margin = chosen_logps / chosen_lengths - rejected_logps / rejected_lengths
    return -F.logsigmoid(beta * margin - gamma)


def kto_loss(logps, ref_logps, desirable, z0, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 8; TRL's KTOTrainer, loss_type 'kto'), per answer, [N] -> [N]:
        r    = log pi(y|x) - log pi_ref(y|x)                the implicit reward, over beta
        loss = lambda_D * (1 - sigmoid(beta * (r - z0)))     a desirable answer (desirable 1)
               lambda_U * (1 - sigmoid(beta * (z0 - r)))     an undesirable one (desirable 0)
    z0, the reference point, is a number (kto_reference_point). Each answer alone, no pair: a
    desirable answer is pushed above the reference point, an undesirable one below it.
    Why the sigmoid and the reference point: docs/dpo.md#kto-one-answer-at-a-time"""
    r = logps - ref_logps
    return torch.where(desirable.bool(), desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))


def kto_reference_point(logps, ref_logps) -> torch.Tensor:
    """KTO's z0, an estimate of KL(pi || pi_ref) that needs no sample of pi (Ethayarajh et al. 2024,
    section 4.1; TRL's KTOTrainer): log pi(y'|x) - log pi_ref(y'|x) of mismatched rows, each prompt x
    with the answer of the row before it (mismatched_rows), its mean, at least 0, with no gradient.
    logps, ref_logps [N] of the mismatched rows; under torchrun the mean is over every process's rows."""
    logratios = (logps - ref_logps).detach()  # [N]
    return (common.global_sum(logratios.sum()) / common.global_sum(len(logratios))).clamp(min=0)


def mismatched_rows(input_ids, attention_mask, T: int):
    """Each row's prompt with the answer of the row before it (the first with the last's): rows
    [N, P+T] of [left-padded prompt | right-padded answer], the answers rolled by one row, as TRL's
    KTOTrainer builds its KL_completion_ids. Rows 2i and 2i + 1 share a prompt in neither layout
    (offline: chosen rows then rejected; online: one sample of each prompt, then the other), so every
    prompt meets another prompt's answer once the step holds 2 pairs or more."""
    rolled = [torch.cat([x[:, :-T], x[:, -T:].roll(1, dims=0)], dim=1) for x in (input_ids, attention_mask)]
    return rolled[0], rolled[1]


def reference_pass(model, ref_model, input_ids, attention_mask, T: int, temperature: float, micro_batches,
                   loss_type: str):
    """Step 2, without gradient: log pi_ref(y|x) of each row [2B] (None for SimPO, which has no
    reference), and KTO's z0 (kto_reference_point: pi against pi_ref on the mismatched rows; None for the
    other losses)."""
    if loss_type == "simpo":
        return None, None
    with common.reference_model(model, ref_model) as reference:  # the frozen copy, or LoRA switched off
        ref_logps = answer_logps(reference, input_ids, attention_mask, T, temperature, micro_batches)  # [2B]
        if loss_type != "kto":
            return ref_logps, None
        mismatched = mismatched_rows(input_ids, attention_mask, T)  # each prompt with another prompt's answer
        ref_mismatched_logps = answer_logps(reference, *mismatched, T, temperature, micro_batches)  # [2B]
    z0 = kto_reference_point(answer_logps(model, *mismatched, T, temperature, micro_batches), ref_mismatched_logps)
    return ref_logps, z0


def pair_losses(cfg, logps, ref_logps, lengths) -> torch.Tensor:
    """The loss of --loss_type (sigmoid, ipo or simpo) for each pair [b]. logps, ref_logps (None for
    simpo), lengths [2b]: the b chosen rows, then the b rejected ones."""
    if cfg.loss_type == "simpo":
        return simpo_loss(*logps.chunk(2), *lengths.chunk(2), cfg.beta, cfg.simpo_gamma)
    if cfg.loss_type == "ipo":
        return ipo_loss(*logps.chunk(2), *ref_logps.chunk(2), *lengths.chunk(2), cfg.beta)
    return sigmoid_loss(*logps.chunk(2), *ref_logps.chunk(2), cfg.beta)


def rewards_of(cfg, logps, ref_logps, lengths) -> torch.Tensor:
    """Each row's reward [N], for the metrics: the implicit reward (DPO, IPO, KTO), or for SimPO beta
    times the mean log-prob per token, as TRL's CPOTrainer logs it."""
    return cfg.beta * logps / lengths if cfg.loss_type == "simpo" else implicit_rewards(logps, ref_logps, cfg.beta)


# ---------------------------------------------------------------------------------------------
# Online DPO: the judge ranks two samples of the policy
# ---------------------------------------------------------------------------------------------
def rule_judge(completions: list[str], answers: list[str]) -> torch.Tensor:
    """The task's checker as a judge: 1 for a right answer (common.is_correct), 0 for a wrong one. [2B]"""
    return torch.tensor([float(common.is_correct(c, a)) for c, a in zip(completions, answers)])


@torch.no_grad()
def reward_model_judge(judge_model, input_ids, attention_mask, batch_size: int) -> torch.Tensor:
    """A reward model written by reward_model.py as the judge: its score r(x, y) of each row
    (reward_model.sequence_scores, at the last real token), batch_size rows at a time. [2B]"""
    return rollout.inference(reward_model.sequence_scores, judge_model, input_ids, attention_mask,
                             micro_batches=torch.arange(len(input_ids)).split(batch_size)).cpu()


def rank_pairs(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two samples of prompt i are rows 2i and 2i + 1 of scores [2B]. Returns the row order
    [2B] that lists the B chosen rows (the higher score), then the B rejected ones, and each pair's
    weight [B]: 0 for a tie (both right or both wrong under the rule judge: no preference to learn),
    1 otherwise. TRL's OnlineDPOTrainer trains on ties too (the first sample as chosen)."""
    first, second = scores[0::2], scores[1::2]  # [B] each
    rows = torch.arange(len(first)) * 2
    chosen = torch.where(first >= second, rows, rows + 1)
    return torch.cat([chosen, chosen ^ 1]), (first != second).float()  # rows 2i and 2i + 1 differ in the last bit


def loss_weights(pair_weights: torch.Tensor, loss_type: str) -> torch.Tensor:
    """What the step's mean loss counts: each pair, weighed by pair_weights [B] (0 for a tie), or for
    KTO each of the 2B answers, weighed 1 [2B] (KTO labels every answer alone: a tie's answers count)."""
    return torch.ones(2 * len(pair_weights)) if loss_type == "kto" else pair_weights


@dataclass
class Pairs:
    """Step 1: a step's B pairs as 2B rows [left-padded prompt | right-padded answer], the B chosen rows, then
    the B rejected; online (sample_and_rank) two samples of each prompt ranked by the judge, offline
    (dataset_pairs) the pairs of --dataset. Tensors on the policy's device."""
    input_ids: torch.Tensor  # [2B, P+T]
    attention_mask: torch.Tensor  # [2B, P+T]: 1 on the real tokens, each answer's EOS included
    T: int  # the answers' columns, the last T of each row
    weights: torch.Tensor  # [B]: what the loss counts (loss_weights), 1 a pair, 0 a tie; KTO [2B], 1 each answer
    desirable: torch.Tensor  # [2B]: KTO's labels, 1 desirable (online: the checker's verdict; offline: chosen)
    online_metrics: dict  # online: pairs, ties, the samples' accuracy (and the judge's score); offline {}
    completions: dict | None  # online: the prompts, samples and scores to log; offline None
    sampler_logprobs: torch.Tensor | None  # [2B, T] online: each sampled token's log-prob as the sampler had it


def sample_and_rank(model, tokenizer, judge_model, step_data: dict, cfg, judge_tokenizer=None) -> Pairs:
    """Online DPO's step 1 for the B prompts of step_data: two samples of each from the current
    policy, scored by the judge (the checker, or judge_model) and put in pair order, the B chosen
    rows then the B rejected (rank_pairs). A judge whose tokenizer is not the policy's (judge_tokenizer)
    reads the samples as text in its own ids (reward_model.tokenize_samples). KTO's labels are each
    row's verdict by the checker (1 right, 0 wrong)."""
    texts = [common.make_prompt(tokenizer, q, cfg.system_prompt)
             for q in step_data["question"] for _ in range(2)]  # [2B]: each prompt twice
    prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs = rollout.generate(
        model, tokenizer, texts, cfg.max_completion_length, cfg.temperature,
        return_logprobs=True)  # [2B, P], [2B, P], [2B, T] x 3
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [2B, P+T], sample a and b of each prompt
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    samples = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    answers = [a for a in step_data["answer"] for _ in range(2)]
    correct = rule_judge(samples, answers)  # [2B] 1 or 0: the samples' accuracy, and the rule judge
    judge_ids, judge_mask = reward_model.judge_rows(  # [2B, P+T]: the policy's rows, or the text in the judge's ids
        judge_tokenizer, tokenizer, [q for q in step_data["question"] for _ in range(2)], samples, input_ids,
        attention_mask, completion_ids.shape[1], cfg.system_prompt)
    scores = (correct if judge_model is None else  # [2B]
              reward_model_judge(judge_model, judge_ids, judge_mask, cfg.per_device_train_batch_size))
    common.check_finite_scores(scores, f"--judge {cfg.judge}")
    order, weights = rank_pairs(scores)  # [2B]: chosen rows then rejected rows; [B]: 0 for a tie
    order = order.to(input_ids.device)
    metrics = {"online/pairs": weights.sum().item(), "online/ties": 1 - weights.mean().item(),
               "accuracy": correct.mean().item(),  # of the samples, as grpo.py logs it
               **({"score": scores.mean().item()} if judge_model is not None else {})}
    completions = {"prompt": texts, "completion": samples, "score": scores.tolist()}
    return Pairs(input_ids[order], attention_mask[order], completion_ids.shape[1],
                 loss_weights(weights, cfg.loss_type).to(input_ids.device), correct[order.cpu()].to(input_ids.device),
                 metrics, completions, sampler_logprobs[order])


def dataset_pairs(batch: list, tokenizer, cfg, device) -> Pairs:
    """Offline DPO's step 1 for the B pairs of batch (reward_model.collate: the B chosen rows, then the
    B rejected): every pair counts (KTO: every answer), each chosen answer is desirable and each rejected
    one not (TRL's unpair_preference_dataset); no online metrics, completions or sampler's log-probs."""
    input_ids, attention_mask = (x.to(device) for x in reward_model.collate(batch, tokenizer.pad_token_id))
    T, B = max(max(len(c), len(r)) for _, c, r in batch), len(batch)
    return Pairs(input_ids, attention_mask, T, loss_weights(torch.ones(B), cfg.loss_type).to(device),
                 (torch.arange(2 * B) < B).to(device), {}, None, None)


def check_ties(run, cfg, weights):
    """Online DPO's step whose every pair is a tie, over every process, has nothing to learn
    (run.nothing_to_learn); KTO's never is, as every answer counts (loss_weights)."""
    if cfg.online and common.global_sum(weights.sum().item()) == 0:
        run.nothing_to_learn("every pair was a tie, the judge scoring both samples of each prompt the same (a higher "
                             "--temperature, or a judge with finer scores, gives pairs)")


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> float | None:
    """The mean of values [B] over the pairs that count (weights [B] of 1 and 0), over every process; None
    if none counts (the metric is left out of the step's line, not logged as 0)."""
    sums = torch.stack([(values * weights).sum(), weights.sum()]).to(distributed.get_device())  # NCCL: on the GPU
    total, count = common.global_sum(sums)
    return (total / count).item() if count > 0 else None


def without_none(metrics: dict) -> dict:
    """The metrics that have a value this step (a KTO batch with no desirable answer has no rewards/chosen)."""
    return {key: value for key, value in metrics.items() if value is not None}


@torch.no_grad()
def step_metrics(rewards, logps, lengths, weights) -> dict:
    """TRL's DPO metrics, each a mean over the step's counted pairs: rewards/chosen, rewards/rejected,
    rewards/margins (chosen - rejected), rewards/accuracies (the share where chosen's reward is the
    higher), logps/chosen, logps/rejected (summed log-probs: when both fall, the policy moves
    probability to answers that are in neither column, a known failure of DPO); completion lengths.
    weights [B]; rewards, logps, lengths [2B] (the chosen rows, then the rejected)."""
    chosen_rewards, rejected_rewards = rewards.chunk(2)
    chosen_logps, rejected_logps = logps.chunk(2)
    return without_none({"rewards/chosen": weighted_mean(chosen_rewards, weights),
                         "rewards/rejected": weighted_mean(rejected_rewards, weights),
                         "rewards/margins": weighted_mean(chosen_rewards - rejected_rewards, weights),
                         "rewards/accuracies": weighted_mean((chosen_rewards > rejected_rewards).float(), weights),
                         "logps/chosen": weighted_mean(chosen_logps, weights),
                         "logps/rejected": weighted_mean(rejected_logps, weights),
                         "completion_length": lengths.float().mean().item()})


@torch.no_grad()
def kto_metrics(rewards, logps, lengths, desirable, z0) -> dict:
    """TRL's KTO metrics: rewards/chosen and logps/chosen are means over the desirable answers,
    rewards/rejected and logps/rejected over the undesirable ones; margins their difference; kto/z0 the
    reference point (TRL's kl); kto/desirable the share of desirable answers. All [2B] but z0."""
    undesirable = 1 - desirable
    chosen, rejected = weighted_mean(rewards, desirable), weighted_mean(rewards, undesirable)
    return without_none({
        "rewards/chosen": chosen, "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected if chosen is not None and rejected is not None else None,
        "logps/chosen": weighted_mean(logps, desirable), "logps/rejected": weighted_mean(logps, undesirable),
        "kto/z0": z0.item(), "kto/desirable": desirable.mean().item(),
        "completion_length": lengths.float().mean().item()})


@torch.no_grad()
def step_log(cfg, batch: Pairs, logps, ref_logps, z0, entropy, loss, grad_norm, learning_rate,
             trained=None) -> tuple:
    """Step 5: run.end_step's arguments, the step's metrics and (online) its completions. The metrics, on
    the CPU: the loss; kto_metrics over KTO's desirable and undesirable answers, or step_metrics over
    the counted pairs, with the rewards of rewards_of; online DPO's pairs and ties; the policy's
    entropy, a mean over the answers' tokens as TRL's DPOTrainer logs it; online, the sampler's gap to the
    trainer's log-probs (trained [2B, T]: rollout.sampler_mismatch; with --steps_per_generation > 1 it also holds
    how far the policy moved since it sampled). batch: step 1's pairs; logps, ref_logps [2B]; entropy [2B, T]."""
    answer_mask = batch.attention_mask[:, -batch.T:]  # [2B, T]
    lengths = answer_mask.sum(dim=1).float()  # [2B] |y|
    rewards = rewards_of(cfg, logps, ref_logps, lengths).cpu()
    metrics = (kto_metrics(rewards, logps.cpu(), lengths.cpu(), batch.desirable.float().cpu(), z0)
               if cfg.loss_type == "kto" else step_metrics(rewards, logps.cpu(), lengths.cpu(), batch.weights.cpu()))
    entropy_sums = torch.where(answer_mask.bool(), entropy, 0.0).sum(1).cpu()  # [2B], each row's
    gap = (rollout.sampler_mismatch(trained, batch.sampler_logprobs, answer_mask)
           if batch.sampler_logprobs is not None else {})
    return ({"loss": loss.item(), **metrics, **batch.online_metrics, **gap,
             "entropy": entropy_sums.sum().item() / lengths.sum().item(),  # a token mean
             "grad_norm": grad_norm.item(), "learning_rate": learning_rate}, batch.completions)


# ---------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------
def load_data(cfg, per_step: int):
    """(offline pairs or None, online prompts or None, held-out problems): the prompts must carry gold
    answers, which the held-out accuracy (and the rule judge) check."""
    columns = common.load_split(cfg.prompts, "train", columns=()).column_names
    if "answer" not in columns or "question" not in columns:
        judge = " and --judge rule" if cfg.online and cfg.judge == "rule" else ""
        common.fail(f"--prompts {cfg.prompts} has no gold answers (it has {', '.join(columns)}): the held-out "
                    f"accuracy{judge} check answers against GSM8K's question / answer rows, such as data/arithmetic")
    prompts, test_data = common.load_splits(cfg.prompts, ("question", "answer"), cfg.num_eval_examples,
                                            per_step if cfg.online else 0)
    pairs = None if cfg.online else common.load_split(cfg.dataset, "train", ("prompt", "chosen", "rejected"))
    return pairs, (prompts if cfg.online else None), test_data


def tokenize_offline_pairs(cfg, pairs, model, tokenizer, per_step: int):
    """The shipped pairs as (prompt ids, chosen ids + EOS, rejected ids + EOS), too-long ones dropped
    (reward_model.tokenize_pairs), checked: a step's worth of them, and the longest within the context.
    Returns the pairs and the longest pair's tokens."""
    pairs = reward_model.tokenize_pairs(tokenizer, pairs, cfg.system_prompt, cfg.max_length, f"{cfg.dataset} train")
    if len(pairs) < per_step:
        common.fail(f"{cfg.dataset} has {len(pairs)} training pairs that fit in --max_length {cfg.max_length}, "
                    f"fewer than a step's --per_device_train_batch_size x --gradient_accumulation_steps ({per_step})")
    longest_pair = max(len(p) + max(len(c), len(r)) for p, c, r in pairs)
    common.check_fits_context(model, longest_pair, f"the longest pair of {cfg.dataset}")
    return pairs, longest_pair


def main(cfg: Config):
    judge_path = cfg.judge if cfg.online and cfg.judge != "rule" else ""
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset, "--prompts": cfg.prompts,
                                   "--judge": judge_path})  # settings, output folder, torchrun
    B = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # pairs per step, per process
    pairs, prompts, test_data = load_data(cfg, B)

    # models: the policy; pi_ref (a frozen copy, or LoRA switched off; SimPO needs none); the judge
    model, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first",
                                         trust_remote_code=cfg.trust_remote_code, flag="--model")
    questions = list(test_data["question"]) + (list(prompts["question"]) if cfg.online else [])
    longest = common.check_prompts_fit(model, tokenizer, questions, cfg.system_prompt, cfg.max_completion_length,
                                       cfg.prompts)
    if not cfg.online:  # (prompt ids, chosen ids + EOS, rejected ids + EOS); too-long pairs dropped
        pairs, longest_pair = tokenize_offline_pairs(cfg, pairs, model, tokenizer, B)
    judge_model = judge_tokenizer = None
    if judge_path:
        judge_model, judge_tokenizer = common.load_model(
            judge_path, scalar_head=True, reward_model=True, trust_remote_code=cfg.trust_remote_code,
            missing_hint="--judge takes 'rule' or a folder written by reward_model.py", flag="--judge")
        judge_model.to(run.device).eval().requires_grad_(False)
        if common.same_tokenizer(judge_tokenizer, tokenizer):  # Speed: it reads the policy's ids as they are
            judge_tokenizer = None
    model = run.prepare(model)  # gradient checkpointing, LoRA, device; DDP: rank 0's weights on every process
    needs_copy = cfg.loss_type != "simpo" and cfg.lora_r is None  # SimPO has no reference; LoRA's is its base
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if needs_copy else None
    run.shard(model, ref_model, judge_model)  # --fsdp: each process keeps 1/N of each model
    run.log_memory([model], [ref_model, judge_model], rows=2 * cfg.per_device_train_batch_size,
                   sequence_length=longest + cfg.max_completion_length if cfg.online else longest_pair,
                   completion_length=cfg.max_completion_length)
    learning_rate = cfg.learning_rate or (5e-5 if cfg.online else 5e-6)  # offline pairs need a gentler step
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_rate)

    def evaluate():  # held-out accuracy, greedy and sampled: run.steps calls it every --eval_steps
        return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                               cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)

    # Gradient accumulation: micro-batches of pairs, each the rows of its chosen and its rejected answers.
    micro_batches = [torch.cat([pair_ids, pair_ids + B])  # [2b] rows: the b chosen, then their b rejected
                     for pair_ids in torch.arange(B, device=run.device).split(cfg.per_device_train_batch_size)]
    for step in run.steps([model], [optimizer], [scheduler], evaluate):
        # 1. Pairs, as 2B rows [left-padded prompt | right-padded answer]: the B chosen, then the B rejected.
        if cfg.online:  # two samples of each of B prompts from the policy, ranked by the judge
            if (step - 1) % cfg.steps_per_generation == 0:  # now: the pairs of this step and the next k - 1
                step_prompts = [prompts[run.rng.sample(range(len(prompts)), B)]  # {column: [B values]} a step
                                for _ in range(cfg.steps_per_generation)]
                sampled = [sample_and_rank(model, tokenizer, judge_model, step_data, cfg, judge_tokenizer)
                           for step_data in step_prompts]
            batch = sampled.pop(0)
        else:  # B pairs of the dataset
            batch = dataset_pairs(run.rng.sample(pairs, B), tokenizer, cfg, run.device)
        check_ties(run, cfg, batch.weights)  # online DPO: a step whose every pair is a tie has nothing to learn
        temperature = cfg.temperature if cfg.online else 1.0
        answer_mask = batch.attention_mask[:, -batch.T:]  # [2B, T]
        lengths = answer_mask.sum(dim=1).float()  # [2B] |y|, EOS included

        # 2. The reference's log-probs, log pi_ref(y|x) per row [2B] (no gradient); KTO's reference point z0.
        ref_logps, z0 = reference_pass(model, ref_model, batch.input_ids, batch.attention_mask, batch.T, temperature,
                                       micro_batches, cfg.loss_type)

        # 3. The policy's log-probs, each pair's loss (KTO: each answer's), its share of the step's mean; backward.
        optimizer.zero_grad(set_to_none=True)
        step_count = common.mean_denominator(batch.weights)  # counted pairs, or answers (under torchrun: of all / N)
        loss, logps = 0.0, torch.zeros_like(lengths)  # the step's loss (the micro-batches' add up to it); logps [2B]
        entropy, trained = (torch.zeros_like(answer_mask, dtype=torch.float) for _ in range(2))  # [2B, T], metrics
        for rows in micro_batches:  # one micro-batch of pairs at a time (memory); the gradients add up
            micro_logprobs, entropy[rows] = rollout.completion_logprobs_and_entropy(
                model, batch.input_ids[rows], batch.attention_mask[rows], batch.T, temperature)  # [2b, T] each
            micro_logps = sequence_logprobs(micro_logprobs, answer_mask[rows])  # [2b]
            micro_ref = ref_logps[rows] if ref_logps is not None else None  # [2b] (SimPO has no reference)
            if cfg.loss_type == "kto":  # KTO: each answer alone, desirable or not, against the reference point z0
                micro_losses = kto_loss(micro_logps, micro_ref, batch.desirable[rows], z0, cfg.beta,
                                        cfg.desirable_weight, cfg.undesirable_weight) * batch.weights[rows]  # [2b]
            else:  # each pair: its chosen row against its rejected row (the pair's index), a tie weighing 0
                pair_weights = batch.weights[rows[: len(rows) // 2]]  # [b]
                micro_losses = pair_losses(cfg, micro_logps, micro_ref, lengths[rows]) * pair_weights
            micro_loss = micro_losses.sum() / step_count
            micro_loss.backward()  # gradients add up over the micro-batches
            loss = loss + micro_loss.detach()
            logps[rows], trained[rows] = micro_logps.detach(), micro_logprobs.detach()

        # 4. The update.
        grad_norm = run.clip_gradients(model, loss)  # DDP: averaged over processes; a NaN or inf stops here
        optimizer.step()
        scheduler.step()

        # 5. Log the metrics and (online) the samples; when due: evaluate, write the metrics line, save a checkpoint.
        run.end_step(*step_log(cfg, batch, logps, ref_logps, z0, entropy, loss, grad_norm, scheduler.get_last_lr()[0],
                               trained))

    run.finish(tokenizer, {"": model}, {"loss": ["loss"],
                                        "implicit rewards": ["rewards/chosen", "rewards/rejected", "rewards/margins"],
                                        "log-probs": ["logps/chosen", "logps/rejected"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"]},
               "Online DPO" if cfg.online else "DPO")
    return model


if __name__ == "__main__":
    main(common.parse_config(Config))
