"""mix.py: the mixed loss by hand, the batch split, the expert data, a training step, a short run."""
import json
import os

import pytest
import torch

import common
from lib import rollout
from floats import approx, assert_close, forward_terms
import grpo
import mix
import sft
from conftest import ROOT, read_metrics, run_main


def _batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g) - 0.1
    old = logprobs + 0.3 * torch.randn(B, T, generator=g)
    ref = logprobs + 0.3 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    mask[4, 2:] = 0
    return logprobs, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_mix_loss_is_grpo_loss_at_mu_0_without_expert_rows(loss_type):
    logprobs, old, ref, advantages, mask = _batch()
    no_expert = torch.zeros(len(logprobs), dtype=torch.bool)
    expected = grpo.grpo_loss(logprobs, old, ref, advantages, mask, grpo.Config(beta=0.04, loss_type=loss_type))
    got = mix.mix_loss(logprobs, old, ref, advantages, mask, no_expert,
                       mix.Config(mu=0.0, beta=0.04, loss_type=loss_type))
    assert got.item() == approx(expected.item(), terms=32)  # sums over 30 tokens
    # mu = 0 also ignores expert rows entirely, whatever they hold
    half = torch.tensor([False, False, False, True, True, True])
    got = mix.mix_loss(logprobs, old, ref, advantages, mask, half, mix.Config(mu=0.0, beta=0.04, loss_type=loss_type))
    expected = grpo.grpo_loss(logprobs[:3], old[:3], ref[:3], advantages[:3], mask[:3],
                              grpo.Config(beta=0.04, loss_type=loss_type))
    assert got.item() == approx(expected.item(), terms=32)  # sums over 30 tokens


def test_mix_loss_is_the_sft_nll_at_mu_1():
    logprobs, old, ref, advantages, mask = _batch()
    all_expert = torch.ones(len(logprobs), dtype=torch.bool)
    # 'dapo' aggregation: one token mean, exactly sft.py's loss
    got = mix.mix_loss(logprobs, old, ref, advantages, mask, all_expert,
                       mix.Config(mu=1.0, beta=0.04, loss_type="dapo"))
    assert got.item() == approx(sft.sft_loss(logprobs, mask).item(), terms=32)
    # 'grpo' aggregation: note 001's formula, the mean NLL of each answer, then over answers (by hand)
    per_answer = [-(logprobs[b, : int(mask[b].sum())].mean()) for b in range(len(logprobs))]
    got = mix.mix_loss(logprobs, old, ref, advantages, mask, all_expert,
                       mix.Config(mu=1.0, beta=0.04, loss_type="grpo"))
    assert got.item() == approx(torch.stack(per_answer).mean().item(), terms=32)


def test_mix_loss_hand_example_and_gradients():
    """Two usual rows and one expert row, one token each, ratio 1 (old = current), beta 0, mu 0.25:
    GRPO term = mean(-A_i) over the usual rows, SFT term = -logp of the expert token."""
    logprobs = torch.tensor([[-1.0], [-2.0], [-0.5]], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 7.0])  # the expert row's advantage must be ignored
    mask = torch.ones(3, 1)
    expert_mask = torch.tensor([False, False, True])
    loss = mix.mix_loss(logprobs, logprobs.detach(), None, advantages, mask, expert_mask, mix.Config(mu=0.25, beta=0.0))
    # value: 0.75 * mean(-1 * 1, -1 * -1) + 0.25 * 0.5 = 0.125
    assert loss.item() == approx(0.125)
    loss.backward()
    # d/dlogp: usual rows -(1 - mu) * A_i / 2 (policy gradient), expert row -mu (raise its likelihood)
    assert logprobs.grad.squeeze(1).tolist() == approx([-0.375, 0.375, -0.25])


def test_mix_loss_padding_junk_never_leaks():
    logprobs, old, ref, advantages, mask = _batch()
    expert_mask = torch.tensor([False, False, False, True, True, True])
    clean = mix.mix_loss(logprobs, old, ref, advantages, mask, expert_mask, mix.Config(mu=0.3, beta=0.04))
    junk = logprobs.clone()
    junk[mask == 0] = float("nan")
    old_junk = old.clone()
    old_junk[mask == 0] = float("inf")
    junk.requires_grad_(True)
    dirty = mix.mix_loss(junk, old_junk, ref, advantages, mask, expert_mask, mix.Config(mu=0.3, beta=0.04))
    assert dirty.item() == clean.item()  # junk is replaced before any arithmetic: the same ops
    dirty.backward()
    assert torch.isfinite(junk.grad).all() and (junk.grad[mask == 0] == 0).all()


def test_append_rows_keeps_the_rollout_layout():
    pad = 0
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[1, 2], [3, 0]])
    completion_mask = torch.tensor([[1, 1], [1, 0]])
    rows = [([4, 4, 4, 4], [2, 2, 2])]  # a longer prompt and a longer answer
    ids, mask, c_ids, c_mask = mix.append_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, rows, pad)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9], [4, 4, 4, 4]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    assert c_ids.tolist() == [[1, 2, 0], [3, 0, 0], [2, 2, 2]]
    assert c_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    # log-probs of the appended rows are the same as in a batch of their own (padding changes nothing)
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    model = common.build_tiny_model(tokenizer).eval()
    sampled = [tokenizer("<|im_start|>user\nWhat is 1 + 2?", add_special_tokens=False)["input_ids"], [51, 52]]
    expert = [tokenizer("<|im_start|>user\nWhat is 10 + 20?", add_special_tokens=False)["input_ids"], [53, 54, 55, 56]]
    alone_ids, alone_mask, answer_mask = sft.collate([expert], tokenizer.pad_token_id)
    alone = rollout.completion_logprobs(model, alone_ids, alone_mask, answer_mask.shape[1])
    p_ids, p_mask, c_ids, c_mask = mix.append_rows(*rollout.pad_left([sampled[0]], tokenizer.pad_token_id),
                                                   *rollout.pad_right([sampled[1]], tokenizer.pad_token_id),
                                                   [expert], tokenizer.pad_token_id)
    both = rollout.completion_logprobs(model, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1),
                                      c_ids.shape[1])
    assert_close(both[1], alone[0], terms=forward_terms(model.config))  # another batch: other padding


def test_load_expert_examples(tmp_path):
    tokenizer = common.build_tokenizer()
    examples = mix.load_expert_examples(os.path.join(ROOT, "data", "expert.jsonl"), tokenizer, 64)
    assert len(examples) == 2000
    prompt_ids, answer_ids = examples[0]
    with open(os.path.join(ROOT, "data", "expert.jsonl")) as f:
        messages = json.loads(f.readline())["messages"]
    # the prompt is the same text a rollout prompt would be; the answer ends in EOS
    assert tokenizer.decode(prompt_ids) == common.make_prompt(tokenizer, messages[0]["content"])
    assert answer_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(answer_ids[:-1]) == messages[-1]["content"]
    # a system message is part of the prompt; an answer over the length limit is dropped, as an unusable row
    # is: 1 in 101 with a count in the log, more than 1% refused
    path = tmp_path / "expert.jsonl"
    good = {"messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 1 + 1?"},
                         {"role": "assistant", "content": "<think>1+1=2</think><answer>2</answer>"}]}
    long = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "x" * 100}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in [good] * 100 + [long]))
    examples = mix.load_expert_examples(str(path), tokenizer, 64)
    assert len(examples) == 100 and tokenizer.decode(examples[0][0]).startswith("<|im_start|>system\nBe exact.")
    path.write_text("".join(json.dumps(r) + "\n" for r in [good, long]))
    with pytest.raises(SystemExit, match="1 of 2 rows are longer than --max_completion_length 64 allows"):
        mix.load_expert_examples(str(path), tokenizer, 64)


def test_expert_data_is_correct_and_disjoint_from_sft_and_test_problems():
    def questions(path, key):
        with open(path) as f:
            return [json.loads(line)[key] for line in f]
    expert = [m[0]["content"] for m in questions(os.path.join(ROOT, "data", "expert.jsonl"), "messages")]
    for other in ("demos/train.jsonl", "demos/test.jsonl"):
        assert not set(expert) & set(questions(os.path.join(ROOT, "data", other), "question")), other
    with open(os.path.join(ROOT, "data", "expert.jsonl")) as f:
        for line in f:
            user, assistant = (m["content"] for m in json.loads(line)["messages"])
            a, op, b = user.removeprefix("What is ").removesuffix("?").split()
            assert common.same_number(common.extract_answer(assistant), str(eval(f"{a}{op}{b}")))
            assert grpo.FORMAT.match(assistant)


@pytest.mark.parametrize("script", ["mix.py", "agent.py", "grpo_entropy.py"])
def test_a_script_that_extends_grpo_imports_its_functions(script):
    """The README's rule for a script that extends GRPO: it imports grpo.py and calls its functions (grpo.name), and
    defines none of them again: its own settings (Config), main and step_log, and what it adds."""
    import ast
    with open(os.path.join(ROOT, "grpo.py")) as f:
        grpos = {node.name for node in ast.parse(f.read()).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    with open(os.path.join(ROOT, script)) as f:
        tree = ast.parse(f.read())
    assert any(isinstance(node, ast.Import) and "grpo" in [a.name for a in node.names] for node in tree.body)
    own = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert own & grpos <= {"Config", "main", "step_log"}, own & grpos


@pytest.mark.slow
def test_mix_without_expert_rows_takes_grpos_step(sft_checkpoint, tmp_path):
    """mix.py with mu 0 and no expert rows is grpo.py: the same step, to the bit (weights, metrics)."""
    args = ["--model", sft_checkpoint, "--max_steps", "2", "--per_device_train_batch_size", "16",
            "--num_generations", "4", "--eval_steps", "100", "--num_eval_examples", "4", "--eval_on_start", "false"]
    run_main("grpo.py", *args, "--output_dir", str(tmp_path / "grpo"))
    run_main("mix.py", *args, "--output_dir", str(tmp_path / "mix"), "--mu", "0", "--expert_data_ratio", "0")
    from safetensors.torch import load_file
    grpo_weights, mix_weights = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("grpo", "mix"))
    assert all(torch.equal(grpo_weights[k], mix_weights[k]) for k in grpo_weights)
    grpo_rows, mix_rows = (read_metrics(str(tmp_path / name)) for name in ("grpo", "mix"))
    for grpo_row, mix_row in zip(grpo_rows, mix_rows):
        for key in ("loss", "reward", "kl", "grad_norm", "eval/accuracy_sampled"):
            assert grpo_row.get(key) == mix_row.get(key), key


@pytest.mark.slow
def test_mix_step_changes_weights_and_batch_split(sft_checkpoint, tmp_path):
    """Two steps with the default split: 96 rollout rows (12 prompts x 8) + 32 expert rows."""
    out = str(tmp_path / "mix")
    run_main("mix.py", "--model", sft_checkpoint, "--output_dir", out, "--max_steps", "2", "--warmup_steps", "1",
        "--eval_steps", "100", "--num_eval_examples", "8")
    rows = [row for row in read_metrics(out) if "reward" in row]
    assert len(rows) == 2
    assert rows[0]["usual/num_rows"] == 96 and rows[0]["expert/num_rows"] == 32  # expert_data_ratio 0.25 of 128
    for key in ("loss", "usual/loss", "expert/sft_loss", "kl", "accuracy", "reward_std", "completion_length"):
        assert key in rows[0], key
    assert rows[0]["expert/sft_loss"] > 0
    for name in ("model.safetensors", "metrics.jsonl", "eval.json", "mix.png"):
        assert os.path.isfile(os.path.join(out, name)), name
    from safetensors.torch import load_file
    before, after = (load_file(os.path.join(d, "model.safetensors")) for d in (sft_checkpoint, out))
    assert all(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_mix_with_only_the_sft_term_raises_expert_likelihood(sft_checkpoint, tmp_path):
    """mu = 1 is pure SFT on the expert rows: over a few steps their NLL falls."""
    out = str(tmp_path / "mix")
    run_main("mix.py", "--model", sft_checkpoint, "--output_dir", out, "--max_steps", "12", "--mu", "1",
        "--per_device_train_batch_size", "48", "--expert_data_ratio", "0.5", "--learning_rate", "1e-3",
        "--warmup_steps", "1", "--eval_steps", "100", "--num_eval_examples", "8", "--beta", "0")
    losses = [row["expert/sft_loss"] for row in read_metrics(out) if "expert/sft_loss" in row]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
