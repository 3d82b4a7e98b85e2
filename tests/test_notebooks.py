"""Every walkthrough notebook runs top to bottom without an error (headless, with nbclient).

The notebooks are executed in memory, so their committed outputs are never rewritten. The
checkpoints they train (notebooks/helpers.py) go to a temporary folder shared by this session:
the first notebook that needs the SFT policy or the reward model trains it, the others reuse it.
"""
import glob
import os
import shutil
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from conftest import ROOT

# each notebook trains small models; with `-n 2`, all on one worker, so the reward model 02 trains serves 03
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("notebooks")]

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


@pytest.fixture(scope="session")
def notebook_out(tmp_path_factory, sft_checkpoint):
    """The notebooks' checkpoint folder, starting with the suite's short SFT run: notebooks/helpers.py's
    SFT_CONFIG is the same run (steps, learning rate, evaluation, seed), so it need not train twice."""
    sys.path.insert(0, os.path.join(ROOT, "notebooks"))
    import helpers

    cfg = helpers.SFT_CONFIG
    settings = (cfg.max_steps, cfg.learning_rate, cfg.eval_steps, cfg.num_eval_examples, cfg.seed)
    assert settings == (300, 2e-3, 300, 64, 0), \
        "notebooks/helpers.py's SFT_CONFIG no longer matches tests/conftest.py's sft_checkpoint: update both"
    out = str(tmp_path_factory.mktemp("notebooks_out"))
    shutil.copytree(sft_checkpoint, os.path.join(out, "sft"))
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, notebook_out, monkeypatch):
    monkeypatch.setenv("RLHF_NOTEBOOKS_OUT", notebook_out)  # the kernel inherits it
    nb = nbformat.read(path, as_version=4)
    # The "python3" kernel of the interpreter running the tests (ipykernel's own spec), not whatever
    # kernel of that name another Jupyter installation registered.
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = NotebookClient(nb, km=kernel, timeout=600, resources={"metadata": {"path": os.path.dirname(path)}})
    try:
        client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    finally:
        if kernel.has_kernel:  # nbclient leaves running a kernel whose manager it was given
            kernel.shutdown_kernel(now=True)


def test_there_is_a_notebook_per_stage():
    names = [os.path.basename(path) for path in NOTEBOOKS]
    assert names == ["01_sft.ipynb", "02_reward_model.ipynb", "03_ppo.ipynb", "04_grpo.ipynb", "05_mix.ipynb",
                     "06_compare.ipynb", "07_dpo.ipynb"]
