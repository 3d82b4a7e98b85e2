"""Bad input gets one sentence and touches nothing; one run per folder, and a run that fails or is
killed over an old run leaves it whole; NaN stops a run and the diverged checkpoint goes; a killed
run resumes to the same result as an unbroken one; the same seed gives the same metrics."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import common
import dpo
from lib import checks, harness
import grpo
import mix
import ppo
import reward_model
import rft
import sft
from conftest import SFT_FOLDER_RUN, ROOT, assert_same_run, rotated_tokenizer, run, run_main, start, tiny_reward_model

SCRIPTS = {"sft.py": sft, "reward_model.py": reward_model, "ppo.py": ppo, "grpo.py": grpo, "mix.py": mix,
           "dpo.py": dpo}
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
GSM8K = ["sft.py", "grpo.py", "mix.py", "ppo.py"]  # the scripts that read GSM8K's question / answer rows
SFT_RUN = SFT_FOLDER_RUN  # conftest's sft_folder: the run whose record the table's output folder holds


def gsm8k_rows(bad: dict, good: int = 20) -> str:
    """`good` usable rows and one row with `bad` in it: 1 in 21 is more than the 1% a file may lose."""
    return ROW * good + json.dumps({"question": "What is 2 + 2?", "answer": "2+2=4\n#### 4", **bad}) + "\n"


def chat(*messages) -> str:
    return json.dumps({"messages": list(messages)}) + "\n"


USER, ASSISTANT = {"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "<answer>2</answer>"}

# (scripts, arguments, the sentence's telling part). {out} is the output folder, which holds an earlier
# run; {sft} a trained SFT checkpoint; the other {names} are folders and files made by `bad_data` below.
# Unless a case sets --resume or --overwrite_output_dir itself, it runs with --overwrite_output_dir true,
# so that the check under test, not the refusal of a folder that holds a run, is what speaks.
CASES = [
    # models and data files
    (ALL, ["--model", "/nonexistent/model"], "no model found at /nonexistent/model"),
    (ALL, ["--model", "{not_a_model}"], "could not load a model from"),
    (ALL, ["--dataset", "/nonexistent/data"], "no dataset folder /nonexistent/data"),
    (ALL, ["--dataset", "{no_train}"], "has no train.jsonl"),
    (ALL, ["--dataset", "{empty}"], "train.jsonl is empty"),
    (ALL, ["--dataset", "{malformed}"], "train.jsonl line 2 is not valid JSON"),
    (ALL, ["--dataset", "{latin1}"], "train.jsonl line 21 is not UTF-8 text"),
    (ALL, ["--dataset", "{array_line}"], "train.jsonl line 21 is not a JSON object"),
    (GSM8K, ["--dataset", "{no_answer}"], "has no column 'answer'"),
    (GSM8K, ["--dataset", "{no_hashes}"], "train.jsonl line 21: 'answer' has no final answer after '####'"),
    (GSM8K, ["--dataset", "{bare_hashes}"], "train.jsonl line 21: 'answer' has no final answer after '####'"),
    (GSM8K, ["--dataset", "{empty_question}"], "train.jsonl line 21: 'question' is empty"),
    (GSM8K, ["--dataset", "{number_question}"], "train.jsonl line 21: 'question' is int"),
    (GSM8K, ["--dataset", "{missing_question}"], "train.jsonl line 21: 'question' is missing"),
    (GSM8K, ["--dataset", "{all_empty}"], "21 of 21 rows are unusable"),
    (GSM8K, ["--dataset", "{mixed_column}"], "train.jsonl line 22: 'source' is list, where line 21 has str"),
    (["reward_model.py", "dpo.py"], ["--dataset", "{no_rejected}"], "has no column 'rejected'"),
    (["reward_model.py", "dpo.py"], ["--dataset", "{same_pair}"], "line 1: 'chosen' and 'rejected' are the same text"),
    (["reward_model.py", "dpo.py"], ["--dataset", "{empty_chosen}"], "line 1: 'chosen' is empty"),
    (["mix.py"], ["--expert_dataset", "{expert_no_assistant}"],
     "line 1: 'messages' does not end with an assistant message"),
    (["mix.py"], ["--expert_dataset", "/nonexistent/expert.jsonl"], "no data file /nonexistent/expert.jsonl"),
    (["mix.py"], ["--expert_dataset", "{expert_empty}"], "expert_empty.jsonl is empty"),
    (["mix.py"], ["--expert_dataset", "{expert_malformed}"], "expert_malformed.jsonl line 2 is not valid JSON"),
    (["mix.py"], ["--expert_dataset", "{expert_no_messages}"], "has no column 'messages'"),
    (["mix.py"], ["--expert_dataset", "{expert_no_content}"],
     "'messages' has a message from the assistant whose content is missing"),
    (["mix.py"], ["--expert_dataset", "{expert_empty_answer}"],
     "'messages' has a message from the assistant whose content is empty"),
    (["mix.py"], ["--expert_dataset", "{expert_bad_role}"],
     "'messages' has a message whose role is not system, user or assistant"),
    (["mix.py"], ["--expert_dataset", "{expert_not_a_list}"], "'messages' is not a list of messages"),
    (ALL, ["--dataset", "{malformed}/train.jsonl"], "is a file, and a dataset is a folder that holds train.jsonl"),
    (GSM8K, ["--dataset", "{duplicate_key}"], "train.jsonl line 21 gives the key 'answer' twice"),
    (GSM8K, ["--dataset", "{nan_answer}"], "line 21: 'answer' has a final answer that is not a finite number ('nan')"),
    (GSM8K, ["--dataset", "{inf_answer}"], "line 21: 'answer' has a final answer that is not a finite number ('inf')"),
    (["sft.py"], ["--dataset", "{long_answers}"], "2 of 21 rows are longer than --max_completion_length 64 allows"),
    (["reward_model.py", "dpo.py"], ["--dataset", "{long_pairs}"],
     "2 of 21 rows are longer than --max_length 128 allows"),
    (["mix.py"], ["--expert_dataset", "{expert_long}"], "rows are longer than --max_completion_length 64 allows"),
    (["mix.py"], ["--expert_dataset", "{expert_only_answer}"], "has no user message before the expert's answer"),
    (ALL, ["--model", "{half_moved}"], "is half replaced: a finished run was being moved into it when it stopped"),
    (["ppo.py"], ["--reward_model", "{sft}"], "is a policy (it has a language-model head), not a reward model"),
    (["grpo.py", "mix.py", "ppo.py", "dpo.py"], ["--model", "{a_reward_model}"], "is a reward model (a scalar head"),
    # dpo.py: the judge of --online, and the gold answers of --prompts
    (["dpo.py"], ["--online", "true", "--judge", "{sft}"], "is a policy (it has a language-model head), not a reward"),
    (["dpo.py"], ["--online", "true", "--judge", "/nonexistent/rm"],
     "no model found at /nonexistent/rm: --judge takes 'rule' or a folder written by reward_model.py"),
    (["dpo.py"], ["--online", "true", "--prompts", "{pairs}"],
     "has no gold answers (it has prompt, chosen, rejected): the held-out accuracy and --judge rule check answers"),
    (["dpo.py"], ["--prompts", "{no_answer}"], "has no gold answers (it has question): the held-out accuracy check"),
    (["dpo.py"], ["--online", "true", "--prompts", "{pairs}", "--judge", "{a_reward_model}"], "has no gold answers"),
    (ALL, ["--model", "{no_chat_template}"], "has no chat template"),
    # settings
    (["grpo.py"], ["--loss_type", "mean"], "--loss_type must be one of grpo, bnpo, dapo, dr_grpo, cispo, not 'mean'"),
    (["mix.py"], ["--loss_type", "cispo"], "--loss_type must be one of grpo, bnpo, dapo, dr_grpo, not 'cispo'"),
    (["grpo.py"], ["--scale_rewards", "std"], "--scale_rewards must be one of group, batch, none"),
    (["grpo.py"], ["--importance_sampling_level", "seq"], "--importance_sampling_level must be one of token, sequence"),
    (["grpo.py", "mix.py"], ["--epsilon_high", "0"], "--epsilon_high must be positive"),
    (["grpo.py"], ["--loss_type", "cispo", "--epsilon_high", "0.5"], "an absolute cap of 1 or more"),
    (["grpo.py"], ["--max_sampling_rounds", "8"], "--max_sampling_rounds limits DAPO's dynamic sampling"),
    (["dpo.py"], ["--judge", "out/rm"], "--judge ranks online DPO's own samples: add --online true"),
    (["ppo.py", "grpo.py", "mix.py", "dpo.py"], ["--temperature", "1e-9"], "--temperature must be at least 0.01"),
    (["grpo.py", "mix.py", "ppo.py", "dpo.py"], ["--log_completions_steps", "-1"],
     "--log_completions_steps must be 0 or more"),
    (["dpo.py"], ["--loss_type", "dpo"], "--loss_type must be one of sigmoid, ipo, simpo, kto, not 'dpo'"),
    (["dpo.py"], ["--steps_per_generation", "2"], "--steps_per_generation says how often online DPO samples new "
     "pairs: add --online true"),
    (["dpo.py"], ["--online", "true", "--steps_per_generation", "3", "--save_steps", "20"],
     "--save_steps 20 must be a multiple of --steps_per_generation 3, so that a checkpoint falls where new pairs"),
    (["dpo.py"], ["--steps_per_generation", "0"], "--steps_per_generation must be at least 1"),
    (["dpo.py"], ["--online", "true", "--steps_per_generation", "5", "--save_steps", "5", "--max_steps", "3"],
     "--steps_per_generation 5 samples the pairs of that many steps at once, more than the run's --max_steps 3"),
    (["dpo.py"], ["--undesirable_weight", "2"], "--undesirable_weight weighs KTO's loss: add --loss_type kto"),
    (["dpo.py"], ["--loss_type", "kto", "--desirable_weight", "0"], "--desirable_weight must be positive"),
    (["dpo.py"], ["--loss_type", "kto", "--online", "true", "--judge", "out/rm"],
     "KTO needs each sample labelled desirable or undesirable, which the checker does: --judge rule"),
    (["dpo.py"], ["--loss_type", "kto", "--per_device_train_batch_size", "1"],
     "KTO's reference point pairs each prompt with another prompt's answer: a step needs at least 2 pairs"),
    (["dpo.py"], ["--beta", "0"], "--beta must be positive, not 0.0"),
    (["dpo.py"], ["--simpo_gamma", "-1"], "--simpo_gamma must be 0 or more"),
    (["ppo.py"], ["--target_kl", "0"], "--target_kl must be positive"),
    (["ppo.py"], ["--kl_horizon", "0"], "--kl_horizon must be at least 1"),
    (["grpo.py", "mix.py"], ["--num_generations", "1"], "--num_generations must be at least 2"),
    (["grpo.py"], ["--per_device_train_batch_size", "12"], "must be a multiple of --num_generations"),
    (["mix.py"], ["--per_device_train_batch_size", "12"], "positive multiple of --num_generations"),
    (["ppo.py"], ["--num_mini_batches", "3"], "must be a multiple of --num_mini_batches"),
    (ALL, ["--lora_r", "0"], "--lora_r must be a positive rank"),
    (ALL, ["--lora_r", "-4"], "--lora_r must be a positive rank"),
    (ALL, ["--lora_r", "4", "--lora_target_modules", "q_proj,q_prj"], "the model has no linear layer named 'q_prj'"),
    (ALL, ["--lora_r", "4", "--lora_alpha", "0"], "--lora_alpha must be positive"),
    (["grpo.py", "mix.py"], ["--epsilon", "0"], "--epsilon must be positive"),
    (["ppo.py"], ["--cliprange", "-0.2"], "--cliprange must be positive"),
    (["ppo.py"], ["--clip_score", "0"], "--clip_score must be positive"),
    (["mix.py"], ["--mu", "1.5"], "--mu must be in [0, 1]"),
    (["mix.py"], ["--expert_data_ratio", "-0.1"], "--expert_data_ratio must be in [0, 1]"),
    (ALL, ["--max_completion_length", "0"], "--max_completion_length must be at least 1 token"),
    (ALL, ["--learning_rate", "0"], "--learning_rate must be positive"),
    (ALL, ["--learning_rate", "nan"], "--learning_rate must be a finite number, not nan"),
    (ALL, ["--max_grad_norm", "-1"], "--max_grad_norm must be positive"),
    (ALL, ["--max_grad_norm", "inf"], "--max_grad_norm must be a finite number, not inf"),
    (ALL, ["--num_eval_examples", "-1"], "--num_eval_examples must be 0 or more"),
    (ALL, ["--seed", "-1"], "--seed must be in [0, 2^32)"),
    (["sft.py", "reward_model.py", "grpo.py", "mix.py", "dpo.py"], ["--weight_decay", "-0.01"],
     "--weight_decay must be 0 or more"),
    (["reward_model.py"], ["--samples_per_prompt", "1"], "--samples_per_prompt must be at least 2"),
    (["reward_model.py", "dpo.py"], ["--max_length", "1"], "--max_length must be at least 2 tokens"),
    (RL, ["--dataset", "{long_prompt}", "--max_completion_length", "64"], "more than the model's context of 1024"),
    (["dpo.py"], ["--prompts", "{long_prompt}", "--max_completion_length", "64"], "more than the model's context"),
    (ALL, ["--system_prompt", "{huge}"], "--system_prompt needs"),
    (["ppo.py"], ["--reward_model", "/nonexistent/rm"], "run `python reward_model.py` first"),
    (ALL, ["--fsdp", "true"], "--fsdp shards the model over processes: run the script under torchrun"),
    (ALL, ["--fsdp", "true", "--lora_r", "8", "--merge_lora", "true"], "--merge_lora does not work with --fsdp"),
    # the output folder and --resume
    (ALL, ["--overwrite_output_dir", "false"], "already holds a run"),
    (ALL, ["--model", "{out}"], "holds --model"),
    (ALL, ["--dataset", "{out}"], "holds --dataset"),
    (ALL, ["--output_dir", "{a_file}"], "is a file, not a folder"),
    (ALL, ["--output_dir", "{a_file}/run"], "cannot be made"),
    (ALL, ["--resume", "true", "--overwrite_output_dir", "true"], "pass one of them"),
    (ALL, ["--resume", "true", "--output_dir", "{tmp}"], "--resume: no checkpoint in"),
    (ALL, ["--resume", "true", "--output_dir", "{tmp}/never_made"], "does not exist, so there is no run to continue"),
    (ALL, ["--output_dir", ""], "--output_dir is empty"),
    (["reward_model.py", "ppo.py", "grpo.py", "mix.py", "dpo.py"], ["--resume", "true"], "is sft.py's, not"),
    (["sft.py"], ["--resume", "true"], "--resume continues the run as it was set, and --max_steps was 80, now 700"),
    (["sft.py"], [*SFT_RUN, "--learning_rate", "1e-3", "--resume", "true"], "--learning_rate was 0.002, now 0.001"),
    (["sft.py"], [*SFT_RUN, "--model", "{sft}", "--resume", "true"], "was trained from --model tiny"),
    (["sft.py"], [*SFT_RUN, "--resume", "true"], "checkpoint/state.pt cannot be read"),
    (["sft.py"], [*SFT_RUN, "--resume", "true", "--output_dir", "{no_run_json}"], "has no readable run.json"),
    (["sft.py"], [*SFT_RUN, "--resume", "true", "--output_dir", "{stopped_early}"],
     "stopped before its first checkpoint"),
    (["sft.py"], [*SFT_RUN, "--resume", "true", "--output_dir", "{changed_input}"],
     "--resume: --dataset data/demos has changed since this run started (its files differ), and continuing "
     "would mix two starts"),
    (ALL, ["--output_dir", "{dangling}"], "is a symbolic link to /nonexistent/disk/run, which does not exist"),
    # a run folder whose own record (run.json, a checkpoint's run.json) cannot be trusted: copied from elsewhere
    (ALL, ["--output_dir", "{tampered_up}"], "run.json lists '../victim', which is not a file a run writes inside"),
    (ALL, ["--output_dir", "{tampered_abs}"], "which is not a file a run writes inside"),
    (ALL, ["--output_dir", "{record_list}"], "run.json is not a record this repo writes (a list of the run's files)"),
    (["sft.py"], [*SFT_RUN, "--resume", "true", "--output_dir", "{no_inputs}"],
     "checkpoint/run.json is not a whole record of its run (its 'inputs' is missing), so --resume cannot tell"),
    (["sft.py"], [*SFT_RUN, "--resume", "true", "--output_dir", "{inputs_list}"],
     "checkpoint/run.json is not a whole record of its run (its 'inputs' is not a dict), so --resume cannot tell"),
    (["sft.py"], [*SFT_RUN, "--resume", "true", "--output_dir", "{record_array}"],
     "checkpoint/run.json is not a whole record of its run, so --resume cannot tell"),
    # the evaluation's settings are the run's: they change what an RL run samples
    (["sft.py"], [*SFT_RUN, "--eval_steps", "40", "--resume", "true"], "--eval_steps was 80, now 40"),
    (["sft.py"], [*SFT_RUN, "--num_eval_examples", "16", "--resume", "true"], "--num_eval_examples was 8, now 16"),
    (["sft.py"], [*SFT_RUN, "--eval_samples_per_problem", "2", "--resume", "true"], "--eval_samples_per_problem was 4"),
    # models that are not what their flag needs
    (["ppo.py"], ["--reward_model", "{critic}"], "critic is ppo.py's critic (a value model"),
    (["dpo.py"], ["--online", "true", "--judge", "{critic}"], "critic is ppo.py's critic (a value model"),
    (["ppo.py"], ["--reward_model", "{rotated_rm}"], "has a tokenizer of its own, not --model's: ppo.py's critic"),
    (ALL, ["--model", "{big_tokenizer}"], "has 300 tokens and its model's embedding 264 rows"),
]
TABLE = [(script, args, message) for scripts, args, message in CASES for script in scripts]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory, sft_folder):
    tmp = tmp_path_factory.mktemp("bad")
    folders = {"not_a_model": write(tmp / "not_a_model" / "config.json", "{not a config").removesuffix("/config.json"),
               "no_train": str((tmp / "no_train").mkdir() or tmp / "no_train"),
               "a_file": write(tmp / "a_file", "not a folder"), "huge": "x" * 100_000}
    datasets = {
        "empty": "",
        "malformed": ROW + "{broken\n",
        "no_answer": json.dumps({"question": "q"}) + "\n",
        "latin1": ROW.encode() * 20
        + '{"question": "Combien font 2 + 2 ? Réponds.", "answer": "#### 4"}\n'.encode("latin-1"),
        "array_line": ROW * 20 + "[1, 2]\n",
        "no_hashes": gsm8k_rows({"answer": "2+2=4, so 4"}),
        "bare_hashes": gsm8k_rows({"answer": "2+2=4\n####"}),
        "empty_question": gsm8k_rows({"question": " "}),
        "number_question": gsm8k_rows({"question": 5}),
        "missing_question": ROW * 20 + json.dumps({"answer": "#### 4"}) + "\n",
        "all_empty": json.dumps({"question": "", "answer": "#### 1"}) + "\n" * 1 + gsm8k_rows({"question": ""}, 0) * 20,
        "mixed_column": ROW * 20 + gsm8k_rows({"source": "a"}, 0) + gsm8k_rows({"source": ["a", "list"]}, 0),
        "no_rejected": json.dumps({"prompt": "p", "chosen": "c"}) + "\n",
        "same_pair": json.dumps({"prompt": "p", "chosen": "<answer>2</answer>", "rejected": "<answer>2</answer>"})
        + "\n"
        + PAIR * 20,
        "pairs": PAIR * 21,  # a preference dataset, without gold answers (dpo.py's --prompts)
        "empty_chosen": json.dumps({"prompt": "p", "chosen": "", "rejected": "<answer>2</answer>"}) + "\n" + PAIR * 20,
        "long_prompt": LONG * 200,
        "duplicate_key": ROW * 20 + '{"question": "What is 2 + 2?", "answer": "#### 4", "answer": "#### 5"}\n',
        "nan_answer": gsm8k_rows({"answer": "2+2=4\n#### nan"}),
        "inf_answer": gsm8k_rows({"answer": "2+2=4\n#### inf"}),
        "long_answers": ROW * 19 + gsm8k_rows({"answer": "1" * 80 + "\n#### 4"}, 0) * 2,
        "long_pairs": PAIR * 19 + (json.dumps({"prompt": "p", "chosen": "<answer>2</answer>" + "1" * 150,
                                               "rejected": "<answer>3</answer>"}) + "\n") * 2,
    }
    for name, text in datasets.items():
        folders[name] = str(tmp / name)
        write(tmp / name / "train.jsonl", text)
        write(tmp / name / "test.jsonl", text)
    experts = {"expert_no_assistant": chat(USER), "expert_empty": "",
               "expert_malformed": chat(USER, ASSISTANT) + "{broken\n",
               "expert_no_messages": json.dumps({"conversation": []}) + "\n",
               "expert_no_content": chat(USER, {"role": "assistant"}),
               "expert_empty_answer": chat(USER, {"role": "assistant", "content": ""}),
               "expert_bad_role": chat({"role": "teacher", "content": "hi"}, ASSISTANT),
               "expert_not_a_list": json.dumps({"messages": "What is 1 + 1? 2"}) + "\n",
               "expert_long": chat(USER, ASSISTANT) * 20 + chat(USER, {"role": "assistant", "content": "1" * 80}),
               "expert_only_answer": chat(ASSISTANT)}
    for name, text in experts.items():
        folders[name] = write(tmp / f"{name}.jsonl", text)
    folders["a_reward_model"] = write(tmp / "rm" / "config.json",
                                      json.dumps({"architectures": ["LlamaForSequenceClassification"]})
                                      ).removesuffix("/config.json")
    no_template = tmp / "no_chat_template"
    shutil.copytree(sft_folder, no_template, ignore=shutil.ignore_patterns("checkpoint*", "chat_template.jinja"))
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    folders["no_chat_template"] = str(no_template)
    # an sft.py run's folder whose checkpoint has no run.json, and one whose replacing run stopped before a checkpoint
    shutil.copytree(sft_folder, tmp / "no_run_json",
                    ignore=shutil.ignore_patterns("run.json", "state.pt", "*.safetensors"))
    write(tmp / "no_run_json" / "checkpoint" / "state.pt", "a good state")
    folders["no_run_json"] = str(tmp / "no_run_json")
    shutil.copytree(sft_folder, tmp / "stopped_early", ignore=shutil.ignore_patterns("state.pt", "*.safetensors"))
    write(tmp / "stopped_early" / ".next_run" / "metrics.jsonl", '{"step": 1}\n')
    folders["stopped_early"] = str(tmp / "stopped_early")
    # an sft.py run whose --dataset held other files when it started than it holds now
    shutil.copytree(sft_folder, tmp / "changed_input", ignore=shutil.ignore_patterns("*.safetensors"))
    record = json.loads((tmp / "changed_input" / "checkpoint" / "run.json").read_text())
    record["inputs"]["--dataset"] = "0" * 64
    (tmp / "changed_input" / "checkpoint" / "run.json").write_text(json.dumps(record))
    folders["changed_input"] = str(tmp / "changed_input")
    os.symlink("/nonexistent/disk/run", tmp / "dangling")
    # finished sft.py runs whose run.json lists a folder outside the run, or is not a list at all
    tampered = {"tampered_up": ["../victim"], "tampered_abs": [str(tmp / "victim")], "record_list": None}
    for name, files in tampered.items():
        shutil.copytree(sft_folder, tmp / name, ignore=shutil.ignore_patterns("checkpoint*"))
        record = json.loads((tmp / name / "run.json").read_text())
        (tmp / name / "run.json").write_text(json.dumps([] if files is None else
                                                        {**record, "files": record["files"] + files}))
        folders[name] = str(tmp / name)
    write(tmp / "victim" / "notes.txt", "someone else's work")
    # sft.py runs whose checkpoint's record has no inputs, or is not a record at all
    for name in ("no_inputs", "record_array", "inputs_list"):
        shutil.copytree(sft_folder, tmp / name, ignore=shutil.ignore_patterns("*.safetensors", "state.pt"))
        write(tmp / name / "checkpoint" / "state.pt", "a good state")
        record = json.loads((tmp / name / "checkpoint" / "run.json").read_text())
        inputs = record.pop("inputs")
        record = {"no_inputs": record, "record_array": [], "inputs_list": {**record, "inputs": list(inputs)}}[name]
        (tmp / name / "checkpoint" / "run.json").write_text(json.dumps(record))
        folders[name] = str(tmp / name)
    # ppo.py's critic (a scalar head, in the critic/ folder of a ppo.py run), and a reward model whose
    # tokenizer gives other ids than the policy's
    write(tmp / "ppo_run" / "run.json", json.dumps({"script": "ppo.py"}))
    shutil.copytree(folders["a_reward_model"], tmp / "ppo_run" / "critic")
    folders["critic"] = str(tmp / "ppo_run" / "critic")
    rotated_tok = rotated_tokenizer()
    tiny_reward_model(rotated_tok).save_pretrained(tmp / "rotated_rm")
    rotated_tok.save_pretrained(tmp / "rotated_rm")
    folders["rotated_rm"] = str(tmp / "rotated_rm")
    shutil.copytree(sft_folder, tmp / "big_tokenizer", ignore=shutil.ignore_patterns("checkpoint*"))
    big = transformers.AutoTokenizer.from_pretrained(tmp / "big_tokenizer")
    big.add_tokens([f"<extra_{i}>" for i in range(300 - len(big))])
    big.save_pretrained(tmp / "big_tokenizer")
    folders["big_tokenizer"] = str(tmp / "big_tokenizer")
    folders["dangling"] = str(tmp / "dangling")
    # a run folder into which a finished run was being moved when it stopped (.next_run/.complete written)
    shutil.copytree(sft_folder, tmp / "half_moved", ignore=shutil.ignore_patterns("checkpoint*"))
    write(tmp / "half_moved" / ".next_run" / ".complete", json.dumps({"files": ["model.safetensors"]}))
    folders["half_moved"] = str(tmp / "half_moved")
    return folders


def snapshot(path) -> dict:
    """Every file and folder under path (hidden ones too), with the bytes of each file."""
    if os.path.isfile(path):
        return {"": open(path, "rb").read()}
    return {os.path.relpath(os.path.join(root, name),
                            path): (open(os.path.join(root, name), "rb").read() if name in files else None)
            for root, folders, files in os.walk(path) for name in folders + files}


@pytest.mark.parametrize("script, args, message", TABLE, ids=[f"{s}:{' '.join(a)[:60]}" for s, a, _ in TABLE])
def test_bad_input_is_one_sentence_and_touches_no_output(sft_folder, bad_data, tmp_path, script, args, message):
    """Each bad input ends in one sentence (SystemExit("error: ..."): exit status 1, no traceback),
    before anything is written: the output folder, which holds an earlier sft.py run (its run.json
    real, its weights and training state stand-ins), is byte for byte what it was."""
    out = tmp_path / "out"
    write(out / "metrics.jsonl", "a good run's metrics\n")
    write(out / "model.safetensors", "a good model")
    write(out / "checkpoint" / "state.pt", "a good state")
    shutil.copy(os.path.join(sft_folder, "checkpoint", "run.json"), out / "checkpoint" / "run.json")
    (tmp_path / "tmp").mkdir()
    names = {**bad_data, "out": str(out), "sft": sft_folder, "tmp": str(tmp_path / "tmp")}
    args = [a.format(**names) for a in args]
    defaults = ["--model", sft_folder] if script != "sft.py" or "--lora_r" in args else []
    if script == "ppo.py" and "--reward_model" not in args:
        defaults += ["--reward_model", "rule"]
    if "--resume" not in args and "--overwrite_output_dir" not in args:
        defaults += ["--overwrite_output_dir", "true"]
    if "--output_dir" not in args:
        defaults += ["--output_dir", str(out)]
    watched = args[args.index("--output_dir") + 1] if "--output_dir" in args else str(out)
    watched = watched if os.path.exists(watched) else str(out)
    before = snapshot(watched)
    module = SCRIPTS[script]
    with pytest.raises(SystemExit) as stop:
        module.main(common.parse_config(module.Config, [*defaults, *args]))
    text = str(stop.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text, text
    assert snapshot(watched) == before


def test_bad_input_from_the_command_line_exits_1_without_traceback(tmp_path):
    result = run("grpo.py", "--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o"), check=False)
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.stderr


# --- training faults -----------------------------------------------------------------------------
@pytest.mark.slow
def test_nan_stops_at_the_step_and_keeps_the_last_good_checkpoint(sft_checkpoint, tmp_path):
    """A starting model whose weights are finite but so large that the first forward pass overflows (a NaN
    weight is refused as the model loads: tests/test_common.py): the run stops at step 1, before the update."""
    broken = tmp_path / "broken"
    shutil.copytree(sft_checkpoint, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(k for k in weights if "layers.0.mlp.up_proj" in k)
    weights[name][:] = 3e38  # finite, and float32's largest values: every product with them overflows
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("the last good model")
    (out / "run.json").write_text(json.dumps({"files": ["model.safetensors", "run.json"]}))  # a run's folder
    result = run("sft.py", "--model", str(broken), "--output_dir", str(out), "--max_steps", "5", "--eval_steps", "100",
                 "--overwrite_output_dir", "true", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: step 1: the grad norm is nan; stopped before applying this update" in result.stderr
    assert "no update had been applied yet and the models' weights are finite as loaded" in result.stderr
    assert (out / "model.safetensors").read_text() == "the last good model"


@pytest.mark.slow
def test_a_checkpoint_whose_weights_diverge_is_not_kept(tmp_path):
    """With --save_steps 1 and a learning rate that explodes the model, the checkpoint written
    after the last finite step holds weights that give NaN: it is dropped, and the one kept is the
    last whose weights gave a finite loss and gradient."""
    out = str(tmp_path / "out")
    result = run("sft.py", "--learning_rate", "10", "--warmup_steps", "0", "--save_steps", "1", "--max_steps", "20",
                 "--per_device_train_batch_size", "8", "--logging_steps", "1", "--output_dir", out, check=False)
    stopped = int(result.stderr.split("error: step ")[1].split(":")[0])  # the step whose values were not finite
    assert result.returncode == 1 and stopped >= 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    if stopped == 2:  # (on a CPU where it diverges at once) step 1's weights gave the NaN: no checkpoint is good
        assert sorted(os.listdir(out)) == ["metrics.jsonl"], os.listdir(out)
        return
    assert sorted(os.listdir(out)) == ["checkpoint", "metrics.jsonl"], os.listdir(out)
    state = torch.load(os.path.join(out, "checkpoint", "state.pt"), weights_only=True)
    assert state["step"] == stopped - 2  # its weights gave step stopped-1 finite values; stopped-1's gave NaN
    assert f"{out}/checkpoint holds the last weights that gave finite values" in result.stderr


def test_a_checkpoint_is_promoted_only_after_its_weights_gave_finite_values(tmp_path):
    """check_finite drops checkpoint.new when its weights gave a NaN or inf; the end of a step whose
    gradients were checked finite promotes it (promote_checkpoint)."""
    for name, step in (("checkpoint", 4), ("checkpoint.new", 6)):
        write(tmp_path / name / "state.pt", f"step {step}")
    with pytest.raises(SystemExit, match="step 7: the loss is inf"):
        harness.check_finite(7, str(tmp_path), grad_norm=1.0, loss=float("inf"))
    assert (
        sorted(os.listdir(tmp_path)) == ["checkpoint"]
        and (tmp_path / "checkpoint" / "state.pt").read_text() == "step 4"
    )
    write(tmp_path / "checkpoint.new" / "state.pt", "step 8")
    harness.check_finite(9, str(tmp_path), grad_norm=1.0, loss=0.5)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.new"]  # finite: kept, not yet promoted
    harness.promote_checkpoint(str(tmp_path))
    assert (
        sorted(os.listdir(tmp_path)) == ["checkpoint"]
        and (tmp_path / "checkpoint" / "state.pt").read_text() == "step 8"
    )


@pytest.mark.slow
def test_resume_restores_metrics_from_the_checkpoint(tmp_path):
    """A missing or torn metrics.jsonl does not make a good checkpoint unusable: the checkpoint
    holds the metrics logged up to its step, and --resume writes them back."""
    args = ["--max_steps", "8", "--save_steps", "3", "--per_device_train_batch_size", "8", "--logging_steps", "1",
            "--eval_steps", "100", "--num_eval_examples", "8"]
    whole = str(tmp_path / "whole")
    run_main("sft.py", *args, "--output_dir", whole)
    killed = str(tmp_path / "killed")
    _signal_when(_start("sft.py", [*args, "--output_dir", killed]),
                 lambda: _lines(os.path.join(killed, "metrics.jsonl")) >= 5)
    for damage in ("torn", "missing"):
        broken = str(tmp_path / damage)
        shutil.copytree(killed, broken)
        metrics = os.path.join(broken, "metrics.jsonl")
        os.remove(metrics)
        if damage == "torn":
            with open(metrics, "w") as f:
                f.write('{"step": 1, "loss": 5.6}\n{"step": 2, "lo')  # cut in the middle of a line
        result = run_main("sft.py", *args, "--output_dir", broken, "--resume", "true")
        assert "resumed from" in result.stdout
        assert_same_run(whole, broken)


def test_a_judges_non_finite_score_stops_the_run():
    """A NaN or inf score of a learned judge or reward model stops with one sentence, not a silent
    preference (NaN != NaN would count every pair) or a NaN reward."""
    checks.check_finite_scores(torch.tensor([0.5, -2.0]), "--judge out/rm")  # finite: nothing happens
    for bad in (float("nan"), float("inf")):
        with pytest.raises(SystemExit, match=f"--judge out/rm gave a score of {bad}: its scores must be finite"):
            checks.check_finite_scores(torch.tensor([0.5, bad]), "--judge out/rm")


def test_troubleshooting_counts_the_table():
    """docs/troubleshooting.md quotes the size of the bad-input table: it stays the table's."""
    with open(os.path.join(ROOT, "docs", "troubleshooting.md")) as f:
        text = " ".join(f.read().split())
    scripts = {script for script, _, _ in TABLE}
    words = {6: "six", 5: "five"}
    assert f"holds the table: {len(CASES)} cases, {len(TABLE)} rows over the {words[len(scripts)]} scripts" in text


def test_every_numeric_setting_has_a_range():
    """Every int or float setting of every script is checked (finite, and in its range)."""
    for name, module in SCRIPTS.items():
        for field in dataclasses.fields(module.Config):
            if field.type in (int, float, int | None, float | None):
                assert checks.declared_check(module.Config, field.name), \
                    f"{name} --{field.name} has no range check (declare it with setting)"


def test_the_runs_settings_are_declared_once():
    """The run's settings (harness.RunConfig and the two that extend it) are declared, with their
    help and check, in lib/harness.py only: a script's Config may change a default, never the check."""
    run_fields = {field.name for field in dataclasses.fields(harness.RLConfig)}
    for name, module in SCRIPTS.items():
        own = module.Config.__dict__["__dataclass_fields__"]
        assert issubclass(module.Config, harness.RunConfig), name
        for field_name in run_fields & set(vars(module.Config).get("__annotations__", {})):
            assert "usable" not in own[field_name].metadata, f"{name} declares the run's --{field_name} again"
    # and a setting whose default a script changes keeps the run's check
    with pytest.raises(SystemExit, match="--max_steps must be at least 1"):
        checks.check_settings(sft.Config(max_steps=0))


@pytest.mark.slow
def test_one_writer_per_folder(tmp_path):
    """A second run into a folder that a running run writes to stops with one sentence."""
    out = str(tmp_path / "out")
    first = _start("sft.py", ["--max_steps", "2000", "--output_dir", out])
    try:
        deadline = time.time() + 120
        while not os.path.isfile(os.path.join(out, "metrics.jsonl")):
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        for flags in (["--overwrite_output_dir", "true"], ["--resume", "true"]):  # this process is the second run
            with pytest.raises(SystemExit) as stop:
                sft.main(common.parse_config(sft.Config, ["--max_steps", "2000", "--output_dir", out, *flags]))
            assert (
                stop.value.code
                == f"error: another run is writing to {out}: wait for it to finish, or choose another --output_dir"
            )
        # from the command line
        second = run("sft.py", "--output_dir", out, "--overwrite_output_dir", "true", check=False)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert second.stderr.strip().splitlines()[-1].startswith(f"error: another run is writing to {out}")
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_a_full_model_replaces_an_older_lora_adapter(sft_checkpoint, tmp_path):
    """A LoRA run's folder holds adapter files; a full run written over it must not leave them
    there (load_model would merge the old adapter instead of reading the new weights)."""
    out = str(tmp_path / "out")
    short = ["--model", sft_checkpoint, "--max_steps", "2", "--eval_steps", "100", "--num_eval_examples", "8",
             "--per_device_train_batch_size", "8"]
    run_main("sft.py", *short, "--lora_r", "4", "--output_dir", out)
    assert os.path.isfile(os.path.join(out, "adapter_config.json"))
    run_main("sft.py", *short, "--learning_rate", "1e-3", "--output_dir", out, "--overwrite_output_dir", "true")
    assert not any(name.startswith("adapter") for name in os.listdir(out)), os.listdir(out)
    with open(os.path.join(out, "run.json")) as f:
        assert json.load(f)["settings"]["lora_r"] is None
    loaded = common.load_model(out)[0]
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())


def _signal_when(process, condition, sig=signal.SIGKILL, timeout=300):
    """Send `sig` to the process as soon as `condition()` holds (it must not finish first)."""
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"finished before the kill point:\n{process.stderr[-2000:]}"
        assert time.time() < deadline
        time.sleep(0.0005)
    process.send_signal(sig)
    process.wait()


def _start(script, args):
    return start(script, *args)


def _lines(path):
    return sum(1 for _ in open(path)) if os.path.isfile(path) else 0


RUNS = {
    "sft.py": lambda checkpoint: ["--max_steps", "12", "--save_steps", "3", "--per_device_train_batch_size", "8",
                                  "--eval_steps", "6", "--num_eval_examples", "16", "--logging_steps", "1"],
    "grpo.py": lambda checkpoint: ["--model", checkpoint, "--max_steps", "8", "--save_steps", "2",
                                   "--per_device_train_batch_size", "16", "--num_generations", "4", "--eval_steps", "4",
                                   "--num_eval_examples", "8", "--warmup_steps", "1"],
}  # agent.py's checkpoints are the same harness path as grpo.py's (its episodes hold no state across steps)


@pytest.mark.slow
@pytest.mark.parametrize("script", list(RUNS))
def test_same_seed_same_metrics_and_a_killed_run_resumes_to_the_same_result(sft_checkpoint, tmp_path, script):
    """A second run of the same seed, killed (SIGKILL) between checkpoints and in the middle of writing one, then
    --resumed each time, logs the same metrics (timings aside) and ends with the same weights as the unbroken
    run: determinism (its steps up to the first kill are a fresh run's) and an exact resume at once."""
    args = RUNS[script](sft_checkpoint)
    first, broken = (str(tmp_path / name) for name in ("first", "broken"))
    run_main(script, *args, "--output_dir", first)

    metrics = os.path.join(broken, "metrics.jsonl")
    # 1. killed between two checkpoints: the 5th metrics line is past the first checkpoint
    _signal_when(_start(script, [*args, "--output_dir", broken]), lambda: _lines(metrics) >= 5)
    # 2. resumed, then killed while it writes its next checkpoint
    _signal_when(_start(script, [*args, "--output_dir", broken, "--resume", "true"]),
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
    assert_same_run(first, broken)


# --- a new run over an old run's folder: killed at any point --------------------------------------
OLD_RUN = ["--max_steps", "6", "--save_steps", "3", "--per_device_train_batch_size", "8", "--eval_steps", "6",
           "--num_eval_examples", "8", "--logging_steps", "1"]
NEW_RUN = [*OLD_RUN[:-4], "--num_eval_examples", "8", "--logging_steps", "1", "--max_steps", "10", "--save_steps", "2",
           "--learning_rate", "1e-3"]


def _visible(folder):
    """The folder as a user sees it: every file and its bytes, hidden entries (.next_run) aside."""
    return {path: data for path, data in snapshot(folder).items() if not path.startswith(".")}


def _check_old_whole_or_new_resumable(folder, old, unbroken_new):
    """The invariant after a kill: the old run is whole (and --resume either continues the new run
    from its own checkpoint or says it has none), or the new run is resumable; either way a
    --resume ends exactly as the unbroken new run, or refuses in one sentence and changes nothing."""
    next_run_checkpoint = harness.newest_checkpoint(os.path.join(folder, harness.NEXT_RUN))
    if _visible(folder) != old:  # not the old run: then the new run must have moved in with its checkpoint
        assert harness.newest_checkpoint(folder) or os.path.isfile(os.path.join(folder, harness.NEXT_RUN, ".complete"))
    if _visible(folder) == old and next_run_checkpoint is None:  # --resume finds the old run's checkpoint, or none
        result = run("sft.py", *NEW_RUN, "--output_dir", folder, "--resume", "true", check=False)
        refusal = ("stopped before its first checkpoint" if os.path.isdir(os.path.join(folder, harness.NEXT_RUN))
                   else "--resume continues the run as it was set, and --max_steps was 6, now 10")
        assert result.returncode == 1 and refusal in result.stderr, result.stderr[-2000:]
        assert _visible(folder) == old
        return "old whole, new not started"
    run_main("sft.py", *NEW_RUN, "--output_dir", folder, "--resume", "true")
    assert_same_run(unbroken_new, folder)
    assert not os.path.exists(os.path.join(folder, harness.NEXT_RUN))
    return "new resumed"


# (signal, when to send it: a condition on the new run's .next_run folder), from the process's start to its move-in
KILL_POINTS = [
    (signal.SIGTERM, lambda next_run: True),  # as soon as the process exists
    (signal.SIGKILL, lambda next_run: os.path.isdir(next_run)),  # the new run has only begun to write
    (signal.SIGKILL, lambda next_run: os.path.isdir(os.path.join(next_run, "checkpoint.tmp"))),  # inside a save
    (signal.SIGTERM, lambda next_run: _lines(os.path.join(next_run, "metrics.jsonl")) >= 7),  # between two saves
    (signal.SIGTERM, lambda next_run: os.path.isfile(os.path.join(next_run, "model.safetensors"))),  # at the end
]  # the move-in itself, a few renames: test_a_crash_inside_the_move_in_is_finished_by_the_next_run


@pytest.mark.slow
def test_a_kill_at_any_point_of_a_run_over_an_old_one_leaves_the_old_whole_or_the_new_resumable(tmp_path):
    old_folder, unbroken = str(tmp_path / "old"), str(tmp_path / "unbroken")
    run_main("sft.py", *OLD_RUN, "--output_dir", old_folder)
    run_main("sft.py", *NEW_RUN, "--output_dir", unbroken)
    old = _visible(old_folder)
    assert "model.safetensors" in old and "checkpoint/state.pt" in old
    outcomes = []
    for number, (sig, condition) in enumerate(KILL_POINTS):
        folder = str(tmp_path / f"run{number}")
        shutil.copytree(old_folder, folder)
        process = _start("sft.py", [*NEW_RUN, "--output_dir", folder, "--overwrite_output_dir", "true"])
        _signal_when(process, lambda: condition(os.path.join(folder, harness.NEXT_RUN)), sig)
        outcomes.append(_check_old_whole_or_new_resumable(folder, old, unbroken))
    assert "old whole, new not started" in outcomes and "new resumed" in outcomes, outcomes


def crash_inside_the_move_in(monkeypatch, folder):
    """Run NEW_RUN over the run in `folder` and crash it between two renames of its move-in (the
    third rename out of .next_run fails, not one of a save): .next_run is left marked complete."""
    renames, replace = [], os.replace

    def crash_on_the_third(source, target):  # (a file written whole inside .next_run is renamed there: not counted)
        if os.path.dirname(source) == os.path.join(folder, harness.NEXT_RUN) and os.path.dirname(target) == folder:
            renames.append(target)
            if len(renames) == 3:
                raise OSError("simulated crash")
        replace(source, target)

    monkeypatch.setattr(harness.os, "replace", crash_on_the_third)
    with pytest.raises(OSError, match="simulated crash"):
        run_main("sft.py", *NEW_RUN, "--output_dir", folder, "--overwrite_output_dir", "true")
    monkeypatch.undo()


@pytest.mark.slow
def test_a_crash_inside_the_move_in_is_finished_by_the_next_run(tmp_path, monkeypatch):
    """The move-in of a finished run is several renames; a crash between two of them (simulated:
    the third rename fails) leaves .next_run marked complete, and the next run into the folder
    finishes the move first: --resume then ends exactly as the unbroken run."""
    old_folder, unbroken = str(tmp_path / "old"), str(tmp_path / "unbroken")
    run_main("sft.py", *OLD_RUN, "--output_dir", old_folder)
    run_main("sft.py", *NEW_RUN, "--output_dir", unbroken)
    crash_inside_the_move_in(monkeypatch, old_folder)
    assert os.path.isfile(os.path.join(old_folder, harness.NEXT_RUN, ".complete"))
    run_main("sft.py", *NEW_RUN, "--output_dir", old_folder, "--resume", "true")
    assert_same_run(unbroken, old_folder)
    assert not os.path.exists(os.path.join(old_folder, harness.NEXT_RUN))


def test_a_small_share_of_bad_rows_is_skipped_and_counted(tmp_path, capsys):
    """1 unusable row in 201 (under 1%) is dropped with a count in the log; a later line is still
    named by its own line number."""
    path = tmp_path / "train.jsonl"
    rows = ROW * 100 + json.dumps({"question": "", "answer": "#### 1"}) + "\n" + ROW * 100
    path.write_text(rows)
    data = common.load_jsonl(str(path), ("question", "answer"))
    assert len(data) == 200 and "" not in data["question"]
    assert (
        f"{path}: skipped 1 of 201 unusable rows (the first, line 101: 'question' is empty)" in capsys.readouterr().out
    )
    path.write_text(rows + json.dumps({"question": "q", "answer": "#### 1", "id": 7}) + "\n"
                    + json.dumps({"question": "q", "answer": "#### 1", "id": "seven"}) + "\n")
    with pytest.raises(SystemExit, match="line 203: 'id' is str, where line 202 has int"):
        common.load_jsonl(str(path), ("question", "answer"))


# --- round three: a new folder, a half-moved run, a full disk, inputs a user expects to work ----------
def test_a_utf8_file_with_a_byte_order_mark_is_read(tmp_path):
    """Some editors save UTF-8 with a byte-order mark (EF BB BF) before the first line: it is read."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (ROW * 3).encode())
    data = common.load_jsonl(str(path), ("question", "answer"))
    assert len(data) == 3 and data.column_names == ["question", "answer"]


def test_a_second_run_into_a_new_folder_is_refused_from_the_first_moment(tmp_path):
    """Two runs started at once into a folder that does not exist yet: the first to get there makes
    the folder and locks it at once, so the other stops with one sentence, and does not replace the
    first's results when it finishes later. Here this process is the first (it has only reached
    prepare_output_dir) and a real second run starts beside it."""
    out = str(tmp_path / "new")
    cfg = sft.Config(output_dir=out)
    assert harness.prepare_output_dir(cfg, {}) == out and os.path.isdir(out)  # made and locked
    second = run("sft.py", "--output_dir", out, "--max_steps", "2", check=False)
    assert second.returncode == 1 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        f"error: another run is writing to {out}: wait for it to finish, or choose another --output_dir")
    assert os.listdir(out) == []


@pytest.mark.slow
def test_a_run_that_stops_on_bad_input_leaves_no_new_folder(tmp_path):
    """In a process forked from the tests' script server and in a new interpreter alike (conftest.start's
    speed-up): the same sentence, exit status and output, and the folder removed by the script's atexit function."""
    results = []
    for name, command in (("forked", run), ("new", lambda *args, check: subprocess.run(
            [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600))):
        out = str(tmp_path / name / "never_written")
        result = command("grpo.py", "--model", str(tmp_path / "missing"), "--output_dir", out, check=False)
        assert result.returncode == 1 and "run `python sft.py` first" in result.stderr
        assert not os.path.exists(out)
        results.append((result.returncode, result.stdout, result.stderr.replace(out, "OUT")))
    assert results[0] == results[1]


@pytest.mark.slow
def test_a_killed_move_in_is_refused_as_a_model_until_a_run_finishes_it(tmp_path, monkeypatch):
    """A run killed while it moved a finished run into place leaves a folder that mixes two runs:
    reading it as --model is refused in one sentence; the next run of the script into it finishes the
    move, and then it reads as the new run."""
    folder = str(tmp_path / "run")
    run_main("sft.py", *OLD_RUN, "--output_dir", folder)
    crash_inside_the_move_in(monkeypatch, folder)
    reader = ["--model", folder, "--max_steps", "1", "--per_device_train_batch_size", "16", "--num_generations", "4",
              "--num_eval_examples", "4", "--output_dir", str(tmp_path / "grpo")]
    with pytest.raises(SystemExit, match=f"{folder} is half replaced") as stop:
        grpo.main(common.parse_config(grpo.Config, reader))
    assert "\n" not in str(stop.value.code)
    run_main("sft.py", *NEW_RUN, "--output_dir", folder, "--resume", "true")  # finishes the move
    run_main("grpo.py", *reader)


def _file_size_limit(limit: int):
    """For a subprocess: writes past `limit` bytes fail (EFBIG), as on a full disk, instead of killing it."""
    def apply():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_is_one_sentence_and_leaves_no_temporary_files(tmp_path):
    """A write that fails while a checkpoint is saved (here a 2 MB file-size limit: the tiny model's
    state.pt is ~13 MB): one sentence naming the folder, checkpoint.tmp removed, nothing half written."""
    out = str(tmp_path / "out")
    result = subprocess.run([sys.executable, "sft.py", "--output_dir", out, "--max_steps", "4", "--save_steps", "2",
                             "--per_device_train_batch_size", "8", "--eval_steps", "100", "--num_eval_examples", "8"],
                            cwd=ROOT, capture_output=True, text=True, preexec_fn=_file_size_limit(2 << 20))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: could not write a checkpoint to {out} (")
    assert "free space on its disk" in result.stderr
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]  # no checkpoint.tmp left behind, no checkpoint half written


@pytest.mark.slow
def test_a_final_save_that_fails_keeps_the_last_checkpoint_and_resumes(tmp_path, monkeypatch):
    """The trained model cannot be written (a full disk, injected): one sentence, the temporary folder
    removed, the last checkpoint whole; --resume then finishes the run as an unbroken one would."""
    args = ["--max_steps", "4", "--save_steps", "2", "--per_device_train_batch_size", "8", "--eval_steps", "100",
            "--num_eval_examples", "8", "--logging_steps", "1"]
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    run_main("sft.py", *args, "--output_dir", whole)

    def disk_full(self, folder, *rest, **kwargs):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"half a model")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(common.build_tiny_model(common.build_tokenizer())), "save_pretrained", disk_full)
    with pytest.raises(SystemExit) as stop:
        sft.main(common.parse_config(sft.Config, [*args, "--output_dir", broken]))
    assert str(stop.value.code).startswith(f"error: could not write the trained model to {broken} "
                                           "(No space left on device)")
    assert not os.path.exists(os.path.join(broken, ".checkpoint_tmp"))
    assert not os.path.exists(os.path.join(broken, "model.safetensors"))
    assert os.path.isfile(os.path.join(broken, "checkpoint", "state.pt"))
    monkeypatch.undo()
    run_main("sft.py", *args, "--output_dir", broken, "--resume", "true")
    assert_same_run(whole, broken)


def test_a_process_whose_peer_stopped_says_so_in_one_sentence(tmp_path, capsys):
    """Under torchrun, when another process stops (bad input there, its own sentence), this process's
    next collective fails: harness's excepthook turns that into one sentence, not a traceback."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        harness._stop_with_a_stopped_peer(RuntimeError, RuntimeError("[pair.cc:534] Connection closed by peer"), None)
        assert capsys.readouterr().err == ("error: process 0 stopped because another process of this run stopped "
                                           "(its own message says why)\n")
    finally:
        dist.destroy_process_group()


# --- inputs that change under --resume, leftovers of a kill, symbolic links, file modes ------------
def test_resume_refuses_a_model_folder_that_changed_since_the_run_started(sft_folder, tmp_path):
    """pi_ref is read again from --model at --resume: a folder rebuilt in between (here: replaced by a
    model of another shape) would mix two starts, so the run refuses it in one sentence naming it,
    before loading anything; put back, the same folder resumes."""
    model = tmp_path / "model"
    shutil.copytree(sft_folder, model, ignore=shutil.ignore_patterns("checkpoint*"))
    out = str(tmp_path / "out")
    args = ["--model", str(model), "--max_steps", "3", "--save_steps", "1", "--per_device_train_batch_size", "8",
            "--eval_steps", "100", "--num_eval_examples", "8", "--output_dir", out]
    run_main("sft.py", *args)
    recorded = json.loads(open(os.path.join(out, "run.json")).read())["inputs"]
    assert recorded["--model"] == harness.fingerprint(str(model)) and "--dataset" in recorded
    shutil.copytree(model, tmp_path / "backup")
    common.build_tiny_model(common.build_tokenizer(), hidden_size=64).save_pretrained(model)  # another shape
    with pytest.raises(SystemExit) as stop:
        sft.main(common.parse_config(sft.Config, [*args, "--resume", "true"]))
    assert str(stop.value.code) == (
        f"error: --resume: --model {model} has changed since this run started (its files differ), and continuing "
        "would mix two starts: put back the --model the run started from, or start a new run "
        "(--overwrite_output_dir true)")
    shutil.rmtree(model)
    shutil.copytree(tmp_path / "backup", model)
    result = run_main("sft.py", *args, "--resume", "true", "--logging_steps", "2")
    assert "resumed from" in result.stdout and "resume: --logging_steps 2 (was 10) applies from here" in result.stdout
    assert "--resume True" not in result.stdout  # the flag that resumes is not a changed setting


def test_a_kills_leftovers_go_with_the_next_run_into_the_folder(tmp_path):
    """checkpoint.tmp and .checkpoint_tmp (a kill during a save) are removed by whatever run comes next
    into the folder, --overwrite_output_dir included: for a real model each is a model's size."""
    out = tmp_path / "out"
    write(out / "run.json", json.dumps({"files": ["model.safetensors", "run.json"]}))
    write(out / "model.safetensors", "an old model")
    leftovers = ["checkpoint.tmp/state.pt", ".checkpoint_tmp/model.safetensors", "critic/.checkpoint_tmp/x",
                 ".next_run/checkpoint.tmp/state.pt"]
    for path in leftovers:
        write(out / path, "half written")
    cfg = common.parse_config(sft.Config, ["--output_dir", str(out), "--overwrite_output_dir", "true"])
    assert harness.prepare_output_dir(cfg, {}) == str(out / harness.NEXT_RUN)
    for path in leftovers:  # the leftover folder itself is gone
        assert not os.path.exists(out / os.path.dirname(path)), path
    assert (out / "model.safetensors").read_text() == "an old model" and (out / "critic").is_dir()


def test_a_checkpoint_folder_that_is_a_symbolic_link_is_replaced_not_followed(tmp_path):
    """A checkpoint/ that is a symbolic link (to another disk, say): promotion renames and removes the
    link itself, never what it points to, and the next promotion works too (no half-moved folder)."""
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "state.pt", "step 2")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(elsewhere, run_dir / "checkpoint")
    for step in (4, 6):
        write(run_dir / "checkpoint.new" / "state.pt", f"step {step}")
        harness.promote_checkpoint(str(run_dir))
        assert sorted(os.listdir(run_dir)) == ["checkpoint"] and not os.path.islink(run_dir / "checkpoint")
        assert (run_dir / "checkpoint" / "state.pt").read_text() == f"step {step}"
    assert (elsewhere / "state.pt").read_text() == "step 2"


def test_a_failed_write_promises_a_checkpoint_only_when_there_is_one(tmp_path):
    for has_checkpoint in (False, True):
        run_dir = tmp_path / str(has_checkpoint)
        write(run_dir / "metrics.jsonl", "")
        if has_checkpoint:
            write(run_dir / "checkpoint" / "state.pt", "a good state")
        with pytest.raises(SystemExit) as stop, harness.writing("the trained model", str(run_dir / "critic")):
            raise OSError(28, "No space left on device")
        text = str(stop.value.code)
        assert text.startswith(f"error: could not write the trained model to {run_dir / 'critic'} (No space left")
        assert (f"the last good checkpoint ({run_dir / 'checkpoint'}) is kept" in text) == has_checkpoint
        assert ("no checkpoint of this run was written yet" in text) != has_checkpoint


def test_the_saved_model_is_readable_as_every_other_file(tmp_path):
    """safetensors writes model.safetensors private (0600): the save gives it the umask's mode, as
    the run's other files have (a shared out/ is readable by the group)."""
    mask = os.umask(0o022)
    try:
        model, tokenizer = common.build_tiny_model(common.build_tokenizer()), common.build_tokenizer()
        harness.save_checkpoint(model, tokenizer, str(tmp_path))
    finally:
        os.umask(mask)
    assert {name: os.stat(tmp_path / name).st_mode & 0o777 for name in ("model.safetensors", "config.json")} == {
        "model.safetensors": 0o644, "config.json": 0o644}


# --- runs that cannot learn, and metrics that are not numbers -----------------------------------------
NOTHING_TO_LEARN = {  # a random model never writes the answer format: every reward, and every judge's score, equal
    "dpo.py": (["--online", "true", "--judge", "rule"], "at each one, every pair was a tie, the judge scoring both "
               "samples of each prompt the same (a higher --temperature, or a judge with finer scores, gives pairs)"),
    "grpo.py": (["--dynamic_sampling", "true", "--max_sampling_rounds", "2"],
                "at each one, dynamic sampling found no group whose rewards differ in --max_sampling_rounds rounds"),
    "rft.py": ([], "at each one, the checker accepted none of the samples"),
}


@pytest.mark.parametrize("script", list(NOTHING_TO_LEARN))
def test_a_run_with_nothing_to_learn_says_so_and_saves_nothing(saved_tiny, tmp_path, script):
    args, why = NOTHING_TO_LEARN[script]
    out = tmp_path / "out"
    module = SCRIPTS.get(script) or __import__(script.removesuffix(".py"))
    with pytest.raises(SystemExit) as stop:
        module.main(common.parse_config(module.Config, [
            "--model", str(saved_tiny[0]), "--max_steps", "2", "--per_device_train_batch_size", "8",
            "--max_completion_length", "8", "--eval_steps", "100", "--num_eval_examples", "8", "--output_dir", str(out),
            *args]))
    text = str(stop.value.code)
    assert text.startswith("error: nothing was trained in 2 steps: ") and why in text, text
    assert text.endswith(f"the model was not saved (the steps' metrics are in {out / 'metrics.jsonl'})")
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert not (out / "model.safetensors").exists() and steps[-2:] == [1, 2]


def test_a_metric_that_is_not_a_number_stops_the_run(saved_tiny, tmp_path, monkeypatch):
    """A NaN or infinite metric (here GRPO's KL, injected) stops the run at its step in one sentence, as a
    NaN loss does, instead of being written to metrics.jsonl while the run goes on."""
    step_metrics = grpo.step_metrics
    monkeypatch.setattr(grpo, "step_metrics", lambda *a, **k: {**step_metrics(*a, **k), "kl": float("nan")})
    with pytest.raises(SystemExit) as stop:
        grpo.main(common.parse_config(grpo.Config, [
            "--model", str(saved_tiny[0]), "--max_steps", "2", "--per_device_train_batch_size", "8",
            "--max_completion_length", "8", "--eval_steps", "100", "--num_eval_examples", "8",
            "--output_dir", str(tmp_path / "out")]))
    assert str(stop.value.code) == ("error: step 1: the metric kl is nan; stopped at this step's metrics; a lower "
                                    "--learning_rate usually helps (in a new run: --overwrite_output_dir true)")


def test_more_processes_than_gpus_is_one_sentence(monkeypatch):
    """torchrun --nproc_per_node 2 on a machine with one GPU: rank 1 would die in CUDA's "invalid device
    ordinal" traceback; it says what is wrong instead, before it touches the GPU."""
    from lib import distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("a GPU was touched"))
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        distributed.setup()
    assert str(stop.value.code) == ("error: torchrun started 2 processes on this machine, which has 1 GPU: each "
                                    "process needs a GPU of its own (torchrun --nproc_per_node 1)")


# --- a run folder's own record, a stop at --resume, evaluation that moves training, a NaN's advice -------
@pytest.mark.slow
def test_a_copied_run_folder_whose_run_json_names_another_folder_deletes_nothing(sft_folder, tmp_path):
    """A finished run's folder copied from someone else, its run.json listing ../victim: replacing that
    run is refused in one sentence before any training, and the folder it names is untouched."""
    victim, out = tmp_path / "victim", tmp_path / "copied"
    write(victim / "notes.txt", "someone else's work")
    shutil.copytree(sft_folder, out)
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**record, "files": [*record["files"], "../victim"]}))
    before = snapshot(str(out))
    with pytest.raises(SystemExit) as stop:
        sft.main(common.parse_config(sft.Config, ["--max_steps", "1", "--output_dir", str(out),
                                                  "--overwrite_output_dir", "true"]))
    assert str(stop.value.code) == (
        f"error: {out / 'run.json'} lists '../victim', which is not a file a run writes inside {out}; a run that "
        "replaces this one would remove it, so nothing was removed: delete that file, or choose another --output_dir")
    assert (victim / "notes.txt").read_text() == "someone else's work" and snapshot(str(out)) == before


@pytest.mark.slow
def test_a_run_whose_run_json_was_deleted_leaves_none_of_its_files_after_an_overwrite(tmp_path):
    """A GRPO-like run's folder without its run.json (deleted, or the run killed before its end):
    the sft.py run that replaces it leaves none of the old run's files (its samples, its figure, its
    checkpoint) and keeps the files no run writes."""
    out = tmp_path / "out"
    for name in ("completions.jsonl", "grpo.png", "metrics.jsonl", "eval.json", "checkpoint/state.pt"):
        write(out / name, "the old run's")
    write(out / "notes.txt", "mine")
    run_main("sft.py", "--max_steps", "1", "--per_device_train_batch_size", "8", "--eval_on_start", "false",
             "--num_eval_examples", "4", "--output_dir", str(out), "--overwrite_output_dir", "true")
    record = json.loads((out / "run.json").read_text())
    assert sorted(os.listdir(out)) == sorted([*record["files"], "notes.txt"])
    assert not {"completions.jsonl", "grpo.png"} & set(os.listdir(out))
    assert (out / "notes.txt").read_text() == "mine" and "the old run's" not in (out / "eval.json").read_text()


@pytest.mark.slow
def test_a_resumed_run_with_nothing_to_learn_stops_again_and_keeps_the_good_run(saved_tiny, tmp_path):
    """rft.py over a good run, from a model that never writes the answer format: it stops with "nothing
    was trained" and keeps the good run. --resume true on it stops the same way (the reason is in the
    checkpoint) instead of saving the untrained model over the good run."""
    out = tmp_path / "out"
    write(out / "eval.json", '{"accuracy_greedy": 0.9}\n')
    write(out / "run.json", json.dumps({"script": "rft.py", "files": ["eval.json", "run.json"]}))
    args = ["--model", str(saved_tiny[0]), "--max_steps", "2", "--per_device_train_batch_size", "8",
            "--max_completion_length", "8", "--eval_steps", "100", "--num_eval_examples", "8", "--output_dir", str(out)]
    for flag in ("--overwrite_output_dir", "--resume"):
        with pytest.raises(SystemExit) as stop:
            rft.main(common.parse_config(rft.Config, [*args, flag, "true"]))
        assert str(stop.value.code).startswith("error: nothing was trained in 2 steps: at each one, the checker")
        assert (out / "eval.json").read_text() == '{"accuracy_greedy": 0.9}\n'
        assert sorted(os.listdir(out)) == [".next_run", "eval.json", "run.json"]


@pytest.mark.slow
def test_the_evaluation_settings_change_an_rl_run_so_resume_refuses_them(sft_checkpoint, tmp_path):
    """--eval_steps alone changes GRPO's trained weights (the sampled evaluation draws from the generator
    the rollouts draw from), which is why --resume refuses an evaluation setting it did not start with."""
    args = ["--model", sft_checkpoint, "--max_steps", "2", "--per_device_train_batch_size", "16",
            "--num_generations", "4", "--num_eval_examples", "8", "--eval_on_start", "false"]
    for every in ("1", "2"):
        run_main("grpo.py", *args, "--eval_steps", every, "--output_dir", str(tmp_path / every))
    a, b = (load_file(str(tmp_path / every / "model.safetensors")) for every in ("1", "2"))
    assert any(not torch.equal(a[name], b[name]) for name in a)
    with pytest.raises(SystemExit) as stop:
        grpo.main(common.parse_config(grpo.Config, [*args, "--eval_steps", "2", "--max_steps", "2",
                                                    "--output_dir", str(tmp_path / "1"), "--resume", "true"]))
    assert "--eval_steps was 1, now 2: resume with the run's values" in str(stop.value.code)


def test_kto_leaves_out_the_statistics_of_answers_a_batch_does_not_hold():
    """A KTO batch with no desirable answer has no rewards/chosen (or logps/chosen, or margins): they are
    left out of the metrics line, not logged as 0.0, which a curve would read as a log-prob of 0."""
    rewards, logps, lengths = torch.tensor([0.5, -0.5]), torch.tensor([-3.0, -5.0]), torch.tensor([4, 6])
    metrics = dpo.kto_metrics(rewards, logps, lengths, torch.zeros(2), torch.tensor(0.1))
    assert not {"rewards/chosen", "logps/chosen", "rewards/margins"} & set(metrics)
    assert metrics["rewards/rejected"] == 0.0 and metrics["logps/rejected"] == -4.0
    pairs = dpo.step_metrics(torch.tensor([1.0, 2.0]), torch.tensor([-1.0, -2.0]), lengths, torch.zeros(1))
    assert set(pairs) == {"completion_length"}  # every pair a tie: no pair statistics at all


def test_a_loss_that_is_not_finite_before_any_update_does_not_blame_the_learning_rate(saved_tiny, tmp_path):
    """Offline DPO with --beta 1e38: the gradient overflows at step 1, before any update, so the advice is
    the setting that scales the loss, not the learning rate (the weights are still the starting model's)."""
    with pytest.raises(SystemExit) as stop:
        dpo.main(common.parse_config(dpo.Config, [
            "--model", str(saved_tiny[0]), "--beta", "1e38", "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--eval_on_start", "false", "--num_eval_examples", "4", "--output_dir", str(tmp_path / "out")]))
    text = str(stop.value.code)
    assert text.startswith("error: step 1: the grad norm is ") and "learning_rate" not in text, text
    assert text.endswith("a smaller --beta (here 1e+38, by default 0.1) usually helps (in a new run: "
                         "--overwrite_output_dir true)"), text
    helps = lambda updated, **settings: harness.Run.what_helps(  # noqa: E731
        types.SimpleNamespace(cfg=grpo.Config(**settings), updated=updated))
    assert helps(True) == "a lower --learning_rate usually helps"
    assert helps(True, beta=1.0) == ("a smaller --beta (here 1, by default 0.04) or a lower --learning_rate "
                                     "usually helps")
    assert helps(False).startswith("no update had been applied yet")
