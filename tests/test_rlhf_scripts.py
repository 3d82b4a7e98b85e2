"""reward_model.py and ppo.py end to end, by subprocess with tiny settings."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import common
import ppo
import reward_model
from conftest import ROOT, assert_same_update, read_metrics, run_main, z_accuracy, z_trend
from floats import assert_close, forward_terms


@pytest.mark.slow
def test_reward_model_learns_and_writes_its_outputs(rm_checkpoint):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "eval.json",
                 "reward_model.png"):
        assert os.path.isfile(os.path.join(rm_checkpoint, name)), name
    with open(os.path.join(rm_checkpoint, "eval.json")) as f:
        scores = json.load(f)
    assert set(scores) == {"pairwise_accuracy", "margin", "n", "policy_pairwise_accuracy"} and scores["n"] == 200
    # above chance (0.5) by more than 3 standard errors of a 200-pair estimate
    assert z_accuracy(0.5, scores["pairwise_accuracy"], n=200) > 3 and scores["margin"] > 0
    losses = [row["loss"] for row in read_metrics(rm_checkpoint) if "loss" in row]
    assert losses[-1] < losses[0]


def _fixed_problems(tmp_path, n=8):
    data = tmp_path / "data"
    data.mkdir()
    with open(os.path.join(ROOT, "data", "arithmetic", "train.jsonl")) as f:
        rows = f.readlines()[:n]
    (data / "train.jsonl").write_text("".join(rows))
    (data / "test.jsonl").write_text("".join(rows))
    return str(data)


@pytest.mark.slow
def test_ppo_short_run_raises_the_score_and_moves_actor_and_critic(sft_checkpoint, rm_checkpoint, tmp_path):
    out = str(tmp_path / "ppo")
    run_main("ppo.py", "--model", sft_checkpoint, "--reward_model", rm_checkpoint, "--dataset",
             _fixed_problems(tmp_path, 32),
        "--output_dir", out, "--max_steps", "20", "--per_device_train_batch_size", "32", "--learning_rate", "1e-4",
        "--warmup_steps", "2", "--eval_steps", "100")
    rows = [row for row in read_metrics(out) if "score" in row]
    assert len(rows) == 20
    scores = [r["score"] for r in rows]
    assert z_trend(scores) > 2, scores  # the score's trend over the 20 steps: up by more than twice its error
    for key in ("accuracy", "kl_sum", "loss/actor", "loss/critic", "clip_fraction/actor", "clip_fraction/critic",
                "value_error", "entropy", "completion_length", "time/generation", "time/forward", "time/backward"):
        assert key in rows[0], key
    assert os.path.isfile(os.path.join(out, "ppo.png"))
    # a PPO step changed every tensor of the actor (from the SFT model) and of the critic (from the RM)
    for start, end in ((sft_checkpoint, out), (rm_checkpoint, os.path.join(out, "critic"))):
        before, after = (load_file(os.path.join(d, "model.safetensors")) for d in (start, end))
        assert before.keys() == after.keys()
        assert all(not (before[k] == after[k]).all() for k in before), start


@pytest.mark.slow
def test_ppo_with_several_epochs_and_mini_batches_and_the_rule_reward(sft_checkpoint, tmp_path):
    out = str(tmp_path / "ppo")
    run_main("ppo.py", "--model", sft_checkpoint, "--reward_model", "rule", "--output_dir", out, "--max_steps", "2",
        "--per_device_train_batch_size", "16", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
        "--whiten_advantages", "false", "--eval_steps", "100", "--num_eval_examples", "8")
    rows = [row for row in read_metrics(out) if "score" in row]
    assert len(rows) == 2 and all(-1 <= row["score"] <= 1 for row in rows)  # the mean of +-1 scores


def test_ppo_one_update_takes_pi_old_and_v_old_from_its_training_pass(sft_folder, tmp_path, monkeypatch):
    """With one update per step (the default), ppo.py skips the actor's and the critic's inference passes and
    takes pi_old and V_old from the training pass (ppo.makes_one_update). One step both ways, the same
    micro-batches: the same experience, the same losses to float rounding, the same weights (as norms, for
    AdamW's first step: conftest.assert_same_update)."""
    args = ["--model", sft_folder, "--reward_model", "rule", "--max_steps", "1", "--eval_steps", "100",
            "--num_eval_examples", "4", "--warmup_steps", "0", "--per_device_train_batch_size", "32"]
    borrowed, plain = str(tmp_path / "borrowed"), str(tmp_path / "plain")
    run_main("ppo.py", *args, "--output_dir", borrowed)
    with monkeypatch.context() as patch:
        patch.setattr(ppo, "makes_one_update", lambda cfg: False)  # the inference passes of every other setting
        run_main("ppo.py", *args, "--output_dir", plain)
    (a,), (b,) = ([row for row in read_metrics(d) if "score" in row] for d in (borrowed, plain))
    for key in ("score", "completion_length", "accuracy"):  # the same rollout
        assert a[key] == b[key], key
    config = common.load_model(sft_folder)[0].config
    tokens = round(32 * a["completion_length"])  # the sums over the step's tokens
    for key, scale in (("kl_sum", 1.0), ("value_error", None), ("loss/critic", None), ("entropy", None),
                       ("loss/actor", 4.0)):  # loss/actor: whitened advantages x a ratio of 1
        assert_close(a[key], b[key], terms=forward_terms(config) + tokens, scale=scale, msg=key)
    for sub in ("", "critic"):  # the critic is the SFT transformer with a new value head: compare the transformer
        assert_same_update(sft_folder, borrowed, plain, sub)


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/sft"], "run `python sft.py` first"),
    (["--reward_model", "/nonexistent/rm"], "run `python reward_model.py` first"),
])
def test_ppo_missing_checkpoints_say_what_to_run(sft_folder, tmp_path, args, message):
    with pytest.raises(SystemExit) as stop:
        ppo.main(common.parse_config(ppo.Config, ["--model", sft_folder, "--output_dir", str(tmp_path), *args]))
    assert message in str(stop.value.code)


def test_reward_model_without_sft_checkpoint_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit) as stop:
        reward_model.main(common.parse_config(reward_model.Config, ["--model", str(tmp_path / "missing"),
                                                                    "--output_dir", str(tmp_path / "o")]))
    assert "run `python sft.py` first" in str(stop.value.code)


@pytest.mark.slow  # it needs the trained SFT and reward-model checkpoints: a minute of setup on a worker
def test_value_model_starts_the_critic_and_changes_nothing_else(sft_checkpoint, rm_checkpoint):
    """--reward_model rule --value_model <rm>: no reward model (the checker scores), and the critic is the
    reward model's weights, as rm_ppo's critic starts; without --value_model the rule critic is a fresh head
    on the policy, and with the reward model the critic is a copy of it (the defaults, unchanged)."""
    tokenizer = common.load_model(sft_checkpoint)[1]
    rm = common.load_model(rm_checkpoint, scalar_head=True)[0].state_dict()
    cfg = ppo.Config(model=sft_checkpoint, reward_model="rule", value_model=rm_checkpoint)
    scorer, critic = ppo.load_reward_model_and_critic(cfg, tokenizer, torch.device("cpu"))
    assert scorer is None and all(torch.equal(critic.state_dict()[k], v) for k, v in rm.items())
    assert all(p.requires_grad for p in critic.parameters())
    fresh = ppo.load_reward_model_and_critic(ppo.Config(model=sft_checkpoint, reward_model="rule"), tokenizer,
                                             torch.device("cpu"))[1]
    assert not torch.equal(fresh.score.weight, critic.score.weight)
    scorer, copied = ppo.load_reward_model_and_critic(ppo.Config(model=sft_checkpoint,
                                                                       reward_model=rm_checkpoint), tokenizer,
                                                            torch.device("cpu"))
    assert torch.equal(copied.score.weight, scorer.score.weight) and copied is not scorer
    with pytest.raises(SystemExit, match="no model found at /nowhere: it takes a folder written by reward_model"):
        ppo.load_reward_model_and_critic(ppo.Config(model=sft_checkpoint, reward_model="rule",
                                                    value_model="/nowhere"), tokenizer, torch.device("cpu"))
