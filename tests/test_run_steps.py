"""harness.Run's own step loop, driven the way the scripts drive it (run.steps, run.clip_gradients, run.end_step)
on a stub config and a 4-weight model: which steps a resumed run takes, and which checkpoint a run that stops at a
NaN leaves. Each test takes well under a second: no script, no transformer, no data.

tests/test_robustness.py calls check_finite and promote_checkpoint one at a time; what joins them (end_step
promotes checkpoint.new only when clip_gradients found the step's loss and gradient norm finite, and Run.steps
clears that flag at each step) is only met here, and in the slow script runs."""
import dataclasses
import json
import os

import pytest
import torch

from lib import harness


@dataclasses.dataclass
class StubConfig(harness.RunConfig):
    """A run of 6 steps, a resumable checkpoint every 2, a metrics line every step, no evaluation but the
    last step's."""
    output_dir: str = ""
    max_steps: int = 6
    save_steps: int = 2
    eval_steps: int = 100
    eval_on_start: bool = False
    warmup_steps: int = 0


class Killed(Exception):
    """The process ending between two steps, as a kill would (the test's stand-in for SIGKILL)."""


@pytest.fixture(autouse=True)
def release_locks():
    """A run holds its folder's lock until it finishes (harness._lock); these runs never call finish: let go."""
    before = set(harness._locks)
    yield
    for key in set(harness._locks) - before:
        os.close(harness._locks.pop(key))


def train(output_dir, *, resume=False, killed_before=None, nan_loss_at=None, nan_grad_at=None, nan_metric_at=None,
          nothing_to_learn_at=()):
    """The scripts' loop (grpo.py's main, cut to its calls into harness) on y = w.x + b with SGD. Returns
    (the steps the loop was handed, {step: the weights after its update}). killed_before: the step at whose start
    the run is killed (the step before it has ended: end_step ran); nan_*_at: the step whose loss, gradient (one
    entry) or logged metric is NaN; nothing_to_learn_at: steps the loop leaves with `continue`, as grpo.py's
    dynamic sampling does when no group has a spread (Run.steps then calls end_step itself)."""
    cfg = StubConfig(output_dir=str(output_dir), resume=resume)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    x, y = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]]), torch.tensor([[1.0], [-2.0]])
    run = harness.Run(cfg, inputs={})
    seen, weights = [], {}
    for step in run.steps([model], [optimizer], [scheduler], lambda: {"accuracy": 0.5, "n": 2}):
        if step == killed_before:
            raise Killed
        seen.append(step)
        if step in nothing_to_learn_at:
            run.nothing_to_learn("no group had a spread")
            continue
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean() + (float("nan") if step == nan_loss_at else 0.0)  # the gradient stays
        loss.backward()
        if step == nan_grad_at:
            model.weight.grad[0, 0] = float("nan")  # the loss is finite, one entry of its gradient is not
        grad_norm = run.clip_gradients(model, loss)
        optimizer.step()
        scheduler.step()
        weights[step] = [p.detach().clone() for p in model.parameters()]
        run.end_step({"loss": loss.item(), "grad_norm": grad_norm.item(),
                      "kl": float("nan") if step == nan_metric_at else 0.0})
    return seen, weights


def killed(output_dir, step, **options):
    """A run killed at the start of `step`."""
    with pytest.raises(Killed):
        train(output_dir, killed_before=step, **options)


def state(output_dir, name="checkpoint") -> dict:
    return torch.load(os.path.join(output_dir, name, "state.pt"), weights_only=True)


def checkpoints(output_dir) -> dict:
    """{checkpoint folder: the step it holds}, for every checkpoint folder of the run."""
    return {name: state(output_dir, name)["step"] for name in sorted(os.listdir(output_dir))
            if name.startswith("checkpoint")}


def test_a_good_step_promotes_the_last_saves_checkpoint(tmp_path):
    """The control: step 4 saves checkpoint.new; step 5's finite loss and gradient norm promote it to checkpoint."""
    killed(tmp_path / "a", 5)
    assert checkpoints(tmp_path / "a") == {"checkpoint": 2, "checkpoint.new": 4}  # step 2's was promoted at step 3
    killed(tmp_path / "b", 6)
    assert checkpoints(tmp_path / "b") == {"checkpoint": 4}


@pytest.mark.parametrize("bad", ["loss", "grad norm"])
def test_a_step_whose_loss_or_gradient_is_not_finite_stops_and_keeps_the_previous_checkpoint(tmp_path, bad):
    """checkpoint (step 2) and checkpoint.new (step 4) on disk; step 5's loss or gradient norm is NaN, so the
    weights of step 4 gave a NaN: the run stops before applying the update, checkpoint.new goes, and checkpoint
    still holds step 2's weights, what --resume continues from."""
    with pytest.raises(SystemExit, match=f"step 5: the {bad} is nan; stopped before applying this update"):
        train(tmp_path / "nan", **{"nan_loss_at" if bad == "loss" else "nan_grad_at": 5})
    assert checkpoints(tmp_path / "nan") == {"checkpoint": 2}
    _, unbroken = train(tmp_path / "unbroken")
    saved = state(tmp_path / "nan")["models"][0]
    assert torch.equal(saved["weight"], unbroken[2][0]) and torch.equal(saved["bias"], unbroken[2][1])  # same code


def test_a_metric_that_is_not_finite_after_the_update_stops_and_keeps_the_previous_checkpoint(tmp_path):
    """Step 5's loss and gradient norm are finite (its update is applied) but a metric logged after it is NaN:
    the run stops in end_step, and step 4's checkpoint.new, whose weights gave that NaN, is not promoted: it goes."""
    with pytest.raises(SystemExit, match="step 5: the metric kl is nan; stopped at this step's metrics"):
        train(tmp_path, nan_metric_at=5)
    assert checkpoints(tmp_path) == {"checkpoint": 2}


def test_a_step_that_trained_nothing_promotes_nothing(tmp_path):
    """Step 5 has nothing to learn from (the loop leaves it with `continue`: no loss, no gradient norm, no check),
    so step 4's weights have not yet given a finite value: checkpoint.new waits. Step 6's loss, from those same
    weights, is NaN: checkpoint.new goes, and checkpoint still holds step 2."""
    killed(tmp_path / "a", 6, nothing_to_learn_at=(5,))
    assert checkpoints(tmp_path / "a") == {"checkpoint": 2, "checkpoint.new": 4}  # not promoted by step 5
    with pytest.raises(SystemExit, match="step 6: the loss is nan"):
        train(tmp_path / "b", nothing_to_learn_at=(5,), nan_loss_at=6)
    assert checkpoints(tmp_path / "b") == {"checkpoint": 2}


@pytest.mark.parametrize("kill", [3, 4, 5, 6])
def test_a_resumed_run_takes_the_steps_after_its_checkpoint_and_ends_as_an_unbroken_one(tmp_path, kill):
    """A run killed at the start of step `kill` resumes from its newest checkpoint, at step c (2 or 4): the loop is
    handed exactly c + 1 .. max_steps, and (same code, same machine) every step's logged loss and the last
    weights are the unbroken run's, bit for bit."""
    unbroken_steps, unbroken = train(tmp_path / "unbroken")
    assert unbroken_steps == [1, 2, 3, 4, 5, 6]
    folder = tmp_path / "killed"
    killed(folder, kill)
    saved = state(folder, os.path.basename(harness.newest_checkpoint(str(folder))))["step"]
    assert saved == {3: 2, 4: 2, 5: 4, 6: 4}[kill]  # checkpoint.new counts once it is whole (newest_checkpoint)
    steps, weights = train(folder, resume=True)
    assert steps == list(range(saved + 1, 7))
    assert all(torch.equal(a, b) for a, b in zip(weights[6], unbroken[6]))
    assert logged_losses(folder) == logged_losses(tmp_path / "unbroken")  # the checkpoint's lines, then the resumed


def logged_losses(output_dir) -> list[tuple]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [(row["step"], row.get("loss")) for row in map(json.loads, f)]
