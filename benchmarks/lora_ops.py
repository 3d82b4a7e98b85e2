"""How many operations LoRA adds to one decoded token, counted rather than timed.

The rollout decodes one token at a time; on a GPU each token's matrix products are small, so a
token costs about the operations launched for it. peft runs an adapted linear layer as the base
layer plus its own small ones (x A^T, then B, a scale and an add). This counts the aten operations
of one decoding forward pass, with and without LoRA r=16 on every linear layer, for a model with
Qwen2.5-0.5B's layer layout (24 layers, 14 heads, 2 key/value heads; the widths are shrunk, which
changes no count), in fp32 and under bf16 autocast (the CPU's, standing in
for CUDA's). Counts, not times: they do not depend on the machine or on what else runs on it.

    python benchmarks/lora_ops.py          # the figures docs/scaling.md quotes
"""
import collections
import os
import sys

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import common  # noqa: E402
from lib import rollout  # noqa: E402
from gpu import QWEN25_05B  # noqa: E402  (the GPU track's model: Qwen2.5-0.5B's config)


class CountOps(TorchDispatchMode):
    """Counts every aten operation run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def model_of_qwen_layout():
    """QWEN25_05B with its widths shrunk (896 -> 112, still 14 heads; MLP 4864 -> 128; vocabulary -> 300)."""
    torch.manual_seed(0)
    shapes = dict(QWEN25_05B, vocab_size=300, hidden_size=112, intermediate_size=128)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes))


class Lora:  # the scripts' LoRA settings (common.add_lora reads these names)
    lora_r, lora_alpha, lora_dropout, lora_target_modules = 16, 32.0, 0.0, "all-linear"


def one_token(model, bf16: bool, rows: int = 64, prompt_length: int = 30) -> collections.Counter:
    """The operations, by name, of one decoding forward pass after a prompt's prefill."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(input_ids=torch.randint(0, 300, (rows, prompt_length)), **{rollout.CACHE: cache}, logits_to_keep=1)
        with CountOps() as counter:
            model(input_ids=torch.randint(0, 300, (rows, 1)), **{rollout.CACHE: cache}, logits_to_keep=1)
    return counter.counts


def main():
    full, lora = model_of_qwen_layout(), common.add_lora(model_of_qwen_layout(), Lora)
    layers = sum(isinstance(m, torch.nn.Linear) for m in full.modules()) - 1  # all but the LM head
    print(f"one decoded token, 64 rows, {layers} adapted linear layers (the LM head is not adapted)")
    for bf16 in (False, True):
        ops_full, ops_lora = one_token(full, bf16), one_token(lora, bf16)
        n_full, n_lora = sum(ops_full.values()), sum(ops_lora.values())
        extra = {name: ops_lora[name] - ops_full[name] for name in ops_lora if ops_lora[name] != ops_full[name]}
        print(f"{'bf16 autocast' if bf16 else 'fp32'}: operations full {n_full:,}, LoRA r=16 {n_lora:,} "
              f"({n_lora / n_full:.2f}x); LoRA's extra: {extra}")


if __name__ == "__main__":
    main()
