"""Every walkthrough notebook runs top to bottom without an error (headless, with nbclient).

The notebooks are executed in memory, so their committed outputs are never rewritten. The
checkpoints they train (notebooks/helpers.py) go to a temporary folder, which starts with the
suite's SFT policy and reward model (the same runs); the notebooks reuse them. Notebooks 01 to 08 and 10 run
in order in one test, as a reader runs them (in one kernel, for speed), and notebook 09, which trains its own
start (here a shorter SFT run than the notebook's: the cells are what is tested), in another, so the two
workers of `-n 2` can run them side by side.
"""
import contextlib
import dataclasses
import glob
import io
import os
import re
import shutil
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from conftest import RM_SETTINGS, ROOT

pytestmark = pytest.mark.slow

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


@pytest.fixture()
def notebook_out(tmp_path, sft_checkpoint, rm_checkpoint):
    """The notebooks' checkpoint folder, starting with the suite's short SFT and reward-model runs:
    notebooks/helpers.py's SFT_CONFIG and RM_CONFIG are the same runs (checked: SFT's steps, learning rate,
    evaluation and seed; every setting the reward model's run changes), so they need not train twice."""
    sys.path.insert(0, os.path.join(ROOT, "notebooks"))
    import helpers
    import reward_model

    cfg = helpers.SFT_CONFIG
    settings = (cfg.max_steps, cfg.learning_rate, cfg.eval_steps, cfg.num_eval_examples, cfg.seed)
    assert settings == (300, 2e-3, 300, 64, 0), \
        "notebooks/helpers.py's SFT_CONFIG no longer matches tests/conftest.py's sft_checkpoint: update both"
    changed = {name: value for name, value in vars(helpers.RM_CONFIG).items()  # the settings it does not default
               if name not in ("model", "output_dir") and value != getattr(reward_model.Config(), name)}
    assert changed == RM_SETTINGS, \
        "notebooks/helpers.py's RM_CONFIG no longer matches tests/conftest.py's rm_checkpoint: update both"
    out = str(tmp_path / "notebooks_out")
    shutil.copytree(sft_checkpoint, os.path.join(out, "sft"))
    shutil.copytree(rm_checkpoint, os.path.join(out, "rm"))
    return out


# Every training run of a notebook stops at this step (notebooks/helpers.py): the cells are what is tested
# here, and a run's plots, tables and checks read a 10-step run as they read the full one.
MAX_STEPS = 10
AGENT = os.path.join(ROOT, "notebooks", "09_agent.ipynb")  # trains its own start (SFT on data/tool_demos)


def test_every_notebook_runs_in_order(notebook_out, monkeypatch):
    """Notebooks 01 to 08 and 10 in order, as a reader runs them (each may reuse the checkpoints of those before).
    Speed: in one kernel, every name cleared between notebooks (%reset): torch and transformers imported once, not
    nine times; a notebook that uses a name it does not define itself still fails."""
    run_notebooks([path for path in NOTEBOOKS if path != AGENT], notebook_out, monkeypatch, one_kernel=True)


# Notebook 09's start in the test: SFT on data/tool_demos for this many steps, not the notebook's 300. At 60 the
# policy already calls the calculator (garbled calls, but calls): the test below asserts that the episode the
# notebook replays by hand holds one.
AGENT_SFT_STEPS = 60


def test_the_agent_notebook_runs(tmp_path, monkeypatch):
    """Notebook 09 needs no other notebook's checkpoint, so it runs apart: under `-n 2` beside the others. Its
    start (helpers.TOOL_SFT_CONFIG) is trained for AGENT_SFT_STEPS first; the cells must show that the policy
    called the calculator in the episode the hand loop replays (the cell that prints "same N tokens, same
    reply_mask (K calculator tokens)")."""
    sys.path.insert(0, os.path.join(ROOT, "notebooks"))
    import helpers
    import sft

    out = str(tmp_path / "notebooks_out")
    start = dataclasses.replace(helpers.TOOL_SFT_CONFIG, max_steps=AGENT_SFT_STEPS, eval_steps=AGENT_SFT_STEPS,
                                output_dir=os.path.join(out, "sft_tool"))
    assert os.path.basename(helpers.TOOL_SFT_CONFIG.output_dir) == "sft_tool"  # where the notebook looks for it
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        sft.main(start)
    (notebook,) = run_notebooks([AGENT], out, monkeypatch)
    printed = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    tokens = re.search(r"same \d+ tokens, same reply_mask \((\d+) calculator tokens\)", printed)
    assert tokens and int(tokens[1]) > 0, "the replayed episode holds no call: train notebook 09's start longer"


def run_notebooks(paths: list[str], out: str, monkeypatch, one_kernel: bool = False) -> list:
    """The notebooks executed in order, each in a kernel of its own (or all in one, its names cleared before each
    notebook: the notebooks share one folder, so one working directory); returns them with their outputs."""
    monkeypatch.setenv("RLHF_NOTEBOOKS_OUT", out)  # the kernel inherits it
    monkeypatch.setenv("RLHF_NOTEBOOKS_MAX_STEPS", str(MAX_STEPS))
    executed, kernel = [], None
    try:
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            if kernel is None or not one_kernel:
                if kernel is not None and kernel.has_kernel:
                    kernel.shutdown_kernel(now=True)
                # The "python3" kernel of the interpreter running the tests (ipykernel's own spec), not whatever
                # kernel of that name another Jupyter installation registered.
                kernel = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
            run = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%reset -f"), *nb.cells],
                                           metadata=nb.metadata) if one_kernel else nb
            client = NotebookClient(run, km=kernel, timeout=600,
                                    resources={"metadata": {"path": os.path.dirname(path)}})
            try:
                client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
            except Exception as error:
                raise AssertionError(f"{os.path.basename(path)}: {error}") from error
            nb.cells = run.cells[1:] if one_kernel else run.cells
            executed.append(nb)
    finally:
        if kernel is not None and kernel.has_kernel:  # nbclient leaves running a kernel whose manager it was given
            kernel.shutdown_kernel(now=True)
    return executed


def test_there_is_a_notebook_per_stage():
    names = [os.path.basename(path) for path in NOTEBOOKS]
    assert names == ["01_sft.ipynb", "02_reward_model.ipynb", "03_ppo.ipynb", "04_grpo.ipynb", "05_mix.ipynb",
                     "06_compare.ipynb", "07_dpo.ipynb", "08_best_of_n.ipynb", "09_agent.ipynb", "10_process.ipynb"]
