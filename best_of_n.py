"""Best-of-N, majority vote and pass@k: what sampling N answers and keeping one buys, with a judge or without.

Sample N answers to each held-out problem at temperature 1 (rollout.generate), grade each with the
checker (gold: right or wrong) and score it with a judge (proxy: the checker itself, a reward model
written by reward_model.py, or a process reward model written by prm.py, its steps' scores joined by
--prm_aggregate: docs/process.md), then read these off the same samples:

  1. pass@k (Chen et al. 2021, eq. 1): the chance that at least one of k answers is right. With c of n
     samples right, drawn k at a time without replacement: pass@k = 1 - C(n - c, k) / C(n, k).
     pass@1 is the sampled accuracy; pass@k at large k is what the policy can write at all. SFT
     against GRPO at k = 1..N asks whether RL sharpens what the samples already hold or adds to it
     (Yue et al. 2025).
  2. Best-of-N (Stiennon et al. 2020; Nakano et al. 2021): keep the one of N answers the judge scores
     highest. Its gold accuracy and its proxy score, for N = 1, 2, 4, ..., each the expectation over
     every N-subset of the n samples (best_of_n_expectation), not one draw. With the checker as the
     judge, best-of-N is pass@N.
  3. Its KL to the policy: KL(best-of-N || pi) = log N - (N - 1) / N, the formula of Stiennon et al. 2020
     and Gao et al. 2023 (an upper bound, Beirami et al. 2024; exact when no two samples tie). Gold and
     proxy against that KL is the over-optimisation curve of Gao et al. 2023: the proxy rises with N;
     where the gold stops following it, best-of-N is picking what the reward model overrates.
  4. Majority vote, maj@k (self-consistency, Wang et al. 2023): keep the answer most of k samples give,
     no judge at all. Right when the right answer is the most frequent of the k; a tie of t answers, one
     of them right, counts 1/t (a fair draw among them). Against pass@k (a perfect judge) and best-of-N
     by a reward model, it asks what agreement alone is worth (majority_vote_expectation).

    python best_of_n.py --model out/grpo                          # pass@k, best-of-N by the checker
    python best_of_n.py --model out/sft --judge out/rm            # best-of-N by the reward model: gold vs proxy
    python best_of_n.py --model out/sft --judge out/prm           # best-of-N by the process reward model
    python best_of_n.py --model out/sft --num_samples 16 --num_eval_examples 100   # a quick look

Writes eval.json (pass@k and maj@k for k = 1, 2, 4, ..., N; best-of-N's gold, proxy and KL for each N;
each problem's count of right answers), best_of_n.png and run.json to --output_dir, with the training scripts'
guarantees (lib/harness.py): the folder checked and locked before any sampling, an earlier evaluation replaced
only when the new one is whole. Nothing is trained.

Left out, and why: best-of-N as a training target (rejection sampling fine-tuning trains on the
kept answers; BoN distillation), a judge other than a reward model (an LLM as judge), several
processes (one process samples every problem: N x 500 answers of the tiny model take about a
minute on a CPU).
"""
import itertools
import math
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

import common
import prm
import reward_model
from lib import distributed, harness, rollout, steps
from lib.checks import check_settings
from common import setting


@dataclass
class Config:
    judge: str = "rule"
    """what picks the best of N: 'rule' (the checker), a reward model folder written by reward_model.py, or a
    process reward model folder written by prm.py (its score of an answer: --prm_aggregate of its steps' p_j)"""
    prm_aggregate: str = setting("min", lambda v: v in ("min", "product"), "min or product")
    """with a prm.py --judge: an answer's score is the minimum of its steps' p_j (Math-Shepherd) or their product
    (Lightman et al. 2023)"""
    num_samples: int = setting(64, lambda v: v >= 1, "at least 1")
    """n: answers sampled per problem; pass@k and best-of-N are read for k, N = 1, 2, 4, ... up to n"""
    # The settings a training run has too (lib/harness.py declares them, with their checks): the run's help
    # text, or the one written under the field where an evaluation differs.
    model: str = harness.run_setting("model", "out/grpo")
    """the policy to sample: a folder written by sft.py, grpo.py, ..., a hub id, or a .gguf file"""
    dataset: str = harness.run_setting("dataset")
    num_eval_examples: int = harness.run_setting("num_eval_examples")
    """held-out problems to sample (the first ones of the test split; 0: all of them)"""
    temperature: float = harness.run_setting("temperature")
    """sampling temperature of the n answers"""
    max_completion_length: int = harness.run_setting("max_completion_length")
    system_prompt: str = harness.run_setting("system_prompt")
    per_device_eval_batch_size: int = harness.run_setting("per_device_eval_batch_size")
    """answers sampled (and scored) at once"""
    seed: int = harness.run_setting("seed")
    output_dir: str = harness.run_setting("output_dir", "out/best_of_n")
    """where eval.json and best_of_n.png go"""
    overwrite_output_dir: bool = harness.run_setting("overwrite_output_dir")
    trust_remote_code: bool = harness.run_setting("trust_remote_code")

    def check_together(self):
        if self.prm_aggregate != "min" and not prm.is_prm(self.judge):
            common.fail("--prm_aggregate reads a process reward model's steps: pass a prm.py folder as --judge")


# ---------------------------------------------------------------------------------------------
# The three estimates, from one problem's n samples
# ---------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k = 1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement,
    hold at least one of the c right ones (Chen et al. 2021, eq. 1, unbiased). Computed as their
    figure 3 does, 1 - prod_{i = n-c+1..n} (1 - k / i), which never forms the huge binomials."""
    if n - c < k:  # every k-subset holds a right answer
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def best_of_n_expectation(values: list[float], scores: list[float], N: int) -> float:
    """E[value of the highest-scored of N samples drawn without replacement from these n], exactly.
    Rank the samples by score, i = 1..n from the lowest: the sample of rank i is the best of an
    N-subset when the other N - 1 come from the i - 1 below it, so it is kept in C(i-1, N-1) of the
    C(n, N) subsets: E = sum_i values_(i) C(i-1, N-1) / C(n, N), the mean over every subset without
    enumerating them. Equal scores keep the earlier sample (rank by score, then order)."""
    n = len(scores)
    ranked = sorted(range(n), key=lambda j: (scores[j], -j))  # lowest first; of equal scores the earlier ranks higher
    return sum(values[j] * math.comb(i, N - 1) for i, j in enumerate(ranked)) / math.comb(n, N)


def best_of_n_kl(N: int) -> float:
    """KL(best-of-N || pi) = log N - (N - 1) / N nats (Stiennon et al. 2020; Gao et al. 2023): 0 at N = 1,
    growing like log N. Exact when no two samples tie; an upper bound in general (Beirami et al. 2024)."""
    return math.log(N) - (N - 1) / N


def vote_key(completion: str) -> str | None:
    """The answer a sample votes for: its <answer> text read as common.same_number reads it ('1,000', '1000'
    and '1000.0' are one vote), or None (no vote) when it gives none or an empty one."""
    answer = common.extract_answer(completion)
    clean = None if answer is None else answer.replace(",", "").replace("$", "").strip().rstrip(".")
    if not clean:
        return None
    try:
        return repr(float(clean) + 0.0)  # + 0.0: '-0' and '0' are one vote, as float equality has them
    except ValueError:
        return clean


def majority_vote_expectation(votes: list, right: list[float], k: int, max_subsets: int = 4096,
                              generator: torch.Generator | None = None) -> float:
    """maj@k of one problem: E over the k-subsets of its n samples of [the subset's most frequent answer is the
    right one], a tie between t answers, the right one among them, counting 1/t. votes [n]: each sample's
    vote_key (None: no vote); right [n]: 1.0 where the sample is right (all of them vote for one key).

    Exact, over every subset, when there are at most max_subsets of them (C(n, k)); otherwise the mean over
    max_subsets subsets drawn at random without replacement within each (its standard error at most
    0.5 / sqrt(max_subsets) per problem). maj@1 = pass@1 = c / n; maj@n is the vote of all n."""
    n = len(votes)
    right_keys = {v for v, r in zip(votes, right) if r}
    if not right_keys:
        return 0.0
    keys = sorted({v for v in votes if v is not None})
    ids = torch.tensor([keys.index(v) if v is not None else len(keys) for v in votes])  # [n]; no vote: its own id
    right_id = keys.index(right_keys.pop())
    if math.comb(n, k) <= max_subsets:
        subsets = torch.tensor(list(itertools.combinations(range(n), k)), dtype=torch.long).view(-1, k)  # [S, k]
    else:
        subsets = torch.rand(max_subsets, n, generator=generator).argsort(dim=1)[:, :k]  # [S, k]
    counts = torch.zeros(len(subsets), len(keys) + 1).scatter_add_(1, ids[subsets], torch.ones(subsets.shape))
    counts = counts[:, :-1]  # [S, answers]: the no-vote column dropped
    top = counts.max(dim=1, keepdim=True).values  # [S, 1]
    leaders = (counts == top) & (top > 0)  # [S, answers]: the most frequent answers of each subset
    credit = leaders[:, right_id].double() / leaders.sum(dim=1).clamp(min=1)  # [S]: 1/t when the right one leads
    return credit.mean().item()


def powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


# ---------------------------------------------------------------------------------------------
# Sampling and judging
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def sample_and_judge(model, tokenizer, judge, judge_tokenizer, questions, answers, cfg, with_votes: bool = False):
    """The n samples of each problem: (gold [P, n] 1.0 or 0.0 by the checker, proxy [P, n] the judge's
    scores: the checker's own with --judge rule), and with_votes the answer each sample gives (votes
    [P][n], vote_key's). A judge with a tokenizer of its own reads the samples as text
    (reward_model.tokenize_samples)."""
    gold, proxy, votes = [], [], []
    problems_per_batch = max(1, cfg.per_device_eval_batch_size // cfg.num_samples)
    bar = tqdm(total=len(questions), desc="best_of_n", dynamic_ncols=True, disable=not harness.show_progress())
    for start in range(0, len(questions), problems_per_batch):
        batch_questions = questions[start: start + problems_per_batch]
        repeated = [q for q in batch_questions for _ in range(cfg.num_samples)]
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in repeated]
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(
            model, tokenizer, prompts, cfg.max_completion_length, cfg.temperature)  # [b*n, P], [b*n, T] x 2
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        right = torch.tensor([float(common.is_correct(text, answer)) for text, answer in
                              zip(texts, [a for a in answers[start: start + problems_per_batch]
                                          for _ in range(cfg.num_samples)])])
        if judge is None:
            scores = right
        elif prm.is_prm(cfg.judge):  # a PRM: its p_j at each step's end, in the policy's own ids (same tokenizer)
            ends = steps.end_tokens(tokenizer, completion_ids, completion_mask,
                                    [[end for _, end in steps.steps(text)] for text in texts])
            probs = prm.step_probs(judge, torch.cat([prompt_ids, completion_ids], 1),
                                   torch.cat([prompt_mask, completion_mask], 1), completion_ids.shape[1], ends,
                                   cfg.per_device_eval_batch_size)
            scores = torch.tensor([prm.answer_score(p, cfg.prm_aggregate) for p in probs])
        else:
            ids, mask = reward_model.judge_rows(  # the policy's rows, or the same text in the judge's own ids
                judge_tokenizer, tokenizer, repeated, texts, torch.cat([prompt_ids, completion_ids], 1),
                torch.cat([prompt_mask, completion_mask], 1), completion_ids.shape[1], cfg.system_prompt)
            scores = reward_model.sequence_scores(judge, ids, mask).float().cpu()
            common.check_finite_scores(scores, f"--judge {cfg.judge}")
        gold.append(right.view(-1, cfg.num_samples))
        proxy.append(scores.view(-1, cfg.num_samples))
        keys = [vote_key(text) for text in texts]
        votes += [keys[i: i + cfg.num_samples] for i in range(0, len(keys), cfg.num_samples)]
        bar.update(len(batch_questions))
    bar.close()
    return (torch.cat(gold), torch.cat(proxy), votes) if with_votes else (torch.cat(gold), torch.cat(proxy))


def summarise(gold: torch.Tensor, proxy: torch.Tensor, votes: list | None = None) -> dict:
    """The means over problems of pass@k, of maj@k (given the votes) and of best-of-N's gold, proxy and KL,
    for k, N = 1, 2, 4, ..., n; and c, the right answers of each problem (which problems a model never
    solves, and which it always does). maj@k's random subsets come from a generator of their own, seeded 0."""
    n = gold.shape[1]
    right = gold.sum(dim=1).long().tolist()  # c of each problem
    gold_rows, proxy_rows = gold.tolist(), proxy.tolist()
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    majority = {"maj@k": {str(k): mean([majority_vote_expectation(v, g, k, generator=generator)
                                        for v, g in zip(votes, gold_rows)]) for k in powers_of_two(n)}} if votes else {}
    return {
        "pass@k": {str(k): mean([pass_at_k(n, c, k) for c in right]) for k in powers_of_two(n)},
        **majority,
        "best_of_n": {str(N): {"gold": mean([best_of_n_expectation(g, p, N) for g, p in zip(gold_rows, proxy_rows)]),
                               "proxy": mean([best_of_n_expectation(p, p, N) for p in proxy_rows]),
                               "kl": best_of_n_kl(N)} for N in powers_of_two(n)},
        "n": len(right), "num_samples": n, "right_per_problem": right}


def plot(results: dict, path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    ks = [int(k) for k in results["pass@k"]]
    left.plot(ks, [100 * v for v in results["pass@k"].values()], marker="o", label="pass@k: the checker picks")
    if results["judge"] != "rule":
        left.plot(ks, [100 * row["gold"] for row in results["best_of_n"].values()], marker="s", color="tab:green",
                  label="best of k by the judge")
    if "maj@k" in results:
        left.plot(ks, [100 * v for v in results["maj@k"].values()], marker="^", color="tab:purple",
                  label="maj@k: the most given answer")
    left.set(xscale="log", xlabel="k (answers sampled)", ylabel="the kept answer right (%)",
             title="one answer kept of k")
    left.set_xticks(ks, [str(k) for k in ks])
    left.legend(fontsize=7)
    rows = results["best_of_n"].values()
    kl = [row["kl"] for row in rows]
    right.plot(kl, [100 * results["pass@k"][N] for N in results["best_of_n"]], linestyle="--", color="tab:gray",
               label="judged by the checker (= pass@N)")
    right.plot(kl, [100 * results["pass@k"]["1"]] * len(kl), linestyle=":", color="black",
               label="one of N at random (= pass@1)")
    right.plot(kl, [100 * row["gold"] for row in rows], marker="o", color="tab:green",
               label=f"judged by {'the checker' if results['judge'] == 'rule' else 'the judge'}: gold")
    right.set(xlabel="KL(best-of-N || policy), nats", ylabel="accuracy of the kept answer (%)",
              title="best-of-N: the kept answer")
    if results["judge"] != "rule":
        proxy = right.twinx()
        proxy.plot(kl, [row["proxy"] for row in rows], marker="s", color="tab:red", label="proxy: judge's score")
        proxy.set_ylabel("judge's score of the kept answer")
        proxy.legend(loc="lower right", fontsize=8)
    right.legend(loc="upper left", fontsize=7)
    for N, row in results["best_of_n"].items():
        right.annotate(f"N={N}", (row["kl"], 100 * row["gold"]), fontsize=7, xytext=(2, -9),
                       textcoords="offset points")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    harness.save_figure(fig, path)  # whole or not at all


def short(path: str) -> str:
    """A path's last two parts (out/syllabus/sft/0 -> sft/0), for a title."""
    return "/".join(os.path.normpath(path).split(os.sep)[-2:])


def main(cfg: Config):
    check_settings(cfg)
    # The output folder as a training run has it (harness): checked and locked before any sampling, an
    # earlier evaluation replaced only when the new one is whole, run.json listing what was written.
    inputs = {"--model": cfg.model, "--dataset": cfg.dataset, **({"--judge": cfg.judge} if cfg.judge != "rule" else {})}
    record = harness.run_record(cfg, inputs)
    out = harness.prepare_output_dir(cfg, inputs, record)  # --output_dir, or its .next_run over an earlier one
    common.set_seed(cfg.seed)
    device = distributed.get_device()
    test = common.load_splits(cfg.dataset, ("question", "answer"), cfg.num_eval_examples)[1]
    model, tokenizer = common.load_model(cfg.model, missing_hint="run `python sft.py` first",
                                         trust_remote_code=cfg.trust_remote_code, flag="--model")
    common.check_prompts_fit(model, tokenizer, list(test["question"]), cfg.system_prompt, cfg.max_completion_length,
                             cfg.dataset)
    judge = judge_tokenizer = None
    if cfg.judge != "rule":
        judge, judge_tokenizer = common.load_model(
            cfg.judge, scalar_head=True, reward_model=True, trust_remote_code=cfg.trust_remote_code,
            missing_hint="--judge takes 'rule' or a folder written by reward_model.py", flag="--judge")
        judge.to(device).eval()
        if common.same_tokenizer(judge_tokenizer, tokenizer):  # Speed: it reads the policy's ids as they are
            judge_tokenizer = None
        elif prm.is_prm(cfg.judge):
            common.fail(f"--judge {cfg.judge} is a process reward model on a tokenizer of its own: it reads the "
                        f"policy's tokens, so train it from this policy (python prm.py --model {cfg.model})")
    model.to(device).eval()

    gold, proxy, votes = sample_and_judge(model, tokenizer, judge, judge_tokenizer, list(test["question"]),
                                          list(test["answer"]), cfg, with_votes=True)
    results = {**summarise(gold, proxy, votes), "model": cfg.model, "judge": cfg.judge, "temperature": cfg.temperature}

    harness.start_output_dir(out, metrics=False)
    harness.write_json(os.path.join(out, "eval.json"), results)
    plot(results, os.path.join(out, "best_of_n.png"),
         f"{short(cfg.model)}: {cfg.num_samples} samples of each of {results['n']} held-out problems at temperature "
         f"{cfg.temperature:g}; best of N by {short(cfg.judge) if judge is not None else 'the checker'}")
    harness.finish_output_dir(out, cfg, record)  # run.json; over an earlier evaluation: it moves in now
    out = cfg.output_dir
    top = str(cfg.num_samples)
    common.log(f"{cfg.model}: pass@1 {100 * results['pass@k']['1']:.1f}%, pass@{top} "
               f"{100 * results['pass@k'][top]:.1f}%, maj@{top} {100 * results['maj@k'][top]:.1f}%; "
               f"best-of-{top} by {cfg.judge}: "
               f"{100 * results['best_of_n'][top]['gold']:.1f}% right at KL {results['best_of_n'][top]['kl']:.2f} "
               f"(n={results['n']}); written to {out}/eval.json and {out}/best_of_n.png")
    return results


if __name__ == "__main__":
    main(common.parse_config(Config))
