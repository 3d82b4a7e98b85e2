"""Bad input gets one sentence and touches nothing; NaN stops a run; a killed run resumes to the
same result as an unbroken one; the same seed gives the same metrics."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import common
import grpo
import mix
import ppo
import reward_model
import sft
from conftest import ROOT, read_metrics, run, run_main

SCRIPTS = {"sft.py": sft, "reward_model.py": reward_model, "ppo.py": ppo, "grpo.py": grpo, "mix.py": mix}
ALL = list(SCRIPTS)
RL = ["ppo.py", "grpo.py", "mix.py"]


def data_folder(tmp_path, train_text, name="data"):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "train.jsonl").write_text(train_text)
    (folder / "test.jsonl").write_text(train_text)
    return str(folder)


ROW = json.dumps({"question": "What is 1 + 1?", "answer": "1+1=2\n#### 2"}) + "\n"
PAIR = json.dumps({"prompt": "What is 1 + 1?", "chosen": "<answer>2</answer>", "rejected": "<answer>3</answer>"}) + "\n"
LONG = json.dumps({"question": "What is " + "1 + " * 400 + "1?", "answer": "#### 401"}) + "\n"

# (scripts, arguments, the sentence's telling part). {tmp} is a fresh folder, {sft} a trained SFT checkpoint,
# {not_a_model} a folder with a broken config.json; data folders are made by `bad_data` below.
CASES = [
    (ALL, ["--model", "/nonexistent/model"], "no model found at /nonexistent/model"),
    (ALL, ["--model", "{not_a_model}"], "could not load a model from"),
    (ALL, ["--dataset", "/nonexistent/data"], "no dataset folder /nonexistent/data"),
    (ALL, ["--dataset", "{no_train}"], "has no train.jsonl"),
    (ALL, ["--dataset", "{empty}"], "train.jsonl is empty"),
    (ALL, ["--dataset", "{malformed}"], "train.jsonl line 2 is not valid JSON"),
    (["sft.py", "grpo.py", "mix.py", "ppo.py"], ["--dataset", "{no_answer}"], "has no column 'answer'"),
    (["reward_model.py"], ["--dataset", "{no_rejected}"], "has no column 'rejected'"),
    (["mix.py"], ["--expert_dataset", "{expert_no_assistant}"], "line 1 does not end with an assistant message"),
    (["mix.py"], ["--expert_dataset", "/nonexistent/expert.jsonl"], "no data file /nonexistent/expert.jsonl"),
    (["mix.py"], ["--expert_dataset", "{expert_empty}"], "expert_empty.jsonl is empty"),
    (["mix.py"], ["--expert_dataset", "{expert_malformed}"], "expert_malformed.jsonl line 2 is not valid JSON"),
    (["mix.py"], ["--expert_dataset", "{expert_no_messages}"], "has no column 'messages'"),
    (["grpo.py", "mix.py"], ["--loss_type", "mean"], "--loss_type must be 'grpo' or 'dapo'"),
    (["grpo.py", "mix.py"], ["--num_generations", "1"], "--num_generations must be at least 2"),
    (["grpo.py"], ["--per_device_train_batch_size", "12"], "must be a multiple of --num_generations"),
    (["mix.py"], ["--per_device_train_batch_size", "12"], "positive multiple of --num_generations"),
    (["ppo.py"], ["--num_mini_batches", "3"], "must be a multiple of --num_mini_batches"),
    (ALL, ["--lora_r", "0"], "--lora_r must be a positive rank"),
    (ALL, ["--lora_r", "-4"], "--lora_r must be a positive rank"),
    (["grpo.py", "mix.py"], ["--epsilon", "0"], "--epsilon must be positive"),
    (["ppo.py"], ["--cliprange", "-0.2"], "--cliprange must be positive"),
    (["mix.py"], ["--mu", "1.5"], "--mu must be in [0, 1]"),
    (["mix.py"], ["--expert_data_ratio", "-0.1"], "--expert_data_ratio must be in [0, 1]"),
    (ALL, ["--max_completion_length", "0"], "--max_completion_length must be at least 1 token"),
    (ALL, ["--learning_rate", "0"], "--learning_rate must be positive"),
    (RL, ["--dataset", "{long_prompt}", "--max_completion_length", "64"], "more than the model's context of 1024"),
    (["ppo.py"], ["--reward_model", "/nonexistent/rm"], "run `python reward_model.py` first"),
    (ALL, ["--resume", "true"], "--resume: no checkpoint in"),
]
TABLE = [(script, args, message) for scripts, args, message in CASES for script in scripts]


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "not_a_model").mkdir()
    (tmp / "not_a_model" / "config.json").write_text("{not a config")
    (tmp / "no_train").mkdir()
    folders = {"not_a_model": str(tmp / "not_a_model"), "no_train": str(tmp / "no_train"),
               "empty": data_folder(tmp, "", "empty"),
               "malformed": data_folder(tmp, ROW + "{broken\n", "malformed"),
               "no_answer": data_folder(tmp, json.dumps({"question": "q"}) + "\n", "no_answer"),
               "no_rejected": data_folder(tmp, json.dumps({"prompt": "p", "chosen": "c"}) + "\n", "no_rejected"),
               "long_prompt": data_folder(tmp, LONG * 200, "long_prompt")}
    expert = tmp / "expert.jsonl"
    expert.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    folders["expert_no_assistant"] = str(expert)
    chat = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n"
    for name, text in (("expert_empty", ""), ("expert_malformed", chat + "{broken\n"),
                       ("expert_no_messages", json.dumps({"conversation": []}) + "\n")):
        (tmp / f"{name}.jsonl").write_text(text)
        folders[name] = str(tmp / f"{name}.jsonl")
    return folders


@pytest.mark.parametrize("script, args, message", TABLE, ids=[f"{s}:{' '.join(a)}" for s, a, _ in TABLE])
def test_bad_input_is_one_sentence_and_touches_no_output(sft_checkpoint, bad_data, tmp_path, script, args, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("a good run's metrics\n")
    (out / "model.safetensors").write_text("a good model")
    args = [a.format(**bad_data) for a in args]
    defaults = ["--model", sft_checkpoint] if script != "sft.py" or "--lora_r" in args else []
    if script == "ppo.py" and "--reward_model" not in args:
        defaults += ["--reward_model", "rule"]
    module = SCRIPTS[script]
    with pytest.raises(SystemExit) as stop:
        module.main(common.parse_config(module.Config, [*defaults, *args, "--output_dir", str(out)]))
    text = str(stop.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "model.safetensors"]
    assert (out / "metrics.jsonl").read_text() == "a good run's metrics\n" and (out / "model.safetensors").read_text() == "a good model"


def test_bad_input_from_the_command_line_exits_1_without_traceback(tmp_path):
    result = run("grpo.py", "--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o"), check=False)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.stderr


# --- training faults -----------------------------------------------------------------------------
def test_nan_stops_at_the_step_and_keeps_the_last_good_checkpoint(sft_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(sft_checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(k for k in weights if "layers.0.mlp.up_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("the last good model")
    result = run("sft.py", "--model", str(broken), "--output_dir", str(out), "--max_steps", "5", "--eval_steps", "100",
                 check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: step 1: the grad norm is nan; stopped before applying this update" in result.stderr
    assert (out / "model.safetensors").read_text() == "the last good model"


def _scalars(output_dir):
    """metrics.jsonl without the wall-clock timings (time/*), which differ from run to run."""
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(output_dir)]


def _assert_same_run(a, b):
    assert _scalars(a) == _scalars(b)
    weights_a, weights_b = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b))
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def _start(script, args):
    return subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when(process, condition, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"finished before the kill point:\n{process.stderr.read()[-2000:]}"
        assert time.time() < deadline
        time.sleep(0.0005)
    process.send_signal(signal.SIGKILL)
    process.wait()


def _lines(path):
    return sum(1 for _ in open(path)) if os.path.isfile(path) else 0


RUNS = {
    "sft.py": lambda checkpoint: ["--max_steps", "12", "--save_steps", "3", "--per_device_train_batch_size", "8",
                                  "--eval_steps", "6", "--num_eval_examples", "16", "--logging_steps", "1"],
    "grpo.py": lambda checkpoint: ["--model", checkpoint, "--max_steps", "8", "--save_steps", "2",
                                   "--per_device_train_batch_size", "16", "--num_generations", "4", "--eval_steps", "4",
                                   "--num_eval_examples", "8", "--warmup_steps", "1"],
}


@pytest.mark.parametrize("script", list(RUNS))
def test_same_seed_same_metrics_and_a_killed_run_resumes_to_the_same_result(sft_checkpoint, tmp_path, script):
    """Determinism: two runs of the same seed log the same metrics (timings aside) and end with the
    same weights. Robustness: SIGKILL between checkpoints and in the middle of writing one, then
    --resume each time: the run ends exactly as the unbroken one did."""
    args = RUNS[script](sft_checkpoint)
    first, second, broken = (str(tmp_path / name) for name in ("first", "second", "broken"))
    run_main(script, *args, "--output_dir", first)
    run_main(script, *args, "--output_dir", second)
    _assert_same_run(first, second)

    metrics = os.path.join(broken, "metrics.jsonl")
    # 1. killed between two checkpoints: the 5th metrics line is past the first checkpoint
    _kill_when(_start(script, [*args, "--output_dir", broken]), lambda: _lines(metrics) >= 5)
    # 2. resumed, then killed while it writes its next checkpoint
    _kill_when(_start(script, [*args, "--output_dir", broken, "--resume", "true"]),
               lambda: os.path.isdir(os.path.join(broken, "checkpoint.tmp")))
    # 3. the same crash as between the two renames of a save: only checkpoint.old and a torn .tmp
    if os.path.isdir(os.path.join(broken, "checkpoint")):
        shutil.rmtree(os.path.join(broken, "checkpoint.old"), ignore_errors=True)
        os.rename(os.path.join(broken, "checkpoint"), os.path.join(broken, "checkpoint.old"))
    os.makedirs(os.path.join(broken, "checkpoint.tmp"), exist_ok=True)
    with open(os.path.join(broken, "checkpoint.tmp", "state.pt"), "wb") as f:
        f.write(b"torn")
    result = run_main(script, *args, "--output_dir", broken, "--resume", "true")
    assert "resumed from" in result.stdout + result.stderr
    _assert_same_run(first, broken)
