"""The machinery of a training run, kept out of the scripts' loops: settings checks, the output
folder (one writer; a failed run never damages the last good one), torchrun's processes
(lib/distributed.py), resumable checkpoints, the evaluation and checkpoint schedule, the NaN/inf stop,
metrics.jsonl and completions.jsonl with the time of each part of a step, the progress bar, and the
final save. A script makes one Run; its loop holds the algorithm and these calls:

    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset})  # settings, folder, torchrun
    model = run.prepare(model)                            # checkpointing, LoRA, device; DDP: rank 0's weights
    run.shard(model, ref_model)                           # --fsdp: 1/N of each model on each process
    for step in run.steps([model], [optimizer], [scheduler], evaluate):   # resume, progress bar
        ...                                               # the algorithm: rollout, rewards, loss, loss.backward()
        grad_norm = run.clip_gradients(model, loss)       # DDP average, clip; a NaN or inf stops the run here
        optimizer.step()
        run.end_step(metrics)                             # log the step (+ time/*); evaluate, write, save: when due
    run.finish(tokenizer, {"": model}, plots, "GRPO")     # the model, eval.json, the PNG; the folder moves in

None of it changes what a step computes: the same seed gives the same numbers with any of it.
"""
import atexit
import contextlib
import copy
import ctypes
import dataclasses
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time

try:
    import fcntl  # the output folder's lock (not on Windows, where runs go unlocked)
except ImportError:
    fcntl = None
import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import common
from lib import distributed, rollout
from lib.checks import NEXT_RUN, check_fsdp, check_settings, fail
from common import first_line, log, setting
from lib.distributed import full_state_dict, is_main_process


TRACKERS = ("tensorboard", "trackio")  # --report_to's choices (Trackers, below)


# ---------------------------------------------------------------------------------------------
# The run's settings, written once: each script's Config extends one of these with its algorithm's
# fields and sets its own defaults (a line `output_dir: str = "out/grpo"`; the help and the check
# stay here). `--help` lists the script's fields first, then these.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunConfig:
    """Every script: inputs and output, steps and batch, AdamW and its schedule, evaluation,
    checkpoints, LoRA, processes."""
    model: str = "out/sft"
    """the model to start from: a folder another script wrote, a .gguf file, or a hub id"""
    dataset: str = "data/arithmetic"
    """a folder with train.jsonl / test.jsonl, or a hub dataset"""
    output_dir: str = "out/run"
    """where the model, metrics.jsonl, eval.json and the PNG go"""
    overwrite_output_dir: bool = False
    """replace the run already in --output_dir: the new run writes into <output_dir>/.next_run and moves in when it
    finishes, so a run that fails or is killed before its move-in leaves the old one whole. It then removes the old
    run's files: those
    its run.json lists and any model weights, adapter, critic/, merged/ and checkpoint (a run.json that lists
    another kind of name is refused); without a run.json, every file whose name a run writes (model, tokenizer,
    metrics, *.png, README.md, ...), whoever put it there. Other files stay. A folder holds a run when it has a
    run.json, a checkpoint or a metrics.jsonl; into any other folder a run writes beside the files there, and is
    refused if one has a name it writes. A kill's leftovers (checkpoint.tmp, .checkpoint_tmp, .<name>.tmp) go once
    the folder check passes"""
    system_prompt: str = ""
    """optional system message before each question (a hub model may need the format explained; use the same one in
    every script of a chain)"""
    max_steps: int = setting(120, lambda v: v >= 1, "at least 1")
    """optimizer steps (in RL: rollout batches, each followed by its updates)"""
    per_device_train_batch_size: int = setting(128, lambda v: v >= 1, "at least 1")
    """rows per forward pass (a micro-batch), per process"""
    gradient_accumulation_steps: int = setting(1, lambda v: v >= 1, "at least 1")
    """micro-batches per optimizer step: the passes and the backward run one micro-batch at a time (less memory),
    and their gradients add up to the step's (the same result)"""
    max_completion_length: int = setting(64, lambda v: v >= 1, "at least 1 token")
    """max new tokens per completion (rollouts and held-out evaluation)"""
    learning_rate: float = setting(5e-5, lambda v: v > 0, "positive")
    """peak learning rate of AdamW"""
    warmup_steps: int = setting(10, lambda v: v >= 0, "0 or more")
    """linear warmup steps from 0 to the learning rate, then a cosine decay"""
    min_lr_rate: float = setting(0.1, lambda v: 0 <= v <= 1, "in [0, 1]")
    """the cosine ends at min_lr_rate x the learning rate"""
    weight_decay: float = setting(0.0, lambda v: v >= 0, "0 or more")
    """AdamW weight decay"""
    max_grad_norm: float = setting(1.0, lambda v: v > 0, "positive (the gradient's norm is clipped to it)")
    """gradient clipping norm"""
    eval_steps: int = setting(40, lambda v: v >= 1, "at least 1")
    """evaluate on held-out data every this many steps, and at the last step. The evaluation settings are part of
    the run: the sampled evaluation draws from the random generator the rollouts draw from, so in RL they change
    the trained weights, and --resume refuses a change"""
    num_eval_examples: int = setting(500, lambda v: v >= 0, "0 or more (0: every held-out example)")
    """held-out examples per evaluation (0 = the whole test split); part of the run, as --eval_steps"""
    per_device_eval_batch_size: int = setting(512, lambda v: v >= 1, "at least 1")
    """sequences generated or scored at once during evaluation (lower it for a large model); part of the run, as
    --eval_steps"""
    eval_on_start: bool = True
    """evaluate before the first step too (the 'before' of the run's before -> after)"""
    logging_steps: int = setting(1, lambda v: v >= 1, "at least 1")
    """write a metrics.jsonl line every this many steps"""
    report_to: str = setting("none", lambda v: set(v.split(",")) <= {"none", *TRACKERS}, "none, tensorboard, "
                             "trackio, or tensorboard,trackio")
    """where each metrics line also goes, beside metrics.jsonl and the PNG: tensorboard (event files in
    <output_dir>/runs; `tensorboard --logdir <output_dir>`), trackio (its local database, or a Space or server when
    TRACKIO_SPACE_ID or TRACKIO_SERVER_URL is set; `trackio show`), both (tensorboard,trackio), or none. At --resume
    the trackers keep what was logged after the checkpoint and get those steps again. Each needs its package only
    when asked for: pip install tensorboard / trackio"""
    seed: int = setting(0, lambda v: 0 <= v < 2**32, "in [0, 2^32)")
    """random seed"""
    lora_r: int | None = setting(None, lambda v: v >= 1, "a positive rank (leave it out to train every weight)")
    """LoRA rank: train low-rank adapters instead of every weight (needs a pretrained --model); in RL, pi_ref is the
    policy with its adapter off (no second copy); unset = full fine-tuning"""
    lora_alpha: float = setting(16.0, lambda v: v > 0, "positive")
    """LoRA scale: the adapter's output is multiplied by lora_alpha / lora_r"""
    lora_dropout: float = setting(0.0, lambda v: 0 <= v < 1, "in [0, 1)")
    """dropout on the adapter's input (keep 0 in RL: rollouts sample without dropout)"""
    lora_target_modules: str = "all-linear"
    """linear layers that get adapters: 'all-linear' or names such as q_proj,v_proj"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, more time (large models)"""
    fsdp: bool = False
    """under torchrun: shard the weights of every model of the run, and the gradients and AdamW states, over the
    processes (FSDP2), instead of a full copy on each (data parallelism); the saved models are whole, resumable
    checkpoints are sharded"""
    save_steps: int = setting(20, lambda v: v >= 1, "at least 1")
    """write a resumable checkpoint (weights, optimizer, random generators) every this many steps, and at the end"""
    resume: bool = False
    """continue the run in --output_dir from its newest checkpoint (every --save_steps): the steps after it run again
    and end as an unbroken run would (the unfinished replacing run in .next_run, if there is one). Refused when the
    checkpoint is another script's, model's or number of processes', an input changed, or a setting that shapes
    training changed. metrics.jsonl is replaced by the checkpoint's copy, and completions.jsonl cut back to its step
    (a completions.jsonl that is a link starts empty: the link goes, what it points to is kept)"""
    trust_remote_code: bool = False
    """let a hub model run its own Python code (off: only its weights and config are loaded)"""
    merge_lora: bool = False
    """with --lora_r, also save the adapter merged into its base model, in <output_dir>/merged"""

    LOSS_SCALES = ()  # the settings that scale a loss term (a script's Config names its own): Run.what_helps

    def check_together(self):
        """Settings that only work together: a script's Config overrides this with its own checks
        (checks.check_settings calls it, before anything is loaded or written)."""

    def changed(self, name: str) -> bool:
        """Whether the setting `name` differs from its default (a setting that needs a partner)."""
        return getattr(self, name) != self.__dataclass_fields__[name].default


@dataclasses.dataclass
class PolicyConfig(RunConfig):
    """A script that trains a policy: its held-out accuracy is measured on sampled answers."""
    eval_samples_per_problem: int = setting(4, lambda v: v >= 1, "at least 1")
    """sampled completions per held-out problem (temperature 1): sampled accuracy is their mean; part of the run,
    as --eval_steps"""


@dataclasses.dataclass
class RLConfig(PolicyConfig):
    """A script that trains a policy on its own samples (ppo.py, grpo.py, mix.py, agent.py, distill.py, dpo.py
    --online, rft.py)."""
    temperature: float = setting(1.0, lambda v: v >= 0.01, "at least 0.01 (below it the log-probs of the "
                                 "tempered distribution overflow to NaN; the evaluation has a greedy score)")
    """sampling temperature of the rollout (the losses' log-probs are those of the same distribution, but rft.py's
    SFT loss, which reads the model's own, at 1)"""
    log_completions_steps: int = setting(10, lambda v: v >= 0, "0 or more (0: never)")
    """every this many steps, write the step's prompts, completions, rewards and advantages to completions.jsonl
    (0 = never)"""


@dataclasses.dataclass
class PolicyGradientConfig(RLConfig):
    """A script whose loss is a policy gradient on its own samples (ppo.py, grpo.py, mix.py, agent.py): the
    correction for a sampler that is not the trainer (rollout.sampler_importance_weights), under TRL's names,
    though the sampler here is rollout.generate (on a GPU a bf16 copy of the weights), not vLLM."""
    vllm_importance_sampling_correction: bool = False
    """weight each token's policy-gradient term by pi_train / pi_sampler, bounded (TIS, Yao et al. 2025); off by
    default (TRL's is on, for vLLM): on the CPU the sampler and the trainer agree to float32 rounding, and
    sampling/sampling_logp_difference in metrics.jsonl shows the gap on any device"""
    vllm_importance_sampling_mode: str = setting("token_truncate", lambda v: v in rollout.IS_MODES,
                                                 "one of " + ", ".join(rollout.IS_MODES))
    """with --vllm_importance_sampling_correction: token_truncate weighs each token by min(ratio, clip_max) (TIS;
    TRL's default is sequence_mask); token_mask zeroes the tokens whose ratio is out of [clip_min, clip_max]; the
    sequence_ modes do the same with each completion's product of ratios (not GSPO's geometric mean)"""
    vllm_importance_sampling_clip_max: float = setting(3.0, lambda v: v >= 1, "at least 1 (below it even a token "
                                                       "the sampler scored exactly would lose weight)")
    """with --vllm_importance_sampling_correction: C, the cap on the ratio (TRL's default 3)"""
    vllm_importance_sampling_clip_min: float | None = setting(None, lambda v: v is None or 0 <= v <= 1,
                                                              "in [0, 1] (leave it out for no lower bound)")
    """with --vllm_importance_sampling_correction: the lower bound on the ratio (none by default, as TRL)"""

    def check_together(self):
        for name in ("mode", "clip_max", "clip_min"):
            if self.changed(f"vllm_importance_sampling_{name}") and not self.vllm_importance_sampling_correction:
                fail(f"--vllm_importance_sampling_{name} belongs to the sampler's correction: add "
                     "--vllm_importance_sampling_correction true, or leave it out")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low >= high:
            fail(f"--vllm_importance_sampling_clip_min ({low}) must be below --vllm_importance_sampling_clip_max "
                 f"({high})")


def run_setting(name: str, default=dataclasses.MISSING):
    """A run setting (RLConfig's, or a class it extends) in a Config that is not a training run's
    (best_of_n.py): its check and its --help come from the one declaration, at its default or
    `default`. A docstring under the field replaces the run's help text (common.parse_config)."""
    field = RLConfig.__dataclass_fields__[name]
    return dataclasses.field(default=field.default if default is dataclasses.MISSING else default,
                             metadata={**field.metadata, "run_setting": True,
                                       "help": "; ".join(common.field_help(RLConfig)[name])})


class Run:
    """One training run (see the module docstring). The loop reads: rank, world_size, device, rng
    (the data order: prompts, batches; kept in every checkpoint) and dir (the folder being written:
    --output_dir, or <output_dir>/.next_run while a run that replaces an old one is unfinished)."""

    def __init__(self, cfg, inputs: dict):
        """Check every setting and --output_dir before anything is loaded or written (inputs: the
        paths the run reads, {"--model": ...}, none of which may lie in the output), join torchrun's
        processes, and seed: each process draws its own samples (seed + rank)."""
        check_settings(cfg)
        self.cfg = cfg
        self.trackers = Trackers(cfg.report_to)  # --report_to: its packages checked now, before anything is written
        self.record = run_record(cfg, inputs)  # run.json: script, model, settings, what each input held
        self.dir = prepare_output_dir(cfg, inputs, self.record)
        self.rank, self.world_size = distributed.setup()  # rank 0 of 1 without torchrun
        check_fsdp(cfg, self.world_size)
        common.set_seed(cfg.seed + self.rank)
        self.device = distributed.get_device()
        self.rng = random.Random(cfg.seed + self.rank)
        self.started = time.perf_counter()  # the run's clock (time/elapsed), carried across --resume
        self.initial = self.scores = None  # the held-out scores at step 0 and at the latest evaluation
        self.step, self.metrics, self.sample, self.progress_postfix = 0, {}, None, {}
        self.learned_steps, self.no_signal = 0, None  # steps that had something to learn from; why one had not
        self.updated = False  # whether an update was applied to the weights yet (a clip_gradients check passed)

    def prepare(self, model, scalar_head: bool = False):
        """The model as training needs it: activations recomputed in the backward pass
        (--gradient_checkpointing), LoRA adapters with the rest frozen (--lora_r), on this process's
        device, in train mode, and the same starting weights on every process (DDP: rank 0's; a new
        scalar head or LoRA's A is random)."""
        cfg = self.cfg
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora_r is not None:
            model = common.add_lora(model, cfg, scalar_head=scalar_head)
        model.to(self.device).train()
        distributed.broadcast_weights(model)
        return model

    def shard(self, *models):
        """--fsdp: each process keeps 1/N of every weight, gradient and AdamW state of these models
        (distributed.shard_model; None is skipped). Call it before building the optimizer."""
        if self.cfg.fsdp:
            for model in models:
                if model is not None:
                    distributed.shard_model(model)

    def log_memory(self, trained, frozen=(), **micro_batch):
        """Print note 002's memory table of this run, per process (distributed.memory_estimate)."""
        shards, frozen = self.world_size if self.cfg.fsdp else 1, [m for m in frozen if m is not None]
        if micro_batch:  # rows, sequence_length, completion_length of one micro-batch
            micro_batch["gradient_checkpointing"] = self.cfg.gradient_checkpointing
        log(distributed.memory_estimate(trained, frozen, shards=shards, **micro_batch))

    def steps(self, models, optimizers, schedulers, evaluate, state: dict | None = None):
        """The steps of the run, 1 .. --max_steps (from the checkpoint's with --resume), with a
        progress bar. Before the first: the output folder is started, or the checkpoint restored;
        evaluate() runs at step 0 with --eval_on_start. Each step ends with end_step(), the loop's
        last line (called here for a step the loop left early with `continue`); its resumable
        checkpoints hold the models, optimizers, schedulers, every random generator and `state`
        (the script's own values that change as it trains, such as PPO's kl_coef; restored in place
        on --resume). evaluate() returns held-out scores {name: value, ..., "n": count}, logged as
        eval/<name>."""
        cfg = self.cfg
        self.evaluate, self.state = evaluate, state if state is not None else {}
        self.training_state = dict(models=models, optimizers=optimizers, schedulers=schedulers, rng=self.rng,
                                   sharded=cfg.fsdp)  # --fsdp: shard() split every trained model
        if cfg.resume:  # continue exactly where the last checkpoint stopped
            first_step, results = load_training_state(self.dir, **self.training_state)
            self.started -= results.get("elapsed", 0.0)
            self.initial, self.scores = results.get("initial"), results["scores"]
            self.learned_steps = results.get("learned_steps", first_step)
            self.no_signal = results.get("no_signal")  # a run with nothing to learn stops the same way when resumed
            self.state.update(results.get("state", {}))
            self.updated = True  # the checkpoint's weights have been updated (check_finite's advice)
        else:
            start_output_dir(self.dir)
            first_step = 0
        self.trackers.start(self.dir, cfg)
        if not cfg.resume and cfg.eval_on_start:  # the "before" of the run's before -> after
            self.initial = self.scores = scores = evaluate()
            self.write_metrics({"step": 0, **self._eval_metrics(0, scores)})
        script = os.path.basename(inspect.getfile(type(cfg))).removesuffix(".py")
        self.progress = tqdm(range(first_step + 1, cfg.max_steps + 1), initial=first_step, total=cfg.max_steps,
                             desc=script, dynamic_ncols=True, disable=not show_progress())
        for step in self.progress:
            self.step, self.metrics, self.sample, self.weights_gave_finite_values = step, {}, None, False
            self.step_had_signal = True
            self.step_started = time.perf_counter()
            rollout.seconds.clear()
            self.step_ended = False
            yield step
            if not self.step_ended:  # the loop went on to the next step without its last line
                self.end_step()

    def clip_gradients(self, model, loss) -> torch.Tensor:
        """After backward(): the gradients averaged over processes (DDP; FSDP averaged them in the
        backward pass; one process: nothing), and their norm clipped to --max_grad_norm. A NaN or
        inf loss or norm stops the run here, before the optimizer applies it (check_finite).
        Returns the norm before clipping."""
        distributed.average_gradients(model)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm)
        check_finite(self.step, self.dir, advice=self.what_helps, grad_norm=grad_norm, loss=loss)
        self.weights_gave_finite_values = True  # so the checkpoint of the last save is a good one (end_step)
        self.updated = True  # the script applies this update next
        return grad_norm

    def what_helps(self) -> str:
        """What to change after a NaN or inf: a setting that scales the loss (the Config's LOSS_SCALES) that
        was raised above its default, and the learning rate once an update was applied (before the first
        one the weights are the starting model's, finite as loaded, so the learning rate cannot be the cause)."""
        cfg = self.cfg
        defaults = {name: cfg.__dataclass_fields__[name].default for name in cfg.LOSS_SCALES}
        raised = [f"--{name} (here {getattr(cfg, name):g}, by default {default:g})"
                  for name, default in defaults.items() if getattr(cfg, name) > default]
        helps = ["a smaller " + " or ".join(raised)] if raised else []
        if self.updated:
            helps.append("a lower --learning_rate")
        if not helps:  # (common.load_model refuses a model with a NaN or inf weight, naming it)
            return ("no update had been applied yet and the models' weights are finite as loaded, so this step's own "
                    "arithmetic gave it (a pass that overflowed, a log of 0): look at the settings that scale the "
                    "rewards or the loss, and at the starting model's scale")
        return " or ".join(helps) + " usually helps"

    def nothing_to_learn(self, why: str, metrics: dict | None = None):
        """This step had nothing to learn from (why: a sentence, and what would give it something); its
        metrics, if given, are logged (log). A run none of whose steps had anything stops at its end with
        that sentence, and saves nothing."""
        self.step_had_signal, self.no_signal = False, why
        if metrics is not None:
            self.log(metrics)

    def log(self, metrics: dict, completions: dict | None = None) -> dict:
        """This step's metrics, written to metrics.jsonl when the step ends (every --logging_steps),
        with time/step and its parts: time/generation (rollout.generate), time/forward (the forward
        passes: log-probs, values, scores) and time/backward (the rest: backward passes, optimizer
        steps, and the small work between). DDP: each the mean over processes. completions: columns
        {"prompt": [...], "completion": [...], other: [...]}, written to completions.jsonl every
        --log_completions_steps (rank 0's rows); the first row is printed at each evaluation.
        Returns the metrics (DDP: the means)."""
        elapsed = time.perf_counter() - self.step_started
        parts = {f"time/{part}": seconds for part, seconds in rollout.seconds.items()}
        metrics = {**metrics, **parts, "time/backward": elapsed - sum(parts.values()), "time/step": elapsed}
        if self.step % self.cfg.logging_steps == 0 or self.step == self.cfg.max_steps:
            metrics = distributed.reduce_metrics(metrics)
        check_finite(self.step, self.dir, after_update=True, advice=self.what_helps,
                     **{f"metric {key}": value for key, value in metrics.items() if isinstance(value, (int, float))})
        self.metrics = metrics
        shown = [key for key in ("loss", "reward", "score", "accuracy", "kl", "kl_sum") if key in metrics]
        self.progress_postfix = {key: f"{metrics[key]:.3f}" for key in shown}
        if completions:
            every = self.cfg.log_completions_steps  # RLConfig: only RL scripts pass completions
            if every and self.step % every == 0:
                log_completions(self.dir, self.step, **completions)
            self.sample = {key: values[0] for key, values in completions.items()}
        return metrics

    def finish(self, tokenizer, models: dict, plots: dict, title: str):
        """The end of the run: each model saved (models: {subfolder: model}, "" the output folder
        itself; with LoRA the adapter, and with --merge_lora also the merged model), eval.json (the
        latest held-out scores), <title>.png (plots: {panel title: [metric names]}), run.json; a run
        that replaces an old one moves into --output_dir now, whole. A run none of whose steps had
        anything to learn from (nothing_to_learn) stops instead, with why, and saves nothing."""
        if self.learned_steps == 0 and self.no_signal:
            fail(f"nothing was trained in {self.cfg.max_steps} steps: at each one, {self.no_signal}; the model "
                 f"was not saved (the steps' metrics are in {os.path.join(self.dir, 'metrics.jsonl')})")
        for folder, model in models.items():
            path = os.path.join(self.dir, folder) if folder else self.dir
            if folder and is_main_process():
                own_folder(path)
            save_checkpoint(model, tokenizer, path, self.cfg.merge_lora and not folder, self.cfg.fsdp)
        write_json(os.path.join(self.dir, "eval.json"), self.scores)
        png = plot_metrics(self.dir, plots, title)
        self.trackers.finish()  # (their files are whole before the folder moves in)
        finish_output_dir(self.dir, self.cfg, self.record)
        change = ", ".join(f"{name.replace('_', ' ')} " + (f"{_show(name, self.initial[name])} -> " if self.initial
                                                             else "") + _show(name, value)
                           for name, value in self.scores.items() if name != "n")
        log(f"saved to {self.cfg.output_dir}; held-out {change} (n={self.scores['n']}); "
            f"curves in {os.path.join(self.cfg.output_dir, png)}")
        if dist.is_initialized():
            dist.barrier()  # no process exits before rank 0 has moved the run in (an abort at exit harms nothing)

    def end_step(self, metrics: dict | None = None, completions: dict | None = None):
        """The work after a step's update, the loop's last line: the step's metrics, if given, logged
        (log); evaluate() every --eval_steps and at the last step; the step's metrics line (every
        --logging_steps, with the evaluation's scores); the last save's checkpoint promoted once this
        step's weights gave finite values; a resumable checkpoint every --save_steps and at the end
        (after the evaluation: a resume repeats nothing)."""
        if metrics is not None:
            self.log(metrics, completions)
        self.step_ended = True
        cfg, step = self.cfg, self.step
        self.learned_steps += self.step_had_signal
        last = step == cfg.max_steps
        line = self.metrics if step % cfg.logging_steps == 0 or last else {}
        if step % cfg.eval_steps == 0 or last:
            self.scores = self.evaluate()
            line = {**line, **self._eval_metrics(step, self.scores)}
            if self.sample:  # what the policy wrote for the first prompt of this step
                sample = dict(self.sample)
                scores = ", ".join(f"{key} {value:.2f}" for key, value in sample.items() if isinstance(value, float))
                log(f"  sample: {sample['prompt']!r} -> {sample['completion']!r} ({scores})")
        if line:
            self.write_metrics({"step": step, **line})
        self.progress.set_postfix(**self.progress_postfix)
        if self.weights_gave_finite_values and is_main_process():  # the last save's weights gave finite values
            promote_checkpoint(self.dir)
        if step % cfg.save_steps == 0 or last:  # after this step's evaluation: a resume repeats nothing
            results = {"initial": self.initial, "scores": self.scores, "state": self.state,
                       "elapsed": time.perf_counter() - self.started, "learned_steps": self.learned_steps,
                       "no_signal": self.no_signal}
            save_training_state(self.dir, self.record, step, results, **self.training_state)

    def write_metrics(self, row: dict):
        """One line of metrics.jsonl ({"step": step, name: value, ...}), and the same to --report_to's trackers."""
        log_metrics(self.dir, row)
        self.trackers.log(row)

    def _eval_metrics(self, step: int, scores: dict) -> dict:
        """eval/<name> for each held-out score, and the run's clock; the scores printed."""
        log(f"step {step}: held-out " + ", ".join(f"{name.replace('_', ' ')} {_show(name, value)}"
                                                  for name, value in scores.items() if name != "n"))
        return {**{f"eval/{name}": value for name, value in scores.items() if name != "n"},
                "time/elapsed": time.perf_counter() - self.started}


def _stop_with_a_stopped_peer(kind, error, traceback):
    """sys.excepthook: under torchrun, a process whose collective fails because another process of
    the run stopped (bad input there, which that process says in its own sentence) stops with one
    sentence too, not a traceback; gloo raises as soon as the peer's connection closes, so neither
    waits. Anything else is printed as Python prints it."""
    peer_gone = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")
    if (dist.is_available() and dist.is_initialized() and isinstance(error, RuntimeError)
            and (isinstance(error, dist.DistError) or any(text in str(error) for text in peer_gone))):
        sys.stderr.write(f"error: process {dist.get_rank()} stopped because another process of this run stopped "
                         "(its own message says why)\n")
        return
    sys.__excepthook__(kind, error, traceback)


sys.excepthook = _stop_with_a_stopped_peer


def _show(name: str, value: float) -> str:
    return f"{value:.1%}" if "accuracy" in name else f"{value:.3f}"


def show_progress() -> bool:
    """A tqdm bar on the main process only, and none when TQDM_DISABLE=1 (the notebooks set it, so
    their saved outputs hold no bars; tqdm itself ignores it when `disable` is passed)."""
    return is_main_process() and os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true")


# ---------------------------------------------------------------------------------------------
# Checkpoints: the final model, the NaN/inf stop, resumable training state
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def writing(what: str, folder: str, temporary: str | None = None):
    """A write that fails (a full disk, a file-size limit, a folder gone read-only) becomes one
    sentence naming the folder, once the temporary files it left are removed (they would keep the
    disk full); what was written before, the last good checkpoint and any older run, stays whole.
    Wraps the writes only: torch.save and safetensors report a full disk as RuntimeError or their
    own error class, not OSError."""
    try:
        yield
    except Exception as error:
        if temporary:
            remove(temporary)
        reason = os.strerror(error.errno) if getattr(error, "errno", None) else first_line(error)
        run_dir = folder if os.path.isfile(os.path.join(folder, "metrics.jsonl")) else os.path.dirname(folder)
        kept = newest_checkpoint(run_dir)  # (a model's subfolder, such as critic/: its run's)
        fail(f"could not write {what} to {folder} ({reason}): free space on its disk, or choose another "
             "--output_dir; " + (f"the last good checkpoint ({kept}) is kept, and --resume true continues from it"
                                 if kept else "no checkpoint of this run was written yet, so it starts over"))


def save_checkpoint(model, tokenizer, output_dir: str, merge_lora: bool = False, sharded: bool = False):
    """Write model + tokenizer to a temporary folder first, then move the files into place, so a
    crash while writing never leaves a half-written checkpoint over a good one. With LoRA this
    is the adapter only (adapter_config.json names the base model; load_model merges them), and
    with merge_lora also the adapter merged into a copy of its base, in <output_dir>/merged.
    Rank 0 writes; a sharded model (sharded: --fsdp, Run.shard split it) is first gathered whole, from
    every process (--merge_lora is refused with --fsdp: check_fsdp)."""
    if merge_lora and hasattr(model, "merge_and_unload") and is_main_process():
        merged = own_folder(os.path.join(output_dir, "merged"))
        save_checkpoint(copy.deepcopy(model).merge_and_unload(), tokenizer, merged)
    state_dict = full_state_dict(model) if sharded else None  # FSDP: every process sends its shards
    if not is_main_process():
        return
    tmp = os.path.join(output_dir, ".checkpoint_tmp")
    remove(tmp)
    with writing("the trained model", output_dir, temporary=tmp):
        # The scripts never resize the vocabulary, so peft need not read the base's config.json to check
        # whether to save the embeddings too (a .gguf base has none, and peft would warn).
        model.save_pretrained(tmp, **(dict(save_embedding_layers=False) if hasattr(model, "peft_config") else {}),
                              **(dict(state_dict=state_dict) if state_dict is not None else {}))
        tokenizer.save_pretrained(tmp)
    mode = 0o666 & ~_umask()  # safetensors writes its file private (0600); the run's other files get the umask's mode
    for name in os.listdir(tmp):
        if os.path.isfile(os.path.join(tmp, name)):
            os.chmod(os.path.join(tmp, name), mode)
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: set it back at once
    os.umask(mask)
    return mask


def check_finite(step: int, run_dir: str, after_update: bool = False,
                 advice=lambda: "a lower --learning_rate usually helps", **values):
    """Stop at a NaN or infinite loss or gradient norm, naming the step, before the update is
    applied (after_update: at a metric logged after it, such as a KL). A checkpoint counts as good
    only once the weights it holds gave finite values: the one written after the last save
    (checkpoint.new) is dropped here when they did not, so --resume never restarts from weights
    that already diverged (promote_checkpoint keeps it when they did). advice(): what to change
    (Run.what_helps), asked only on a stop.
    Pass the gradient norm first: under torchrun it is the same on every process, so all stop together."""
    for name, value in values.items():
        value = float(value.detach()) if torch.is_tensor(value) else float(value)
        if not math.isfinite(value):
            if is_main_process():
                remove(os.path.join(run_dir, "checkpoint.new"))
            kept = newest_checkpoint(run_dir)
            fail(f"step {step}: the {name.replace('_', ' ')} is {value}; stopped "
                 + ("at this step's metrics" if after_update else "before applying this update")
                 + (f" ({kept} holds the last weights that gave finite values)" if kept else "")
                 + f"; {advice()} (in a new run: --overwrite_output_dir true)")


def newest_checkpoint(run_dir: str) -> str | None:
    """The newest whole checkpoint folder of a run: checkpoint.new (written, not yet promoted),
    checkpoint, or checkpoint.old (a kill fell between the two renames of a promotion)."""
    for name in ("checkpoint.new", "checkpoint", "checkpoint.old"):
        if os.path.isfile(os.path.join(run_dir, name, "state.pt")):
            return os.path.join(run_dir, name)
    return None


def promote_checkpoint(run_dir: str):
    """checkpoint.new -> checkpoint, by two renames (the previous one waits as checkpoint.old)."""
    new, final, old = (os.path.join(run_dir, name) for name in ("checkpoint.new", "checkpoint", "checkpoint.old"))
    if not os.path.isdir(new):
        return
    remove(old)
    if os.path.lexists(final):  # a folder, or a symbolic link to one (the link goes, never what it points to)
        os.rename(final, old)
    os.rename(new, final)
    remove(old)


def remove(path: str):
    """Remove a folder, a file or a symbolic link (the link only, never what it points to); nothing if absent."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


# A run writes, moves and removes only inside its folder, and a link never changes that. Every write is one of
# three kinds: a file or folder the run has just made under a temporary name, then renamed into place (written_whole
# for eval.json, run.json, the PNG and the logs at --resume; .checkpoint_tmp for the model; checkpoint.tmp for a
# checkpoint: a rename replaces a link or a hard link's name, never what it points to); a log appended to, after
# own_file; a model's subfolder written into, after own_folder. Removing a link removes the link (remove), and the
# folder a run moves files out of, its .next_run, is never a link (prepare_output_dir refuses one).
def own_file(path: str) -> str:
    """Make `path` a file of the run's own before it is appended to: a symbolic link there is removed (what it
    points to is never written), and a file with a second hard link (the same bytes under another name, maybe
    outside the folder) is first copied to a file of its own, so the other name keeps what it held. Returns path."""
    if os.path.islink(path):
        os.remove(path)
    elif os.path.isfile(path) and os.stat(path).st_nlink > 1:
        with written_whole(path) as temporary:
            shutil.copyfile(path, temporary)
    return path


def own_folder(path: str) -> str:
    """Make `path` a folder of the run's own before anything is written into it (a model's subfolder: critic/,
    merged/): a symbolic link there is removed, never written through. Returns path."""
    if os.path.islink(path):
        os.remove(path)
    os.makedirs(path, exist_ok=True)
    return path


def save_training_state(run_dir: str, record: dict, step: int, results: dict, models, optimizers, schedulers, rng,
                        sharded: bool = False):
    """A resumable checkpoint: the weights, optimizer and scheduler states, every random generator
    (of every process), the step, the metrics logged so far and run.json (run_record: script,
    model, settings, inputs), so that --resume continues exactly where the run was, bit for bit on the same
    machine, and knows whose run it continues.

    Written whole into checkpoint.tmp, then renamed to checkpoint.new; the next step promotes it
    to checkpoint once its weights gave finite values. A kill at any moment leaves a whole
    checkpoint (newest_checkpoint finds it). With --fsdp (sharded) every process writes the shards of the
    weights and AdamW states it holds, into checkpoint.tmp/sharded (torch.distributed.checkpoint:
    the output folder must be one that every machine sees); rank 0 writes the rest."""
    generators = {"python": random.getstate(),
                  "numpy": [np.random.get_state()[1].tolist(),
                            *np.random.get_state()[2:]], "torch": torch.get_rng_state(),
                  "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [], "data": rng.getstate()}
    if dist.is_initialized():  # every process draws its own samples: keep each one's generators
        all_generators = [None] * dist.get_world_size()
        dist.all_gather_object(all_generators, generators)
    else:
        all_generators = [generators]
    tmp = os.path.join(run_dir, "checkpoint.tmp")
    with writing("a checkpoint", run_dir, temporary=tmp):  # e.g. a full disk: the checkpoints before stay whole
        if is_main_process():
            promote_checkpoint(run_dir)  # an older checkpoint.new that no gradient check came after
            remove(tmp)
            os.makedirs(tmp)
        if sharded:  # FSDP: each process its own shards; save() returns once all of them are written
            import torch.distributed.checkpoint as dcp

            dist.barrier()  # checkpoint.tmp exists before anyone writes into it
            dcp.save(_sharded_state(models, optimizers), checkpoint_id=os.path.join(tmp, "sharded"))
        if not is_main_process():
            return
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = f.readlines()
        state = {"step": step, "results": results, "generators": all_generators, "metrics": metrics,
                 "models": [] if sharded else [m.state_dict() for m in models],
                 "optimizers": [] if sharded else [o.state_dict() for o in optimizers],
                 "schedulers": [s.state_dict() for s in schedulers]}
        torch.save(state, os.path.join(tmp, "state.pt"))
        write_json(os.path.join(tmp, RUN_FILE), record)
    os.rename(tmp, os.path.join(run_dir, "checkpoint.new"))


def _sharded_state(models, optimizers) -> dict:
    """The weights and AdamW states of sharded models (this process's shards), named as
    torch.distributed.checkpoint saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {**{f"model_{i}": get_model_state_dict(m) for i, m in enumerate(models)},
            **{f"optimizer_{i}": get_optimizer_state_dict(m, o) for i, (m, o) in enumerate(zip(models, optimizers))}}


def load_training_state(run_dir: str, models, optimizers, schedulers, rng, sharded: bool = False) -> tuple[int, dict]:
    """Restore the newest checkpoint (weights_only: tensors and plain values, no pickled code),
    and metrics.jsonl as it was at its step (a missing or torn metrics file does not matter).
    prepare_output_dir has checked that it is this script's and model's. Returns (step, results)."""
    path = newest_checkpoint(run_dir)
    try:
        state = torch.load(os.path.join(path, "state.pt"), weights_only=True, map_location="cpu")
    except Exception as error:
        fail(f"{path}/state.pt cannot be read ({first_line(error)}): it was damaged after it was written; "
             "start a new run (--overwrite_output_dir true)")
    if sharded:  # FSDP: each process reads its own shards
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        shards = _sharded_state(models, optimizers)  # the shapes to read into
        dcp.load(shards, checkpoint_id=os.path.join(path, "sharded"))
        for i, (model, optimizer) in enumerate(zip(models, optimizers)):
            set_model_state_dict(model, shards[f"model_{i}"])
            set_optimizer_state_dict(model, optimizer, shards[f"optimizer_{i}"])
    for model, saved in zip(models, state["models"]):
        model.load_state_dict(saved)
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(saved)
    generators = state["generators"][dist.get_rank() if dist.is_initialized() else 0]
    random.setstate(generators["python"])
    np.random.set_state(("MT19937", np.array(generators["numpy"][0], dtype=np.uint32), *generators["numpy"][1:]))
    torch.set_rng_state(generators["torch"])
    if generators["cuda"]:
        torch.cuda.set_rng_state_all(generators["cuda"])
    rng.setstate(generators["data"])
    if is_main_process():  # the logs as they were at the checkpoint: what was logged after it is logged again
        completions = os.path.join(run_dir, "completions.jsonl")
        kept = completions_up_to(completions, state["step"])  # read and checked before anything is rewritten
        write_lines(os.path.join(run_dir, "metrics.jsonl"), state["metrics"])
        if kept is not None:
            write_lines(completions, kept)
    log(f"resumed from {path} at step {state['step']}")
    return state["step"], state["results"]


def completions_up_to(path: str, step: int) -> list[str] | None:
    """The lines of completions.jsonl logged at or before `step` (a torn last line left out), or None
    without the file. A line that is not one this repo writes (a JSON object with its step) stops --resume in
    one sentence, before the run's logs are rewritten. A symbolic link at the name is not the run's file: nothing
    is read through it, and the run's own file starts again, empty (write_lines replaces the link)."""
    if os.path.islink(path):
        return []
    if not os.path.isfile(path):
        return None
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):  # a kill in the middle of a write
                continue
            try:
                logged_at = json.loads(line)["step"]
                if not isinstance(logged_at, int):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                fail(f"{path} line {number} is not a line a run writes (a JSON object with a whole-number step), so "
                     "--resume cannot cut the file back to the checkpoint's step; the run's files were left as they "
                     "were: delete that line, or the file")
            if logged_at <= step:
                kept.append(line)
    return kept


def write_lines(path: str, lines: list[str]):
    """A log file rewritten whole (written_whole: a new file renamed into place, so a link or a second hard
    link at the name keeps what it held)."""
    with written_whole(path) as temporary:
        with open(temporary, "w") as f:
            f.writelines(lines)


# ---------------------------------------------------------------------------------------------
# The output folder: one writer at a time, and a new run replaces an old one only when it is whole
# ---------------------------------------------------------------------------------------------
RUN_FILE = "run.json"  # the script, model and settings of a run: in each checkpoint, and in the finished folder
# A new run's weights never sit beside an old run's: these go when a run replaces another.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "adapter_config.json",
                "merged", "critic", "checkpoint", "checkpoint.new", "checkpoint.old")
# Every name a run of this repo writes into its folder: its model and tokenizer (as transformers and peft save them,
# peft's README.md included), its logs, its figures (*.png) and its checkpoints. A run that replaces another removes
# nothing else, whatever the old run.json lists.
RUN_NAMES = {*WEIGHT_FILES, "config.json", "generation_config.json", "README.md", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
             "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "metrics.jsonl", "completions.jsonl",
             "eval.json", RUN_FILE, "runs"}  # runs/: --report_to tensorboard's event files
# The settings --resume lets change: how a run is watched and saved, not what it trains. Not the evaluation's:
# the sampled evaluation draws from the random generator the rollouts draw from, so it changes what a run trains.
RESUME_MAY_CHANGE = {"output_dir", "resume", "overwrite_output_dir", "logging_steps", "save_steps", "eval_on_start",
                     "gradient_checkpointing", "merge_lora", "trust_remote_code", "log_completions_steps", "report_to"}
_locks = {}  # folder -> the open descriptor that holds its lock until this process ends
_made = set()  # folders this process made (prepare_output_dir): an empty one is removed when the process ends


@atexit.register
def _remove_unused_folders():
    """A run that stopped before it wrote anything (bad input found after the folder was made and
    locked) leaves no empty folder behind. Only a folder this process made and still locks."""
    for folder in _made:
        if folder in _locks and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def _rank0() -> bool:
    """Rank 0, also before the process group exists (torchrun sets RANK for every process)."""
    return os.environ.get("RANK", "0") == "0"


def _lock(folder: str):
    """One writer per output folder: an exclusive flock on the folder itself, which the system
    releases when the process ends, however it ends (a kill included). Rank 0 only."""
    key = os.path.realpath(folder)
    if key in _locks or fcntl is None or not _rank0():  # held already (several runs in one Python process)
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        fail(f"another run is writing to {folder}: wait for it to finish, or choose another --output_dir")
    _locks[key] = descriptor


def run_record(cfg, inputs: dict) -> dict:
    """What a checkpoint must know of its run: the script, the model, the processes, the settings, and
    what each input held when the run started (fingerprint), so that --resume can refuse one that changed."""
    model = cfg.model if not os.path.exists(cfg.model) else os.path.realpath(cfg.model)
    return {"script": os.path.basename(inspect.getfile(type(cfg))), "model": model,
            "processes": int(os.environ.get("WORLD_SIZE", "1")), "settings": dataclasses.asdict(cfg),
            "inputs": {flag: fingerprint(path) for flag, path in inputs.items() if path and os.path.exists(path)}}


RUN_LOGS = ("metrics.jsonl", "completions.jsonl", "eval.json", RUN_FILE)  # what a run writes beside its model


def fingerprint(path: str) -> str:
    """The sha256 of what a local input holds: a file's bytes, or a folder's top-level files (names and
    bytes: config, weights, tokenizer, data), without the run logs (RUN_LOGS, figures) and subfolders."""
    digest = hashlib.sha256()
    files = [path] if os.path.isfile(path) else [
        os.path.join(path, name) for name in sorted(os.listdir(path))
        if name not in RUN_LOGS and not name.startswith(".") and not name.endswith(".png")
        and os.path.isfile(os.path.join(path, name))]
    for file in files:
        digest.update(os.path.basename(file).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def prepare_output_dir(cfg, inputs: dict, record: dict | None = None) -> str:
    """Check --output_dir before anything is loaded or written, lock it, and return the folder the
    run writes into: --output_dir itself for a new run into an empty folder and for --resume;
    <output_dir>/.next_run for a run that replaces an old one (--overwrite_output_dir), so the old
    one stays whole until the new one finishes and finish_output_dir moves it in.
    `inputs` maps a flag to the path it reads (--model, --dataset, ...): none may be in the output.
    record: run_record(cfg, inputs), what --resume compares with the checkpoint's."""
    out = cfg.output_dir
    if not out.strip():
        fail("--output_dir is empty: name the folder the run writes to")
    if os.path.islink(out) and not os.path.exists(out):
        fail(f"--output_dir {out} is a symbolic link to {os.readlink(out)}, which does not exist: "
             "make that folder, or choose another --output_dir")
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--output_dir {out} is a file, not a folder")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        fail(f"--output_dir {out} cannot be made: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"--output_dir {out} cannot be written ({existing} is not writable)")
    for flag, path in inputs.items():
        inside = os.path.realpath(path) + os.sep
        if path and os.path.exists(path) and inside.startswith(os.path.realpath(out) + os.sep):
            fail(
                f"--output_dir {out} holds {flag} {path}: "
                "write the run to another folder (an input is never overwritten)"
            )
    resume = getattr(cfg, "resume", False)  # (best_of_n.py writes a folder too, and continues none)
    if resume and cfg.overwrite_output_dir:
        fail("--resume continues the run in --output_dir and --overwrite_output_dir replaces it: pass one of them")
    if resume and not os.path.isdir(out):
        fail(f"--resume: {out} does not exist, so there is no run to continue (leave out --resume to start one)")
    if not os.path.isdir(out) and _rank0():  # one writer from the first moment: make the folder and lock it now
        try:
            os.makedirs(out)
            _made.add(os.path.realpath(out))  # removed again if the run stops before it writes anything
        except FileExistsError:  # another run made it a moment ago: the lock below decides which one goes on
            pass
    if not os.path.isdir(out):  # another process of this run, before rank 0 made it
        return out
    _lock(out)
    next_run = os.path.join(out, NEXT_RUN)
    if os.path.islink(next_run):  # a run moves files out of its .next_run and runs inside it: never through a link
        fail(f"{next_run} is a symbolic link (to {os.readlink(next_run)}), and a run's own .next_run never is; "
             "nothing was changed: remove the link, or choose another --output_dir")
    if os.path.isfile(os.path.join(next_run, ".complete")) and _rank0():  # a kill fell inside the last move-in
        _move_in(out)
    if resume:
        run_dir = next_run if os.path.isdir(next_run) else out
        checkpoint = newest_checkpoint(run_dir)
        if checkpoint is None and run_dir == next_run:
            fail(f"the run started over {out} stopped before its first checkpoint: "
                 "start it again with --overwrite_output_dir true")
        if checkpoint is None:
            fail(f"--resume: no checkpoint in {out} (one is written every --save_steps steps)")
        _check_same_run(cfg, checkpoint, record or run_record(cfg, inputs))
    elif not holds_a_run(out):  # a user's folder, or an empty one: the run writes beside what is there
        clash = sorted(name for name in os.listdir(out) if written_by_a_run(name))
        if clash:
            fail(f"--output_dir {out} holds no run of this repo (no run.json, checkpoint or metrics.jsonl) but files "
                 f"with names a run writes ({', '.join(clash[:3])}{', ...' if len(clash) > 3 else ''}), which it "
                 "would overwrite; nothing was removed: choose another --output_dir, or move those files")
        run_dir = out
    else:
        if not cfg.overwrite_output_dir:
            held = sorted(name for name in os.listdir(out) if not name.startswith("."))
            fail(f"--output_dir {out} already holds a run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
                 + ("--resume true continues it, " if hasattr(cfg, "resume") else "")
                 + "--overwrite_output_dir true replaces it when the new run finishes, or choose another folder")
        run_files(out)  # the old run's record, checked now: the new run will remove what it lists
        run_dir = next_run
    if _rank0():  # the run goes ahead (a refusal above changes nothing): a kill's leftovers go now
        remove_leftovers(out)
    return run_dir


def holds_a_run(folder: str) -> bool:
    """Does `folder` hold a run of this repo: its record (run.json, which a finished run writes), a checkpoint
    (every --save_steps), or the metrics.jsonl a training run starts with? Only such a folder is a run to
    replace or continue: any other folder's files stay."""
    return (os.path.lexists(os.path.join(folder, RUN_FILE)) or newest_checkpoint(folder) is not None
            or os.path.lexists(os.path.join(folder, "metrics.jsonl")))


def written_by_a_run(name: str) -> bool:
    """Is `name` a plain name inside a run folder (no folder part, not . or ..) that a run of this repo writes?"""
    return (name == os.path.basename(name) and name not in ("", ".", "..")
            and (name in RUN_NAMES or name.endswith(".png") or re.fullmatch(r"model-\d+-of-\d+\.safetensors", name)
                 is not None))


def run_files(folder: str, record: str = RUN_FILE) -> set[str]:
    """The names of the run in `folder` that a run replacing it removes: those its run.json (or .complete) lists,
    each of them a plain name this repo writes (written_by_a_run); a folder whose run.json is missing (deleted,
    or a run killed before its end): every such name in it. A record that lists anything else (../other_run,
    /home, notes.txt), or that is not such a list, is refused in one sentence before anything is removed:
    a run folder copied from elsewhere may hold any record."""
    path = os.path.join(folder, record)
    if record == RUN_FILE and not os.path.lexists(path):
        return {name for name in os.listdir(folder) if written_by_a_run(name)}
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        fail(f"{path} is not a record this repo writes (a list of the run's files), so the run it belongs to "
             "cannot be replaced safely; nothing was removed: delete that file (the files this repo writes then "
             "go with the old run), or choose another --output_dir")
    outside = [name for name in files if not written_by_a_run(name)]
    if outside:
        fail(f"{path} lists {outside[0]!r}, which is not a file a run writes inside {folder}; a run that replaces "
             "this one would remove it, so nothing was removed: delete that file, or choose another --output_dir")
    return set(files)


def a_leftover(name: str) -> bool:
    """Is `name` a temporary name this repo writes: checkpoint.tmp, a model's .checkpoint_tmp, or the
    .<name>.tmp of written_whole for a file a run writes (.complete's included)? A user's .notes.tmp is none."""
    if name in ("checkpoint.tmp", ".checkpoint_tmp"):
        return True
    written = name[1:-len(".tmp")] if name.startswith(".") and name.endswith(".tmp") else ""
    return written == ".complete" or written_by_a_run(written)


def remove_leftovers(output_dir: str):
    """What a kill during a save left (checkpoint.tmp, a model's .checkpoint_tmp, in the folder, its
    .next_run or a model's subfolder; a .<name>.tmp of written_whole) goes when the next run into the
    folder starts, whatever that run is: for a real model each is a model's size. Only those names
    (a_leftover), and in a run's own subfolders only (critic/, merged/): a user's other files and folders stay.
    Call it with the folder locked, once the run is accepted (prepare_output_dir)."""
    for folder in (output_dir, os.path.join(output_dir, NEXT_RUN)):
        if not os.path.isdir(folder) or os.path.islink(folder):
            continue
        subfolders = [os.path.join(folder, name) for name in os.listdir(folder) if written_by_a_run(name)
                      and os.path.isdir(os.path.join(folder, name)) and not os.path.islink(os.path.join(folder, name))]
        for parent in (folder, *subfolders):
            for name in ("checkpoint.tmp", ".checkpoint_tmp"):
                remove(os.path.join(parent, name))
        for name in os.listdir(folder):  # a file written_whole was writing when the kill came
            if a_leftover(name):
                remove(os.path.join(folder, name))


RECORD = {"script": str, "model": str, "processes": int, "settings": dict, "inputs": dict}  # run_record's parts


def _check_same_run(cfg, checkpoint: str, now: dict):
    """--resume continues the run it finds, as that run was set: another script's or model's
    checkpoint, an input whose files changed since the run started (the model pi_ref is read from,
    a reward model, the data), or a changed setting that shapes training, is refused; a changed
    setting of RESUME_MAY_CHANGE (or a new split of the same step batch) applies from the resumed step.
    A record that is not whole (no inputs, say) is refused: what it does not hold is never read as unchanged."""
    try:
        with open(os.path.join(checkpoint, RUN_FILE)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        fail(f"{checkpoint} has no readable {RUN_FILE}, so it cannot say whose run it is: start a new run")
    if not isinstance(saved, dict) or not all(isinstance(saved.get(key), kind) for key, kind in RECORD.items()):
        wrong = "" if not isinstance(saved, dict) else next(key for key, kind in RECORD.items()
                                                              if not isinstance(saved.get(key), kind))
        fail(f"{os.path.join(checkpoint, RUN_FILE)} is not a whole record of its run"
             + (f" (its {wrong!r} is {'missing' if wrong not in saved else 'not a ' + RECORD[wrong].__name__})"
                if wrong else "") + ", so --resume cannot tell whether the run it would "
             "continue was set and fed as this one: start a new run (--overwrite_output_dir true)")
    if saved["script"] != now["script"]:
        fail(f"the checkpoint in {checkpoint} is {saved['script']}'s, not {now['script']}'s: "
             f"resume it with {saved['script']}")
    if saved["model"] != now["model"]:
        fail(f"the checkpoint in {checkpoint} was trained from --model {saved['model']}, not {cfg.model}")
    if saved["processes"] != now["processes"]:
        fail(f"the checkpoint in {checkpoint} was written by {saved['processes']} processes, not {now['processes']}: "
             "resume with the same number")
    for flag in sorted({*saved["inputs"], *now["inputs"]}):  # an input on one side only is a change too
        if now["inputs"].get(flag) != saved["inputs"].get(flag):
            path = now["settings"].get(flag.removeprefix("--"))
            fail(f"--resume: {flag} {path} " + ("no longer exists" if flag not in now["inputs"] else
                                                 "was not a local path when this run started" if flag not in
                                                 saved["inputs"] else
                                                 "has changed since this run started (its files differ)")
                 + f", and continuing would mix two starts: put back the {flag} the run started from, "
                 "or start a new run (--overwrite_output_dir true)")
    old, new = saved["settings"], now["settings"]
    changed = [key for key in new if key != "model" and old.get(key) != new[key]]
    batch = ("per_device_train_batch_size", "gradient_accumulation_steps")
    same_step_batch = math.prod(old.get(k, 1) for k in batch) == math.prod(new.get(k, 1) for k in batch)
    refused = [k for k in changed if k not in RESUME_MAY_CHANGE and not (k in batch and same_step_batch)]
    if refused:
        changes = ", ".join(f"--{k} was {old.get(k)}, now {new[k]}" for k in refused)
        fail(f"--resume continues the run as it was set, and {changes}: resume with the run's values, "
             "or start a new run (--overwrite_output_dir true)")
    for key in [key for key in changed if key not in ("resume", "overwrite_output_dir")]:
        if _rank0():
            tqdm.write(f"resume: --{key} {new[key]} (was {old.get(key)}) applies from here")


def start_output_dir(run_dir: str, metrics: bool = True):
    """Create the folder this run writes into, lock it, and start an empty metrics.jsonl (rank 0; with
    metrics=False none: best_of_n.py trains nothing). A .next_run left by an earlier run that was stopped
    is cleared: this run replaces it too."""
    if not is_main_process():
        return
    output_dir = os.path.dirname(run_dir) if os.path.basename(run_dir) == NEXT_RUN else run_dir
    with writing("metrics.jsonl", run_dir):
        os.makedirs(run_dir, exist_ok=True)
        _lock(output_dir)
        if run_dir != output_dir:
            remove(run_dir)
            os.makedirs(run_dir)
        if metrics:
            open(own_file(os.path.join(run_dir, "metrics.jsonl")), "w").close()


def finish_output_dir(run_dir: str, cfg, record: dict):
    """The end of a run: its last checkpoint counts as good, run.json lists what it wrote, and a
    run that replaces an old one moves into --output_dir (rank 0)."""
    if not is_main_process():
        return
    promote_checkpoint(run_dir)
    files = sorted(name for name in os.listdir(run_dir) if written_by_a_run(name))  # a user's files beside: not
    write_json(os.path.join(run_dir, RUN_FILE), {**record, "files": sorted({*files, RUN_FILE})})
    if os.path.basename(run_dir) == NEXT_RUN:
        write_json(os.path.join(run_dir, ".complete"), {"files": sorted({*files, RUN_FILE})})  # from here on, a kill is
        _move_in(cfg.output_dir)  # finished by the next run into the folder (prepare_output_dir)
    descriptor = _locks.pop(os.path.realpath(cfg.output_dir), None)
    if descriptor is not None:
        os.close(descriptor)


def _move_in(output_dir: str):
    """Replace the old run in output_dir by the finished one in .next_run. Repeatable: a kill in
    the middle is completed by running it again. Only the old run's own files go (run_files: those its
    run.json lists, and any weights), never other files of the folder."""
    next_run = os.path.join(output_dir, NEXT_RUN)
    new = run_files(next_run, ".complete")
    if os.path.exists(os.path.join(next_run, RUN_FILE)):  # the old run's files are still there: they go first
        old = run_files(output_dir)
        for name in sorted((old | set(WEIGHT_FILES)) - new):
            path = os.path.join(output_dir, name)
            remove(path)
    for name in sorted(new - {RUN_FILE}) + [RUN_FILE]:  # run.json last: while it waits, the old run's files may remain
        source, target = os.path.join(next_run, name), os.path.join(output_dir, name)
        if os.path.exists(source):
            if os.path.isdir(target):
                remove(target)
            os.replace(source, target)
    shutil.rmtree(next_run)


# ---------------------------------------------------------------------------------------------
# metrics.jsonl and completions.jsonl
# ---------------------------------------------------------------------------------------------
def log_metrics(output_dir: str, metrics: dict):
    """Append one JSON object to <output_dir>/metrics.jsonl (rank 0 only)."""
    if not is_main_process():
        return
    path = own_file(os.path.join(output_dir, "metrics.jsonl"))
    with writing("metrics.jsonl", output_dir), open(path, "a") as f:
        f.write(_json_line(metrics))


def _json_line(row: dict) -> str:
    """One JSON object and a newline, each float to 6 significant digits (what a curve needs)."""
    return json.dumps({k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in row.items()}) + "\n"


def log_completions(output_dir: str, step: int, **columns):
    """Append what the policy wrote at this step to <output_dir>/completions.jsonl, one JSON object
    per completion: the step and each of `columns` (prompt, completion, its rewards, its advantage),
    as TRL's log_completions and nano-aha-moment's episode dumps keep them (rank 0's share only)."""
    if not is_main_process():
        return
    path = own_file(os.path.join(output_dir, "completions.jsonl"))
    with writing("completions.jsonl", output_dir), open(path, "a") as f:
        for i in range(len(next(iter(columns.values())))):
            row = {"step": step, **{k: v[i] for k, v in columns.items()}}
            f.write(_json_line(row))


class Trackers:
    """--report_to (transformers' and TRL's name): each metrics line also goes to TensorBoard (event files in
    <output_dir>/runs, as transformers' TensorBoardCallback writes them) and/or Trackio (local: its database in
    TRACKIO_DIR, by default ~/.cache/huggingface/trackio; project TRACKIO_PROJECT or "rlhf", the run named after
    --output_dir's last part). metrics.jsonl and the PNG stay the run's record; nothing here changes what a step
    computes. A package is imported only when its tracker is asked for. Rank 0 only."""

    def __init__(self, report_to: str):
        self.names = [name for name in TRACKERS if name in report_to.split(",")]
        for name in self.names:
            if importlib.util.find_spec(name) is None:
                fail(f"--report_to {name} needs the {name} package, which is not installed: pip install {name}, "
                     "or leave out --report_to")
        self.writer = self.trackio = None

    def start(self, run_dir: str, cfg):
        if not is_main_process():
            return
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=own_folder(os.path.join(run_dir, "runs")))
        if "trackio" in self.names:
            import trackio

            self.trackio = trackio
            trackio.init(project=os.environ.get("TRACKIO_PROJECT", "rlhf"),
                         name=os.path.basename(os.path.realpath(cfg.output_dir)), config=dataclasses.asdict(cfg),
                         resume="allow" if cfg.resume else "never", embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, row: dict):
        """A metrics line {"step": step, name: value, ...}: its numbers, at its step."""
        numbers = {key: value for key, value in row.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.writer is not None:
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, row["step"])
            self.writer.flush()
        if self.trackio is not None:
            self.trackio.log(numbers, step=row["step"])

    def finish(self):
        if self.writer is not None:
            self.writer.close()
        if self.trackio is not None:
            self.trackio.finish()
        self.writer = self.trackio = None


# ---------------------------------------------------------------------------------------------
# eval.json and the PNG of the curves
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def written_whole(path: str):
    """Write a file whole or not at all: yields a temporary name beside `path` (a dot name, which no run
    lists), and once the write into it has finished, one rename puts it in place. A write that fails (a
    full disk) leaves the file that was there whole and no torn one: one sentence (writing)."""
    folder = os.path.dirname(path) or "."
    temporary = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    remove(temporary)  # a leftover, or a link at that name: never written through
    with writing(os.path.basename(path), folder, temporary=temporary):
        yield temporary
        os.replace(temporary, path)


def write_json(path: str, obj: dict):
    if not is_main_process():
        return
    with written_whole(path) as temporary:
        with open(temporary, "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")


def save_figure(fig, path: str):
    """A matplotlib figure to a PNG, written whole (written_whole), then closed."""
    import matplotlib.pyplot as plt

    with written_whole(path) as temporary:
        fig.savefig(temporary, dpi=110, format="png")
    plt.close(fig)


def plot_metrics(output_dir: str, panels: dict[str, list[str]], title: str):
    """One subplot per panel (its metric names vs step) from metrics.jsonl -> <output_dir>/<title>.png;
    returns the file's name. A metric logged at two steps or fewer (an SFT run's evaluations) is drawn as
    points only: a line between two evaluations would show a trend that was not measured."""
    name = title.lower().replace(" ", "_") + ".png"
    if not is_main_process():
        return name
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (panel, keys) in zip(axes[0], panels.items()):
        for key in keys:
            points = [(row["step"], row[key]) for row in rows if key in row]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3 if len(points) > 2 else 5,
                        linestyle="-" if len(points) > 2 else "none", label=key)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # a panel whose metrics were never logged has none
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, os.path.join(output_dir, name))
    return name


# ---------------------------------------------------------------------------------------------
# Memory reuse (a speed-up of every script, set once at import)
# ---------------------------------------------------------------------------------------------
def keep_freed_memory():
    """Speed (Linux): glibc gives each large freed tensor back to the OS, and the next step's tensors
    page-fault that memory in again; keeping freed memory for reuse makes a tiny-model step faster
    (docs/speed.md). Runs once, at import; does nothing without glibc (macOS, Windows) or when the
    environment already sets glibc's MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's option numbers (malloc.h)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # tensors up to 32 MB come from the reusable heap, not mmap
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)  # keep up to 1 GB of freed heap instead of returning it


keep_freed_memory()
