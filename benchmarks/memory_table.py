"""The README's predicted memory table for the Qwen2.5-Instruct models: distributed.memory_estimate on
models built on the meta device (shapes only, no weights, no download) from the configs below,
copied from each model's config.json. Predictions, not measurements. One command, a few seconds:

    python benchmarks/memory_table.py

The recipe is the README's GSM8K one: GRPO, 200-token prompts, 320-token completions, 64
completions a step, fp32 weights, gradients and AdamW moments. Full fine-tuning keeps a reference
copy; LoRA (r = 16 on every linear layer) does not. The FSDP columns shard the weights, gradients,
AdamW moments and the reference over N processes, each with the same micro-batch of 8 completions
and gradient checkpointing, and count the full weights the rollout gathers (distributed.gathered).
"""
import os
import sys
import types

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from lib import distributed

QWEN = {  # from each model's config.json; all three: vocabulary 151,936, embeddings tied to the LM head
    "Qwen2.5-0.5B-Instruct": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2),
    "Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2),
    "Qwen2.5-3B-Instruct": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                num_attention_heads=16, num_key_value_heads=2),
}
PROMPT, COMPLETION, COMPLETIONS = 200, 320, 64
LORA = types.SimpleNamespace(lora_r=16, lora_alpha=32.0, lora_dropout=0.0, lora_target_modules="all-linear")


def total_gib(trained, frozen, rows, checkpointing=False, shards=1) -> float:
    """The `total` line of memory_estimate's table, in GiB."""
    table = distributed.memory_estimate(trained, frozen, rows=rows, sequence_length=PROMPT + COMPLETION,
                                   completion_length=COMPLETION, gradient_checkpointing=checkpointing, shards=shards)
    return float(table.splitlines()[-1].split()[-2])


def main():
    print("| model | parameters | full, 64 in one pass | full, 8 x 8 micro-batches | + gradient checkpointing "
          "| LoRA r=16, 8 x 8 | LoRA + checkpointing (trained) | FSDP over 2, per device | over 4 | over 8 |")
    print("| --- " * 10 + "|")
    for name, sizes in QWEN.items():
        config = transformers.Qwen2Config(vocab_size=151936, tie_word_embeddings=True, **sizes)
        with torch.device("meta"):  # shapes only
            model = transformers.Qwen2ForCausalLM(config)
            lora = common.add_lora(transformers.Qwen2ForCausalLM(config), LORA)
        full = [total_gib([model], [model], COMPLETIONS), total_gib([model], [model], 8),
                total_gib([model], [model], 8, checkpointing=True)]
        adapters = [total_gib([lora], [], 8), total_gib([lora], [], 8, checkpointing=True)]
        sharded = [total_gib([model], [model], 8, checkpointing=True, shards=n) for n in (2, 4, 8)]
        parameters = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
        cells = [f"{gib:.1f} GiB" for gib in full + adapters[:1]]
        cells += [f"{adapters[1]:.1f} GiB ({trained / 1e6:.1f}M)"] + [f"{gib:.1f} GiB" for gib in sharded]
        print(f"| {name} | {parameters / 1e9:.2f}B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
