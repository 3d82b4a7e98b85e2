"""The sampler is not the trainer (rollout.sampler_mismatch, rollout.sampler_importance_weights): the
rollout returns the log-probs it sampled from, on the CPU equal to the trainer's pass to float32
rounding on both decode paths; the mismatch metrics and the correction's weights by hand; the
correction in each script's loss, and each RL script logging the gap."""
import json
import math
import os

import pytest
import torch
from transformers import AutoConfig

import common
import grpo
import ppo
from lib import harness, rollout
from conftest import read_metrics, run_main
from floats import approx, assert_close, forward_terms, tolerance


@pytest.mark.parametrize("static_cache, drop_finished, temperature, greedy", [
    (False, True, 1.0, False), (False, False, 0.7, False), (True, False, 1.0, False), (True, False, 0.7, False),
    (False, True, 0.7, True), (True, False, 0.7, True)])
def test_sampler_logprobs_equal_the_trainers_on_the_cpu(saved_tiny, static_cache, drop_finished, temperature, greedy):
    """On the CPU the sampler is the float32 model itself (the plain loop, or decode_step on the static
    cache): its log-probs of the tokens it wrote are the trainer's pass's at the same temperature up to
    summation order (greedy rows too: the argmax scored by the tempered policy), and 0 after each row's
    EOS. return_logprobs changes no token."""
    path, tokenizer, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    prompts = [common.make_prompt(tokenizer, q) for q in ("What is 1 + 2?", "What is 47 + 85 + 1000?")
               for _ in range(4)]
    kwargs = dict(static_cache=static_cache, drop_finished=drop_finished, greedy=greedy)
    torch.manual_seed(0)
    prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs = rollout.generate(
        model, tokenizer, prompts, 16, temperature, return_logprobs=True, **kwargs)
    torch.manual_seed(0)
    *_, plain_ids, _ = rollout.generate(model, tokenizer, prompts, 16, temperature, **kwargs)
    assert torch.equal(completion_ids, plain_ids)
    assert sampler_logprobs.shape == completion_ids.shape
    real = completion_mask.bool()
    assert (sampler_logprobs[~real] == 0).all() and (sampler_logprobs[real] < 0).all()

    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, completion_ids.shape[1], temperature)
    scale = logprobs[real].abs().max().item()
    assert_close(sampler_logprobs[real], logprobs[real], terms=forward_terms(model.config), scale=scale)
    gap = rollout.sampler_mismatch(logprobs, sampler_logprobs, completion_mask)
    assert gap["sampling/sampling_logp_difference/max"] <= tolerance(forward_terms(model.config), scale)
    assert 0 <= gap["sampling/kl"] <= gap["sampling/sampling_logp_difference/max"] ** 2  # k3 ~ d^2 / 2 >= 0


def test_mismatch_metrics_by_hand():
    """d = trainer - sampler on the real tokens: [0.1, -0.3] and [0.2] (a padded token's junk ignored)."""
    trainer = torch.tensor([[-1.0, -2.3, 5.0], [-0.5, 0.0, 0.0]])
    sampler = torch.tensor([[-1.1, -2.0, 0.0], [-0.7, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    gap = rollout.sampler_mismatch(trainer, sampler, mask)
    d = [0.1, -0.3, 0.2]
    # each d is a float32 difference of log-probs up to 2.3 in size: it rounds by eps x 2.3, and so do |d| and
    # k3 = exp(d) - d - 1 (whose slope |exp(d) - 1| is below 1 here): the scale of every comparison is 2.3
    assert gap["sampling/sampling_logp_difference/mean"] == approx(0.6 / 3, scale=2.3)
    assert gap["sampling/sampling_logp_difference/max"] == approx(0.3, scale=2.3)
    assert gap["sampling/kl"] == approx(sum(math.exp(x) - x - 1 for x in d) / 3, scale=2.3)
    no_tokens = rollout.sampler_mismatch(trainer, sampler, torch.zeros_like(mask))  # every process logs the keys
    assert no_tokens == {key: 0.0 for key in gap}
    w = torch.tensor([[3.0, 0.5, 9.0], [1.5, 9.0, 9.0]])  # the weights the loss used: padding's are not counted
    with_weights = rollout.sampler_mismatch(trainer, sampler, mask, w)
    assert [with_weights[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == approx(
        [0.5, 5.0 / 3, 3.0])
    per_row = rollout.sampler_mismatch(trainer, sampler, mask, torch.tensor([[0.0], [2.0]]))  # a sequence mode's
    assert per_row["sampling/importance_sampling_ratio/mean"] == approx(1.0)


def test_importance_weights_by_hand():
    """rho = exp(trainer - sampler) per real token: [2, 0.5, 4] on row 0, [1.5, padding] on row 1."""
    sampler = torch.zeros(2, 3)
    trainer = torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.5, 9.0, 9.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])

    def weights(mode, clip_max=3.0, clip_min=None):
        return rollout.sampler_importance_weights(trainer, sampler, mask, mode, clip_max, clip_min).tolist()

    assert weights("token_truncate") == [approx([2.0, 0.5, 3.0]), approx([1.5, 1.0, 1.0])]  # TIS: min(rho, 3)
    assert weights("token_truncate", clip_min=0.8) == [approx([2.0, 0.8, 3.0]), approx([1.5, 1.0, 1.0])]
    assert weights("token_mask", clip_min=0.8) == [approx([2.0, 0.0, 0.0]), approx([1.5, 1.0, 1.0])]
    # the sequence modes: row 0's product 2 x 0.5 x 4 = 4, row 1's 1.5 (padding counts as 1)
    assert weights("sequence_truncate") == [approx([3.0]), approx([1.5])]
    assert weights("sequence_mask") == [[0.0], approx([1.5])]
    assert weights("sequence_mask", clip_max=5.0) == [approx([4.0]), approx([1.5])]
    with pytest.raises(ValueError):
        weights("token")
    exact = rollout.sampler_importance_weights(trainer, trainer.clone(), mask, "token_truncate", 3.0)
    assert torch.equal(exact, torch.ones(2, 3))  # an exact sampler: every weight 1, the loss unchanged


# A step's pi_old as the trainer computes it and as the sampler did: 3 completions of 3, 2 and 4 tokens, the ratios
# rho = pi_train / pi_sampler chosen by hand, far from 1 (above the cap 3, below the floor 0.4, in between), and
# junk on the padding (a ratio of 1e4 there if it were read). Row products: 2 x 0.25 x 5 = 2.5, 1.5 x 4 = 6,
# 0.5 x 0.5 x 0.8 x 1.25 = 0.25.
RHO = torch.tensor([[2.0, 0.25, 5.0, 1e4], [1.5, 4.0, 1e4, 1e4], [0.5, 0.5, 0.8, 1.25]])
RHO_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
RHO_TRAINER = torch.tensor([[-0.5, -2.0, -0.1, -3.0], [-1.0, -0.2, -0.7, -0.7], [-2.5, -0.05, -1.2, -0.9]])
RHO_SAMPLER = RHO_TRAINER - torch.log(RHO)  # log pi_sampler = log pi_train - log rho
# The weights of each mode at C = 3, with no floor and with c = 0.4 (padding: rho 1, within [c, C]):
HAND_WEIGHTS = {
    ("token_truncate", None): [[2.0, 0.25, 3.0, 1.0], [1.5, 3.0, 1.0, 1.0], [0.5, 0.5, 0.8, 1.25]],  # min(rho, 3)
    ("token_truncate", 0.4): [[2.0, 0.4, 3.0, 1.0], [1.5, 3.0, 1.0, 1.0], [0.5, 0.5, 0.8, 1.25]],  # clamp to [0.4, 3]
    ("token_mask", None): [[2.0, 0.25, 0.0, 1.0], [1.5, 0.0, 1.0, 1.0], [0.5, 0.5, 0.8, 1.25]],  # 0 above 3
    ("token_mask", 0.4): [[2.0, 0.0, 0.0, 1.0], [1.5, 0.0, 1.0, 1.0], [0.5, 0.5, 0.8, 1.25]],  # 0 outside [0.4, 3]
    ("sequence_truncate", None): [[2.5], [3.0], [0.25]],  # min(product, 3)
    ("sequence_truncate", 0.4): [[2.5], [3.0], [0.4]],  # the product clamped to [0.4, 3]
    ("sequence_mask", None): [[2.5], [0.0], [0.25]],  # 0 where the product is above 3
    ("sequence_mask", 0.4): [[2.5], [0.0], [0.0]],  # 0 where it is outside [0.4, 3]
}
# Tolerance of a weight: rho = exp(trainer - sampler), each log-prob up to 3.1 in size (eps x 3.1 of rounding in the
# difference, summed over up to 4 tokens in the sequence modes, then exp: ~1 ulp): about 6 roundings at the scale of
# the weight times the log-probs, 6 x 3.1 (a weight up to 6 before its cap). A wrong rule moves a weight by > 0.1.
WEIGHT_TERMS, WEIGHT_SCALE = 6, 6.0 * 3.1


@pytest.mark.parametrize("mode, clip_min", list(HAND_WEIGHTS))
def test_importance_weights_far_from_one_by_hand_in_every_mode(mode, clip_min):
    """rollout.sampler_importance_weights, as the losses call it (the mode, the cap and the floor as set), equals
    the hand table above."""
    expected = HAND_WEIGHTS[(mode, clip_min)]
    weights = rollout.sampler_importance_weights(RHO_TRAINER, RHO_SAMPLER, RHO_MASK, mode, 3.0, clip_min)
    assert_close(weights, expected, terms=WEIGHT_TERMS, scale=WEIGHT_SCALE, msg=mode)
    cfg = grpo.Config(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=clip_min)
    cfg.check_together()
    assert_close(sampler_weights(RHO_TRAINER, RHO_SAMPLER, RHO_MASK, cfg), expected, terms=WEIGHT_TERMS,
                 scale=WEIGHT_SCALE, msg=mode)


def sampler_weights(trainer_logprobs, sampler_logprobs, mask, cfg):
    """The weights' line of the scripts' loops: w at cfg's settings, None with the correction off."""
    return (rollout.sampler_importance_weights(trainer_logprobs, sampler_logprobs, mask,
                                               cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max,
                                               cfg.vllm_importance_sampling_clip_min)
            if cfg.vllm_importance_sampling_correction else None)


def grpo_step_loss(logprobs, old_logprobs, ref_logprobs, A, mask, cfg, sampler_logprobs):
    """grpo.py main()'s loss lines on one micro-batch: pi_old (old_logprobs, or pi itself at one update per batch),
    the sampler's weights from it, grpo_loss."""
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    return grpo.grpo_loss(logprobs, old, ref_logprobs, A, mask, cfg, mask,
                          sampler_weights(old, sampler_logprobs, mask, cfg))


@pytest.mark.parametrize("script, function, arguments", [
    ("grpo", "main", ["micro_old", "batch.sampler_logprobs[rows]", "loss_mask[rows]"]),
    ("grpo", "step_log", ["old", "batch.sampler_logprobs", "batch.completion_mask"]),
    ("mix", "main", ["micro_old", "sampler_logprobs[rows]", "completion_mask[rows]"]),
    ("async_rl", "trainer", ["micro_old", "sampler_logprobs[rows]", "completion_mask[rows]"]),
    ("agent", "main", ["micro_old", "episodes.sampler_logprobs[rows]", "policy_mask[rows]"]),
    ("agent", "step_log", ["old", "episodes.sampler_logprobs", "policy_mask"]),
    ("ppo", "make_experience", ["old_logprobs", "sampler_logprobs", "mask"]),
])
def test_the_loops_call_the_weights_at_their_settings(script, function, arguments):
    """Each script computes w from pi_old by the trainer, at the run's mode, cap and floor, as sampler_weights
    above: rollout.sampler_importance_weights(...) if --vllm_importance_sampling_correction else None."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(getattr(__import__(script), function)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.IfExp) and isinstance(node.body, ast.Call)
             and ast.unparse(node.body.func) == "rollout.sampler_importance_weights"]
    assert len(calls) == 1, script
    assert ast.unparse(calls[0].test) == "cfg.vllm_importance_sampling_correction"
    assert ast.unparse(calls[0].orelse) == "None"
    assert [ast.unparse(a) for a in calls[0].body.args] == arguments + [
        f"cfg.vllm_importance_sampling_{name}" for name in ("mode", "clip_max", "clip_min")]


# grpo.py's loss with the correction, one update per batch (ratio 1), beta 0, 'dapo' (one mean over the 9 tokens),
# A = [1, -2, 0.5]: each token's loss is -w A, so the loss is -sum_i A_i sum_t w_it / 9, with the floor c = 0.4:
HAND_LOSSES = {
    "token_truncate": -(5.4 - 2 * 4.5 + 0.5 * 3.05) / 9,  # row sums of w: 2 + 0.4 + 3; 1.5 + 3; 0.5 + 0.5 + 0.8 + 1.25
    "token_mask": -(2.0 - 2 * 1.5 + 0.5 * 3.05) / 9,  # 2 + 0 + 0; 1.5 + 0; 3.05
    "sequence_truncate": -(3 * 2.5 - 2 * 2 * 3.0 + 0.5 * 4 * 0.4) / 9,  # the row's weight times its tokens
    "sequence_mask": -(3 * 2.5 - 0.0 + 0.0) / 9,
}


@pytest.mark.parametrize("mode", list(HAND_LOSSES))
def test_grpos_step_loss_and_gradient_take_the_weights_of_every_mode(mode):
    """grpo.py's loss lines (grpo_step_loss) with --vllm_importance_sampling_correction (pi_old: the trainer's pass
    itself, one update per batch) on the table's log-probs: its value is HAND_LOSSES's, and its gradient
    -w_it A_i / 9 (the weight is detached: it scales the policy gradient, it has none of its own); padding gets
    none."""
    cfg = grpo.Config(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_clip_min=0.4, beta=0.0, loss_type="dapo")
    cfg.check_together()
    logprobs = RHO_TRAINER.clone().requires_grad_(True)
    A = torch.tensor([1.0, -2.0, 0.5])
    loss = grpo_step_loss(logprobs, None, None, A, RHO_MASK, cfg, RHO_SAMPLER)
    # 9 terms of size <= 2 x 3 (|A| w), each weight within the tolerance above: 9 x that bound
    assert loss.item() == approx(HAND_LOSSES[mode], terms=9 * WEIGHT_TERMS, scale=2 * WEIGHT_SCALE)
    loss.backward()
    w = torch.tensor(HAND_WEIGHTS[(mode, 0.4)]).expand(3, 4)  # a sequence mode's weight on each of its tokens
    expected = torch.where(RHO_MASK.bool(), -w * A[:, None] / 9, 0.0)
    assert_close(logprobs.grad, expected, terms=WEIGHT_TERMS + 2, scale=2 * WEIGHT_SCALE / 9)


def test_a_weight_per_completion_weighs_each_of_its_tokens():
    """The sequence modes give w [N, 1]: it scales every token of its row, in GRPO's and PPO's losses."""
    logprobs, mask = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]]), torch.ones(2, 2)
    A, w = torch.tensor([1.0, -1.0]), torch.tensor([[2.0], [0.0]])
    assert grpo.per_token_loss(logprobs, logprobs, None, A, mask, 0.2, 0.0, sampler_weights=w).tolist() == [
        approx([-2.0, -2.0]), [0.0, 0.0]]
    token_A = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    assert ppo.ppo_actor_loss(logprobs, logprobs, token_A, mask, 0.2, sampler_weights=w).item() == approx(-4.0 / 4)


def test_grpo_weighs_the_policy_term_not_the_kl():
    """l = -w min(ratio A, clip(ratio) A) + beta k3, at one update per batch (ratio 1): the weight scales the
    policy term and its gradient, the KL term stays as it was."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask, A, w = torch.ones(1, 2), torch.tensor([2.0]), torch.tensor([[3.0, 0.5]])
    loss = grpo.per_token_loss(logprobs, logprobs.detach(), ref, A, mask, 0.2, 0.1, sampler_weights=w)
    k3 = math.exp(-0.5) + 0.5 - 1  # exp(ref - logp) - (ref - logp) - 1 at the first token; 0 at the second
    assert loss.tolist() == [approx([-3.0 * 2.0 + 0.1 * k3, -0.5 * 2.0], scale=6.0)]
    loss.sum().backward()
    # d/dlogp of -w A ratio is -w A; of beta k3 is beta (1 - exp(ref - logp))
    assert logprobs.grad.tolist() == [approx([-6.0 + 0.1 * (1 - math.exp(-0.5)), -1.0], scale=6.0)]


def test_ppo_actor_loss_weighs_each_token():
    logprobs, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]])
    A, mask, w = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2), torch.tensor([[3.0, 0.5]])
    assert ppo.ppo_actor_loss(logprobs, old, A, mask, 0.2).item() == approx((-1.0 + 2.0) / 2)
    assert ppo.ppo_actor_loss(logprobs, old, A, mask, 0.2, sampler_weights=w).item() == approx((-3.0 + 1.0) / 2)


def correction_config(**changes):
    cfg = grpo.Config(vllm_importance_sampling_correction=True, beta=0.04, **changes)
    cfg.check_together()
    return cfg


def test_an_exact_sampler_leaves_grpos_loss_as_it_was():
    """With the sampler's log-probs equal to the trainer's the weights are exactly 1: the loss with the
    correction on is the loss with it off, bit for bit; a sampler that gave the tokens less probability
    raises the loss's weight on them."""
    torch.manual_seed(0)
    logprobs = -torch.rand(4, 5)
    ref, mask, A = -torch.rand(4, 5), torch.ones(4, 5), torch.tensor([1.0, -1.0, 0.5, -0.5])
    off = grpo_step_loss(logprobs, None, ref, A, mask, grpo.Config(beta=0.04), None)
    on = grpo_step_loss(logprobs, None, ref, A, mask, correction_config(), logprobs.clone())
    assert torch.equal(on, off)
    lower = grpo_step_loss(logprobs, None, ref, A[:1].expand(4), mask, correction_config(),
                           logprobs - 0.5)  # rho = e^0.5 on every token, under the cap 3
    same = grpo_step_loss(logprobs, None, ref, A[:1].expand(4), mask, grpo.Config(beta=0.04), None)
    kl = grpo.aggregate(0.04 * grpo.kl_k3(logprobs, ref), mask, "grpo")
    # terms: the 20 tokens' sum in aggregate, each weight exp(d) rounded once more than e^0.5 (d a float32
    # difference of numbers below 1.5), and the subtraction of kl
    assert (lower - kl).item() == approx(math.exp(0.5) * (same - kl).item(), terms=mask.numel() + 4)


def test_with_several_updates_the_weights_read_old_logprobs():
    """With num_iterations > 1, pi_old by the trainer is old_logprobs (computed once, before the updates), not
    the moving policy's own: the weights, and so the loss, follow old_logprobs."""
    logprobs, ref, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)
    old, A = torch.tensor([[-1.2, -1.9]]), torch.tensor([1.0])
    cfg = correction_config(num_iterations=2)
    loss = grpo_step_loss(logprobs, old, ref, A, mask, cfg, old - 0.5)  # w = e^0.5
    plain = grpo_step_loss(logprobs, old, ref, A, mask, grpo.Config(beta=0.04, num_iterations=2), None)
    assert loss.item() == approx(math.exp(0.5) * plain.item(), terms=8)


def test_the_corrections_settings_are_checked_together():
    from lib.checks import check_settings

    with pytest.raises(SystemExit):
        grpo.Config(vllm_importance_sampling_clip_max=2.0).check_together()  # without the correction
    with pytest.raises(SystemExit):
        correction_config(vllm_importance_sampling_clip_min=1.0, vllm_importance_sampling_clip_max=1.0)
    for bad in (dict(vllm_importance_sampling_clip_max=0.5), dict(vllm_importance_sampling_clip_min=1.5),
                dict(vllm_importance_sampling_mode="token")):  # an exact sampler must keep weight 1; TRL's modes
        with pytest.raises(SystemExit):
            check_settings(grpo.Config(vllm_importance_sampling_correction=True, **bad))
    check_settings(grpo.Config(vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_min=0.5))
    assert sampler_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), grpo.Config()) is None
    for script in ("ppo", "grpo", "mix", "agent"):
        assert issubclass(__import__(script).Config, harness.PolicyGradientConfig), script


def assert_float32_gap(step: dict, model_path: str):
    """A step's logged gap between sampler and trainer on the CPU: float32 rounding of one forward pass's
    sums, at the scale of a sampled token's log-prob (above -30 for the tiny model at temperature 1)."""
    config = AutoConfig.from_pretrained(model_path)
    mean, worst = step["sampling/sampling_logp_difference/mean"], step["sampling/sampling_logp_difference/max"]
    assert 0 <= mean <= worst <= tolerance(forward_terms(config), 30.0), step
    assert 0 <= step["sampling/kl"] <= worst ** 2, step  # k3 = exp(d) - d - 1 ~ d^2 / 2


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py", "mix.py"])
def test_each_policy_gradient_script_runs_the_correction(script, sft_checkpoint, tmp_path):
    """One step with --vllm_importance_sampling_correction on the CPU: it runs, and logs a float32-sized gap
    (the weights are then 1 to float32 rounding; test_an_exact_sampler_leaves_grpos_loss_as_it_was)."""
    extra = {"ppo.py": ["--reward_model", "rule", "--max_completion_length", "24"],
             "grpo.py": ["--num_generations", "4", "--max_completion_length", "24"],
             "mix.py": ["--num_generations", "4", "--per_device_train_batch_size", "32"]}[script]  # the expert data
    run_main(script, "--model", sft_checkpoint, "--max_steps", "1", "--per_device_train_batch_size", "16",
             "--eval_steps", "100", "--num_eval_examples", "8",
             "--eval_on_start", "false", "--vllm_importance_sampling_correction", "true",
             "--vllm_importance_sampling_mode", "token_mask", *extra, "--output_dir", str(tmp_path))
    step = [row for row in read_metrics(tmp_path) if "learning_rate" in row][0]  # the training step's row
    assert_float32_gap(step, sft_checkpoint)


def test_gpu_track_gap_part_runs_on_the_cpu(monkeypatch, tmp_path, sft_folder):
    """benchmarks/gpu.py's part (e) with a small layout on the CPU: each model and sampler path gives its
    gap, float32 rounding here (on the CPU the trainer's pass and the fp32 pass are one and the same);
    the runs with the correction off and on read what grpo.py logged; save() after every measurement."""
    import types

    from conftest import load_benchmark

    gpu = load_benchmark("gpu")
    runs = []

    def fake_run(script, args, output_dir, **options):  # grpo.py's metrics.jsonl, as a run writes it
        runs.append((script, "--vllm_importance_sampling_correction" in args, options))
        os.makedirs(output_dir)
        with open(os.path.join(output_dir, "metrics.jsonl"), "w") as f:
            for step in range(1, 4):
                f.write(json.dumps({"step": step, "reward": step / 2, "sampling/kl": 1e-14,
                                    "sampling/sampling_logp_difference/max": 2e-6 * step}) + "\n")
        return {"s_per_step": 1.0, "after": {"accuracy_greedy": 0.5, "accuracy_sampled": 0.25}}

    monkeypatch.setattr(gpu, "run_script", fake_run)
    small = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    saved = []
    args = types.SimpleNamespace(completions=8, max_completion_length=6, tiny_model=str(sft_folder), tis_seeds=1,
                                 rl_steps=3)
    figures = gpu.part_e(args, lambda so_far: saved.append(len(so_far["gap"]) + len(so_far["tis"])), shapes=small)
    assert [(row["model"].split(" ")[0], row["sampler"]) for row in figures["gap"]] == [
        (model, sampler) for model in ("tiny", "full", "LoRA") for sampler in ("static cache", "plain loop")]
    assert saved == list(range(1, 9))
    for row in figures["gap"]:
        config = AutoConfig.from_pretrained(sft_folder) if row["model"].startswith("tiny") else types.SimpleNamespace(
            **small)
        assert row["trainer_vs_fp32"]["max"] == 0.0, row  # no autocast on the CPU: the same pass
        assert 0 <= row["vs_trainer"]["mean"] <= row["vs_trainer"]["max"] <= tolerance(forward_terms(config), 30.0)
    assert [(on, options["no_saves"]) for _, on, options in runs] == [(False, True), (True, True)]
    assert [row["correction"] for row in figures["tis"]] == ["off", "on"]
    assert figures["tis"][0]["last_20_reward"] == approx(1.0) and figures["tis"][1]["gap_max_median"] == approx(4e-6)
    assert "| 0 | on | 50.0% | 25.0% | 1.000 |" in gpu.gap_tables(figures)


def test_benchmarks_bf16_sampler_computes_in_bf16_on_the_cpu(saved_tiny, monkeypatch):
    """benchmarks/sampler_gap.py's bf16 sampler (rollout.generate under CPU autocast, on the static cache): its
    log-probs part from the float32 trainer's by more than float32 rounding allows, so the benchmark's bf16 arms
    really sample in bf16; and the trainer's pass stays float32 (autocast is the sampler's only)."""
    from conftest import load_benchmark

    path, tokenizer, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    monkeypatch.setattr(rollout, "generate", rollout.generate)  # restored after the test
    load_benchmark("sampler_gap").bf16_sampler()
    prompts = [common.make_prompt(tokenizer, "What is 47 + 85 + 1000?")] * 8
    torch.manual_seed(0)
    prompt_ids, prompt_mask, ids, mask, sampler_logprobs = rollout.generate(model, tokenizer, prompts, 16,
                                                                            return_logprobs=True)
    assert not torch.is_autocast_enabled("cpu")
    input_ids, attention_mask = torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, mask], 1)
    with torch.no_grad():
        logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, ids.shape[1])
    assert logprobs.dtype == torch.float32
    gap = rollout.sampler_mismatch(logprobs, sampler_logprobs, mask)
    scale = logprobs[mask.bool()].abs().max().item()  # float32's bound at these log-probs' own size
    assert gap["sampling/sampling_logp_difference/max"] > tolerance(forward_terms(model.config), scale), (gap, scale)
