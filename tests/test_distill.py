"""distill.py: the divergences against hand-worked numbers and TRL's own loss, their gradient, and the script."""
import copy
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import common
import distill
from conftest import rotated_tokenizer, run, run_main
from floats import assert_close
from test_common import damaged_copy

P_S, P_T = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])  # one position, a vocabulary of two


def test_the_three_divergences_by_hand():
    """p_s = (0.5, 0.5), p_t = (0.9, 0.1):
    reverse KL(p_s || p_t) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5 (-0.58779) + 0.5 (1.60944) = 0.51083
    forward KL(p_t || p_s) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.52901 - 0.16094 = 0.36806
    beta 0.5: m = (0.7, 0.3); 0.5 KL(p_t || m) + 0.5 KL(p_s || m) = 0.5 (0.11632) + 0.5 (0.08718) = 0.10175
    beta 0.25: m = 0.25 p_t + 0.75 p_s = (0.6, 0.4): 0.07188 (the weight beta sits on the teacher)."""
    log_s, log_t = P_S.log().view(1, 1, 2), P_T.log().view(1, 1, 2)
    for beta, expected in ((1.0, 0.5108256), (0.0, 0.3680642), (0.5, 0.1017492), (0.25, 0.0718805)):
        assert_close(distill.generalized_jsd(log_s, log_t, beta), [[expected]], terms=20, scale=1.0, msg=f"beta {beta}")


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                             reduction="batchmean"):
    """TRL's GKDTrainer.generalized_jsd_loss as written at commit f2cd577 (trl/experimental/gkd/gkd_trainer.py),
    without its num_items_in_batch branch: the reference distill.py's loss must equal."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]), dim=0)
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if reduction == "batchmean":
        denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
        return jsd.sum() / denom
    raise ValueError(reduction)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_loss_equals_trls(beta, temperature):
    """The token mean of the divergence over the completion tokens, with padding (TRL's labels -100) left
    out: the same number as TRL's loss on the same logits, at every beta and temperature."""
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11) * 2, torch.randn(3, 5, 11) * 2  # [N, T, V]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    labels = torch.where(mask.bool(), 1, -100)
    ours = distill.distill_loss(torch.log_softmax(student / temperature, -1),
                                torch.log_softmax(teacher / temperature, -1), mask, beta)
    theirs = trl_generalized_jsd_loss(student, teacher, labels, beta, temperature)
    assert_close(ours, theirs, terms=10 * 11 * 8, scale=1.0)
    assert ours > 0.05  # distributions this far apart: a real divergence, not 0 against 0


def test_the_reverse_kl_gradient_by_hand():
    """d KL(softmax(z) || q) / dz_v = p_v (log p_v - log q_v - KL): the student's logits move each token's
    probability by how much more it holds than the teacher gives it, relative to the KL."""
    z = torch.tensor([0.3, -1.2, 2.0, 0.5], requires_grad=True)
    log_q = torch.log_softmax(torch.tensor([1.0, 0.0, 0.5, -0.5]), -1)
    log_p = torch.log_softmax(z, -1)
    kl = distill.generalized_jsd(log_p.view(1, 1, 4), log_q.view(1, 1, 4), 1.0).sum()
    kl.backward()
    p = log_p.exp().detach()
    expected = p * (log_p.detach() - log_q - kl.detach())
    assert_close(z.grad, expected, terms=40, scale=1.0)
    assert z.grad.abs().max() > 0.1


def test_a_student_that_is_the_teacher_has_nothing_to_learn():
    """Equal distributions: every divergence is 0, and so is the gradient, at every beta."""
    for beta in (0.0, 0.5, 1.0):
        z = torch.randn(2, 3, 7, requires_grad=True)
        loss = distill.distill_loss(torch.log_softmax(z, -1), torch.log_softmax(z.detach(), -1), torch.ones(2, 3), beta)
        loss.backward()
        assert abs(loss.item()) < 1e-6 and z.grad.abs().max() < 1e-6


def test_padding_never_reaches_the_loss():
    """Whatever the two models put at the padded positions, the loss and its gradient are the same."""
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    student, teacher = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    losses, grads = [], []
    for junk in (0.0, 30.0):
        s = torch.where(mask.bool().unsqueeze(-1), student, junk).requires_grad_(True)
        t = torch.where(mask.bool().unsqueeze(-1), teacher, -junk)
        loss = distill.distill_loss(torch.log_softmax(s, -1), torch.log_softmax(t, -1), mask, 1.0)
        loss.backward()
        losses.append(loss.item())
        grads.append(s.grad[mask.bool()])
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])


def test_micro_batches_add_up_to_the_step():
    """Each micro-batch divides by the step's token count, so their losses add up to the whole step's."""
    torch.manual_seed(2)
    s, t = torch.log_softmax(torch.randn(4, 6, 9), -1), torch.log_softmax(torch.randn(4, 6, 9), -1)
    mask = (torch.rand(4, 6) > 0.3).long()
    whole = distill.distill_loss(s, t, mask, 1.0)
    parts = sum(distill.distill_loss(s[rows], t[rows], mask[rows], 1.0, step_mask=mask) for rows in ([0, 1], [2, 3]))
    assert_close(parts, whole, terms=24 * 9 * 8)


def test_steps_on_the_loss_bring_the_student_to_the_teacher(saved_tiny):
    """Ten AdamW steps on the reverse KL to another random tiny model, on fixed sequences: the divergence falls
    by more than half, and the teacher's weights do not move."""
    _, tokenizer, _ = saved_tiny
    torch.manual_seed(3)
    student, teacher = common.build_tiny_model(tokenizer), common.build_tiny_model(tokenizer).eval()
    teacher_before = [p.detach().clone() for p in teacher.parameters()]
    input_ids = torch.randint(0, 256, (4, 12))
    mask, T = torch.ones(4, 12, dtype=torch.long), 6
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        with torch.no_grad():
            teacher_logprobs = distill.token_logprobs(teacher, input_ids, mask, T, 1.0)
        loss = distill.distill_loss(distill.token_logprobs(student, input_ids, mask, T, 1.0), teacher_logprobs,
                                    mask[:, -T:], 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(a, b) for a, b in zip(teacher_before, teacher.parameters()))


def test_token_logprobs_hold_the_sampled_tokens_logprobs(saved_tiny):
    """The column of the sampled token in token_logprobs' [N, T, V] is rollout.completion_logprobs' [N, T]."""
    from lib import rollout

    _, tokenizer, model = saved_tiny
    torch.manual_seed(4)
    input_ids = torch.randint(0, 256, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded prompt
    with torch.no_grad():
        full = distill.token_logprobs(model, input_ids, mask, 4, 1.0)
        sampled = rollout.completion_logprobs(model, input_ids, mask, 4, length_chunks=1, share_prompts=False)
    assert_close(full.gather(-1, input_ids[:, -4:].unsqueeze(-1)).squeeze(-1), sampled, terms=2 * 128, scale=8.0)


@pytest.mark.slow
def test_the_script_trains_and_writes_its_run(sft_checkpoint, saved_tiny, tmp_path):
    """Two steps from the short SFT model toward another model: the weights change, the metrics hold the
    divergence and the sampled tokens, the output folder has its files."""
    teacher_path, _, _ = saved_tiny
    out = str(tmp_path / "distill")
    run_main("distill.py", "--model", sft_checkpoint, "--teacher_model_name_or_path", str(teacher_path),
             "--max_steps", "2", "--per_device_train_batch_size", "16", "--eval_steps", "2",
             "--num_eval_examples", "8", "--output_dir", out)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [row for row in rows if "loss" in row]
    assert len(train) == 2 and all(row["loss"] > 0 and row["sampled_tokens"] > 16 for row in train)
    from test_sampler_mismatch import assert_float32_gap

    for row in train:  # the student's sampled tokens: the sampler's log-probs against the training pass's
        assert_float32_gap(row, sft_checkpoint)
    assert {"model.safetensors", "eval.json", "distillation.png", "run.json"} <= set(os.listdir(out))
    from safetensors.torch import load_file

    before, after = load_file(os.path.join(sft_checkpoint, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_refused(sft_checkpoint, saved_tiny, tmp_path):
    """Token-by-token distributions need one vocabulary: another tokenizer is one sentence, a non-zero exit."""
    _, _, model = saved_tiny
    teacher = tmp_path / "rotated"
    model.save_pretrained(teacher)
    rotated_tokenizer().save_pretrained(teacher)
    result = run("distill.py", "--model", sft_checkpoint, "--teacher_model_name_or_path", str(teacher),
                 "--max_steps", "1", "--output_dir", str(tmp_path / "out"), check=False)
    assert result.returncode != 0 and "another tokenizer" in result.stderr and "Traceback" not in result.stderr


QUICK = ["--max_steps", "1", "--per_device_train_batch_size", "8", "--num_eval_examples", "4"]


@pytest.mark.parametrize("flag", ["--model", "--teacher_model_name_or_path"])
def test_a_model_with_non_finite_weights_is_named_by_its_flag(saved_tiny, tmp_path, flag):
    """A damaged student or teacher stops the run before training in one sentence naming that model's flag, not
    the first step's NaN loss (which could not say which model gave it)."""
    broken = str(damaged_copy(saved_tiny[0], tmp_path / "broken"))
    models = {"--model": str(saved_tiny[0]), "--teacher_model_name_or_path": str(saved_tiny[0]), flag: broken}
    with pytest.raises(SystemExit) as stop:
        distill.main(common.parse_config(distill.Config, [*[w for pair in models.items() for w in pair], *QUICK,
                                                          "--output_dir", str(tmp_path / "out")]))
    text = str(stop.value.code)
    assert text.startswith(f"error: the model at {broken} ({flag}) holds NaN or infinite values in 2 of its "), text
    assert "\n" not in text and not os.path.exists(tmp_path / "out" / "model.safetensors")


NOTHING_TO_LEARN = ("equal distributions are the divergence's minimum, so its loss and gradient are 0 at every token "
                    "and there is nothing to learn; pass a teacher trained beyond the student as "
                    "--teacher_model_name_or_path (e.g. out/grpo)")


def test_a_teacher_that_is_the_student_is_refused(saved_tiny, tmp_path):
    """`python distill.py --model M --teacher_model_name_or_path M`: a zero loss at every step, so one sentence
    and a non-zero exit before training, and no model written."""
    student, out = str(saved_tiny[0]), tmp_path / "out"
    result = run("distill.py", "--model", student, "--teacher_model_name_or_path", student, *QUICK,
                 "--output_dir", str(out), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: the teacher {student} holds the same weights as the student {student}: {NOTHING_TO_LEARN}")
    assert not os.path.exists(out / "model.safetensors")


def test_a_teacher_copied_from_the_student_is_refused(saved_tiny, tmp_path):
    """The student's weights in another folder are the student too: the tensors are compared, not the paths.
    One value changed makes it another model."""
    student, copied, out = str(saved_tiny[0]), str(tmp_path / "copied"), tmp_path / "out"
    shutil.copytree(student, copied)
    with pytest.raises(SystemExit) as stop:
        distill.main(common.parse_config(distill.Config, ["--model", student, "--teacher_model_name_or_path", copied,
                                                          *QUICK, "--output_dir", str(out)]))
    assert str(stop.value.code) == (
        f"error: the teacher {copied} holds the same weights as the student {student}: {NOTHING_TO_LEARN}")
    assert not os.path.exists(out / "model.safetensors")
    model = saved_tiny[2]
    other = copy.deepcopy(model)
    assert distill.same_weights(model, other)
    with torch.no_grad():
        other.model.norm.weight[0] += 1e-3
    assert not distill.same_weights(model, other)
