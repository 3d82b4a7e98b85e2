"""Tokenizer round trip, data parsing, and that log-probs line up with what generation sampled."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from floats import assert_close, forward_terms, tolerance

TEXTS = [
    "What is 47 + 85?",
    "  two spaces,\nnewlines\n\n and\ttabs  ",
    "<think>7+5=12\n4+8+1=13</think><answer>132</answer>",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "unicode: é ö 中文 🙂",
]


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A freshly built tiny model + tokenizer saved to disk, as sft.py does."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = common.build_tokenizer()
    torch.manual_seed(0)
    model = common.build_tiny_model(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer, model


def test_tokenizer_is_byte_level():
    tokenizer = common.build_tokenizer()
    assert tokenizer("Hé", add_special_tokens=False)["input_ids"] == list("Hé".encode())
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_tokenizer_round_trip_through_autotokenizer(saved_tiny):
    path, tokenizer, _ = saved_tiny
    reloaded = AutoTokenizer.from_pretrained(path)
    assert reloaded.padding_side == "left"
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert reloaded(text, add_special_tokens=False)["input_ids"] == ids
        assert reloaded.decode(ids) == text
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(reloaded, name) == getattr(tokenizer, name)
    assert len({tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}) == 3
    assert reloaded.chat_template == tokenizer.chat_template
    # load_model (what the RL scripts call) gives the same tokenizer
    _, loaded = common.load_model(str(path))
    expected = tokenizer(TEXTS[1], add_special_tokens=False)["input_ids"]
    assert loaded(TEXTS[1], add_special_tokens=False)["input_ids"] == expected


def test_format_tags_are_single_tokens_and_survive_decoding():
    tokenizer = common.build_tokenizer()
    ids = tokenizer("<think>1</think><answer>2</answer>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6
    text = tokenizer.decode(ids + [tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True)
    assert text == "<think>1</think><answer>2</answer>"


def test_chat_template():
    tokenizer = common.build_tokenizer()
    prompt = common.make_prompt(tokenizer, "What is 1 + 2?")
    assert prompt == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    with_system = common.make_prompt(tokenizer, "Q", system_prompt="S")
    assert with_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_model_size():
    n = sum(p.numel() for p in common.build_tiny_model(common.build_tokenizer()).parameters())
    assert 0.9e6 < n < 1.3e6


# --- answer parsing --------------------------------------------------------------------------
def test_split_gsm8k_answer():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"
    assert common.split_gsm8k_answer(answer) == ("Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72.", "72")


@pytest.mark.parametrize(
    "completion, answer, correct",
    [
        ("<think>x</think><answer>132</answer>", "... #### 132", True),
        ("<think>x</think><answer> 1,000 </answer>", "#### 1000", True),
        ("<think>x</think><answer>-33</answer>", "#### -33", True),
        ("<think>x</think><answer>133</answer>", "#### 132", False),
        ("132", "#### 132", False),  # no <answer> tag: not gradable
        ("<answer>5</answer><answer>6</answer>", "#### 6", False),  # the first answer counts
    ],
)
def test_is_correct(completion, answer, correct):
    assert common.is_correct(completion, answer) is correct


# --- data loading ----------------------------------------------------------------------------
def test_load_split_errors_are_one_sentence(tmp_path):
    with pytest.raises(SystemExit, match="has no train.jsonl"):
        common.load_split(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{not json\n")
    with pytest.raises(SystemExit, match="line 2 is not valid JSON"):
        common.load_split(str(tmp_path), "train")
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "solution": "1"}) + "\n")
    with pytest.raises(SystemExit, match="no column 'answer'"):
        common.load_split(str(tmp_path), "train")


def test_load_model_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="run `python sft.py` first"):
        common.load_model(str(tmp_path / "sft"), missing_hint="run `python sft.py` first")


# --- log-probs line up with generation --------------------------------------------------------
def test_completion_logprobs_match_generation_scores(saved_tiny):
    """The log-probs we train on are those of the tokens generation sampled, at the same positions,
    despite left padding (prompts of different lengths)."""
    path, tokenizer, _ = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [common.make_prompt(tokenizer, q) for q in ("What is 1 + 2?", "What is 47 + 85 + 1000?")]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**encoded, max_new_tokens=6, do_sample=True, top_k=0, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=-1)
    completion_ids = out.sequences[:, encoded["input_ids"].shape[1]:]
    scores = torch.stack(out.logits, dim=1)  # [B, T, V]: what generation sampled from
    expected = torch.log_softmax(scores.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = torch.cat([encoded["attention_mask"], torch.ones_like(completion_ids)], dim=1)
    with torch.no_grad():
        got = common.completion_logprobs(model, out.sequences, mask, completion_ids.shape[1])
    assert_close(got, expected, terms=forward_terms(model.config))  # generate's cached passes vs one pass


def test_completion_logprobs_equal_full_forward(saved_tiny):
    _, _, model = saved_tiny
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [B, 9, V]
        full = torch.log_softmax(logits[:, 5:8], -1).gather(-1, input_ids[:, 6:9].unsqueeze(-1)).squeeze(-1)
        got = common.completion_logprobs(model, input_ids, attention_mask, 3)
    assert_close(got, full, terms=forward_terms(model.config))


def test_generate_masks_after_first_eos(saved_tiny):
    path, tokenizer, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    torch.manual_seed(0)
    prompts = [common.make_prompt(tokenizer, "What is 1 + 2?")] * 16
    prompt_ids, prompt_mask, completion_ids, completion_mask = common.generate(model, tokenizer, prompts, 12)
    assert prompt_ids.shape == prompt_mask.shape and completion_ids.shape == completion_mask.shape
    assert torch.equal(completion_mask, common.mask_after_eos(completion_ids, tokenizer.eos_token_id))
    # whatever follows a row's mask is padding
    assert (completion_ids[completion_mask == 0] == tokenizer.pad_token_id).all()


def test_parse_config_reads_types_bools_and_help(tmp_path, monkeypatch, capsys):
    (tmp_path / "cfgmod.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass C:\n    flag: bool = False\n"
        "    \"\"\"turn it on\"\"\"\n    n: int = 3\n    \"\"\"how many\"\"\"\n    lr: float = 0.1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from cfgmod import C

    assert common.parse_config(C, ["--flag", "false"]) == C(flag=False, n=3, lr=0.1)
    assert common.parse_config(C, ["--flag", "true", "--n", "5", "--lr", "2e-3"]) == C(flag=True, n=5, lr=2e-3)
    with pytest.raises(SystemExit):
        common.parse_config(C, ["--help"])
    assert "turn it on" in capsys.readouterr().out


def test_prompt_sharing_gives_the_same_logprobs_and_gradients(saved_tiny):
    """Rows that share a prompt (GRPO's groups) run it once (common.prompt_cache): the log-probs
    and the gradients are those of one plain forward pass over every row."""
    path, tokenizer, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    prompts = [common.make_prompt(tokenizer, q) for q in ("1+2=", "47+85+1000=", "9-3=") for _ in range(3)]
    prompt_ids, prompt_mask = common.pad_left([tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                                              tokenizer.pad_token_id)
    torch.manual_seed(0)
    completion_ids = torch.randint(0, 256, (len(prompts), 5))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0  # a completion that ended early
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    assert common.prompts_repeat(prompt_ids) and not common.prompts_repeat(prompt_ids[::3])

    def logprobs_and_grads(shared: bool):
        model.zero_grad()
        if shared:
            logprobs = common.completion_logprobs(model, input_ids, attention_mask, 5)
        else:  # the plain pass, by hand
            position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            logprobs = common.gather_logprobs(logits[:, -6:-1], completion_ids)
        (logprobs * completion_mask).sum().backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    shared, shared_grads = logprobs_and_grads(True)
    plain, plain_grads = logprobs_and_grads(False)
    assert_close(shared * completion_mask, plain * completion_mask, terms=forward_terms(model.config))
    for a, b in zip(shared_grads, plain_grads):  # a gradient also sums over the batch's positions
        assert_close(a, b, terms=forward_terms(model.config) + input_ids.numel())


def test_generate_greedy_equals_hf_generate(sft_checkpoint):
    """Our rollout loop (prompt cache, rows leaving the batch at EOS) decodes exactly what
    transformers' generate does, greedy, with repeated and unique prompts of different lengths.
    Both compute the same logits in another order, so a near-tie (top two logits closer than
    float32 rounding) may break either way: a row is compared up to its first near-tie."""
    from transformers import GenerationConfig

    model, tokenizer = common.load_model(sft_checkpoint)
    prompts = [common.make_prompt(tokenizer, q) for q in ("12+345=", "7-80=", "123+456=", "1-999=") for _ in range(2)]
    prompts += [common.make_prompt(tokenizer, q) for q in ("5+5=", "999-1=")]
    _, _, completion_ids, completion_mask = common.generate(model, tokenizer, prompts, 40, greedy=True)
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, output_logits=True, return_dict_in_generate=True)
    out = model.generate(**encoded, generation_config=config)
    expected = out.sequences[:, encoded["input_ids"].shape[1]:]
    expected_mask = common.mask_after_eos(expected, tokenizer.eos_token_id)
    top2 = torch.stack(out.logits, dim=1).float().topk(2, dim=-1).values  # [B, T, 2]
    gap = top2[..., 0] - top2[..., 1]
    near_tie = gap <= tolerance(forward_terms(model.config), top2[..., 0].abs().max().item())
    compared = (near_tie.long().cumsum(1) == 0)  # positions before the row's first near-tie
    assert completion_ids.shape[1] == expected.shape[1]
    ours, theirs = completion_ids * completion_mask, expected * expected_mask
    assert torch.equal(ours[compared], theirs[compared])
    assert compared.float().mean() > 0.9, "too many near-ties for the check to mean anything"
    lengths = completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows stopped at different steps: the batch shrank


def test_length_chunks_change_nothing_but_the_padding(saved_tiny):
    """completion_logprobs sorts rows by completion length into chunks cut to their own longest
    completion: the log-probs of real tokens are those of one pass, whatever the chunks."""
    _, _, model = saved_tiny
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (6, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, :2] = torch.tensor([0, 1]).repeat(6, 1)  # some left padding in the prompts
    ends = torch.tensor([6, 1, 3, 6, 2, 5])  # completion lengths (of T = 6)
    attention_mask[:, -6:] = (torch.arange(6) < ends[:, None]).long()
    with torch.no_grad():
        one = common.completion_logprobs(model, input_ids, attention_mask, 6, length_chunks=1)
        for chunks in (2, 3, 6):
            got = common.completion_logprobs(model, input_ids, attention_mask, 6, length_chunks=chunks)
            mask = attention_mask[:, -6:].bool()
            assert_close(got[mask], one[mask], terms=forward_terms(model.config)) and torch.isfinite(got).all()
