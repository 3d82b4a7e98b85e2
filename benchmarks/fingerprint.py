"""Same code path, same numbers: a fingerprint of short runs of every script, to compare two commits.

A restructuring (or a speed-up that keeps the arithmetic) must leave every result as it was. This runs
a fixed set of short runs through the command line only (so it works on any commit of the repo), then
prints one JSON object: for each run, every metric but the wall-clock timings (time/*), eval.json,
completions.jsonl, and a sha256 of every saved weight file. Two checkouts that compute the same things
print the same fingerprint, byte for byte:

    git worktree add /tmp/before <commit>            # the commit before the change
    python benchmarks/fingerprint.py --repo /tmp/before --out /tmp/fp_before > before.json
    python benchmarks/fingerprint.py --out /tmp/fp_after > after.json
    cmp before.json after.json && echo identical

On 2 CPU cores (2026-11-27, beside other work): the fourteen runs other than DPO's, RFT's and agent.py's 8 minutes,
the DPO and RFT runs with the runs they read 3 minutes (--only NAME ...: those runs and the runs they
read; --quick: the default runs only, 96 s on 2026-11-28). The runs: SFT 40 steps, then from it GRPO and MIX
(3 steps), the reward model then PPO (3 steps each), SFT on data/tool_demos (150 steps) then agent.py
from it (3 steps), each at its defaults with small evaluations; then variants that take the other
branches (accumulation, LoRA, several updates per batch, the loss types and reward scalings, the sequence
ratio, PPO's epochs, mini-batches, rule reward and adaptive KL, SFT on prompt / chosen data); DPO's
branches (offline sigmoid with accumulation, IPO with LoRA, SimPO, KTO offline and online, online DPO
judged by the checker, iterative DPO judged by the reward model), RFT and distillation (the 40-step SFT
taught by the 300-step one), the online ones from a 300-step
SFT that is right some of the time (the 40-step one wrote no right answer in 384 samples: every pair
tied, and RFT kept nothing); Clip-Cov and KL-Cov (grpo_entropy.py, KL-Cov with the sampler's
correction); and GRPO under torchrun, data-parallel and sharded.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = ["--num_eval_examples", "16", "--eval_samples_per_problem", "2"]


def runs(out: str, quick: bool) -> list[tuple[str, list[str]]]:
    """(name, command) of each run, in order; later runs read the folders of earlier ones."""
    sft, rm, weak = os.path.join(out, "sft"), os.path.join(out, "rm"), os.path.join(out, "sft_weak")
    short = ["--max_steps", "3", "--eval_steps", "3", *EVAL]
    chain = [
        ("sft", ["sft.py", "--max_steps", "40", "--eval_steps", "40", *EVAL]),
        ("grpo", ["grpo.py", "--model", sft, *short, "--log_completions_steps", "1"]),
        ("mix", ["mix.py", "--model", sft, *short]),
        ("rm", ["reward_model.py", "--model", sft, "--max_steps", "3", "--eval_steps", "3", "--policy_prompts", "16",
                "--num_eval_examples", "32"]),
        ("ppo", ["ppo.py", "--model", sft, "--reward_model", rm, *short, "--log_completions_steps", "1"]),
        ("sft_tool", ["sft.py", "--dataset", "data/tool_demos", "--max_steps", "150", "--eval_steps", "150", *EVAL]),
        ("agent", ["agent.py", "--model", os.path.join(out, "sft_tool"), *short, "--log_completions_steps", "1"]),
    ]
    if quick:
        return chain
    variants = [
        ("sft_pairs", ["sft.py", "--dataset", "data/preference", "--max_steps", "6", "--eval_steps", "3",
                       "--num_eval_examples", "16", "--gradient_accumulation_steps", "2",
                       "--per_device_train_batch_size", "8"]),
        ("grpo_variants", ["grpo.py", "--model", sft, *short, "--num_iterations", "2", "--loss_type", "dapo",
                           "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "32",
                           "--lora_r", "4", "--mask_truncated_completions", "true", "--epsilon_high", "0.28",
                           "--scale_rewards", "batch", "--max_completion_length", "24"]),
        ("grpo_sequence", ["grpo.py", "--model", sft, *short, "--importance_sampling_level", "sequence",
                           "--beta", "0", "--loss_type", "dr_grpo", "--scale_rewards", "none",
                           "--num_iterations", "2", "--per_device_train_batch_size", "64"]),
        ("grpo_bnpo", ["grpo.py", "--model", sft, *short, "--loss_type", "bnpo", "--gradient_accumulation_steps", "2",
                       "--per_device_train_batch_size", "32", "--gradient_checkpointing", "true"]),
        ("mix_variants", ["mix.py", "--model", sft, *short, "--loss_type", "dapo", "--gradient_accumulation_steps",
                          "2", "--per_device_train_batch_size", "32", "--num_iterations", "2", "--mu", "0.3"]),
        ("ppo_variants", ["ppo.py", "--model", sft, "--reward_model", "rule", *short, "--num_ppo_epochs", "2",
                          "--num_mini_batches", "2", "--gradient_accumulation_steps", "2",
                          "--per_device_train_batch_size", "16", "--lora_r", "4", "--target_kl", "0.1"]),
        ("rm_lora", ["reward_model.py", "--model", sft, "--max_steps", "3", "--eval_steps", "3", "--policy_prompts",
                     "0", "--num_eval_examples", "32", "--lora_r", "4", "--gradient_accumulation_steps", "2",
                     "--per_device_train_batch_size", "8"]),
        ("sft_weak", ["sft.py", "--max_steps", "300", "--eval_steps", "300", *EVAL]),  # for the checker's runs
        ("dpo_sigmoid", ["dpo.py", "--model", sft, *short, "--gradient_accumulation_steps", "2",
                         "--per_device_train_batch_size", "16"]),
        ("dpo_ipo", ["dpo.py", "--model", sft, *short, "--loss_type", "ipo", "--per_device_train_batch_size", "16",
                     "--lora_r", "4"]),
        ("dpo_simpo", ["dpo.py", "--model", sft, *short, "--loss_type", "simpo",
                       "--per_device_train_batch_size", "16"]),
        ("dpo_kto", ["dpo.py", "--model", sft, *short, "--loss_type", "kto", "--gradient_accumulation_steps", "2",
                     "--per_device_train_batch_size", "8"]),
        ("dpo_online", ["dpo.py", "--model", weak, *short, "--online", "true", "--judge", "rule",
                        "--per_device_train_batch_size", "32", "--log_completions_steps", "1"]),
        ("dpo_online_kto", ["dpo.py", "--model", weak, *short, "--online", "true", "--loss_type", "kto",
                            "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "16"]),
        ("dpo_iterative", ["dpo.py", "--model", weak, "--max_steps", "4", "--eval_steps", "4", *EVAL, "--online",
                           "true", "--judge", rm, "--steps_per_generation", "2", "--save_steps", "2",
                           "--per_device_train_batch_size", "32", "--log_completions_steps", "1"]),
        ("rft", ["rft.py", "--model", weak, *short, "--log_completions_steps", "1"]),
        ("distill", ["distill.py", "--model", sft, "--teacher_model_name_or_path", weak, *short,
                     "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "8",
                     "--log_completions_steps", "1"]),
        ("grpo_kl_cov", ["grpo_entropy.py", "--model", sft, *short, "--loss_mode", "kl_cov", "--num_iterations", "2",
                         "--vllm_importance_sampling_correction", "true", "--per_device_train_batch_size", "64"]),
        ("grpo_clip_cov", ["grpo_entropy.py", "--model", sft, *short, "--loss_mode", "clip_cov",
                           "--clip_cov_ratio", "0.02", "--per_device_train_batch_size", "64"]),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517"]
    parallel = [
        ("grpo_ddp", [*torchrun, "grpo.py", "--model", sft, *short, "--per_device_train_batch_size", "32"]),
        ("grpo_fsdp", [*torchrun, "grpo.py", "--model", sft, *short, "--per_device_train_batch_size", "32",
                       "--fsdp", "true"]),
    ]
    return chain + variants + parallel


def with_inputs(runs: list[tuple[str, list[str]]], out: str, only: list[str]) -> list[tuple[str, list[str]]]:
    """The runs named in only, and the earlier runs whose folders they read (an argument that is one's
    folder), in the order of runs."""
    unknown = set(only) - {name for name, _ in runs}
    if unknown:
        sys.exit(f"--only: no run named {', '.join(sorted(unknown))} (the runs: {', '.join(n for n, _ in runs)})")
    wanted = set(only)
    for name, command in reversed(runs):  # a run comes after the runs it reads
        if name in wanted:
            wanted |= {other for other, _ in runs if os.path.join(out, other) in command}
    return [(name, command) for name, command in runs if name in wanted]


def digest(folder: str) -> dict:
    """What a run computed: metrics without time/*, eval.json, completions.jsonl, and the weights' sha256."""
    result = {"metrics": {}}  # step -> {metric: value}: the same whether a step's metrics come in one line or two
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            logged = result["metrics"].setdefault(str(row["step"]), {})
            logged.update({k: v for k, v in row.items() if not k.startswith("time/") and k != "step"})
    with open(os.path.join(folder, "eval.json")) as f:
        result["eval"] = json.load(f)
    completions = os.path.join(folder, "completions.jsonl")
    if os.path.isfile(completions):
        with open(completions) as f:
            result["completions"] = hashlib.sha256(f.read().encode()).hexdigest()
    for base, _, files in sorted(os.walk(folder)):
        if "checkpoint" in base:
            continue
        for name in sorted(files):
            if name.endswith(".safetensors"):
                path = os.path.join(base, name)
                with open(path, "rb") as f:
                    result[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=ROOT, help="the checkout to run (default: this one)")
    parser.add_argument("--out", required=True, help="a new folder for the runs' output")
    parser.add_argument("--quick", action="store_true", help="the default runs only (no variants)")
    parser.add_argument("--digest", action="store_true", help="no runs: the fingerprint of the runs already in --out")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these runs and the runs they read")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    selected = runs(out, args.quick) if not args.only else with_inputs(runs(out, False), out, args.only)
    if args.digest:
        names = [name for name, _ in selected if os.path.isdir(os.path.join(out, name))]
        print(json.dumps({name: digest(os.path.join(out, name)) for name in names}, indent=1, sort_keys=True))
        return
    os.makedirs(out, exist_ok=False)
    fingerprint = {}
    env = {**os.environ, "TQDM_DISABLE": "1"}
    for name, command in selected:
        folder = os.path.join(out, name)
        command = command if command[0] == sys.executable else [sys.executable, *command]
        done = subprocess.run([*command, "--output_dir", folder, "--seed", "0"], cwd=args.repo, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        fingerprint[name] = digest(folder)
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(json.dumps(fingerprint, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
