"""Losses and gradients of one fixed batch, computed by 1 process on all of it or by N processes
(torchrun) on N slices of it, then averaged as in training. Saves them (rank 0) to argv[1]: {"ddp": ...} and,
with --fsdp (argv[2]), {"fsdp": ...} too, from the same processes.

The rows have very different completion lengths, so a token mean over each slice would differ
from the token mean over the batch: only the global normalisation (common.mean_denominator) agrees.
"dapo_local_mean" is the mistake the test must catch: each process divides by its own token count.
Under "fsdp" the model is sharded (distributed.shard_model) and FSDP reduces the gradients."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import common  # noqa: E402
from lib import distributed, rollout
import grpo  # noqa: E402
import mix  # noqa: E402
import ppo  # noqa: E402
import sft  # noqa: E402

rank, world_size = distributed.setup()
tokenizer = common.build_tokenizer()
lengths = [1, 2, 9, 12]  # short completions first: with 2 processes, rank 0 gets 3 tokens, rank 1 gets 21
examples = [(tokenizer(f"<|im_start|>user\nWhat is {i} + {i}?", add_special_tokens=False)["input_ids"],
             list(range(40, 40 + n)))
            for i, n in enumerate(lengths)]
input_ids, attention_mask, mask = sft.collate(examples, tokenizer.pad_token_id)
advantages = torch.tensor([1.0, -0.5, 0.25, -2.0])
expert = torch.tensor([False, True, False, True])  # MIX: one expert row on each process
share = slice(rank * len(lengths) // world_size, (rank + 1) * len(lengths) // world_size)
losses = {
    "sft": lambda lp, m, a: sft.sft_loss(lp, m),
    "grpo_dapo": lambda lp, m, a: grpo.grpo_loss(lp, lp.detach() + 0.1, lp.detach() - 0.2, a, m,
                                                 grpo.Config(beta=0.04, loss_type="dapo")),
    "grpo_grpo": lambda lp, m, a: grpo.grpo_loss(lp, lp.detach() + 0.1, lp.detach() - 0.2, a, m,
                                                 grpo.Config(beta=0.04, loss_type="grpo")),
    "ppo_actor": lambda lp, m, a: ppo.ppo_actor_loss(lp, lp.detach() + 0.1, a[:, None].expand_as(lp), m, 0.2),
    "mix_dapo": lambda lp, m, a: mix.mix_loss(lp, lp.detach(), None, a, m, expert[share],
                                              mix.Config(mu=0.5, epsilon=0.2, beta=0.0, loss_type="dapo")),
    "dapo_local_mean": lambda lp, m, a: (-a[:, None] * lp * m).sum() / m.sum(),  # wrong under torchrun, on purpose
}


def whole(grad):
    """A gradient as one tensor: a sharded one (a DTensor, under --fsdp) gathered from every process."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


results = {}
for parallelism in ["ddp", "fsdp"] if sys.argv[2:] == ["--fsdp"] else ["ddp"]:
    torch.manual_seed(0)
    model = common.build_tiny_model(tokenizer)  # the same weights for both
    if parallelism == "fsdp":
        distributed.shard_model(model)
    results[parallelism] = {}
    for name, loss_fn in losses.items():
        model.zero_grad(set_to_none=True)
        logprobs = rollout.completion_logprobs(model, input_ids[share], attention_mask[share], mask.shape[1])
        loss = loss_fn(logprobs, mask[share], advantages[share])
        loss.backward()
        distributed.average_gradients(model)
        results[parallelism][name] = {"loss": common.global_sum(loss.item()) / world_size,
                                      "grad": torch.cat([whole(p.grad).flatten() for p in model.parameters()]),
                                      "terms": input_ids.numel()}  # positions summed into a weight's gradient
if distributed.is_main_process():
    torch.save(results, sys.argv[1])
