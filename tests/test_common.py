"""Tokenizer round trip, data parsing, model loading's refusals, and that log-probs line up with what
generation sampled."""
import copy
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import common

TEXTS = [
    "What is 47 + 85?",
    "  two spaces,\nnewlines\n\n and\ttabs  ",
    "<think>7+5=12\n4+8+1=13</think><answer>132</answer>",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "unicode: é ö 中文 🙂",
]


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


def damaged_copy(folder, to):
    """A copy of a saved model folder whose weights hold a NaN and an inf (a checkpoint damaged when it was
    trained or saved): the path of the copy."""
    shutil.copytree(folder, to)
    weights = load_file(to / "model.safetensors")
    name = next(k for k in weights if "layers.0.mlp.up_proj" in k)
    weights[name][0, 0], weights[name][0, 1] = float("nan"), float("inf")
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_load_model_refuses_non_finite_weights_naming_the_model(saved_tiny, tmp_path):
    """A NaN or inf in the weights stops the load in one sentence that names the folder, and the flag that
    named it when the caller gives one, rather than the first training step's NaN loss."""
    broken = damaged_copy(saved_tiny[0], tmp_path / "broken")
    for kwargs, named in (({}, str(broken)), ({"flag": "--model"}, f"{broken} (--model)")):
        with pytest.raises(SystemExit) as stop:
            common.load_model(str(broken), **kwargs)
        text = str(stop.value.code)
        assert text.startswith(f"error: the model at {named} holds NaN or infinite values in 2 of its "), text
        assert text.endswith(" weights and buffers: a run that diverged, or a damaged file, wrote it; train it again, "
                             "or choose another")
        assert "\n" not in text


def test_a_gguf_model_with_non_finite_weights_is_refused_too(saved_tiny, tmp_path, monkeypatch):
    """A .gguf file goes through the same check: here load_gguf gives the tiny model with an inf in it."""
    _, tokenizer, model = saved_tiny
    damaged = copy.deepcopy(model)
    with torch.no_grad():
        damaged.model.norm.weight[0] = float("inf")
    monkeypatch.setattr(common, "load_gguf", lambda path, scalar_head=False: (damaged, tokenizer))
    path = str(tmp_path / "model.gguf")
    with pytest.raises(SystemExit) as stop:
        common.load_model(path)
    assert str(stop.value.code).startswith(f"error: the model at {path} holds NaN or infinite values in 1 of its ")
    monkeypatch.setattr(common, "load_gguf", lambda path, scalar_head=False: (model, tokenizer))
    assert common.load_model(path)[0] is model  # finite: loaded as before


def test_a_gguf_file_is_read_once_while_it_is_unchanged(tmp_path):
    """load_gguf's reader cache (common.last_file_kept): a second open of the same file, by any spelling of its
    path, returns the first reader; a file rewritten since, or another file, is read again."""
    opened = []
    open_kept = common.last_file_kept(lambda path, mode: opened.append(path) or object())
    first, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"GGUF one")
    other.write_bytes(b"GGUF two")
    reader = open_kept(str(first))
    assert open_kept(os.path.join(str(tmp_path), ".", "a.gguf")) is reader and len(opened) == 1
    os.utime(first, ns=(0, os.stat(first).st_mtime_ns + 1))  # rewritten: a new modification time
    assert open_kept(str(first)) is not reader and len(opened) == 2
    open_kept(str(other))
    assert opened == [str(first), str(first), str(other)]


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


def test_help_texts_read_from_the_file_are_those_of_the_class_source():
    """common._field_docs reads a Config's help texts from one parse of its file (a speed-up); read the plain way,
    from inspect.getsource(cls), every dataclass of the scripts and of lib/ gives the same texts."""
    import ast
    import dataclasses
    import glob
    import importlib
    import inspect
    import textwrap

    from conftest import ROOT

    def plain(cls) -> dict:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        return {node.target.id: nxt.value.value for node, nxt in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)}

    files = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "lib", "[!_]*.py")))
    names = [os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".") for path in files]
    classes = [cls for name in names for cls in vars(importlib.import_module(name)).values()
               if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == name]
    assert len(classes) >= 18 and any(common._field_docs(cls) for cls in classes)
    for cls in classes:
        assert common._field_docs(cls) == plain(cls), cls.__qualname__


def test_warmup_cosine_schedule_hand_computed():
    """Warmup 4 of 10 steps, min_lr_rate 0.1, peak 1: (t + 1) / 4 for t < 4, then
    0.1 + 0.9 * 0.5 * (1 + cos(pi * (t - 4) / 6)); from the warmup's end on it is transformers' own
    cosine_with_min_lr schedule, whose warmup (t / 4) starts at 0 instead."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    def lrs(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = make(optimizer)
        values = []
        for _ in range(11):
            values.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return values

    ours = lrs(lambda opt: common.warmup_cosine_schedule(opt, 4, 10, 0.1))
    expected = [0.25, 0.5, 0.75, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 6)),
                0.1 + 0.45 * (1 + math.cos(math.pi / 3)), 0.55, 0.1 + 0.45 * (1 + math.cos(2 * math.pi / 3)),
                0.1 + 0.45 * (1 + math.cos(5 * math.pi / 6)), 0.1]
    assert ours == pytest.approx(expected, abs=1e-12)  # python floats: a few ulps of 1
    theirs = lrs(lambda opt: get_cosine_with_min_lr_schedule_with_warmup(opt, 4, 10, min_lr_rate=0.1))
    assert theirs[:4] == pytest.approx([0.0, 0.25, 0.5, 0.75], abs=1e-12)
    assert ours[4:] == pytest.approx(theirs[4:], abs=1e-12)
