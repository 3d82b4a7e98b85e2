"""GRPO with process supervision (DeepSeekMath, Shao et al. 2024, section 4.1.3; docs/process.md).

grpo.py plus one idea: a reward for each step of a completion, not one for the whole. A step is a line of the
worked answer, then the answer itself (lib/steps.py). With outcome supervision (grpo.py) every token of
completion i gets the same advantage, its reward normalised over the group. With process supervision, each of
the group's step rewards is normalised over all of the group's step rewards, and a token's advantage is the sum
of the normalised rewards of the steps that end at or after it:

    R            = { r_i^(j) : every step j of every completion i of the group }
    r~_i^(j)     = (r_i^(j) - mean(R)) / (std(R) + 1e-4)
    A_i,t        = sum over the steps j of completion i with end(j) >= t of r~_i^(j)

(The paper divides by std(R); the 1e-4 and the unbiased std are TRL's, as in grpo.py, so that the twins share them.)

So the advantage changes inside an answer at each step's end: a token carries the credit of every step from its own
to the last (a right line before a slip carries the slip's blame too), where an outcome reward gives the whole
answer one number.

A step's reward r_i^(j) comes from one of two judges:

    exact labels (the default)        1 when every line so far is the solver's line, else 0; the answer step is
                                      the outcome (right number, answer closed): lib/steps.py's exact_labels
    --process_reward_model out/prm    the PRM's p_j at the step's end (prm.py): a learned judge

--process_supervision false keeps the same judge and scores the answer step alone, the outcome twin: each
completion's reward is its last step's, and every token gets its group-normalised value, grpo.py's step 3. The
twins differ in the density of the signal and in what comes with it: the process advantage's size grows with the
number of steps, and the normalisation pools steps, not answers (docs/process.md). The twin's reward is the
outcome label (1 or 0), not grpo.py's correctness plus format, whose metrics (reward, rewards/*, reward_std,
accuracy, frac_reward_zero_std: groups whose grpo.py rewards are all equal) are still logged for comparison;
steps/reward is the judge's mean over all steps (what the process arm trains on; the twin trains on the answer
steps' alone). Everything else is grpo.py's: its settings, its loop (grpo.main, given step_advantages:
process_advantages, or outcome_advantages for the twin), its loss (grpo_loss, with a token's own advantage), its
metrics; plus the step metrics (steps/carry_slip: how often the line where the careless teacher forgot the carry
is wrong, among rollouts whose lines are right up to it).

    python grpo_process.py                                         # exact step labels: out/sft -> out/grpo_process
    python grpo_process.py --process_supervision false             # the outcome twin, same judge
    python prm.py && python grpo_process.py --process_reward_model out/prm   # a learned judge

Left out, and why: DeepSeekMath's iterative RL (the PRM retrained on the policy's new samples between rounds; here
the PRM stays frozen, so whether the policy learns to please it is visible); DAPO's dynamic sampling and the
other advantage estimators (their rewards are one per completion).
"""
from dataclasses import dataclass

import torch

import common
import grpo
import prm
from lib import steps


@dataclass
class Config(grpo.Config):
    """grpo.py's settings, and the process reward's."""
    process_supervision: bool = True
    """a reward for each step, normalised over the group's steps (false: the answer step's alone, grpo.py's step 3,
    the outcome twin with the same judge)"""
    process_reward_model: str = ""
    """a PRM folder (prm.py's): its p_j at each step's end is step j's reward; unset = the exact labels (lib/steps)"""
    output_dir: str = "out/grpo_process"

    def check_together(self):
        super().check_together()
        if self.dynamic_sampling or self.advantage_estimator != "grpo" or self.scale_rewards != "group":
            common.fail("grpo_process.py normalises each step's reward over the group's steps: leave "
                        "--dynamic_sampling, --advantage_estimator and --scale_rewards at grpo.py's defaults")


def process_advantages(step_rewards: list[list[float]], step_ends: list[list[int]], group_size: int, T: int,
                       eps: float = 1e-4) -> torch.Tensor:
    """DeepSeekMath's process supervision (section 4.1.3): each step reward normalised over all the step rewards
    of its group, r~ = (r - mean(R)) / (std(R) + eps), then A_i,t = the sum of r~_i^(j) over the steps j of
    completion i that end at or after token t. step_rewards, step_ends: per completion (groups contiguous),
    one reward and one end token (lib/steps.py's end_tokens: the answer step ends at the last real token) per
    step. Returns advantages [N, T], 0 after each completion's last token. The paper divides by std(R); the eps
    and the unbiased std are TRL's (grpo.group_advantages's), kept so that the twins share them."""
    advantages = torch.zeros(len(step_rewards), T)
    for start in range(0, len(step_rewards), group_size):
        group = torch.tensor([r for rewards in step_rewards[start : start + group_size] for r in rewards])  # R
        mean, std = group.mean(), group.std() if len(group) > 1 else torch.tensor(0.0)
        for i in range(start, start + group_size):
            for reward, end in zip(step_rewards[i], step_ends[i]):
                advantages[i, : end + 1] += (reward - mean) / (std + eps)  # the tokens at or before the step's end
    return advantages


def outcome_advantages(step_rewards: list[list[float]], group_size: int, T: int) -> torch.Tensor:
    """The outcome twin: completion i's reward is its last step's; every token gets grpo.py's group-normalised
    advantage of it. -> [N, T]."""
    rewards = torch.tensor([rewards[-1] for rewards in step_rewards])  # [N]
    return grpo.group_advantages(rewards, group_size).unsqueeze(1).expand(-1, T).clone()


class StepJudge:
    """Step 2 of process supervision: each completion's steps, the token ending each, and a reward per step, from
    the exact labels or a PRM; then step 3 (process_advantages, or outcome_advantages for the twin)."""

    def __init__(self, cfg: Config):
        self.cfg, self.model = cfg, None
        if cfg.process_reward_model:  # loaded before the run starts: a wrong folder stops it before anything is written
            self.model, self.prm_tokenizer = common.load_model(
                cfg.process_reward_model, missing_hint="run `python prm.py` first", scalar_head=True,
                reward_model=True, flag="--process_reward_model", trust_remote_code=cfg.trust_remote_code)
            self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, batch: grpo.Rollout, step_data: dict, tokenizer) -> tuple[torch.Tensor, dict]:
        """Advantages [N, T] of the batch's rows (step_data: its B prompts' columns) and the step metrics."""
        G, T = self.cfg.num_generations, batch.completion_ids.shape[1]
        questions = [q for q in step_data["question"] for _ in range(G)]
        answers = [a for a in step_data["answer"] for _ in range(G)]
        exact = [steps.exact_labels(q, c, a) for q, c, a in zip(questions, batch.completions, answers)]  # [N][S_i]
        ends = steps.end_tokens(tokenizer, batch.completion_ids, batch.completion_mask,
                                [[end for _, end in steps.steps(c)] for c in batch.completions])  # [N][S_i]
        rewards = [[float(y) for y in labels] for labels in exact]
        if self.model is not None:  # the PRM's p_j at each step's end (prm.step_logits), in the policy's ids
            if not common.same_tokenizer(self.prm_tokenizer, tokenizer):
                common.fail(f"--process_reward_model {self.cfg.process_reward_model} has a tokenizer of its own, "
                            f"not --model's: it reads the policy's tokens (train it from this policy: python prm.py "
                            f"--model {self.cfg.model})")
            rewards = self.prm_rewards(batch, ends)
        advantages = (process_advantages(rewards, ends, G, T) if self.cfg.process_supervision
                      else outcome_advantages(rewards, G, T))
        return advantages * batch.completion_mask.cpu(), self.metrics(questions, batch.completions, answers, exact,
                                                                      rewards)

    def prm_rewards(self, batch: grpo.Rollout, ends: list[list[int]]) -> list[list[float]]:
        """The PRM's p_j at each step's end (prm.step_probs), reading the policy's own token ids."""
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
        self.model.to(input_ids.device)
        return prm.step_probs(self.model, input_ids, attention_mask, batch.completion_ids.shape[1], ends,
                              self.cfg.per_device_train_batch_size)

    @staticmethod
    def metrics(questions, completions, answers, exact, rewards) -> dict:
        """The step metrics: steps per completion, the mean step reward, the share of line steps the exact labels
        call right, the judge's mean reward minus the exact label (a learned judge's overrating), and the slip's
        error rate (lib/steps.py's slip_errors)."""
        lines = [(r, y) for rs, ys in zip(rewards, exact) for r, y in zip(rs[:-1], ys[:-1])]
        return {"steps/per_completion": sum(map(len, exact)) / len(exact),
                "steps/reward": sum(map(sum, rewards)) / sum(map(len, rewards)),
                "steps/lines_right": sum(y for _, y in lines) / max(1, len(lines)),
                "steps/judge_minus_exact": sum(r - y for r, y in lines) / max(1, len(lines)),
                **steps.slip_errors(questions, completions, answers)}


def main(cfg: Config):
    inputs = {"--process_reward_model": cfg.process_reward_model} if cfg.process_reward_model else {}
    return grpo.main(cfg, step_advantages=StepJudge(cfg), inputs=inputs)


if __name__ == "__main__":
    main(common.parse_config(Config))
