"""Process rewards (lib/steps.py, prm.py, grpo_process.py, ppo.py --process_rewards): steps and labels by hand,
the advantages of a group worked out on paper, the masks, bad inputs, and the scripts' runs, kill and resume."""
import json
import math
import os

import pytest
import torch

import common
import grpo
import grpo_process
import ppo
import prm
from conftest import assert_same_run, run, run_main, start
from floats import approx, assert_close
from lib import harness, steps
from test_robustness import _signal_when

Q, GOLD = "What is 47 + 85?", "7+5=12\n4+8+1=13\n#### 132"
RIGHT = "<think>7+5=12\n4+8+1=13</think><answer>132</answer>"
CARRY_SLIP = "<think>7+5=12\n4+8=12</think><answer>122</answer>"  # the careless teacher's: the carry forgotten


# --- steps and their exact labels ------------------------------------------------------------
def test_a_worked_answer_splits_into_its_lines_then_the_answer():
    assert steps.steps(RIGHT) == [("7+5=12", 13), ("4+8+1=13", 22), ("</think><answer>132</answer>", len(RIGHT))]
    assert RIGHT[:13].endswith("7+5=12") and RIGHT[:22].endswith("4+8+1=13")  # each end is just after its line


def test_exact_labels_follow_the_prefix_and_the_answer_step_is_the_outcome():
    assert steps.exact_labels(Q, RIGHT, GOLD) == [1, 1, 1]
    assert steps.exact_labels(Q, CARRY_SLIP, GOLD) == [1, 0, 0]  # the slip's line, then a wrong answer
    after_slip = "<think>7+5=13\n4+8+1=13</think><answer>132</answer>"  # line 2 is the solver's, line 1 is not
    assert steps.exact_labels(Q, after_slip, GOLD) == [0, 0, 1]  # a broken prefix stays broken; the outcome is right
    assert steps.line_labels(Q, after_slip) == [0, 1]  # each line alone, whatever came before it
    unclosed = RIGHT.removesuffix("</answer>")
    assert steps.exact_labels(Q, unclosed, GOLD)[-1] == 0  # the right number, the answer not closed


def test_bad_inputs_get_a_defined_label():
    """A completion with no steps has the answer step alone; a line that is not the solver's is a wrong line."""
    assert steps.steps("") == [("", 0)] and steps.exact_labels(Q, "", GOLD) == [0]
    assert steps.exact_labels(Q, "132", GOLD) == [0, 0]  # a line '132' that is no column, then no answer
    assert steps.exact_labels(Q, "<think>carry the one</think><answer>132</answer>", GOLD) == [0, 1]
    assert steps.exact_labels(Q, "<think>\n\n</think><answer>132</answer>", GOLD) == [1]  # blank lines: no steps
    extra = "<think>7+5=12\n4+8+1=13\n0+0=0</think><answer>132</answer>"
    assert steps.exact_labels(Q, extra, GOLD) == [1, 1, 0, 1] and steps.step_kinds(Q, extra)[2] == "extra"
    with pytest.raises(SystemExit):  # not the shipped arithmetic: one sentence, no exact labels
        steps.exact_labels("How many apples?", RIGHT, "#### 3")


def test_step_kinds_say_where_the_careless_slips_sit():
    assert steps.step_kinds(Q, RIGHT) == ["no carry", "carry", "answer"]
    assert steps.slip_step(Q) == 1 and steps.slip_step("What is 11 + 81?") is None
    borrow = steps.true_lines("What is 72 - 18?")
    assert borrow == ["12-8=4", "7-1-1=5"] and steps.slip_step("What is 72 - 18?") == 1
    negative = "What is 49 - 66?"
    worked = "<think>" + "\n".join(steps.true_lines(negative)) + "</think><answer>-17</answer>"
    kinds = steps.step_kinds(negative, worked)
    assert kinds == ["sign", "no borrow", "borrow", "answer, negative"]


def test_slip_errors_count_the_slip_line_only_after_a_right_prefix():
    rates = steps.slip_errors([Q, Q, Q], [CARRY_SLIP, RIGHT, "<think>7+5=13\n4+8=12</think><answer>122</answer>"],
                              [GOLD] * 3)
    # the slip's line judged twice (the third answer broke before it): one wrong of two; other lines: 1 wrong of 3
    assert rates == {"steps/carry_slip": 0.5, "steps/other_lines": pytest.approx(1 / 3)}


def test_each_step_ends_on_the_token_holding_its_last_character_and_the_answer_on_the_last_token():
    tokenizer = common.build_tokenizer()
    ids = tokenizer(RIGHT + tokenizer.eos_token, add_special_tokens=False, return_tensors="pt")["input_ids"]
    padded = torch.cat([ids, torch.full((1, 3), tokenizer.pad_token_id)], 1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros(1, 3, dtype=torch.long)], 1)
    ends = steps.end_tokens(tokenizer, padded, mask, [[end for _, end in steps.steps(RIGHT)]])[0]
    assert [tokenizer.decode(padded[0, k]) for k in ends] == ["2", "3", tokenizer.eos_token]
    assert ends[-1] == ids.shape[1] - 1  # the EOS, before the padding
    empty = steps.end_tokens(tokenizer, torch.tensor([[tokenizer.eos_token_id]]), torch.ones(1, 1, dtype=torch.long),
                             [[0]])
    assert empty == [[0]]


# --- GRPO's process advantages, by hand -----------------------------------------------------
def test_process_advantages_of_a_group_by_hand():
    """Two completions, two steps each. R = {1, 0, 1, 1}: mean 3/4, unbiased std 1/2, so a 1 normalises to
    +1/2 and a 0 to -3/2. A token's advantage sums the normalised rewards of the steps that end at or after it."""
    rewards, ends = [[1.0, 0.0], [1.0, 1.0]], [[1, 3], [2, 4]]
    A = grpo_process.process_advantages(rewards, ends, group_size=2, T=5)
    s = 0.5 + 1e-4  # std + eps
    expected = torch.tensor([[(0.25 - 0.75) / s] * 2 + [-0.75 / s] * 2 + [0.0],
                             [0.5 / s] * 3 + [0.25 / s] * 2])
    assert_close(A, expected, terms=8)
    # the slip's tokens (row 0, tokens 2-3) carry only the wrong step's reward; before it, the right step's too
    assert A[0, 2] < A[0, 0] < 0 < A[1, 4] < A[1, 0]


def test_process_advantages_sum_to_zero_over_a_groups_steps_and_vanish_when_every_step_agrees():
    """sum over steps of r~ is 0, so the first tokens' advantages (every step counted) sum to 0 over the group."""
    rewards, ends = [[1.0, 0.0, 1.0], [0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], [[0, 2, 5], [1, 3], [0, 1, 2, 6]]
    A = grpo_process.process_advantages(rewards, ends, group_size=3, T=7)
    assert abs(A[:, 0].sum().item()) < 1e-5
    assert torch.equal(grpo_process.process_advantages([[1.0, 1.0], [1.0]], [[0, 1], [1]], 2, 3), torch.zeros(2, 3))


def test_the_outcome_twin_gives_every_token_grpos_group_advantage_of_the_last_step():
    rewards = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]  # last steps: 1, 0 | 1, 1
    A = grpo_process.outcome_advantages(rewards, group_size=2, T=3)
    expected = grpo.group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    assert torch.equal(A, expected.unsqueeze(1).expand(-1, 3))


def test_grpos_loss_takes_a_tokens_own_advantage():
    """A [N] advantage broadcast over the tokens and the same values written out as [N, T] give the same loss."""
    torch.manual_seed(0)
    logprobs, ref = -torch.rand(3, 4), -torch.rand(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    A = torch.tensor([0.5, -1.0, 2.0])
    per_row = grpo.per_token_loss(logprobs, logprobs, ref, A, mask, 0.2, 0.04)
    per_token = grpo.per_token_loss(logprobs, logprobs, ref, A.unsqueeze(1).expand(-1, 4), mask, 0.2, 0.04)
    assert torch.equal(per_row, per_token)


# --- PPO's rewards at each step's end ------------------------------------------------------
def test_ppo_puts_each_steps_reward_on_the_token_that_ends_it():
    tokenizer = common.build_tokenizer()
    texts = [RIGHT, CARRY_SLIP]
    encoded = [tokenizer(t + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, encoded))
    ids = torch.tensor([e + [tokenizer.pad_token_id] * (T - len(e)) for e in encoded])
    mask = (torch.arange(T) < torch.tensor([[len(e)] for e in encoded])).long()
    scores = ppo.process_scores(None, tokenizer, [Q, Q], texts, [GOLD, GOLD], ids, mask, mask, 8)
    # RIGHT: +1 on '2' (token 6), '3' (15) and its EOS; CARRY_SLIP: +1 on '2', -1 on the slip's '2' (13), -1 on EOS
    assert scores[0].nonzero().squeeze(1).tolist() == [6, 15, len(encoded[0]) - 1]
    assert scores[0][scores[0] != 0].tolist() == [1.0, 1.0, 1.0]
    assert scores[1].nonzero().squeeze(1).tolist() == [6, 13, len(encoded[1]) - 1]
    assert scores[1][scores[1] != 0].tolist() == [1.0, -1.0, -1.0]
    # compute_rewards adds them where they stand (clipped), with the KL term on every real token
    logprobs, ref_logprobs = -torch.rand(2, T), -torch.rand(2, T)
    rewards = ppo.compute_rewards(scores, logprobs, ref_logprobs, mask, 0.1, 5.0)
    assert torch.equal(rewards, torch.where(mask.bool(), -0.1 * (logprobs - ref_logprobs) + scores, 0.0))


# --- the PRM's loss and readings ------------------------------------------------------------
def test_prm_loss_by_hand_counts_the_real_steps_only():
    logits = torch.tensor([[0.0, 2.0, 9.0], [-1.0, 0.0, 0.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    step_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # 3 real steps; the 9.0 is padding
    loss = prm.prm_loss(logits, labels, step_mask)
    expected = (math.log(2) + math.log1p(math.exp(2)) + math.log1p(math.exp(-1))) / 3
    assert loss.item() == approx(expected, terms=8)
    loss.backward()
    assert logits.grad[0, 2] == 0 and logits.grad[1, 1] == 0  # padding gets no gradient
    assert logits.grad[0, 0].item() == approx((0.5 - 1) / 3)  # (sigmoid(z) - y) / n
    assert prm.prm_loss(logits, labels, step_mask, num_steps=6).item() == approx(expected / 2, terms=8)


def test_answer_scores_auroc_and_agreement_by_hand():
    assert prm.answer_score([0.9, 0.5]) == 0.5 and prm.answer_score([0.8, 0.6, 0.7]) == 0.6
    assert prm.answer_score([0.9, 0.5], "product") == approx(0.45)
    assert prm.auroc([0.9, 0.4, 0.4, 0.1], [1, 1, 0, 0]) == 0.875  # 3 of 4 pairs ordered, one tie: 3.5 / 4
    assert math.isnan(prm.auroc([0.3], [1]))
    table = prm.agreement([[1.0, 0.0, 1.0], [1.0, 1.0]], [[1, 1, 1], [0, 0]], [["no carry", "carry", "answer"],
                                                                             ["carry", "answer"]])
    assert table["label_steps/carry"] == 2 and table["label_agreement/carry"] == 0.0
    assert table["label_wrong_called_right/carry"] == 0.5 and table["label_right_called_wrong/carry"] == 0.5
    assert table["label_agreement/all"] == pytest.approx(1 / 3)


def test_step_logits_read_the_head_at_the_given_positions():
    """The PRM's logit at position k is the scalar head on the hidden state there, the ORM's reading at that token."""
    import reward_model

    tokenizer = common.build_tokenizer()
    from conftest import tiny_reward_model

    model = tiny_reward_model(tokenizer).eval()
    ids = tokenizer([RIGHT], add_special_tokens=False, return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    logits = prm.step_logits(model, ids, mask, torch.tensor([[3, ids.shape[1] - 1]]))
    whole = reward_model.sequence_scores(model, ids, mask)  # the last token's
    prefix = reward_model.sequence_scores(model, ids[:, :4], mask[:, :4])  # causal: position 3 sees tokens 0-3
    assert_close(logits[0], torch.stack([prefix[0], whole[0]]), terms=4 * 128)


def test_a_few_steps_of_the_prm_loss_learn_which_line_slipped():
    """The PRM's loss on a handful of answers, each step labelled: a few AdamW steps fit the labels (the loss
    falls, and every step is on the right side of 1/2), so the head reads each step's end, not the answer's."""
    from conftest import tiny_reward_model

    tokenizer = common.build_tokenizer()
    model = tiny_reward_model(tokenizer)
    questions = [Q, Q, "What is 72 - 18?", "What is 72 - 18?"]
    answers = [RIGHT, CARRY_SLIP, "<think>12-8=4\n7-1-1=5</think><answer>54</answer>",
               "<think>12-8=4\n7-1=6</think><answer>64</answer>"]
    golds = [GOLD, GOLD, "#### 54", "#### 54"]
    labels = [steps.exact_labels(q, a, g) for q, a, g in zip(questions, answers, golds)]
    assert labels == [[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    input_ids, attention_mask, positions, targets, step_mask = prm.collate(
        prm.encode(tokenizer, questions, answers, labels, ""), tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(60):
        loss = prm.prm_loss(prm.step_logits(model, input_ids, attention_mask, positions), targets, step_mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10, losses
    with torch.no_grad():
        probs = torch.sigmoid(prm.step_logits(model, input_ids, attention_mask, positions))
    assert (((probs > 0.5) == (targets > 0.5)) | ~step_mask.bool()).all(), probs


# --- the scripts ----------------------------------------------------------------------------
PRM_RUN = ["--policy_prompts", "16", "--samples_per_prompt", "2", "--per_device_train_batch_size", "8",
           "--num_eval_examples", "8", "--eval_steps", "4", "--save_steps", "2", "--max_steps", "4",
           "--warmup_steps", "1"]


@pytest.fixture(scope="module")
def prm_folder(sft_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prm"))
    run_main("prm.py", "--model", sft_checkpoint, *PRM_RUN, "--output_dir", out, "--overwrite_output_dir", "true")
    return out


@pytest.mark.slow
def test_prm_writes_a_judge_that_best_of_n_reads(sft_checkpoint, prm_folder, tmp_path):
    with open(os.path.join(prm_folder, "eval.json")) as f:
        scores = json.load(f)
    assert 0 <= scores["step_accuracy"] <= 1 and "answer_auroc/min" in scores and scores["n"] == 16
    assert prm.is_prm(prm_folder) and not prm.is_prm(sft_checkpoint)
    result = run_main("best_of_n.py", "--model", sft_checkpoint, "--judge", prm_folder, "--num_samples", "4",
                      "--num_eval_examples", "8", "--output_dir", str(tmp_path / "bon"))
    assert "best-of-4 by" in result.stdout
    failed = run("ppo.py", "--model", sft_checkpoint, "--process_rewards", "true", "--output_dir",
                 str(tmp_path / "x"), check=False)  # the default --reward_model is an outcome reward model
    assert failed.returncode == 1 and "--process_rewards reads a score at each step's end" in failed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["prm.py", "grpo_process.py", "ppo.py"])
def test_a_killed_run_resumes_to_the_unbroken_one(sft_checkpoint, prm_folder, tmp_path, script):
    """Killed (SIGKILL) after its first checkpoint, then --resumed: the same metrics and bit-identical weights as
    the unbroken run (prm.py labels its answers again at the start; the RL scripts read the PRM, frozen, at each
    step's end, and log the slip's error rate)."""
    args = {"prm.py": ["--model", sft_checkpoint, *PRM_RUN],
            "grpo_process.py": ["--model", sft_checkpoint, "--process_reward_model", prm_folder,
                                "--num_generations", "4"],
            "ppo.py": ["--model", sft_checkpoint, "--reward_model", prm_folder, "--process_rewards", "true"]}[script]
    if script != "prm.py":  # Speed: 3 steps, a checkpoint after each, one evaluation at the end on 4 problems
        args += ["--max_steps", "3", "--save_steps", "1", "--per_device_train_batch_size", "8", "--eval_steps", "3",
                 "--num_eval_examples", "4", "--eval_on_start", "false", "--warmup_steps", "1"]
    first, broken = str(tmp_path / "first"), str(tmp_path / "broken")
    run_main(script, *args, "--output_dir", first)
    _signal_when(start(script, *args, "--output_dir", broken),
                 lambda: harness.newest_checkpoint(broken) is not None)  # its first checkpoint is written
    result = run_main(script, *args, "--output_dir", broken, "--resume", "true")
    assert "resumed from" in result.stdout + result.stderr
    assert_same_run(first, broken)
    if script != "prm.py":
        with open(os.path.join(first, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        assert [row["step"] for row in rows] == [1, 2, 3] and all("steps/other_lines" in row for row in rows)
