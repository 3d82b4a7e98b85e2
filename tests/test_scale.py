"""Scale-out paths on CPU: torchrun data parallelism, LoRA, and the loaders of the public data schemas."""
import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

import common
from lib import distributed, rollout
import grpo
from conftest import ROOT, assert_same_run, built_once, read_metrics, run, run_main, start
from floats import assert_close, forward_terms, tolerance

HELPERS = os.path.join(ROOT, "tests", "helpers")


def torchrun(*args, nproc=2):
    """`torchrun --standalone --nproc_per_node nproc args` to its end, torchrun itself (each process a new interpreter,
    one thread): .stdout, .stderr."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def start_as_torchrun(*args, nproc=2) -> list:
    """`python args` in nproc processes, started with the variables torchrun gives its processes (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: distributed.setup() joins the group from them).
    Speed: forked from the test's script server (conftest.start), without the launcher's and the processes' new
    interpreters (~9 s each here, importing torch and transformers). torchrun itself: torchrun() above, which
    test_torchrun_two_processes_end_with_identical_weights and the tests of the process group's exit use."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    return [start(*args, env={"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                              "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(nproc)]


def as_torchrun(*args, nproc=2):
    """start_as_torchrun's processes to their end: what they printed (rank 0's, then the others') as .stdout and
    .stderr, as torchrun passes on its processes' output."""
    processes = start_as_torchrun(*args, nproc=nproc)
    for process in processes:
        process.wait()
    result = types.SimpleNamespace(stdout="".join(p.stdout for p in processes),
                                   stderr="".join(p.stderr for p in processes))
    assert all(p.returncode == 0 for p in processes), \
        f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


# --- torchrun ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_process_losses_and_gradients_equal_one_process(tmp_path):
    """Token means over the global batch: 2 processes on halves of a batch (3 and 21 tokens) give
    the loss and the averaged gradient of 1 process on all of it, for every loss of the scripts,
    to float32 rounding: with data parallelism (average_gradients) and with the model sharded
    (FSDP reduces the gradients, each process keeps its shard; gathered here to compare).
    A per-process token mean (the usual mistake) misses by orders of magnitude. Speed: both
    parallelisms in one two-process start (as_torchrun: one start-up)."""
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run(os.path.join(HELPERS, "ddp_losses.py"), one)
    as_torchrun(os.path.join(HELPERS, "ddp_losses.py"), two, "--fsdp")
    one = torch.load(one)["ddp"]
    for parallelism, two_processes in torch.load(two).items():
        for name in ("sft", "grpo_dapo", "grpo_grpo", "ppo_actor", "mix_dapo"):
            # each gradient entry sums over the batch's positions (and the two halves add in another order)
            label = f"{parallelism}: {name}"
            assert_close(two_processes[name]["loss"], one[name]["loss"], terms=one[name]["terms"], msg=label)
            assert_close(two_processes[name]["grad"], one[name]["grad"], terms=one[name]["terms"], msg=label)
        wrong, right = two_processes["dapo_local_mean"]["grad"], one["dapo_local_mean"]["grad"]
        allowed = tolerance(one["dapo_local_mean"]["terms"], right.abs().max().item())
        assert (wrong - right).abs().max().item() > 1000 * allowed, parallelism  # the check above would catch it


SAME_WEIGHT_RUNS = [  # script, its settings, the metrics lines it logs
    ("grpo", ["--max_steps", "3", "--per_device_train_batch_size", "16", "--num_generations", "4"], 3),
    ("sft", ["--model", "tiny", "--max_steps", "4", "--per_device_train_batch_size", "8"], 1),
]


@pytest.mark.slow
def test_torchrun_two_processes_end_with_identical_weights(sft_checkpoint, tmp_path):
    """grpo.py and sft.py under torchrun: both processes end with the same weights, and rank 0 alone writes the
    outputs. Speed: the runs share one torchrun (one start-up, tests/helpers/ddp_same_weights.py with a runs file)."""
    runs = [[script, *([] if "--model" in args else ["--model", sft_checkpoint]), *args, "--output_dir",
             str(tmp_path / script), "--eval_steps", "100", "--num_eval_examples", "8", "--warmup_steps", "1"]
            for script, args, _ in SAME_WEIGHT_RUNS]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    printed = torchrun(os.path.join(HELPERS, "ddp_same_weights.py"), str(tmp_path / "runs.json")).stdout
    for (script, _, logged), output in zip(SAME_WEIGHT_RUNS, printed.split("=== run ")[1:], strict=True):
        assert "2 processes" in output and "identical" in output, (script, output)
        # rank 0 alone wrote the outputs: one metrics line per logged step, not two
        rows = [row for row in read_metrics(tmp_path / script) if "loss" in row]
        assert len(rows) == logged, script
        with open(tmp_path / script / "eval.json") as f:
            assert json.load(f)["n"] == 8, script  # each process evaluated 4 problems; the counts were summed


def test_each_process_leaves_the_process_group_as_it_exits(tmp_path):
    """distributed.setup() registers leave_group at exit: the group is destroyed before the interpreter
    tears gloo down (left to that teardown, gloo's threads aborted some finished --fsdp runs). atexit
    runs its handlers last registered first, so a handler registered before setup() sees the end.
    Each process writes its own file (two processes printing to one pipe interleave their lines)."""
    script = tmp_path / "join_and_exit.py"
    script.write_text(
        f"import atexit, os, sys\nsys.path.insert(0, {ROOT!r})\nimport torch.distributed as dist\n"
        "from lib import distributed\n"
        f"report = open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w')\n"
        "atexit.register(lambda: (report.write(f'in a group at exit: {dist.is_initialized()}'), report.close()))\n"
        "report.write(f'rank, world size: {distributed.setup()}; ')\n")
    torchrun(str(script))
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == f"rank, world size: ({rank}, 2); in a group at exit: False"


@pytest.mark.slow
def test_torchrun_reward_model_with_one_held_out_pair(sft_folder, tmp_path):
    """One held-out pair on two processes: rank 1's share is empty, and every process takes the same
    branch of the check (one stopping alone would leave the other in a collective). And what the
    two processes must give: identical weights on both (one starting value head, rank 0's, and averaged
    gradients), and held-out scores of the one pair that are one process's scores of it with the saved model.
    The reward model needs a policy folder, not a policy that solves the task: sft_folder's 80-step run."""
    import reward_model

    data = tmp_path / "pairs"
    data.mkdir()
    with open(os.path.join(ROOT, "data", "preference", "train.jsonl")) as f:
        rows = f.readlines()
    (data / "train.jsonl").write_text("".join(rows[:64]))
    (data / "test.jsonl").write_text(rows[64])
    out = str(tmp_path / "rm")
    result = as_torchrun(os.path.join(HELPERS, "ddp_same_weights.py"), "reward_model", "--model", sft_folder,
                         "--dataset", str(data), "--output_dir", out, "--max_steps", "2",
                         "--per_device_train_batch_size", "8", "--policy_prompts", "0")
    assert "2 processes" in result.stdout and "identical" in result.stdout, result.stdout
    with open(os.path.join(out, "eval.json")) as f:
        scores = json.load(f)
    assert scores["n"] == 1
    model, tokenizer = common.load_model(out, scalar_head=True)
    held_out = common.load_split(str(data), "test", ("prompt", "chosen", "rejected"))
    pairs = reward_model.tokenize_pairs(tokenizer, held_out, "", reward_model.Config.max_length)
    with torch.no_grad():  # r(chosen), r(rejected) of the one pair, in this one process
        chosen, rejected = reward_model.sequence_scores(model, *reward_model.collate(pairs, tokenizer.pad_token_id))
    margin = (chosen - rejected).item()
    # the margin: two forward passes' scores (each through the layers' sums and the head), subtracted, computed by
    # rank 0 with one thread and here with this process's threads: 2 x forward_terms x eps x the scores' size
    allowed = 2 * tolerance(forward_terms(model.config), max(abs(chosen.item()), abs(rejected.item())))
    assert abs(scores["margin"] - margin) <= allowed, (scores, margin, allowed)
    assert abs(margin) <= allowed or scores["pairwise_accuracy"] == (1.0 if margin > 0 else 0.0), (scores, margin)


@pytest.mark.slow
def test_two_nodes_of_one_process_train_as_one_two_process_run(sft_checkpoint, tmp_path):
    """Multi-node torchrun on localhost: two "nodes" of one process each (their own torchrun, joined by
    a c10d rendezvous) train as one run of two processes on one node: the same metrics and weights. The
    one-node run is `torchrun --nproc_per_node 2 grpo.py ...` as a user runs it: it saves the model, and its
    one held-out problem is evaluated by rank 0 (rank 1 evaluates none)."""
    args = ["grpo.py", "--model", sft_checkpoint, "--max_steps", "2", "--per_device_train_batch_size", "16",
            "--num_generations", "4", "--eval_steps", "100", "--num_eval_examples", "1", "--warmup_steps", "1"]
    one_node = str(tmp_path / "one_node")
    torchrun(*args, "--output_dir", one_node)
    assert os.path.isfile(os.path.join(one_node, "model.safetensors"))
    with open(os.path.join(one_node, "eval.json")) as f:
        assert json.load(f)["n"] == 1
    with socket.socket() as free:  # a free port for the rendezvous
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    two_nodes = str(tmp_path / "two_nodes")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                               "1", "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_endpoint",
                               f"localhost:{port}", "--rdzv_id", "two_nodes", *args, "--output_dir", two_nodes],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(output[-2000:] for output in outputs)
    assert_same_run(two_nodes, one_node)  # same operations in the same order: bit for bit


def test_process_shares_cut_as_datasets_does_and_may_be_empty():
    import datasets

    for num_rows in range(10):
        data = datasets.Dataset.from_dict({"x": list(range(num_rows))})
        for world_size in range(1, 5):
            shares = [distributed.share_rows(num_rows, rank, world_size) for rank in range(world_size)]
            assert [i for share in shares for i in share] == list(range(num_rows))  # every row once, in order
            if num_rows >= world_size:  # where datasets can cut, it cuts the same
                assert [list(share) for share in shares] == [
                    data.shard(world_size, rank, contiguous=True)["x"] for rank in range(world_size)]


# --- FSDP (--fsdp): weights, gradients and AdamW states sharded over the processes --------------
def _same_up_to_rounding(a, b, terms):
    """Two runs that compute the same sums in another order (FSDP gathers, reduce-scatters and runs
    GRPO's groups without the prompt cache; DDP all-reduces): the same metrics, timings aside, and
    the same saved weights, to float32 rounding of `terms`-term sums. The sampled tokens, rewards
    and accuracies come out equal; a wrong gradient would show in grad_norm, a wrongly gathered
    checkpoint in the weights. The weights' scale is the largest weight of the file: AdamW divides
    each gradient entry by its own running size, so where an entry is within rounding of zero the
    two runs' updates of that weight can differ by up to the learning rate, which LoRA's B (grown
    from 0 by those updates alone) would show against a scale of its own size."""
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [sorted(r) for r in rows_a] == [sorted(r) for r in rows_b]
    for row_a, row_b in zip(rows_a, rows_b):
        for key in row_a:
            if not key.startswith("time"):  # scale: a loss sums terms of size ~1 (advantages, ratios)
                assert_close(row_a[key], row_b[key], terms=terms, scale=max(abs(row_b[key]), 1.0),
                             msg=f"step {row_b['step']} {key}")
    for name in ("model.safetensors", "critic/model.safetensors", "adapter_model.safetensors",
                 "critic/adapter_model.safetensors"):
        if os.path.isfile(os.path.join(b, name)):
            weights_a, weights_b = (load_file(os.path.join(out, name)) for out in (a, b))
            assert weights_a.keys() == weights_b.keys(), name  # a tied LM head saved once, as save_pretrained does
            scale = max(w.abs().max().item() for w in weights_b.values())
            for key in weights_b:
                assert_close(weights_a[key], weights_b[key], terms=terms, scale=scale, msg=f"{name} {key}")


# 9 held-out problems: 5 + 4 over the two processes, evaluated (sharded generation) once, at the end
FSDP_SHORT = ["--eval_steps", "100", "--num_eval_examples", "9", "--eval_on_start", "false", "--warmup_steps", "1"]
GRPO_SHORT = ["--per_device_train_batch_size", "16", "--num_generations", "4"]
FSDP_RUNS = [  # 2 steps: the second reads the AdamW states the first left sharded
    ("sft.py", ["--max_steps", "2", "--per_device_train_batch_size", "8"]),
    ("reward_model.py", ["--max_steps", "2", "--per_device_train_batch_size", "8", "--policy_prompts", "16",
                         "--samples_per_prompt", "2", "--eval_steps", "2"]),
    ("grpo.py", ["--max_steps", "2", *GRPO_SHORT]),
    ("ppo.py", ["--max_steps", "2", "--per_device_train_batch_size", "8"]),
    # LoRA: the frozen base sharded beside the adapters (the policy's, its reference the adapter off, as in
    # grpo.py), and PPO's critic a LoRA scalar head
    ("ppo.py", ["--max_steps", "2", "--per_device_train_batch_size", "8", "--lora_r", "8"]),
]


@pytest.mark.slow
def test_fsdp_trains_as_data_parallelism_does(sft_checkpoint, rm_lora, tmp_path):
    """sft, reward_model, grpo and ppo on two processes with --fsdp (FSDP_RUNS; the other scripts share their
    run machinery but are not run sharded here: mix.py's sharding is grpo.py's line, and its loss and gradient
    under FSDP are the test above's): the same metrics and weights as the same
    two-process run with data parallelism (which the test above and test_torchrun_* tie to one
    process on the whole batch), to float32 rounding; the start-up memory table divides the sharded
    rows by 2. Speed: the 10 runs share one two-process start (as_torchrun, tests/helpers/run_mains.py), one
    start-up instead of 10 (importing torch and transformers is most of a 3-step run); one test, so that one
    worker of `-n 2` runs them while the other runs other tests."""
    runs = []
    for i, (script, args) in enumerate(FSDP_RUNS):
        args = [script.removesuffix(".py"), "--model", sft_checkpoint, *args, *FSDP_SHORT,
                *(["--reward_model", rm_lora] if script == "ppo.py" else [])]
        runs += [[*args, "--output_dir", str(tmp_path / f"{i}_ddp")],
                 [*args, "--output_dir", str(tmp_path / f"{i}_fsdp"), "--fsdp", "true"]]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    # split at the markers: [what came before run 0, run 0 (DDP of FSDP_RUNS[0]), run 1 (its FSDP), run 2, ...]
    printed = as_torchrun(os.path.join(HELPERS, "run_mains.py"), str(tmp_path / "runs.json")).stdout.split("=== run ")
    config = common.load_model(sft_checkpoint)[0].config
    for i, (script, args) in enumerate(FSDP_RUNS):
        name = script + " LoRA" * ("--lora_r" in args)
        assert "/ 2 (sharded)" in printed[2 * i + 2], name
        # the longest sums: a forward pass, then a gradient entry over the global batch's tokens
        # (2 processes x at most 16 rows x at most 100 tokens of prompt and completion)
        try:
            _same_up_to_rounding(str(tmp_path / f"{i}_fsdp"), str(tmp_path / f"{i}_ddp"),
                                 terms=forward_terms(config) + 2 * 16 * 100)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error


def test_memory_estimate_divides_what_fsdp_shards():
    """Over N processes: weights, gradients, AdamW moments and frozen copies / N, plus the policy's
    full weights, gathered for the rollout; activations stay per process. A 16.9M-parameter model,
    built on the meta device (shapes only): 4 bytes per weight and gradient, 8 for AdamW."""
    tokenizer = common.build_tokenizer()
    with torch.device("meta"):
        model = common.build_tiny_model(tokenizer, hidden_size=512, num_layers=4, num_heads=8)
    n = sum(p.numel() for p in model.parameters())
    gib = lambda text: [float(line.split()[-2]) for line in text.splitlines()[1:]]  # noqa: E731
    one = gib(distributed.memory_estimate([model], [model], rows=4, sequence_length=100, completion_length=50))
    four = gib(distributed.memory_estimate([model], [model], rows=4, sequence_length=100, completion_length=50,
                                      shards=4))
    expected_one = [4 * n, 4 * n, 8 * n, 4 * n]  # bytes: weights, gradients, AdamW, frozen copy
    assert one[:4] == pytest.approx([b / 2**30 for b in expected_one], abs=5e-4)  # printed to 3 decimals
    assert four[:4] == pytest.approx([b / 4 / 2**30 for b in expected_one], abs=5e-4)
    assert four[4] == pytest.approx(4 * n / 2**30, abs=5e-4)  # gathered to generate
    assert four[5:7] == one[4:6]  # activations and logits of one micro-batch: per process, unchanged
    assert four[-1] == pytest.approx(sum(four[:-1]), abs=5e-3) and four[-1] < one[-1]


@pytest.mark.slow
def test_fsdp_killed_run_resumes_from_its_sharded_checkpoint_exactly(sft_checkpoint, tmp_path):
    """--fsdp writes its resumable checkpoints sharded (each process its own part of the weights and
    AdamW states, torch.distributed.checkpoint). A run killed after its step-2 checkpoint, then
    resumed, ends bit for bit as the unbroken run: metrics and weights."""
    import time

    args = ["grpo.py", "--model", sft_checkpoint, "--max_steps", "4", "--save_steps", "2", "--fsdp", "true",
            *GRPO_SHORT, *FSDP_SHORT]
    unbroken, broken = str(tmp_path / "unbroken"), str(tmp_path / "broken")
    as_torchrun(*args, "--output_dir", unbroken)
    assert sorted(os.listdir(os.path.join(unbroken, "checkpoint", "sharded"))) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file of shards per process
    processes = start_as_torchrun(*args, "--output_dir", broken)
    metrics, deadline = os.path.join(broken, "metrics.jsonl"), time.time() + 300
    while not (os.path.isfile(metrics) and len(open(metrics).readlines()) >= 3):  # step 3 logged: past step 2's save
        assert all(p.poll() is None for p in processes) and time.time() < deadline, "it ended before the kill point"
        time.sleep(0.001)
    for process in processes:  # both, wherever they were
        process.kill()
        process.wait()
    result = as_torchrun(*args, "--output_dir", broken, "--resume", "true")
    assert "resumed from" in result.stdout + result.stderr
    assert_same_run(broken, unbroken)


# --- LoRA --------------------------------------------------------------------------------------
class LoraConfig:
    lora_r, lora_alpha, lora_dropout, lora_target_modules = 8, 16.0, 0.0, "all-linear"


def test_lora_step_trains_the_adapter_only_and_disabling_it_gives_the_base_model():
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    base = common.build_tiny_model(tokenizer)
    start = {k: v.clone() for k, v in base.state_dict().items()}
    model = common.add_lora(base, LoraConfig())
    prompts = [common.make_prompt(tokenizer, "What is 1 + 2?")] * 4
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 8)
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    T = completion_ids.shape[1]
    base_logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, T).detach()  # B = 0: LoRA is a no-op
    logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, T)
    advantages = grpo.group_advantages(torch.tensor([1.0, -1.0, 0.5, 2.0]), group_size=4)
    with common.reference_model(model, None) as reference:
        ref_logprobs = rollout.completion_logprobs(reference, input_ids, attention_mask, T)
    loss = grpo.grpo_loss(logprobs, logprobs.detach(), ref_logprobs, advantages, completion_mask,
                          grpo.Config(beta=0.04))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    loss.backward()
    optimizer.step()
    # the base weights did not move; every adapter's B did (A gets no gradient while B = 0)
    for name, value in model.get_base_model().state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, start[name.replace(".base_layer", "")]), name
    assert all(not torch.equal(p, lora_before[n]) for n, p in model.named_parameters() if "lora_B" in n)
    # the adapter now changes the policy; switched off, it is exactly the starting model (pi_ref)
    with torch.no_grad():
        trained = rollout.completion_logprobs(model, input_ids, attention_mask, T)
        with common.reference_model(model, None) as reference:
            ref = rollout.completion_logprobs(reference, input_ids, attention_mask, T)
    real = completion_mask.bool()
    assert not torch.allclose(trained[real], base_logprobs[real])
    assert torch.equal(ref[real], base_logprobs[real])  # B = 0 adds exactly 0.0 to every base output


@pytest.fixture(scope="session")
def rm_lora(sft_checkpoint, tmp_path_factory):
    """A 3-step LoRA reward model, built once per session (built_once)."""
    return built_once(tmp_path_factory, "rm_lora", lambda out: run_main(
        "reward_model.py", "--model", sft_checkpoint, "--output_dir", out, "--max_steps", "3", "--lora_r", "8",
        "--policy_prompts", "16", "--samples_per_prompt", "2", "--num_eval_examples", "32", "--eval_steps", "3"))


@pytest.mark.slow
def test_lora_works_on_all_five_scripts(sft_checkpoint, rm_lora, tmp_path):
    """--lora_r 8 on sft, reward_model, grpo, mix and ppo; a LoRA run saves its adapter, and the next script loads it
    merged (every script with LoRA on the real model: tests/test_gguf.py)."""
    short = ["--eval_steps", "100", "--num_eval_examples", "8", "--warmup_steps", "1", "--lora_r", "8"]
    sft_out = str(tmp_path / "sft")
    run_main("sft.py", "--model", sft_checkpoint, "--output_dir", sft_out, "--max_steps", "3", *short)
    assert os.path.isfile(os.path.join(sft_out, "adapter_model.safetensors"))
    assert not os.path.isfile(os.path.join(sft_out, "model.safetensors"))
    assert os.path.isfile(os.path.join(rm_lora, "adapter_model.safetensors"))
    rl = ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_generations", "4"]
    ppo_short = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--reward_model", rm_lora]
    for script, extra in (("grpo.py", rl), ("mix.py", rl), ("ppo.py", ppo_short)):
        out = str(tmp_path / script)
        # starts from the LoRA SFT adapter
        result = run_main(script, "--model", sft_out, "--output_dir", out, *extra, *short,
                     *(["--merge_lora", "true"] if script == "grpo.py" else []))
        assert os.path.isfile(os.path.join(out, "adapter_model.safetensors")), script
        assert "trained parameters" in result.stdout + result.stderr
        rows = [row for row in read_metrics(out) if "learning_rate" in row]  # the training steps' lines
        assert len(rows) == 2
    # --merge_lora: a plain model folder, the adapter folded into the base weights, loads like any checkpoint
    merged, _ = common.load_model(str(tmp_path / "grpo.py" / "merged"))
    assert not hasattr(merged, "peft_config") and os.path.isfile(tmp_path / "grpo.py" / "merged" / "model.safetensors")
    # the PPO critic is a LoRA adapter on the reward model, with its value head trained
    adapter = load_file(os.path.join(tmp_path / "ppo.py", "critic", "adapter_model.safetensors"))
    assert any("score" in name for name in adapter)


@pytest.mark.slow
def test_lora_rl_step_needs_less_memory_than_full_fine_tuning(tmp_path):
    """Peak resident memory of a GRPO step on a 34M-parameter model: full fine-tuning holds
    gradients, AdamW states and a reference copy of every weight; LoRA of the adapters only (all of them
    allocated by the first step; its evaluation after it, none before)."""
    tokenizer = common.build_tokenizer()
    torch.manual_seed(0)
    model = common.build_tiny_model(tokenizer, hidden_size=512, num_layers=8, num_heads=8)
    folder = str(tmp_path / "model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # glibc keeps freed memory below its (adaptive) mmap threshold, so the process's peak RSS would
    # track the allocator's history more than the live tensors; a fixed threshold returns it.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    peak = {}
    for name, extra in (("full", []), ("lora", ["--lora_r", "8"])):
        # VmHWM, this process's own peak: ru_maxrss would include the RSS of the pytest process it was forked from
        code = (
            "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path('grpo.py', run_name='__main__'); "
            "print('PEAK_KB', next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')))"
        )
        args = ["--model", folder, "--output_dir", str(tmp_path / name), "--max_steps", "1",
                "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "16",
                "--eval_steps", "100", "--num_eval_examples", "2", "--eval_on_start", "false", *extra]
        result = subprocess.run([sys.executable, "-c", code, "grpo.py", *args], cwd=ROOT, capture_output=True,
                                text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        peak[name] = int(result.stdout.split("PEAK_KB")[1].split()[0]) / 1024
    print(f"peak RSS of a GRPO step, 34M parameters: full {peak['full']:.0f} MB, LoRA r=8 {peak['lora']:.0f} MB")
    # 34M fp32 weights: gradients 135 MB + AdamW 270 MB + reference 135 MB that LoRA does not hold
    assert peak["lora"] < peak["full"] - 200, peak


# --- the public data schemas, from local files -------------------------------------------------
GSM8K_ROWS = [  # openai/gsm8k, config 'main': question, answer = reasoning with <<calculator>> notes + '#### n'
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
]
RM_STATIC_ROWS = [  # Dahoas/rm-static: prompt, response, chosen, rejected
    {"prompt": "\n\nHuman: What is the capital of France?\n\nAssistant:", "response": " Paris.",
     "chosen": " The capital of France is Paris.", "rejected": " I like bread."},
    {"prompt": "\n\nHuman: How many legs does a spider have?\n\nAssistant:", "response": " Eight.",
     "chosen": " A spider has eight legs.", "rejected": " Spiders are scary."},
]


def _folder(tmp_path, name, rows):
    folder = tmp_path / name
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_gsm8k_schema_answer_parsing_and_reward():
    reasoning, number = common.split_gsm8k_answer(GSM8K_ROWS[0]["answer"])
    assert number == "72" and "<<" not in reasoning and reasoning.startswith("Natalia sold 48/2 = 24 clips")
    assert common.is_correct("<think>...</think><answer>72</answer>", GSM8K_ROWS[0]["answer"])
    assert common.is_correct("<think>...</think><answer>$10.</answer>", GSM8K_ROWS[1]["answer"])
    assert not common.is_correct("<think>...</think><answer>71</answer>", GSM8K_ROWS[0]["answer"])


@pytest.mark.slow
def test_sft_and_mix_read_gsm8k_files(sft_checkpoint, tmp_path):
    data = _folder(tmp_path, "gsm8k", GSM8K_ROWS)
    short = ["--eval_steps", "100", "--warmup_steps", "1", "--max_completion_length", "160"]
    run_main("sft.py", "--model", sft_checkpoint, "--dataset", data, "--output_dir", str(tmp_path / "sft"),
             "--max_steps", "2",
        "--per_device_train_batch_size", "2", *short)
    # 2 prompts x 4 + 8 expert rows
    for script, batch in (("mix.py", ["--per_device_train_batch_size", "16", "--expert_data_ratio", "0.5"]),):
        run_main(script, "--model", sft_checkpoint, "--dataset", data, "--output_dir", str(tmp_path / script),
            "--max_steps", "1", "--num_generations", "4", *batch, *short)


@pytest.mark.slow
def test_sft_reward_model_ppo_read_rm_static_files(sft_checkpoint, tmp_path):
    data = _folder(tmp_path, "rm_static", RM_STATIC_ROWS)
    run_main("sft.py", "--model", sft_checkpoint, "--dataset", data, "--output_dir", str(tmp_path / "sft"),
             "--max_steps", "2",
        "--per_device_train_batch_size", "2", "--eval_steps", "100")
    rm = str(tmp_path / "rm")
    run_main("reward_model.py", "--model", sft_checkpoint, "--dataset", data, "--output_dir", rm, "--max_steps", "2",
        "--per_device_train_batch_size", "2", "--policy_prompts", "0", "--eval_steps", "100")
    out = str(tmp_path / "ppo")
    run_main("ppo.py", "--model", sft_checkpoint, "--reward_model", rm, "--dataset", data, "--output_dir", out,
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--eval_steps", "100", "--warmup_steps", "1")
    with open(os.path.join(out, "eval.json")) as f:
        scores = json.load(f)
    assert "score" in scores and "accuracy_sampled" not in scores  # no answers to check: the RM's held-out score


def test_adding_lora_warns_of_nothing():
    """peft's get_peft_model reads transformers' deprecated name for gradient checkpointing; a student
    adding --lora_r should not see a FutureWarning they cannot act on (add_lora silences that one)."""
    import warnings

    tokenizer = common.build_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = common.add_lora(common.build_tiny_model(tokenizer), LoraConfig())
    assert any("lora_A" in name for name, _ in model.named_parameters())
