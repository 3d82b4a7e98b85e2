"""Several processes: data parallelism (DDP) and sharded data parallelism (FSDP), note 002.

Nothing here changes a run of one process (`python grpo.py`): every function returns at once, or
returns its input. Under `torchrun --nproc_per_node N`:

  data parallelism (DDP)   each process holds a whole copy of the model and trains on its own share of
                           the batch; after backward() the gradients are averaged over processes
                           (average_gradients), so every process takes the same step.
  sharded (FSDP, --fsdp)   each process holds 1/N of every weight, gradient and AdamW state
                           (shard_model); the weights of a layer are gathered for its forward and
                           backward passes, and for the whole rollout (gathered).

Most of it is reached through harness.Run (setup, the shared starting weights, sharding, the gradient
average, the metrics' mean, the saved weights) and the rollout (gathered); the scripts' loops use
global_sum and global_min (counts over every process; common.py passes them on) and get_device, and
the data is split by process_share. The memory each layout needs is memory_estimate's.
"""
import atexit
import contextlib
import gc
import os

import torch
import torch.distributed as dist
from tqdm import tqdm


def setup() -> tuple[int, int]:
    """(rank, world_size) of this process. Under torchrun, which sets RANK, WORLD_SIZE and
    LOCAL_RANK, join the process group: nccl between GPUs, gloo on CPU. A plain
    `python script.py` is rank 0 of 1 and starts no group."""
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            gpus, processes = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            if int(os.environ.get("LOCAL_RANK", 0)) >= gpus:  # (CUDA would stop it with "invalid device ordinal")
                raise SystemExit(f"error: torchrun started {processes} processes on this machine, which has {gpus} "
                                 f"GPU{'s' if gpus > 1 else ''}: each process needs a GPU of its own "
                                 f"(torchrun --nproc_per_node {gpus})")
            torch.cuda.set_device(get_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        atexit.register(leave_group)
    return dist.get_rank(), dist.get_world_size()


def leave_group():
    """At the process's exit, leave the process group while Python is still whole. Left to the
    interpreter's own teardown, gloo's threads can abort a run that has finished its
    work (SIGABRT, "terminate called without an active exception"; docs/troubleshooting.md).
    Garbage is collected first, so that a sharded model's device meshes (10 at the end of a --fsdp run,
    in reference cycles) are freed before the group goes, not during the teardown."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def get_device() -> torch.device:
    """This process's GPU (torchrun's LOCAL_RANK picks which), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def is_main_process() -> bool:
    """Rank 0 prints, writes metrics and saves; the other ranks only compute."""
    return not dist.is_initialized() or dist.get_rank() == 0


def log(message: str):
    """Print a line (between tqdm updates), from rank 0 only."""
    if is_main_process():
        tqdm.write(message)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def global_min(value: int) -> int:
    """The smallest of every process's value (an int); unchanged in a single process."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor(value, device=get_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def global_sum(value):
    """A tensor or number summed over all processes; unchanged in a single process."""
    if not dist.is_initialized():
        return value
    tensor = torch.as_tensor(value, device=value.device if torch.is_tensor(value) else get_device()).clone()
    dist.all_reduce(tensor)
    return tensor if torch.is_tensor(value) else tensor.item()


# ---------------------------------------------------------------------------------------------
# Data parallelism
# ---------------------------------------------------------------------------------------------
def broadcast_weights(model):
    """Every process starts from rank 0's weights (a model built from scratch is random)."""
    if dist.is_initialized():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def average_gradients(model):
    """Data parallelism, as torch's DistributedDataParallel does it (there overlapped with the
    backward pass): every process holds the same weights and backpropagates its own share of
    the batch; averaging the gradients over processes gives every process the same update, so
    the weights stay identical. Token means divide by common.mean_denominator, which makes this average
    exactly the gradient of one loss over the whole global batch. Call it after backward().
    A sharded model (--fsdp) needs nothing here: FSDP averaged its gradients in the backward pass."""
    if dist.is_initialized() and not is_sharded(model):
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)  # sum over processes (gloo has no AVG)
                param.grad.div_(dist.get_world_size())


def reduce_metrics(metrics: dict) -> dict:
    """Each float metric averaged over processes (one all_reduce); ints such as `step` kept."""
    keys = [key for key, value in metrics.items() if isinstance(value, float)]
    if not dist.is_initialized() or not keys:
        return metrics
    values = global_sum(torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=get_device()))
    return {**metrics, **{key: value / dist.get_world_size() for key, value in zip(keys, values.tolist())}}


def share_rows(num_rows: int, rank: int, world_size: int) -> range:
    """The rows of process `rank`: a contiguous share, the first num_rows % world_size shares one row
    longer (datasets' shard(contiguous=True) cuts the same, but refuses more processes than rows;
    here a share may be empty)."""
    size, extra = divmod(num_rows, world_size)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


def process_share(dataset):
    """This process's share of a dataset (share_rows); all of it in one process."""
    if not dist.is_initialized():
        return dataset
    rows = share_rows(len(dataset), dist.get_rank(), dist.get_world_size())
    return dataset.select(rows if rows else [])  # datasets refuses an empty range that starts past its end


# ---------------------------------------------------------------------------------------------
# Sharded data parallelism (--fsdp): weights, gradients and AdamW states split over the processes
# ---------------------------------------------------------------------------------------------
def shard_model(model):
    """FSDP (torch's fully_shard, "FSDP2"; DeepSpeed's ZeRO stage 3): each of the N processes keeps
    1/N of every weight (a DTensor shard), hence 1/N of its gradient and of AdamW's two moments.
    Before a unit's forward (and again before its backward) the processes all-gather its full
    weights, and free them after; its gradient is reduce-scattered, averaged over the processes as
    average_gradients does for data parallelism, so each keeps the mean gradient of its own shard
    and AdamW updates only that shard. The units: each decoder layer, then the rest (embeddings,
    final norm and the head), so at most one layer's full weights are gathered at a time.
    A scalar head (reward model, critic) is called apart from its transformer
    (rollout.last_hidden_states, then .score), so the transformer and the head are units of their
    own. With LoRA the frozen base weights are sharded as well, beside the adapters.
    Call it after broadcast_weights and before building the optimizer (it must hold the shards)."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = model._no_split_modules or ()  # what transformers never splits: e.g. LlamaDecoderLayer
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:  # checks.fail's form; this module imports nothing of the repo's
        raise SystemExit(f"error: --fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules) "
                         "to shard by")
    # reshard_after_forward=True everywhere (torch keeps the root's weights gathered by default): between
    # passes every process holds only its shards.
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps it
    if hasattr(base, "score"):  # scalar head: see rollout.last_hidden_states
        fully_shard(base.base_model, reshard_after_forward=True)
        fully_shard(base.score, reshard_after_forward=True)
    else:
        fully_shard(model, reshard_after_forward=True)
    return model


def is_sharded(model) -> bool:
    """Whether shard_model has split this model over the processes."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextlib.contextmanager
def gathered(model):
    """A sharded model with its full weights on every process for the duration, gathered once:
    for the rollout and for evaluation, where a per-unit gather would repeat at every token, and
    where processes run different numbers of forward passes (a batch stops at its own longest
    completion), which sharded passes cannot do, since every gather needs all the processes.
    Holds one full copy of the weights meanwhile. Does nothing to a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()  # all-gather this unit's weights
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()  # free them: back to this process's shards
            unit.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model) -> dict:
    """The whole weights of a sharded model, gathered onto rank 0's CPU (to save them; the other
    processes send their shards and get an empty dict).
    A tied weight (an LM head that shares the embedding matrix) is kept once, under its first name,
    as save_pretrained keeps it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: tensor for name, tensor in weights.items() if name in names}


# ---------------------------------------------------------------------------------------------
# Memory: how much a run needs, in one process or sharded over several
# ---------------------------------------------------------------------------------------------
def memory_estimate(trained_models, frozen_models=(), rows: int = 0, sequence_length: int = 0,
                    completion_length: int = 0, gradient_checkpointing: bool = False, shards: int = 1) -> str:
    """Note 002's memory table for this run, in GiB: the weights; gradients and AdamW's two
    moments, fp32, for each *trained* parameter (all of them, or with LoRA only the adapters);
    frozen copies (reference policy, reward model). Then, when the micro-batch is given (rows of
    sequence_length tokens, the last completion_length of them scored), what one micro-batch's
    forward pass keeps for its backward (gradient_checkpointing trades it for recomputation):

      activations  layers x rows x sequence_length x (6 d + 2 d_kv + 4 d_ff) floats per token: per
                   decoder layer autograd saves the two RMSNorms' inputs and outputs (4 d), the
                   attention's q, k, v and output (2 d + 2 d_kv), and the MLP's gate, up, SiLU and
                   product (4 d_ff); d = hidden size, d_kv = key/value width (GQA), d_ff = MLP width.
                   With gradient checkpointing: each layer's input (d), plus one layer's worth for
                   the layer being recomputed
      logits       2 x rows x completion_length x vocabulary floats: the logits, and the softmax
                   the log-sum-exp's backward makes from them

    An upper bound for GRPO, whose prompt cache runs each distinct prompt once, not once per row.

    With --fsdp over `shards` processes, each holds 1/shards of the weights, gradients, AdamW moments
    and frozen copies, plus the first trained model's full weights while it generates (gathered
    for the rollout and evaluation): an upper bound, since those full weights and the backward's
    activations are not held at once. The activations are per process, as before."""
    weights = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    trained = sum(p.numel() for m in trained_models for p in m.parameters() if p.requires_grad)
    total = sum(p.numel() for m in trained_models for p in m.parameters())
    per = f" / {shards} (sharded)" if shards > 1 else ""
    table = [(f"weights of the trained model(s){per}", sum(weights(m) for m in trained_models) / shards),
             (f"gradients ({trained / 1e6:.2f}M trained parameters of {total / 1e6:.2f}M){per}", 4 * trained / shards),
             (f"AdamW moments (2 x fp32 per trained parameter){per}", 8 * trained / shards),
             (f"frozen copies (reference, reward model){per}", sum(weights(m) for m in frozen_models) / shards)]
    if shards > 1 and trained_models:
        table.append(("the model's full weights, gathered (rollout, evaluation)", weights(trained_models[0])))
    if rows and trained_models:
        c = trained_models[0].config
        c = getattr(c, "text_config", None) or c
        d_kv = c.hidden_size // c.num_attention_heads * getattr(c, "num_key_value_heads", c.num_attention_heads)
        per_layer = 6 * c.hidden_size + 2 * d_kv + 4 * c.intermediate_size  # floats per token
        per_token = (c.num_hidden_layers * c.hidden_size + per_layer if gradient_checkpointing
                     else c.num_hidden_layers * per_layer)
        table += [(f"activations of one micro-batch ({rows} x {sequence_length} tokens)",
                   4 * rows * sequence_length * per_token),
                  (f"logits of one micro-batch ({rows} x {completion_length} x {c.vocab_size})",
                   2 * 4 * rows * completion_length * c.vocab_size)]
    lines = [f"  {name:<62} {size / 2**30:8.3f} GiB" for name, size in table]
    lines.append(
        f"  {'total' if rows else 'total, before activations':<62} {sum(size for _, size in table) / 2**30:8.3f} GiB"
    )
    return "memory estimate (note 002):\n" + "\n".join(lines)
