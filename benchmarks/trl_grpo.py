"""The same GRPO work as `python grpo.py`, done by TRL's GRPOTrainer (for benchmarks/run.py).

Same model folder, data, prompts (rendered by common.make_prompt), reward functions (imported
from grpo.py), group size, batch, max new tokens, beta, epsilon, learning rate and schedule, one
update per batch. TRL's defaults that differ from grpo.py's are set explicitly: beta (TRL 0),
loss_type (TRL 'dapo'), learning rate (TRL 1e-6), bf16 (off: grpo.py uses fp32 on CPU), the
scheduler and warmup, AdamW (TRL 'adamw_torch_fused'; grpo.py uses torch.optim.AdamW), and
gradient checkpointing (TRL 1.16 turns it on by default; grpo.py only with --gradient_checkpointing).

    python benchmarks/trl_grpo.py --max_steps 6 --result /tmp/trl.json
    python benchmarks/trl_grpo.py --model path/to/model.gguf --per_device_train_batch_size 16 --num_generations 4

Any other flag is grpo.py's (the same Config), so both sides take the same settings.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: common, grpo

import datasets
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import common
from lib import harness
import grpo


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (TRL generates inside the step) and TRL's logged metrics."""

    def __init__(self):
        self.step_times, self.logs = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_times.append(time.perf_counter() - self.start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", default=None, help="write the measured figures to this JSON file")
    args, grpo_args = parser.parse_known_args()
    # the settings to copy
    ours = common.parse_config(grpo.Config, ["--max_steps", "6", "--output_dir", "out/bench/trl", *grpo_args])

    model, tokenizer = common.load_model(ours.model, missing_hint="run `python sft.py` first")
    if ours.model.endswith(".gguf"):  # TRL loads its reference model from the policy's path: give it a folder
        folder = os.path.join(ours.output_dir, "model")
        harness.save_checkpoint(model, tokenizer, folder)
        model, tokenizer = common.load_model(folder)
    train = common.load_split(ours.dataset, "train")
    train = datasets.Dataset.from_dict({
        "prompt": [common.make_prompt(tokenizer, q, ours.system_prompt) for q in train["question"]],
        "answer": list(train["answer"]),
    })
    config = GRPOConfig(
        output_dir=ours.output_dir,
        max_steps=ours.max_steps,
        num_generations=ours.num_generations,
        per_device_train_batch_size=ours.per_device_train_batch_size,  # completions per micro-batch, as in grpo.py
        gradient_accumulation_steps=ours.gradient_accumulation_steps,  # TRL generates for all of them at once too
        max_completion_length=ours.max_completion_length,
        temperature=ours.temperature, top_k=0, top_p=1.0,
        num_iterations=ours.num_iterations,
        epsilon=ours.epsilon,
        beta=ours.beta,
        loss_type=ours.loss_type,
        use_bias_correction_kl=False,  # TRL 1.16's default True multiplies k3 by the ratio: grpo.py's plain k3
        scale_rewards="group",  # (r - group mean) / group std, as grpo.group_advantages
        learning_rate=ours.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": ours.min_lr_rate},
        warmup_steps=ours.warmup_steps,
        weight_decay=ours.weight_decay,
        max_grad_norm=ours.max_grad_norm,
        optim="adamw_torch",
        gradient_checkpointing=ours.gradient_checkpointing,  # TRL 1.16's default is True
        bf16=False, use_cpu=True,
        seed=ours.seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=grpo.REWARD_FUNCS, args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()

    steps = [log for log in timer.logs if "completions/mean_length" in log]
    result = {"step_times": timer.step_times,
              "completion_length": [log["completions/mean_length"] for log in steps],
              "reward": [log.get("reward") for log in steps]}
    print(json.dumps({"median_step_s": statistics.median(timer.step_times[1:] or timer.step_times)}))
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
