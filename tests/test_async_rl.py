"""async_rl.py: the explorer and the trainer as two processes (lib/synchronizer.py)."""
import os
import random
import time

import psutil
import pytest
import torch
from conftest import assert_same_run, read_metrics, run_main, start, z_trend
from safetensors.torch import load_file
from test_rlhf_scripts import _fixed_problems

from lib import synchronizer
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
    process = start("async_rl.py", *args)
    process.wait()
    if check:
        assert process.returncode == 0, process.stderr[-3000:]
    return process


@pytest.mark.slow
def test_at_staleness_0_the_pair_is_grpo_bit_for_bit(sft_checkpoint, tmp_path, monkeypatch):
    """--sync_offset 0: the explorer waits for every version, draws the same prompts and samples with the same
    random streams as grpo.py's one process, and the trainer takes grpo.py's step: the same weights, bit for bit,
    and every metric grpo.py logs the same (timings aside). One thread in every process (the sums' order)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    args = _short(sft_checkpoint, _fixed_problems(tmp_path, 16), 4)
    run_main("grpo.py", *args, "--output_dir", str(tmp_path / "grpo"))
    _pair_run(*args, "--sync_offset", "0", "--vllm_importance_sampling_correction", "false",
              "--output_dir", str(tmp_path / "pair"))
    grpo, pair = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("grpo", "pair"))
    assert grpo.keys() == pair.keys() and all(torch.equal(grpo[k], pair[k]) for k in grpo)
    for a, b in zip(read_metrics(str(tmp_path / "grpo")), read_metrics(str(tmp_path / "pair")), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
               {k: v for k, v in b.items() if k in a and not k.startswith("time/")}
        assert b.get("off_policy/mean", 0) == 0
    torch.set_num_threads(threads)


def _kill_one(process, victim: int, after_checkpoint_of: str):
    """SIGKILL the trainer (0) or the explorer (1) of a launched pair at a random moment after its first
    checkpoint; the launcher must then stop with the other's sentence, not hang."""
    while not any(os.path.isdir(os.path.join(after_checkpoint_of, name)) for name in ("checkpoint", "checkpoint.new")):
        assert process.poll() is None, process.stderr[-3000:]
        time.sleep(0.01)
    time.sleep(random.Random(victim).uniform(0, 1.5))
    children = sorted(psutil.Process(process.pid).children(), key=lambda c: c.create_time())
    assert len(children) == 2, "the launcher runs the trainer and the explorer"
    children[victim].kill()
    killed = time.time()
    assert process.wait(timeout=60) == 1
    assert time.time() - killed < 30  # the peer stopped on its next message (or the launcher stopped it)
    other = ("the trainer", "the explorer")[victim]
    assert f"stopped, so {('the explorer', 'the trainer')[victim]} stops too" in process.stderr or \
        f"stopped before the two processes met, so {('the explorer', 'the trainer')[victim]}" in process.stderr, \
        (other, process.stderr[-2000:])


@pytest.mark.slow
def test_the_pair_learns_and_a_kill_of_either_process_resumes_to_the_unbroken_run(sft_checkpoint, tmp_path):
    """MIX's loss on the pair, one update stale (the default sync_offset 1), with the correction: the reward rises
    over the run, every batch after the first is one update old, the importance weights are logged. Killed
    (SIGKILL) first in the explorer, then in the trainer, each time --resumed: the same metrics and weights as the
    unbroken run (the checkpoint holds the explorer's random streams and the versions it had still to load)."""
    args = [*_short(sft_checkpoint, _fixed_problems(tmp_path, 8), 12), "--algorithm", "mix"]
    unbroken, broken = str(tmp_path / "unbroken"), str(tmp_path / "broken")
    _pair_run(*args, "--output_dir", unbroken)
    rows = [row for row in read_metrics(unbroken) if "reward" in row]
    assert [row["off_policy/mean"] for row in rows] == [0] + [1] * 11
    assert z_trend([row["reward"] for row in rows]) > 2, [row["reward"] for row in rows]
    assert all("sampling/importance_sampling_ratio/mean" in row and "expert/sft_loss" in row for row in rows)

    _kill_one(start("async_rl.py", *args, "--output_dir", broken), 1, broken)
    _kill_one(start("async_rl.py", *args, "--output_dir", broken, "--resume", "true"), 0, broken)
    assert "resumed from" in _pair_run(*args, "--output_dir", broken, "--resume", "true").stdout
    assert_same_run(unbroken, broken)


def test_bad_settings_are_one_sentence_before_any_process_starts():
    result = _pair_run("--mu", "0.5", check=False)
    assert result.returncode == 1 and "error: --mu belongs to --algorithm mix" in result.stderr
    result = _pair_run("--fsdp", "true", check=False)
    assert result.returncode == 1 and "trainer is one process" in result.stderr
