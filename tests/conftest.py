import contextlib
import importlib
import importlib.util
import io
import json
import logging
import math
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # import the scripts (sft, grpo, common, ...) as modules
import common  # noqa: E402
import transformers  # noqa: E402


class DeprecationLog(logging.Handler):
    """The deprecations transformers announces through its logger (warning_once) rather than the
    warnings module, e.g. an output's `past_key_values` in 5.24: kept, so that the test that
    triggered one fails (see pyproject.toml's filterwarnings for the others)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        if "deprecat" in record.getMessage().lower():
            self.messages.append(record.getMessage())


@pytest.fixture(autouse=True)
def no_deprecation_logged():
    """common.py sets transformers' logger to errors only (no noise around our progress bars): here it
    passes warnings to DeprecationLog, and its own console handler still prints errors only."""
    logger = transformers.utils.logging.get_logger("transformers")
    level, console = logger.level, logger.handlers[:]
    for handler in console:
        handler.setLevel(max(handler.level, logging.ERROR))
    logger.setLevel(logging.WARNING)
    log = DeprecationLog()
    logger.addHandler(log)
    yield
    logger.removeHandler(log)
    logger.setLevel(level)
    assert not log.messages, f"transformers logged a deprecation: {log.messages}"


class ScriptProcess:
    """`python script args` started by start(): Popen's pid, poll(), send_signal() and kill(); wait() (at most
    `timeout` seconds, then an AssertionError); what it printed so far (.stdout, .stderr), read from its files."""

    def __init__(self, out_dir: str, pid: int, popen: subprocess.Popen | None = None):
        self.out_dir, self.pid, self.popen, self.returncode = out_dir, pid, popen, None

    def poll(self):
        if self.returncode is None:
            self.returncode = self.popen.poll() if self.popen else _server().exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float = 600):
        deadline = time.time() + timeout
        while self.poll() is None:
            assert time.time() < deadline, f"the process {self.pid} ran past {timeout} s"
            if self.popen:
                time.sleep(0.01)
            else:
                _server().exit_code(self.pid, timeout=min(1.0, max(deadline - time.time(), 0.01)))
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    @property
    def stdout(self) -> str:
        with open(os.path.join(self.out_dir, "stdout"), errors="backslashreplace") as f:
            return f.read()

    @property
    def stderr(self) -> str:
        with open(os.path.join(self.out_dir, "stderr"), errors="backslashreplace") as f:
            return f.read()


class _ScriptServer:
    """tests/helpers/script_server.py, started once per test process: it forks the scripts' processes."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers", "script_server.py")],
                                        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.env, self.exits, self.pending = _environment(), {}, b""
        assert self._line(timeout=120) == "ready", "the script server did not start"

    def _line(self, timeout: float):
        """The server's next answer line, or None after `timeout` seconds."""
        deadline = time.time() + timeout
        while b"\n" not in self.pending:
            readable, _, _ = select.select([self.process.stdout], [], [], max(deadline - time.time(), 0))
            if not readable:
                return None
            data = os.read(self.process.stdout.fileno(), 1 << 16)
            assert data, "the script server stopped"
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def start(self, argv: list[str], out_dir: str, env: dict | None = None) -> ScriptProcess:
        request = {"argv": argv, "cwd": ROOT, "env": {**os.environ, **(env or {})},
                   "stdout": os.path.join(out_dir, "stdout"),
                   "stderr": os.path.join(out_dir, "stderr")}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        while True:
            line = self._line(timeout=60)
            assert line is not None, "the script server did not answer"
            kind, pid, *code = line.split()
            if kind == "pid":
                return ScriptProcess(out_dir, int(pid))
            self.exits[int(pid)] = int(code[0])

    def exit_code(self, pid: int, timeout: float):
        """The exit code of a process the server started, or None if it is still running after `timeout` s."""
        while pid not in self.exits:
            line = self._line(timeout)
            if line is None:
                return None
            _, other, code = line.split()
            self.exits[int(other)] = int(code)
        return self.exits[pid]


_servers = {}  # this process's id -> its script server (a forked test process starts its own)


def _server() -> _ScriptServer:
    if os.getpid() not in _servers:
        _servers[os.getpid()] = _ScriptServer()
    return _servers[os.getpid()]


def _environment() -> dict:
    """os.environ without PYTEST_CURRENT_TEST (the test pytest is running, which changes with every test)."""
    return {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}


def start(script, *args, env: dict | None = None) -> ScriptProcess:
    """`python script args` in the repository's root, as a process of its own. Speed: forked from a process that
    has imported torch and transformers already (tests/helpers/script_server.py) rather than a new interpreter,
    which spends ~6 s importing them; the script, common.py and lib/ are imported afresh in it. A call whose
    environment differs from the one the script server started with (this process's first start()) gets a new
    interpreter: the libraries read some variables when imported. env: variables for this process only, which no
    library reads when imported (torchrun's RANK, MASTER_PORT, ...: async_rl.py's pair)."""
    out_dir = tempfile.mkdtemp(prefix="script_")
    for name in ("stdout", "stderr"):
        open(os.path.join(out_dir, name), "w").close()
    if _environment() != _server().env:
        with open(os.path.join(out_dir, "stdout"), "w") as out, open(os.path.join(out_dir, "stderr"), "w") as err:
            popen = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=err, env={**os.environ, **(env or {})})
        return ScriptProcess(out_dir, popen.pid, popen)
    return _server().start([script, *args], out_dir, env)


def run(script, *args, check=True):
    """`python script args` to its end (start() above, at most 600 s): .returncode, .stdout, .stderr. With check,
    a non-zero exit fails the test with the end of what it printed."""
    process = start(script, *args)
    process.wait()
    result = types.SimpleNamespace(returncode=process.returncode, stdout=process.stdout, stderr=process.stderr)
    shutil.rmtree(process.out_dir)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_main(script, *args):
    """`python script args`, but in this process: the script's main() on its parsed config, without
    the ~6 s a new interpreter spends importing torch and transformers. Returns what it printed
    (as .stdout, like run()); a one-sentence error fails the test with that sentence."""
    module = importlib.import_module(script.removesuffix(".py"))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            module.main(common.parse_config(module.Config, list(args)))
    except SystemExit as stop:
        raise AssertionError(f"{script} {' '.join(args)} failed: {stop.code}\n{printed.getvalue()[-3000:]}") from None
    return types.SimpleNamespace(returncode=0, stdout=printed.getvalue(), stderr="")


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def z_gain(first: list[float], last: list[float]) -> float:
    """How many standard errors mean(last) lies above mean(first) (Welch's t statistic): a learning
    check whose threshold follows from the run's own noise, not from one machine's trajectory."""
    var = statistics.variance(first) / len(first) + statistics.variance(last) / len(last)
    return (statistics.mean(last) - statistics.mean(first)) / math.sqrt(var)


def z_trend(values: list[float]) -> float:
    """How many standard errors the least-squares slope of values against their step lies above 0: a learning
    check that reads every step of a short run, not only its two ends (the ends of a 20-step run are 5 noisy
    points each; the slope's standard error comes from the scatter around the line)."""
    n = len(values)
    steps = range(n)
    mean_step, mean_value = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((t - mean_step) ** 2 for t in steps)
    slope = sum((t - mean_step) * (v - mean_value) for t, v in zip(steps, values)) / sxx
    residuals = [v - mean_value - slope * (t - mean_step) for t, v in zip(steps, values)]
    return slope / math.sqrt(sum(r * r for r in residuals) / (n - 2) / sxx)


def z_accuracy(before: float, after: float, n: int) -> float:
    """The same for two accuracies, each measured on n independent samples (binomial errors)."""
    var = (before * (1 - before) + after * (1 - after)) / n
    return (after - before) / math.sqrt(max(var, 1e-12))


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_run(a, b):
    """Two runs of the same code on the same machine: the same metrics (the wall-clock timings
    time/* aside) and bit-identical saved weights."""
    def scalars(out):
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(out)]

    assert scalars(a) == scalars(b)
    weights_a, weights_b = (load_file(os.path.join(out, "model.safetensors")) for out in (a, b))
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def assert_same_update(start, a, b, sub=""):
    """Two one-step runs from the weights in folder `start` that differ in float order only (their
    <a or b>/<sub>/model.safetensors): the same update. AdamW's first step divides each gradient entry
    by its own size, so an entry whose gradient is below float rounding may move by up to lr either
    way: the weights are compared as norms, the runs' difference against the update, over the tensors
    `start` holds (all but a new value head)."""
    w_start = load_file(os.path.join(start, "model.safetensors"))
    w_a, w_b = (load_file(os.path.join(d, sub, "model.safetensors")) for d in (a, b))
    shared = [k for k in w_a if k in w_start]
    assert w_a.keys() == w_b.keys() and len(shared) >= len(w_a) - 1, sub
    update = sum(((w_a[k] - w_start[k]) ** 2).sum() for k in shared).sqrt()
    difference = sum(((w_b[k] - w_a[k]) ** 2).sum() for k in shared).sqrt()
    assert update > 0 and difference <= 1e-3 * update, (sub, difference, update)


# `python -m pytest tests -n 2` (pytest-xdist, as CI runs the suite) runs the tests in two worker
# processes, one per core of a laptop: each worker computes with one thread (two workers of two threads
# each would share two cores), and so do the processes it starts (scripts, torchrun, notebook kernels).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The test of notebooks 01 to 08 and 10 first: the longest, it starts by training the SFT model and the reward
    model (a few minutes, one worker of -n 2) while the other worker runs the tests that need no trained checkpoint,
    which come next; then those that need the SFT model, then the reward model (a stable sort: file order within
    each). So the other worker reaches the checkpoint tests after they are trained, rather than waiting on
    built_once's lock.
    Within each group the longest tests (LONGEST, a minute or more each on one core) go first, so that the suite
    does not end with one worker on a long test while the other has nothing left."""
    items.sort(key=lambda item: (item.name != "test_every_notebook_runs_in_order",
                                 "sft_checkpoint" in item.fixturenames, "rm_checkpoint" in item.fixturenames,
                                 item.originalname not in LONGEST))


LONGEST = {"test_the_agent_notebook_runs", "test_fsdp_trains_as_data_parallelism_does",
           "test_fsdp_killed_run_resumes_from_its_sharded_checkpoint_exactly",
           "test_two_nodes_of_one_process_train_as_one_two_process_run",
           "test_lora_rl_step_needs_less_memory_than_full_fine_tuning", "test_grpo_short_run_raises_reward",
           "test_ppo_short_run_raises_the_score_and_moves_actor_and_critic"}


def built_once(tmp_path_factory, name: str, build) -> str:
    """A folder that build(folder) fills, made once per test session: with -n 2 the first worker
    to ask builds it (the other waits on a lock) and both read it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = str(tmp_path_factory.mktemp(name))
        build(folder)
        return folder
    from filelock import FileLock  # installed with transformers (huggingface_hub)

    shared = tmp_path_factory.getbasetemp().parent  # this session's, above each worker's own
    folder = str(shared / name)
    with FileLock(str(shared / f"{name}.lock")):
        if not os.path.isfile(f"{folder}.done"):
            build(folder)
            open(f"{folder}.done", "w").close()
    return folder


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory):
    """A short SFT run (~2 min on one core): the answer format is learned; greedy, the sums are right 17% to 55%
    of the time, by seed and CPU (tests/test_scripts.py)."""
    return built_once(tmp_path_factory, "sft", lambda out: run_main(
        "sft.py", "--output_dir", out, "--max_steps", "300", "--learning_rate", "2e-3", "--eval_steps", "300",
        "--num_eval_examples", "64", "--overwrite_output_dir", "true"))


@pytest.fixture(scope="session")
def rm_checkpoint(sft_checkpoint, tmp_path_factory):
    """A short reward-model run from the short SFT checkpoint (~1 min): the shipped pairs plus pairs from the
    policy's samples on 64 prompts. notebooks/helpers.py's RM_CONFIG is the same run, so notebook 02 need not
    train it again (tests/test_notebooks.py copies it)."""
    settings = [word for name, value in RM_SETTINGS.items() for word in (f"--{name}", str(value))]
    return built_once(tmp_path_factory, "rm", lambda out: run_main(
        "reward_model.py", "--model", sft_checkpoint, "--output_dir", out, *settings, "--overwrite_output_dir", "true"))


RM_SETTINGS = {"max_steps": 100, "policy_prompts": 64, "eval_steps": 50, "num_eval_examples": 200}  # the rest default


@pytest.fixture(scope="session")
def sft_folder(tmp_path_factory):
    """A folder sft.py wrote after 80 steps (~20 s): its layout, run record, checkpoint and tokenizer, and a
    model that has learned the answer's layout and to stop (completions end at different lengths), not yet
    the sums. For the tests that need a policy folder, not a policy that solves the task."""
    return built_once(tmp_path_factory, "sft_folder", lambda out: run_main(
        "sft.py", "--output_dir", out, *SFT_FOLDER_RUN, "--overwrite_output_dir", "true"))


SFT_FOLDER_RUN = ["--max_steps", "80", "--learning_rate", "2e-3", "--eval_steps", "80", "--num_eval_examples", "8",
                  "--eval_on_start", "false"]  # sft_folder's settings


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A freshly built tiny model + tokenizer saved to disk, as sft.py does."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = common.build_tokenizer()
    torch.manual_seed(0)
    model = common.build_tiny_model(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer, model


def rotated_tokenizer(shift: int = 7) -> transformers.PreTrainedTokenizerFast:
    """common.build_tokenizer with byte b at id (b + shift) % 256: the same text, the same special tokens
    and chat template, other ids (a reward model with a tokenizer of its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: (byte + shift) % 256 for byte, char in common._bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|im_end|>", pad_token="<|pad|>",
        extra_special_tokens=["<|im_start|>"], padding_side="left")
    tokenizer.add_tokens(common.THINK_ANSWER_TOKENS)
    tokenizer.chat_template = common.CHAT_TEMPLATE
    return tokenizer


def rotated_reward_model(reward_model, shift: int = 7):
    """A copy of reward_model that reads rotated_tokenizer(shift)'s ids: embedding row (b + shift) % 256
    holds what row b held, so the same text gives the same score."""
    import copy

    rotated = copy.deepcopy(reward_model)
    old = reward_model.get_input_embeddings().weight
    rows = torch.arange(old.shape[0])
    rows[:256] = (rows[:256] + shift) % 256
    with torch.no_grad():
        rotated.get_input_embeddings().weight[rows] = old
    return rotated


def tiny_reward_model(tokenizer, seed: int = 0):
    """A random tiny Llama with a scalar head (reward_model.py's architecture, untrained)."""
    torch.manual_seed(seed)
    config = common.build_tiny_model(tokenizer).config
    config.num_labels = 1
    return transformers.LlamaForSequenceClassification(config)
