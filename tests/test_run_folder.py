"""A run writes, moves and removes only inside --output_dir, links or not; it replaces only a run, never a
folder of someone's own files; its clean-up removes only the leftovers this repo writes; --resume reads
back only the lines a run writes. Each case as a user meets it: a script's command line on a folder."""
import importlib
import json
import os

import pytest

import common
from lib import harness
from conftest import run_main

SFT = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--eval_on_start", "false", "--num_eval_examples", "4",
       "--save_steps", "1"]  # a finished sft.py run in a few seconds, with a checkpoint at its last step
GRPO = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4", "--eval_on_start", "false",
        "--num_eval_examples", "4", "--eval_samples_per_problem", "1", "--max_completion_length", "16",
        "--save_steps", "1", "--log_completions_steps", "1"]  # the same for grpo.py, with completions.jsonl


def stopped(script: str, *args) -> str:
    """`python script args` in this process, which must stop with one sentence: returns it."""
    module = importlib.import_module(script.removesuffix(".py"))
    with pytest.raises(SystemExit) as stop:
        module.main(common.parse_config(module.Config, list(args)))
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message.strip() and "Traceback" not in message, message
    return message


def snapshot(folder) -> dict:
    """Every path under folder (links as links) -> its bytes, or where a link points."""
    found = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = (f"-> {os.readlink(path)}" if os.path.islink(path) else
                                                    open(path, "rb").read() if os.path.isfile(path) else "folder")
    return found


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def a_finished_run(out):
    """The files and record of a finished run, written by hand (a run's layout, without its minutes)."""
    files = ["model.safetensors", "metrics.jsonl", "eval.json", "sft.png", "run.json"]
    for name in files[:-1]:
        write(out / name, "the old run's")
    write(out / "run.json", json.dumps({"files": files}))


# ---------------------------------------------------------------------------------------------
# 1. Links: never written, emptied or moved through
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "completions.jsonl"])
def test_resume_never_writes_through_a_log_that_is_a_link_to_a_file_outside(sft_folder, tmp_path, name):
    """A log of the run replaced by a symbolic link to a file of someone else's: --resume rewrites the run's
    own file in its place (the checkpoint's lines), and the file outside keeps every byte."""
    out, outside = tmp_path / "out", tmp_path / "precious.jsonl"
    run_main("grpo.py", "--model", sft_folder, "--output_dir", str(out), *GRPO)
    logged = (out / name).read_text()
    outside.write_text('{"step": 99, "mine": true}\n' * 3)
    os.remove(out / name)
    os.symlink(outside, out / name)
    run_main("grpo.py", "--model", sft_folder, "--output_dir", str(out), *GRPO, "--resume", "true")
    assert outside.read_text() == '{"step": 99, "mine": true}\n' * 3
    assert not os.path.islink(out / name)
    if name == "metrics.jsonl":  # the checkpoint holds the metrics, so the run's file is whole again
        assert (out / name).read_text() == logged


@pytest.mark.slow
def test_resume_does_not_rewrite_a_log_with_a_second_hard_link_in_place(tmp_path):
    """metrics.jsonl with a second name (a user's `ln metrics.jsonl backup.jsonl`): --resume cuts the run's
    file back to the checkpoint, and the other name keeps what it held."""
    out = tmp_path / "out"
    run_main("sft.py", "--output_dir", str(out), *SFT)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "logged after the checkpoint": 1}\n')
    held = (out / "metrics.jsonl").read_text()
    os.link(out / "metrics.jsonl", tmp_path / "backup.jsonl")
    run_main("sft.py", "--output_dir", str(out), *SFT, "--resume", "true")
    assert (tmp_path / "backup.jsonl").read_text() == held
    assert "logged after the checkpoint" not in (out / "metrics.jsonl").read_text()


@pytest.mark.parametrize("flag", [[], ["--overwrite_output_dir", "true"], ["--resume", "true"]])
def test_a_next_run_that_is_a_link_is_refused_and_nothing_moves(tmp_path, flag):
    """.next_run is where a run that replaces another writes; one that is a link to another folder (holding
    a finished run's record, leftovers, files) is never followed: not moved in, not cleaned, not resumed."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    a_finished_run(out)
    write(elsewhere / ".complete", json.dumps({"files": ["model.safetensors", "eval.json", "run.json"]}))
    write(elsewhere / "model.safetensors", "theirs")
    write(elsewhere / "eval.json", "theirs")
    write(elsewhere / "run.json", json.dumps({"files": ["model.safetensors"]}))
    write(elsewhere / ".eval.json.tmp", "theirs")
    write(elsewhere / "checkpoint.tmp" / "state.pt", "theirs")
    os.symlink(elsewhere, out / harness.NEXT_RUN)
    before_out, before_elsewhere = snapshot(out), snapshot(elsewhere)
    message = stopped("sft.py", "--output_dir", str(out), *SFT, *flag)
    assert "is a symbolic link" in message
    assert snapshot(out) == before_out and snapshot(elsewhere) == before_elsewhere


def test_a_file_written_whole_never_writes_through_a_link_at_its_temporary_name(tmp_path):
    """written_whole's temporary name (.eval.json.tmp) that is a link: the link goes, not what it points to."""
    outside = tmp_path / "precious.txt"
    outside.write_text("mine")
    (tmp_path / "out").mkdir()
    os.symlink(outside, tmp_path / "out" / ".eval.json.tmp")
    harness.write_json(str(tmp_path / "out" / "eval.json"), {"accuracy": 1.0})
    assert outside.read_text() == "mine" and json.loads((tmp_path / "out" / "eval.json").read_text()) == {
        "accuracy": 1.0}


def test_an_appended_log_is_the_runs_own_file(tmp_path):
    """log_metrics and log_completions append to a file of the run's own: a link at the name is replaced
    (the file it points to keeps its bytes), a second hard link keeps what it held."""
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "precious.jsonl"
    outside.write_text("mine\n")
    os.symlink(outside, out / "metrics.jsonl")
    harness.log_metrics(str(out), {"step": 1})
    assert outside.read_text() == "mine\n" and (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    os.link(out / "metrics.jsonl", tmp_path / "backup.jsonl")
    harness.log_metrics(str(out), {"step": 2})
    assert (tmp_path / "backup.jsonl").read_text() == '{"step": 1}\n'
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    os.symlink(outside, out / "completions.jsonl")
    harness.log_completions(str(out), 3, prompt=["p"], completion=["c"])
    assert outside.read_text() == "mine\n" and not os.path.islink(out / "completions.jsonl")


def test_a_models_subfolder_that_is_a_link_is_replaced_not_written_through(tmp_path):
    """critic/ or merged/ as a link to another folder: the run's model goes into a folder of its own."""
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere / "model.safetensors", "theirs")
    os.symlink(elsewhere, tmp_path / "critic")
    folder = harness.own_folder(str(tmp_path / "critic"))
    assert os.path.isdir(folder) and not os.path.islink(folder) and os.listdir(folder) == []
    assert snapshot(elsewhere) == {"model.safetensors": b"theirs"}


# ---------------------------------------------------------------------------------------------
# 2. A folder that holds no run is not a run to replace
# ---------------------------------------------------------------------------------------------
def test_overwrite_into_a_folder_of_figures_and_notes_that_holds_no_run_removes_nothing(tmp_path):
    """A user's folder (a README, figures, notes; the repo's own docs/ is such a folder): no run.json,
    checkpoint or metrics.jsonl, so there is no run to replace. Its files have names a run writes
    (README.md, *.png): refused in one sentence, every file kept."""
    folder = tmp_path / "docs"
    for name in ("README.md", "sft.png", "grpo.png", "notes.txt", ".sft.png.tmp", "checkpoint.tmp/state.pt"):
        write(folder / name, f"the user's {name}")  # (the last two: names of a kill's leftovers, kept on a refusal)
    before = snapshot(folder)
    message = stopped("sft.py", "--output_dir", str(folder), *SFT, "--overwrite_output_dir", "true")
    assert "holds no run of this repo" in message and "README.md" in message
    assert snapshot(folder) == before


@pytest.mark.slow
def test_a_run_writes_beside_files_whose_names_it_does_not_use_and_keeps_them_when_replaced(tmp_path):
    """A folder with only the user's notes: the run writes beside them, its run.json lists only its own
    files, and the run that replaces it later removes those and leaves the notes."""
    folder = tmp_path / "mine"
    write(folder / "notes.txt", "mine")
    write(folder / "data" / "train.jsonl", "mine")
    run_main("sft.py", "--output_dir", str(folder), *SFT)
    record = json.loads((folder / "run.json").read_text())
    assert "model.safetensors" in record["files"] and not {"notes.txt", "data"} & set(record["files"])
    run_main("sft.py", "--output_dir", str(folder), *SFT, "--overwrite_output_dir", "true")
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "data" / "train.jsonl").read_text() == "mine"
    assert sorted(os.listdir(folder)) == sorted([*json.loads((folder / "run.json").read_text())["files"], "notes.txt",
                                                 "data"])


# ---------------------------------------------------------------------------------------------
# 3. The clean-up removes only what this repo leaves behind
# ---------------------------------------------------------------------------------------------
def test_a_refused_run_removes_not_even_a_kills_leftovers(tmp_path):
    """A run refused because the folder holds a run (no --overwrite_output_dir) changes nothing in it, the
    leftovers of an earlier kill included: they go with the next run that goes ahead."""
    out = tmp_path / "out"
    a_finished_run(out)
    for name in (".eval.json.tmp", "checkpoint.tmp/state.pt", "critic/.checkpoint_tmp/model.safetensors"):
        write(out / name, "half written")
    before = snapshot(out)
    assert "already holds a run" in stopped("sft.py", "--output_dir", str(out), *SFT)
    assert snapshot(out) == before


def test_the_clean_up_keeps_a_users_dot_tmp_files_and_removes_the_runs_leftovers(tmp_path):
    """A kill leaves .eval.json.tmp, ..complete.tmp, checkpoint.tmp/: they go with the next run. A user's
    .notes.tmp (a file) and .cache.tmp/ (a folder) in the same folder are not a run's, and stay."""
    out = tmp_path / "out"
    a_finished_run(out)
    for name in (".notes.tmp", ".cache.tmp/a", harness.NEXT_RUN + "/.notes.tmp", "mine/checkpoint.tmp/a"):
        write(out / name, "mine")  # (mine/: a subfolder of the user's, not a model's)
    for name in (".eval.json.tmp", ".sft.png.tmp", "checkpoint.tmp/state.pt", harness.NEXT_RUN + "/..complete.tmp"):
        write(out / name, "half written")
    cfg = common.parse_config(importlib.import_module("sft").Config, ["--output_dir", str(out),
                                                                      "--overwrite_output_dir", "true"])
    harness.prepare_output_dir(cfg, {})
    assert (out / ".notes.tmp").read_text() == "mine" and (out / ".cache.tmp" / "a").read_text() == "mine"
    assert (out / harness.NEXT_RUN / ".notes.tmp").read_text() == "mine"
    assert (out / "mine" / "checkpoint.tmp" / "a").read_text() == "mine"
    for name in (".eval.json.tmp", ".sft.png.tmp", "checkpoint.tmp", harness.NEXT_RUN + "/..complete.tmp"):
        assert not os.path.lexists(out / name), name


# ---------------------------------------------------------------------------------------------
# 6. --resume reads back only the lines a run writes
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("line", ["this is not JSON", "[1, 2]", '{"prompt": "no step"}', '{"step": "3"}'])
def test_a_completions_line_that_is_not_a_runs_stops_resume_in_one_sentence_and_changes_nothing(
        sft_folder, tmp_path, line):
    out = tmp_path / "out"
    run_main("grpo.py", "--model", sft_folder, "--output_dir", str(out), *GRPO)
    with open(out / "completions.jsonl", "a") as f:
        f.write(line + "\n")
    before = snapshot(out)
    message = stopped("grpo.py", "--model", sft_folder, "--output_dir", str(out), *GRPO, "--resume", "true")
    lines = (out / "completions.jsonl").read_text().splitlines()
    assert f"completions.jsonl line {len(lines)} is not a line a run writes" in message
    assert snapshot(out) == before
