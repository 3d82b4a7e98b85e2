"""What the walkthrough notebooks share: the small checkpoints they start from, and two plots.

The checkpoints are made by the scripts themselves (`sft.main`, `reward_model.main`) with short
configs, the first time a notebook asks for them, into out/notebooks/ (or $RLHF_NOTEBOOKS_OUT),
and reused after that: the committed outputs of notebooks 01 to 08 come from one SFT checkpoint and
one reward model (notebook 09 adds its own, on data/tool_demos; notebook 10's come from SFT_CONFIG's run
on another machine, which samples other answers). The same config, seed and machine
give the same checkpoint; on another machine the float order differs and SFT amplifies it, so a
notebook run elsewhere prints other numbers than its committed outputs.
"""
import dataclasses
import json
import os

import matplotlib
import numpy as np

import reward_model
import sft

OUT = os.environ.get("RLHF_NOTEBOOKS_OUT", "out/notebooks")
# Unset for a reader. The test suite (tests/test_notebooks.py) sets it to check that every cell runs without the
# minutes of training: each run a notebook makes stops at that many steps, its evaluation at the last step kept.
# The checkpoints they start from (checkpoint() below) are trained in full: notebook 09's cells read the calls
# its SFT policy makes.
MAX_STEPS = int(os.environ.get("RLHF_NOTEBOOKS_MAX_STEPS", "0"))

# 300 SFT steps (~1 min on 2 cores): the answer format is learned and greedy decoding gets about half of the sums right,
# so RL groups hold both right and wrong answers. (The README's full run is 700 steps.)
SFT_CONFIG = sft.Config(max_steps=300, eval_steps=300, num_eval_examples=64, output_dir=f"{OUT}/sft")
# A short reward model on the shipped pairs plus pairs from the SFT policy's samples on 64 prompts.
RM_CONFIG = reward_model.Config(model=SFT_CONFIG.output_dir, max_steps=100, policy_prompts=64, eval_steps=50,
                                num_eval_examples=200, output_dir=f"{OUT}/rm")
# The agent's start (notebook 09): the same 300 SFT steps on data/tool_demos, whose teacher calls the calculator
# (`<calc>47+85</calc><result>132</result>`) in half its demonstrations and works the columns in the others.
TOOL_SFT_CONFIG = sft.Config(dataset="data/tool_demos", max_steps=300, eval_steps=300, num_eval_examples=64,
                             output_dir=f"{OUT}/sft_tool")


def run(main, cfg, capped=True):
    """A script's main(cfg), then the notebook's own matplotlib backend back
    (harness.plot_metrics switches to Agg to write its PNG, which would hide the inline plots).
    A notebook run again replaces its earlier run (--overwrite_output_dir)."""
    backend = matplotlib.get_backend()
    if MAX_STEPS and capped:  # the test's short runs, evaluated on a few problems
        cfg = dataclasses.replace(cfg, max_steps=min(cfg.max_steps, MAX_STEPS),
                                  eval_steps=min(cfg.eval_steps, MAX_STEPS),
                                  num_eval_examples=min(cfg.num_eval_examples, MAX_STEPS))
    main(dataclasses.replace(cfg, overwrite_output_dir=True))
    matplotlib.use(backend)
    return cfg.output_dir


def checkpoint(main, cfg):
    """cfg.output_dir, trained by main(cfg) first unless it already holds a model."""
    if os.path.isfile(os.path.join(cfg.output_dir, "model.safetensors")):
        print(f"reusing {cfg.output_dir} (delete it to train it again)")
        return cfg.output_dir
    return run(main, cfg, capped=False)


def sft_policy():
    """The SFT policy every RL notebook starts from (and its reference policy)."""
    return checkpoint(sft.main, SFT_CONFIG)


def reward_checkpoint():
    """The reward model PPO scores with and starts its critic from."""
    sft_policy()
    return checkpoint(reward_model.main, RM_CONFIG)


def tool_sft_policy():
    """The SFT policy that learnt to call the calculator, the agent's start (notebook 09)."""
    return checkpoint(sft.main, TOOL_SFT_CONFIG)


def read_metrics(output_dir):
    """metrics.jsonl as a list of dicts."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(ax, rows, key, **kwargs):
    """One metric against the step, from read_metrics rows that have it."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    ax.plot(*zip(*points), marker="o", markersize=3, label=key, **kwargs)


def token_heatmap(ax, values, mask, title, symmetric=True, cmap="coolwarm"):
    """values [N, T] as a heatmap, one row per sequence, one column per completion token;
    positions where mask [N, T] is 0 (after EOS, padding) are left blank. Red > 0, blue < 0 by default."""
    shown = np.where(mask.bool().cpu().numpy(), values.detach().float().cpu().numpy(), np.nan)
    limit = np.nanmax(np.abs(shown)) if symmetric else None
    image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=-limit if symmetric else None, vmax=limit)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("completion token t")
    ax.figure.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    return image
