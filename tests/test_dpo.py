"""dpo.py: the losses by hand (values and gradients; KTO's also against TRL's formula), the implicit
rewards, the online judge and its pairs; end to end (slow): an offline run, an online run that learns,
online KTO, iterative DPO, LoRA, resume, torchrun."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

import common
import dpo
from lib import harness
import reward_model
from conftest import (ROOT, assert_same_run, read_metrics, rotated_reward_model, rotated_tokenizer, run_main,
                      tiny_reward_model, z_gain)
from floats import approx, assert_close


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --- the losses, by hand ----------------------------------------------------------------------
def test_sigmoid_loss_hand_computed_and_its_gradient_weight():
    """h = (-1 - -2) - (-3 - -2.5) = 1.5; loss = -log sigmoid(0.1 * 1.5); d loss / d log pi(y_c) =
    -beta * sigmoid(-beta h), d loss / d log pi(y_r) = +beta * sigmoid(-beta h); the reference gets none."""
    chosen = torch.tensor([-1.0, -4.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -4.0], requires_grad=True)
    ref_chosen, ref_rejected = torch.tensor([-2.0, -4.0]), torch.tensor([-2.5, -4.0])
    losses = dpo.sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1)
    # pair 0: h = 1.5; pair 1: the policy is the reference, h = 0, loss = log 2
    assert losses.tolist() == approx([math.log1p(math.exp(-0.15)), math.log(2)], terms=8)
    losses.sum().backward()
    weights = [0.1 * sigmoid(-0.15), 0.1 * 0.5]
    assert chosen.grad.tolist() == approx([-w for w in weights], terms=8, scale=0.1)
    assert rejected.grad.tolist() == approx(weights, terms=8, scale=0.1)


def test_sigmoid_loss_is_the_bradley_terry_loss_of_the_implicit_rewards():
    """note 000's -log sigmoid(r_c - r_r), with r = beta * (log pi - log pi_ref): reward_model.preference_loss."""
    import reward_model

    torch.manual_seed(0)
    logps, ref_logps = torch.randn(8) * 10, torch.randn(8) * 10
    rewards = dpo.implicit_rewards(logps, ref_logps, beta=0.3)
    assert_close(rewards, 0.3 * (logps - ref_logps), terms=2)
    losses = dpo.sigmoid_loss(*logps.chunk(2), *ref_logps.chunk(2), beta=0.3)
    assert_close(losses.mean(), reward_model.preference_loss(*rewards.chunk(2)), terms=8, scale=rewards.abs().max())


def test_ipo_loss_is_zero_at_its_target_margin_and_squared_around_it():
    """h = per-token log-ratio margin; loss = (h - 1/(2 beta))^2: 0 (and a zero gradient) at h = 5 for beta 0.1."""
    lengths_c, lengths_r = torch.tensor([2.0, 4.0]), torch.tensor([5.0, 1.0])
    # pair 0: chosen log-ratio 10 over 2 tokens (5 a token), rejected 0: h = 5 = 1 / (2 * 0.1)
    # pair 1: chosen log-ratio 4 over 4 tokens (1), rejected -1 over 1 token (-1): h = 2, loss = (2 - 5)^2 = 9
    chosen = torch.tensor([-10.0, -6.0], requires_grad=True)
    ref_chosen, rejected, ref_rejected = torch.tensor([-20.0, -10.0]), torch.tensor([-3.0, -8.0]), torch.tensor(
        [-3.0, -7.0])
    losses = dpo.ipo_loss(chosen, rejected, ref_chosen, ref_rejected, lengths_c, lengths_r, beta=0.1)
    assert losses.tolist() == approx([0.0, 9.0], terms=8, scale=9.0)
    losses.sum().backward()
    # d/d log pi(y_c) = 2 (h - 5) / |y_c|: 0 at the target, 2 * (-3) / 4 = -1.5 for pair 1
    assert chosen.grad.tolist() == approx([0.0, -1.5], terms=8, scale=1.5)


def test_simpo_loss_normalises_by_length_and_subtracts_its_margin():
    """loss = -log sigmoid(beta (log pi(y_c)/|y_c| - log pi(y_r)/|y_r|) - gamma), no reference."""
    chosen, rejected = torch.tensor([-4.0]), torch.tensor([-9.0])
    lengths_c, lengths_r = torch.tensor([2.0]), torch.tensor([3.0])
    # per token: -2 vs -3, margin 1; beta 2, gamma 0.5: -log sigmoid(2 - 0.5)
    loss = dpo.simpo_loss(chosen, rejected, lengths_c, lengths_r, beta=2.0, gamma=0.5)
    assert loss.item() == approx(math.log1p(math.exp(-1.5)), terms=8)
    # the same answers written twice as long, same log-prob per token: the same loss (DPO's sum would double)
    assert dpo.simpo_loss(2 * chosen, 2 * rejected, 2 * lengths_c, 2 * lengths_r, 2.0, 0.5).item() == approx(
        loss.item(), terms=8)
    # gamma = beta * margin: the logit is 0, loss log 2
    assert dpo.simpo_loss(chosen, rejected, lengths_c, lengths_r, 2.0, 2.0).item() == approx(math.log(2), terms=8)


def test_pair_losses_dispatch_and_rewards_per_loss_type():
    logps, ref_logps, lengths = torch.tensor([-2.0, -6.0]), torch.tensor([-3.0, -5.0]), torch.tensor([2.0, 3.0])
    cfg = dpo.Config(beta=0.5)
    losses, rewards = dpo.pair_losses(cfg, logps, ref_logps, lengths), dpo.rewards_of(cfg, logps, ref_logps, lengths)
    assert losses.tolist() == approx([-math.log(sigmoid(0.5 * 2.0))], terms=8)  # h = 1 - (-1) = 2
    assert rewards.tolist() == approx([0.5, -0.5], terms=4)
    cfg = dpo.Config(beta=0.5, loss_type="simpo", simpo_gamma=0.0)
    losses, rewards = dpo.pair_losses(cfg, logps, None, lengths), dpo.rewards_of(cfg, logps, None, lengths)
    assert rewards.tolist() == approx([-0.5, -1.0], terms=4)  # beta * log-prob per token
    assert losses.tolist() == approx([-math.log(sigmoid(0.5))], terms=8)
    cfg = dpo.Config(beta=0.5, loss_type="ipo")
    assert dpo.pair_losses(cfg, logps, ref_logps, lengths).tolist() == approx([(0.5 + 1 / 3 - 1) ** 2], terms=8)


def test_kto_loss_hand_computed_with_its_gradients():
    """beta 0.1, z0 0.5, lambda_D 2, lambda_U 1. Answer 0, desirable: r = -1 - -2 = 1, loss = 2 (1 - sigmoid(0.05)),
    d loss / d log pi = -2 * 0.1 * s (1 - s) with s = sigmoid(0.05). Answer 1, undesirable: r = -3 - -2 = -1,
    loss = 1 - sigmoid(0.1 * (0.5 + 1)) = 1 - sigmoid(0.15), d loss / d log pi = +0.1 * s (1 - s), s = sigmoid(0.15)."""
    logps = torch.tensor([-1.0, -3.0], requires_grad=True)
    ref_logps, desirable = torch.tensor([-2.0, -2.0]), torch.tensor([1.0, 0.0])
    losses = dpo.kto_loss(logps, ref_logps, desirable, torch.tensor(0.5), beta=0.1, desirable_weight=2.0,
                          undesirable_weight=1.0)
    assert losses.tolist() == approx([2 * (1 - sigmoid(0.05)), 1 - sigmoid(0.15)], terms=8, scale=2)
    losses.sum().backward()
    s0, s1 = sigmoid(0.05), sigmoid(0.15)
    assert logps.grad.tolist() == approx([-2 * 0.1 * s0 * (1 - s0), 0.1 * s1 * (1 - s1)], terms=8, scale=0.1)


def test_kto_loss_is_trls_kto_trainer_formula():
    """The loss and reference point of TRL 1.16's KTOTrainer._compute_loss (loss_type 'kto'), transcribed:
    kl = (KL_logps - ref_KL_logps).mean().clamp(min=0); chosen_losses = 1 - sigmoid(beta (chosen_logratios -
    kl)); rejected_losses = 1 - sigmoid(beta (kl - rejected_logratios)); loss = cat(desirable_weight *
    chosen_losses, undesirable_weight * rejected_losses).nanmean(). Ours, on the same numbers in a mixed order."""
    torch.manual_seed(0)
    logps, ref_logps = -10 * torch.rand(12), -10 * torch.rand(12)  # [N] log pi(y|x) of 12 answers
    kl_logps, ref_kl_logps = -10 * torch.rand(12), -10 * torch.rand(12)  # of the mismatched rows
    desirable = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1.0])
    beta, dw, uw = 0.3, 1.5, 0.8
    kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)  # TRL's, from here on
    logratios = logps - ref_logps
    chosen_losses = 1 - torch.sigmoid(beta * (logratios[desirable == 1] - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - logratios[desirable == 0]))
    trl_loss = torch.cat((dw * chosen_losses, uw * rejected_losses), 0).nanmean()
    z0 = dpo.kto_reference_point(kl_logps, ref_kl_logps)  # ours
    assert z0.item() == approx(kl.item(), terms=12, scale=10)
    ours = dpo.kto_loss(logps, ref_logps, desirable, z0, beta, dw, uw).mean()
    assert ours.item() == approx(trl_loss.item(), terms=12)


def test_kto_reference_point_is_a_mean_at_least_zero_without_gradient():
    logps = torch.tensor([-1.0, -2.0, -6.0], requires_grad=True)
    assert dpo.kto_reference_point(logps, torch.tensor([-2.0, -2.0, -9.0])).item() == approx(4 / 3, terms=3)  # 1, 0, 3
    z0 = dpo.kto_reference_point(logps, torch.tensor([-1.0, -1.0, -1.0]))  # the mean log-ratio is -7/3
    assert z0.item() == 0.0 and not z0.requires_grad


def test_kto_reference_point_under_torchrun_is_the_mean_over_every_process(monkeypatch):
    """Under torchrun z0 is the mean log-ratio of every process's mismatched rows, not of this process's:
    common.global_sum adds the other process's sum (6 over 3 rows) to this one's (-3 over 3 rows). Alone,
    this process's mean is -1 and its z0 would be 0; over both, (-3 + 6) / 6 = 0.5."""
    logps, ref_logps = torch.tensor([-3.0, -2.0, -4.0]), torch.tensor([-2.0, -2.0, -2.0])  # log-ratios -1, 0, -2
    assert dpo.kto_reference_point(logps, ref_logps).item() == 0.0  # one process
    other_process = {"sum": torch.tensor(6.0), "count": 3}  # log-ratios 3, 1, 2
    monkeypatch.setattr(common, "global_sum",
                        lambda x: x + other_process["count" if isinstance(x, int) else "sum"])
    assert dpo.kto_reference_point(logps, ref_logps).item() == 0.5  # exact: small integers and a power of two


def test_mismatched_rows_give_each_prompt_the_answer_of_the_row_before():
    """[left-padded prompt | right-padded answer] rows, 2 pairs laid out as dpo.py lays them (rows 0, 1 the
    chosen answers of prompts a, b; rows 2, 3 their rejected): each row keeps its prompt and takes the answer
    of the row before, the first the last's; no prompt meets an answer of its own."""
    P = [[0, 11], [12, 13], [0, 11], [12, 13]]  # prompts a, b, a, b (0 = padding)
    A = [[21, 0], [22, 23], [24, 0], [25, 26]]  # their answers
    ids = torch.tensor([p + a for p, a in zip(P, A)])
    mask = (ids != 0).long()
    mismatched_ids, mismatched_mask = dpo.mismatched_rows(ids, mask, T=2)
    assert mismatched_ids.tolist() == [[0, 11, 25, 26], [12, 13, 21, 0], [0, 11, 22, 23], [12, 13, 24, 0]]
    assert torch.equal(mismatched_mask, (mismatched_ids != 0).long())


def test_kto_counts_every_answer_and_its_rewards_are_the_implicit_rewards():
    """KTO's loss is per answer, each counted with weight 1 (a tied pair's two answers too), where the pair
    losses count each pair by its weight; its rewards for the metrics are DPO's implicit rewards."""
    logps, ref_logps, lengths = torch.tensor([-2.0, -6.0]), torch.tensor([-3.0, -5.0]), torch.tensor([2.0, 3.0])
    cfg = dpo.Config(beta=0.5, loss_type="kto", undesirable_weight=2.0)
    losses = dpo.kto_loss(logps, ref_logps, torch.tensor([1.0, 0.0]), torch.tensor(0.0), cfg.beta,
                          cfg.desirable_weight, cfg.undesirable_weight)
    assert losses.tolist() == approx([1 - sigmoid(0.5), 2 * (1 - sigmoid(0.5))], terms=8, scale=2)
    assert dpo.rewards_of(cfg, logps, ref_logps, lengths).tolist() == approx([0.5, -0.5], terms=4)
    pair_weights = torch.tensor([1.0, 0.0, 1.0])  # the second pair a tie
    assert dpo.loss_weights(pair_weights, "kto").tolist() == [1.0] * 6
    assert dpo.loss_weights(pair_weights, "sigmoid") is pair_weights


def test_sequence_logprobs_sum_the_real_tokens_only():
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert dpo.sequence_logprobs(logprobs, mask).tolist() == [-3.0, -0.5]


# --- online: the judge and its pairs -----------------------------------------------------------
def test_rank_pairs_orders_chosen_then_rejected_and_weighs_ties_zero():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.2, 0.7])  # 5 prompts, rows 2i and 2i + 1
    order, weights = dpo.rank_pairs(scores)
    assert order.tolist() == [0, 2, 5, 6, 9, 1, 3, 4, 7, 8]
    assert weights.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    chosen, rejected = scores[order].chunk(2)
    assert bool((chosen >= rejected).all())


def test_rule_judge_is_the_checker():
    samples = ["<think>1+1=2</think><answer>2</answer>", "<answer>3</answer>", "no answer"]
    assert dpo.rule_judge(samples, ["1+1=2\n#### 2"] * 3).tolist() == [1.0, 0.0, 0.0]


def test_a_judge_with_its_own_tokenizer_reads_the_samples_as_text():
    """A judge whose tokenizer gives other ids for the same text (here: our byte tokenizer rotated by 7,
    its embedding rows rotated with it) scores the policy's samples as the same judge with the policy's
    tokenizer does, to the bit, once they are decoded and tokenized with its own; fed the policy's ids
    as they are, it would read other tokens and score them otherwise."""
    tokenizer, rotated_tok = common.build_tokenizer(), rotated_tokenizer()
    assert common.same_tokenizer(tokenizer, common.build_tokenizer())
    assert not common.same_tokenizer(tokenizer, rotated_tok)
    judge = tiny_reward_model(tokenizer).eval()
    rotated_judge = rotated_reward_model(judge).eval()
    questions = ["What is 2 + 3?", "What is 7 - 9?"]
    completions = ["<think>2+3=5</think><answer>5</answer>", "<answer>-1</answer> and more"]
    ended = torch.tensor([True, False])  # the second was cut off: no EOS
    ids, mask = reward_model.tokenize_samples(tokenizer, questions, completions, ended, "")
    rotated_ids, rotated_mask = reward_model.tokenize_samples(rotated_tok, questions, completions, ended, "")
    assert torch.equal(mask, rotated_mask) and not torch.equal(ids, rotated_ids)
    assert ids[0, mask[0].bool()][-1] == tokenizer.eos_token_id and ids[1, -1] != tokenizer.eos_token_id
    with torch.no_grad():
        scores = reward_model.sequence_scores(judge, ids, mask)
        assert torch.equal(reward_model.sequence_scores(rotated_judge, rotated_ids, rotated_mask), scores)
        assert not torch.allclose(reward_model.sequence_scores(rotated_judge, ids, mask), scores)

    # Online DPO's step 1 with either judge: the same samples, scores, pairs and weights.
    policy = common.build_tiny_model(tokenizer).eval()
    cfg = common.parse_config(dpo.Config, ["--online", "true", "--max_completion_length", "12"])
    step_data = {"question": questions * 2, "answer": ["#### 5", "#### -2"] * 2}
    outputs = []
    for judge_model, judge_tokenizer in ((judge, tokenizer), (rotated_judge, rotated_tok)):
        torch.manual_seed(0)
        outputs.append(dpo.sample_and_rank(policy, tokenizer, judge_model, step_data, cfg, judge_tokenizer))
    a, b = outputs
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.weights, b.weights)
    assert torch.equal(a.desirable, b.desirable) and a.completions == b.completions  # the verdicts, the scores


# --- end to end --------------------------------------------------------------------------------
SHORT = ["--per_device_train_batch_size", "8", "--eval_steps", "100", "--num_eval_examples", "8",
         "--warmup_steps", "1", "--max_completion_length", "48"]


@pytest.mark.slow
def test_offline_run_changes_the_weights_and_writes_its_outputs(sft_checkpoint, tmp_path):
    """4 offline steps, 2 micro-batches each: the policy moves, and the first step's loss is log 2 (the
    policy starts as its reference, h = 0); the chosen answers' implicit reward then rises above the rejected."""
    out = str(tmp_path / "dpo")
    run_main("dpo.py", "--model", sft_checkpoint, "--output_dir", out, "--max_steps", "4",
             "--gradient_accumulation_steps", "2", "--learning_rate", "1e-4", *SHORT)
    for name in ("model.safetensors", "metrics.jsonl", "eval.json", "dpo.png", "run.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert len(rows) == 4
    assert rows[0]["loss"] == approx(math.log(2), terms=16)
    assert rows[0]["rewards/margins"] == 0.0 and rows[-1]["rewards/margins"] > 0
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert key in rows[0], key
    with open(os.path.join(out, "eval.json")) as f:
        assert set(json.load(f)) == {"accuracy_greedy", "accuracy_sampled", "n"}
    before, after = load_file(os.path.join(sft_checkpoint, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in after)


@pytest.mark.slow
def test_online_run_with_the_rule_judge_raises_the_accuracy_of_its_samples(sft_checkpoint, tmp_path):
    """30 online steps on 8 fixed problems: the share of right samples rises by more than twice its noise
    (with lr 0 this passes by chance 2.3% of the time), and ties are counted and weigh nothing."""
    data = tmp_path / "data"
    data.mkdir()
    with open(os.path.join(ROOT, "data", "arithmetic", "train.jsonl")) as f:
        rows = f.readlines()[:8]
    (data / "train.jsonl").write_text("".join(rows) * 4)
    (data / "test.jsonl").write_text("".join(rows))
    out = str(tmp_path / "online")
    run_main("dpo.py", "--model", sft_checkpoint, "--online", "true", "--prompts", str(data), "--output_dir", out,
             "--max_steps", "30", "--per_device_train_batch_size", "32", "--learning_rate", "1e-4",
             "--warmup_steps", "2", "--eval_steps", "100", "--num_eval_examples", "8")
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert len(rows) == 30
    first, last = [r["accuracy"] for r in rows[:10]], [r["accuracy"] for r in rows[-10:]]
    assert z_gain(first, last) > 2, (first, last)
    assert all(r["online/pairs"] == approx(32 * (1 - r["online/ties"]), terms=4, scale=32) for r in rows)
    from test_sampler_mismatch import assert_float32_gap

    for row in rows:  # sampled and trained in the same step (--steps_per_generation 1): float32's gap only
        assert_float32_gap(row, sft_checkpoint)
    assert os.path.isfile(os.path.join(out, "online_dpo.png")) and os.path.isfile(os.path.join(out,
                                                                                               "completions.jsonl"))


@pytest.mark.slow
def test_online_kto_starts_at_half_and_learns_from_the_checkers_labels(sft_checkpoint, tmp_path):
    """Online KTO: the policy starts as its reference, so at step 1 every log-ratio is 0, z0 is 0 and each
    answer's loss 1 - sigmoid(0) = 1/2 (weights 1): the loss is 0.5 to float precision. Every sample counts,
    ties included: kto/desirable is the share of right samples, as the checker labels them."""
    out = str(tmp_path / "kto")
    run_main("dpo.py", "--model", sft_checkpoint, "--online", "true", "--loss_type", "kto", "--output_dir", out,
             "--max_steps", "3", "--learning_rate", "1e-4", "--gradient_accumulation_steps", "2", *SHORT)
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert rows[0]["kto/z0"] == 0.0 and rows[0]["loss"] == approx(0.5, terms=16)
    assert all(row["kto/desirable"] == row["accuracy"] for row in rows)
    assert rows[-1]["loss"] != rows[0]["loss"]
    before, after = load_file(os.path.join(sft_checkpoint, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in after)


@pytest.mark.slow
def test_lora_run_saves_an_adapter_and_its_reference_is_the_adapter_switched_off(sft_checkpoint, tmp_path):
    """With LoRA, pi_ref is the policy with its adapter off: B = 0 at the start, so the first loss is log 2."""
    out = str(tmp_path / "lora")
    run_main("dpo.py", "--model", sft_checkpoint, "--output_dir", out, "--max_steps", "2", "--lora_r", "4",
             "--learning_rate", "1e-3", *SHORT)
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert rows[0]["loss"] == approx(math.log(2), terms=16) and rows[1]["loss"] != rows[0]["loss"]
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in adapter.items())


@pytest.mark.slow
@pytest.mark.parametrize("iterative", [False, True], ids=["offline", "iterative"])
def test_a_run_stopped_after_a_checkpoint_resumes_to_the_unbroken_result(sft_checkpoint, tmp_path, monkeypatch,
                                                                          iterative):
    """A crash right after the step-2 checkpoint, then --resume: the same metrics and weights as an unbroken run.
    Offline DPO, and iterative DPO with --steps_per_generation 2, which samples at steps 1 and 3 only (no
    time/generation at 2 and 4): its resume starts a round of sampling."""
    extra = ["--online", "true", "--steps_per_generation", "2"] if iterative else []
    args = ["--model", sft_checkpoint, "--max_steps", "4", "--save_steps", "2", "--eval_steps", "2", *extra, *SHORT]
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    run_main("dpo.py", *args, "--output_dir", whole)
    if iterative:
        rows = [row for row in read_metrics(whole) if "loss" in row]
        assert ["time/generation" in row for row in rows] == [True, False, True, False]
    save = harness.save_training_state

    def crash_after_step_2(run_dir, cfg, step, *rest, **kwargs):
        save(run_dir, cfg, step, *rest, **kwargs)
        if step == 2:
            raise RuntimeError("crashed after the checkpoint")

    monkeypatch.setattr(harness, "save_training_state", crash_after_step_2)
    with pytest.raises(RuntimeError, match="crashed"):
        dpo.main(dpo.common.parse_config(dpo.Config, [*args, "--output_dir", broken]))
    monkeypatch.undo()
    assert "resumed from" in run_main("dpo.py", *args, "--output_dir", broken, "--resume", "true").stdout
    assert_same_run(whole, broken)


@pytest.mark.slow
def test_torchrun_two_processes_online_end_with_identical_weights(sft_checkpoint, tmp_path):
    """Online DPO, and online KTO (whose reference point z0 sums over both processes' rows: a collective
    each must join, or the run hangs), run under torchrun and end with the same weights on both. Speed: the two
    runs share one torchrun (one start-up: tests/helpers/ddp_same_weights.py with a runs file)."""
    from test_scale import HELPERS, as_torchrun

    loss_types = ["sigmoid", "kto"]
    runs = [["dpo", "--model", sft_checkpoint, "--online", "true", "--loss_type", loss_type, "--max_steps", "2",
             "--output_dir", str(tmp_path / loss_type), *SHORT] for loss_type in loss_types]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    printed = as_torchrun(os.path.join(HELPERS, "ddp_same_weights.py"), str(tmp_path / "runs.json")).stdout
    for loss_type, output in zip(loss_types, printed.split("=== run ")[1:], strict=True):
        assert "2 processes" in output and "identical" in output, (loss_type, output)
        rows = [row for row in read_metrics(tmp_path / loss_type) if "loss" in row]
        assert len(rows) == 2, loss_type  # rank 0 alone wrote them
        assert loss_type != "kto" or (rows[0]["kto/z0"] == 0.0 and rows[0]["loss"] == approx(0.5, terms=16))
