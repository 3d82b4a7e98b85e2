"""async_rl.py: the explorer and the trainer as two processes (lib/synchronizer.py)."""
import json
import os
import random
import socket
import time

import pytest
import torch
from conftest import ROOT, assert_same_run, read_metrics, run_main, start, z_accuracy
from safetensors.torch import load_file
from test_rlhf_scripts import _fixed_problems

import async_rl
import common
from lib import synchronizer
from lib.checks import check_settings
from lib.synchronizer import published_versions, staleness, version_for_batch


def test_the_schedule_by_hand():
    # sync_interval 1, sync_offset 0: every batch from the newest weights (grpo.py's loop)
    assert [version_for_batch(i, 1, 0) for i in range(1, 6)] == [0, 1, 2, 3, 4]
    # sync_offset 1: one batch behind, the first two from the start
    assert [version_for_batch(i, 1, 1) for i in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [staleness(i, 1, 1) for i in range(1, 6)] == [0, 1, 1, 1, 1]
    # sync_interval 3: new weights every third batch, 0, 1, 2 updates stale in turn
    assert [version_for_batch(i, 3, 0) for i in range(1, 8)] == [0, 0, 0, 3, 3, 3, 6]
    assert [staleness(i, 3, 0) for i in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    # ... with max_staleness 1 the explorer waits for a newer version where the interval would be 2 behind
    assert [version_for_batch(i, 3, 0, 1) for i in range(1, 8)] == [0, 0, 1, 3, 3, 4, 6]
    assert max(staleness(i, 4, 2, 3) for i in range(1, 40)) == 3
    # what the trainer publishes: the versions that sample, those evaluated (every 4th and the last), and 0
    assert published_versions(6, 4, 1, 1) == [0, 1, 2, 3, 4, 6]
    assert published_versions(9, 4, 3, 0) == [0, 3, 4, 6, 8, 9]


def test_flat_weights_round_trip_only_the_trained_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)  # frozen, as LoRA's base: not part of a version
    flat = synchronizer.flat_weights(model)
    assert flat.shape == (2 + 4 + 2,)
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    other[0].weight.requires_grad_(False)
    frozen = other[0].weight.clone()
    synchronizer.load_flat_weights(other, flat)
    assert torch.equal(synchronizer.flat_weights(other), flat) and torch.equal(other[0].weight, frozen)


def _short(checkpoint, data, steps):
    return ["--model", checkpoint, "--dataset", data, "--max_steps", str(steps), "--per_device_train_batch_size", "16",
            "--num_generations", "4", "--eval_steps", "4", "--num_eval_examples", "8", "--warmup_steps", "1",
            "--save_steps", "2", "--learning_rate", "1e-4"]


def _pair_run(*args, check=True):
    """`python async_rl.py args`: the launcher starts the trainer and the explorer as new interpreters."""
    process = start("async_rl.py", *args)
    process.wait()
    if check:
        assert process.returncode == 0, process.stderr[-3000:]
    return process


def _pair_start(*args) -> list:
    """The trainer and the explorer started as torchrun starts them (RANK, MASTER_PORT, ...). Speed: forked from
    the test's script server, without the launcher's two new interpreters; the launcher is _pair_run's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [start("async_rl.py", *args, env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in (0, 1)]


def _pair_wait(processes, check=True) -> list:
    for process in processes:
        process.wait()
        if check:
            assert process.returncode == 0, process.stderr[-3000:]
    return processes


@pytest.mark.slow
def test_at_staleness_0_the_pair_is_grpo_bit_for_bit(sft_checkpoint, tmp_path, monkeypatch):
    """--sync_offset 0: the explorer waits for every version, draws the same prompts and samples with the same
    random streams as grpo.py's one process, and the trainer takes grpo.py's step: the same weights, bit for bit,
    and every metric grpo.py logs the same (timings aside). One thread in grpo.py and in each of the pair's
    processes (the sums' order); the pair started by `python async_rl.py`, the launcher."""
    args = _short(sft_checkpoint, _fixed_problems(tmp_path, 16), 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher gives each of its processes this many threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_main("grpo.py", *args, "--output_dir", str(tmp_path / "grpo"))
    finally:
        torch.set_num_threads(threads)
    _pair_run(*args, "--sync_offset", "0", "--vllm_importance_sampling_correction", "false",
              "--output_dir", str(tmp_path / "pair"))
    grpo, pair = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("grpo", "pair"))
    assert grpo.keys() == pair.keys() and all(torch.equal(grpo[k], pair[k]) for k in grpo)
    for a, b in zip(read_metrics(str(tmp_path / "grpo")), read_metrics(str(tmp_path / "pair")), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if k in a and not k.startswith("time/")}
        assert b.get("off_policy/mean", 0) == 0


def _kill_one(processes, victim: int, under_way):
    """SIGKILL the trainer (0) or the explorer (1) at a random moment once under_way() says the two have met and the
    run is going: the other must stop on its next message, with one sentence, not hang. (One killed before they met
    leaves the other waiting at the meeting point until --pair_timeout_minutes; the launcher, or torchrun, stops it
    sooner: synchronizer.launch.)"""
    while not under_way():
        assert all(p.poll() is None for p in processes), processes[0].stderr[-3000:]
        time.sleep(0.01)
    time.sleep(random.Random(victim).uniform(0, 1.0))
    processes[victim].kill()
    other = processes[1 - victim]
    assert other.wait(timeout=60) == 1, other.stderr[-2000:]
    names = ("the trainer", "the explorer")
    assert f"error: {names[victim]} stopped, so {names[1 - victim]} stops too" in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr


@pytest.mark.slow
def test_mix_on_the_pair_and_a_kill_of_either_process_resumes_to_the_unbroken_run(sft_checkpoint, tmp_path):
    """MIX's loss on the pair, one update stale (the default sync_offset 1), with the correction: every batch after
    the first is one update old, the importance weights and MIX's terms are logged. Killed
    (SIGKILL) first in the explorer, then in the trainer, each time --resumed: the same metrics and weights as the
    unbroken run (the checkpoint holds the explorer's random streams and the versions it had still to load).
    pi_ref's log-probs computed by the trainer, as grpo.py computes them."""
    args = [*_short(sft_checkpoint, _fixed_problems(tmp_path, 8), 6), "--algorithm", "mix", "--reference_pass",
            "trainer"]  # pi_ref's pass in the trainer here; in the explorer (the default) in the test above
    unbroken, broken = str(tmp_path / "unbroken"), str(tmp_path / "broken")
    _pair_wait(_pair_start(*args, "--output_dir", unbroken))
    rows = [row for row in read_metrics(unbroken) if "reward" in row]
    assert [row["off_policy/mean"] for row in rows] == [0] + [1] * 5
    assert all("sampling/importance_sampling_ratio/mean" in row and "expert/sft_loss" in row for row in rows)
    # a stale batch's weights pi_old / pi_sampler are not 1: the correction acts (at staleness 0, step 1, only rounding)
    assert all(row["sampling/importance_sampling_ratio/max"] - row["sampling/importance_sampling_ratio/min"] > 1e-3
               for row in rows[1:])

    _kill_one(_pair_start(*args, "--output_dir", broken), 1, lambda: os.path.isdir(os.path.join(broken, "checkpoint")))
    resumed = _pair_start(*args, "--output_dir", broken, "--resume", "true")
    _kill_one(resumed, 0, lambda: "resumed from" in resumed[0].stdout)
    trainer, _ = _pair_wait(_pair_start(*args, "--output_dir", broken, "--resume", "true"))
    assert "resumed from" in trainer.stdout
    assert_same_run(unbroken, broken)


def test_the_committed_runs_learn_at_every_staleness():
    """docs/async_runs.json (benchmarks/async_runs.py): async_rl.py from sft.py's model, 40 steps at grpo.py's
    settings (stale1 is python async_rl.py's defaults), every arm and seed: the held-out sampled accuracy at step
    40 above step 0's by more than twice its noise (500 problems, their 4 samples counted once: a bound). Speed:
    the committed runs, not a new one; tests/test_scripts.py's learning test runs grpo.py, which the pair equals
    at staleness 0."""
    with open(os.path.join(ROOT, "docs", "async_runs.json")) as f:
        arms = json.load(f)["arms"]
    assert "stale1" in arms and len(arms) == 7
    for arm, runs in arms.items():
        for seed, run in runs.items():
            assert z_accuracy(run["start_sampled"] / 100, run["sampled"] / 100, n=500) > 2, (arm, seed, run)


def test_bad_settings_are_one_sentence_before_any_process_starts():
    for args, sentence in ((["--mu", "0.5"], "error: --mu belongs to --algorithm mix"),
                           (["--fsdp", "true"], "async_rl.py's trainer is one process")):
        with pytest.raises(SystemExit, match=sentence):  # what async_rl.py's __main__ runs before launch()
            check_settings(common.parse_config(async_rl.Config, args))
