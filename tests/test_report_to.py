"""--report_to: each metrics line of metrics.jsonl also goes to TensorBoard and Trackio, read back here from
what they wrote; a tracker whose package is missing is one sentence before anything is written."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import common
from lib import harness
from conftest import ROOT, read_metrics


@dataclasses.dataclass
class StubConfig(harness.RunConfig):
    """Three steps of a stub loop, a metrics line each, an evaluation at step 0 and at the last."""
    output_dir: str = ""
    max_steps: int = 3
    eval_steps: int = 100
    warmup_steps: int = 0


def stub_run(output_dir: str, report_to: str):
    """The scripts' loop, cut to its calls into harness, on y = w.x with SGD; finish() as a script ends."""
    cfg = StubConfig(output_dir=output_dir, report_to=report_to)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0]])
    run = harness.Run(cfg, inputs={})
    for _ in run.steps([model], [optimizer], [], lambda: {"accuracy": 0.5, "n": 1}):
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        grad_norm = run.clip_gradients(model, loss)
        optimizer.step()
        run.end_step({"loss": loss.item(), "grad_norm": grad_norm.item()})
    run.finish(common.build_tokenizer(), {}, {"loss": ["loss"]}, "Stub")


def tensorboard_scalars(folder: str) -> dict:
    """{tag: [(step, value), ...]} of every event file under folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def same_points(written: list, logged: list) -> bool:
    """The same steps, and values equal to a relative 1e-5 (metrics.jsonl keeps 6 significant digits, the events
    float32: each within half a unit of its 6th digit of the other)."""
    return ([step for step, _ in written] == [step for step, _ in logged]
            and [value for _, value in written] == pytest.approx([value for _, value in logged], rel=1e-5, abs=1e-6))


def metrics_by_tag(output_dir: str) -> dict:
    """metrics.jsonl as {tag: [(step, value), ...]}, the numbers only."""
    found = {}
    for row in read_metrics(output_dir):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                found.setdefault(key, []).append((row["step"], value))
    return found


def test_tensorboard_gets_every_metrics_line(tmp_path):
    """The event files in <output_dir>/runs hold every number of metrics.jsonl at its step, and runs/ is the
    run's (its run.json lists it: a run that replaces this one removes it)."""
    out = str(tmp_path / "out")
    stub_run(out, "tensorboard")
    written, logged = tensorboard_scalars(os.path.join(out, "runs")), metrics_by_tag(out)
    assert set(written) == set(logged) and {"loss", "grad_norm", "eval/accuracy", "time/step"} <= set(written)
    for tag, points in logged.items():
        assert same_points(written[tag], points), (tag, written[tag], points)
    assert "runs" in json.load(open(os.path.join(out, "run.json")))["files"]  # replaced with the run, as its files


def test_no_tracker_writes_nothing_beside_the_run(tmp_path):
    out = str(tmp_path / "out")
    stub_run(out, "none")
    assert "runs" not in os.listdir(out)


def test_a_tracker_whose_package_is_missing_is_one_sentence_before_anything_is_written(tmp_path, monkeypatch):
    real = harness.importlib.util.find_spec
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None if name == "trackio" else real(name))
    with pytest.raises(SystemExit) as stop:
        stub_run(str(tmp_path / "out"), "tensorboard,trackio")
    assert str(stop.value.code) == ("error: --report_to trackio needs the trackio package, which is not installed: "
                                    "pip install trackio, or leave out --report_to")
    assert not os.path.exists(tmp_path / "out")


def test_report_to_is_checked_with_the_other_settings():
    from lib import checks

    with pytest.raises(SystemExit, match="--report_to"):
        checks.check_settings(StubConfig(report_to="wandb"))


@pytest.mark.slow
def test_a_scripts_run_reports_to_tensorboard_and_trackio(tmp_path):
    """sft.py from the command line with both trackers: Trackio's local database (in TRACKIO_DIR) and the
    TensorBoard events hold the metrics.jsonl lines, read back from what each wrote."""
    out, store = str(tmp_path / "sft"), str(tmp_path / "trackio")
    env = {**os.environ, "TRACKIO_DIR": store, "TRACKIO_PROJECT": "test"}
    subprocess.run([sys.executable, "sft.py", "--output_dir", out, "--max_steps", "2", "--per_device_train_batch_size",
                    "8", "--num_eval_examples", "4", "--report_to", "tensorboard,trackio"], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=600)
    read = ("import json; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('test', 'sft')))")
    rows = json.loads(subprocess.run([sys.executable, "-c", read], env=env, check=True, capture_output=True,
                                     text=True, timeout=120).stdout)
    logged = metrics_by_tag(out)
    for tag, points in logged.items():
        tracked = [(row["step"], row[tag]) for row in rows if tag in row]
        assert same_points(tracked, points), (tag, tracked, points)
        assert same_points(tensorboard_scalars(os.path.join(out, "runs"))[tag], points), tag
