"""What every script needs the same way: tokenizer and model loading, LoRA, data and prompts,
generation (rollout), per-token log-probs, held-out evaluation, config parsing, several
processes (torchrun), logging.

Each algorithm itself (SFT, reward model, PPO, GRPO, MIX) lives in its own script.
"""
import argparse
import ast
import contextlib
import copy
import ctypes
import dataclasses
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import textwrap
import types

try:
    import fcntl  # the output folder's lock (not on Windows, where runs go unlocked)
except ImportError:
    fcntl = None
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import datasets  # noqa: E402
from tqdm import tqdm  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
)

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars around our own tqdm bar
transformers.utils.logging.set_verbosity_error()
datasets.disable_progress_bars()


def fail(message: str):
    """Stop with one clear sentence and exit status 1 (no traceback): for bad input, not for bugs."""
    raise SystemExit(f"error: {message}")


# ---------------------------------------------------------------------------------------------
# Config: a dataclass per script, parsed from the command line
# ---------------------------------------------------------------------------------------------
def parse_config(config_class, args=None):
    """Build an argparse parser from a dataclass, CleanRL style: each field's help text is the
    string literal written under it, so `python grpo.py --help` documents every field."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(config_class))).body[0].body
    except (OSError, TypeError):  # no source file (e.g. a class typed into a REPL): no help texts
        body = []
    docs = {
        node.target.id: nxt.value.value
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }
    script_doc = sys.modules["__main__"].__doc__
    parser = argparse.ArgumentParser(description=script_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(config_class):
        kind = field.type
        if isinstance(kind, types.UnionType):  # `int | None`: parse an int, None when left out
            kind = next(t for t in kind.__args__ if t is not type(None))
        kind = _to_bool if kind is bool else kind  # argparse's bool("False") would be True
        parser.add_argument(
            f"--{field.name}",
            type=kind,
            default=field.default,
            help=f"{docs.get(field.name, '')} (default: %(default)s)",
        )
    return config_class(**vars(parser.parse_args(args)))


def _to_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def set_seed(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def show_progress() -> bool:
    """A tqdm bar on the main process only, and none when TQDM_DISABLE=1 (the notebooks set it, so
    their saved outputs hold no bars; tqdm itself ignores it when `disable` is passed)."""
    return is_main_process() and os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true")


def get_device() -> torch.device:
    """This process's GPU (torchrun's LOCAL_RANK picks which), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def keep_freed_memory():
    """Speed (Linux): glibc gives each large freed tensor back to the OS, and the next step's tensors
    page-fault that memory in again; keeping freed memory for reuse makes a tiny-model step ~15%
    faster. Runs once, at import; does nothing without glibc (macOS, Windows) or when the
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


# ---------------------------------------------------------------------------------------------
# Several processes (torchrun --nproc_per_node N): data parallelism
# ---------------------------------------------------------------------------------------------
def setup_distributed() -> tuple[int, int]:
    """(rank, world_size) of this process. Under torchrun, which sets RANK, WORLD_SIZE and
    LOCAL_RANK, join the process group: nccl between GPUs, gloo on CPU. A plain
    `python script.py` is rank 0 of 1 and starts no group."""
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(get_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def is_main_process() -> bool:
    """Rank 0 prints, writes metrics and saves; the other ranks only compute."""
    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_weights(model):
    """Every process starts from rank 0's weights (a model built from scratch is random)."""
    if dist.is_initialized():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def average_gradients(model):
    """Data parallelism, as torch's DistributedDataParallel does it (there overlapped with the
    backward pass): every process holds the same weights and backpropagates its own share of
    the batch; averaging the gradients over processes gives every process the same update, so
    the weights stay identical. Token means divide by token_count(), which makes this average
    exactly the gradient of one loss over the whole global batch. Call it after backward().
    A sharded model (--fsdp) needs nothing here: FSDP averaged its gradients in the backward pass."""
    if dist.is_initialized() and not is_sharded(model):
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)  # sum over processes (gloo has no AVG)
                param.grad.div_(dist.get_world_size())


def global_sum(value):
    """A tensor or number summed over all processes; unchanged in a single process."""
    if not dist.is_initialized():
        return value
    tensor = torch.as_tensor(value, device=value.device if torch.is_tensor(value) else get_device()).clone()
    dist.all_reduce(tensor)
    return tensor if torch.is_tensor(value) else tensor.item()


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


def token_count(mask: torch.Tensor) -> torch.Tensor:
    """The denominator of a token mean: mask.sum() in one process; with N processes, the token
    count of the whole batch divided by N. Each process divides its own token sum by it, so the
    mean of the N losses, and of their gradients (average_gradients), is the sum over all
    tokens of the global batch divided by their number: the loss of one process on all of it."""
    count = global_sum(mask.sum().float())
    return (count / (dist.get_world_size() if dist.is_initialized() else 1)).clamp(min=1)


def reduce_metrics(metrics: dict) -> dict:
    """Each float metric averaged over processes (one all_reduce); ints such as `step` kept."""
    keys = [key for key, value in metrics.items() if isinstance(value, float)]
    if not dist.is_initialized() or not keys:
        return metrics
    values = global_sum(torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=get_device()))
    return {**metrics, **{key: value / dist.get_world_size() for key, value in zip(keys, values.tolist())}}


# ---------------------------------------------------------------------------------------------
# Sharded data parallelism (--fsdp): weights, gradients and AdamW states split over the processes
# ---------------------------------------------------------------------------------------------
def check_fsdp(cfg, world_size: int):
    """--fsdp shards over processes, so it needs torchrun; --merge_lora would need the whole model on one process."""
    if cfg.fsdp and cfg.merge_lora:
        fail("--merge_lora does not work with --fsdp: the adapter is saved alone, and every script's --model "
             "merges it into its base when loading")
    if cfg.fsdp and world_size == 1:
        fail("--fsdp shards the model over processes: run the script under torchrun --nproc_per_node 2 (or more)")


def shard_model(model):
    """FSDP (torch's fully_shard, "FSDP2"; DeepSpeed's ZeRO stage 3): each of the N processes keeps
    1/N of every weight (a DTensor shard), hence 1/N of its gradient and of AdamW's two moments.
    Before a unit's forward (and again before its backward) the processes all-gather its full
    weights, and free them after; its gradient is reduce-scattered, averaged over the processes as
    average_gradients does for data parallelism, so each keeps the mean gradient of its own shard
    and AdamW updates only that shard. The units: each decoder layer, then the rest (embeddings,
    final norm and the head), so at most one layer's full weights are gathered at a time.
    A scalar head (reward model, critic) is called apart from its transformer (last_hidden_states,
    then .score), so the transformer and the head are units of their own. With LoRA the frozen
    base weights are sharded as well, beside the adapters.
    Call it after broadcast_weights and before building the optimizer (it must hold the shards)."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = model._no_split_modules or ()  # what transformers never splits: e.g. LlamaDecoderLayer
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        fail(f"--fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    # reshard_after_forward=True everywhere (torch keeps the root's weights gathered by default): between
    # passes every process holds only its shards.
    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps it
    if hasattr(base, "score"):  # scalar head: see last_hidden_states
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


def log(message: str):
    """Print a line (between tqdm updates), from rank 0 only."""
    if is_main_process():
        tqdm.write(message)


def warmup_cosine_schedule(optimizer, warmup_steps: int, total_steps: int, min_lr_rate: float):
    """lr(t) = peak * t / warmup during warmup, then a cosine from peak down to min_lr_rate * peak
    (transformers' cosine_with_min_lr schedule, written out)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_rate + (1 - min_lr_rate) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------
# The embedded tokenizer and tiny model (used when sft.py gets no --model)
# ---------------------------------------------------------------------------------------------
THINK_ANSWER_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (so a byte-level vocab is text)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level tokenizer: token id = byte value (0..255), so any UTF-8 text encodes, plus
    special tokens (bos, pad, eos = <|im_end|>, <|im_start|>) and the four format tags as single
    tokens. It has a ChatML chat template (system / user / assistant) like Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        extra_special_tokens=["<|im_start|>"],
        padding_side="left",  # must be given here to be saved; left padding is what generation needs
    )
    tokenizer.add_tokens(THINK_ANSWER_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer, hidden_size=128, num_layers=4, num_heads=4) -> torch.nn.Module:
    """A Llama-style causal LM from scratch: ~1.1M parameters with the defaults.

    Llama rather than Qwen2: with model_type qwen2, AutoTokenizer reloads our tokenizer as a
    Qwen2Tokenizer, which changes the ids."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.LlamaForCausalLM(config)


def load_model(name_or_path: str, missing_hint: str = "", scalar_head: bool = False, trust_remote_code: bool = False,
               reward_model: bool = False):
    """(model, tokenizer) from a local folder or a hub id; a missing folder is one clear sentence.
    Weights are read from safetensors only (no pickle), and a model's own Python code runs only
    with trust_remote_code (--trust_remote_code).

    scalar_head=True loads the transformer with a linear N -> 1 head instead of the LM head
    (AutoModelForSequenceClassification, num_labels=1): the reward model and the critic. From an
    SFT checkpoint the head starts random; from a reward-model checkpoint it is the trained one.
    reward_model=True refuses a folder that holds a policy (its head would start random), and
    a policy is never loaded from a reward model's folder.

    A .gguf file (llama.cpp's format) loads too: see load_gguf."""
    if name_or_path.endswith(".gguf") or os.path.isfile(name_or_path):
        return load_gguf(name_or_path, scalar_head)
    is_local = os.path.exists(name_or_path) or name_or_path.startswith((".", "/", "out", "data"))
    is_adapter = os.path.isfile(os.path.join(name_or_path, "adapter_config.json"))  # a LoRA run's output
    if is_local and not (is_adapter or os.path.isfile(os.path.join(name_or_path, "config.json"))):
        fail(f"no model found at {name_or_path}" + (f": {missing_hint}" if missing_hint else ""))
    saved_head = _saved_head(name_or_path) if is_local else None
    if reward_model and saved_head == "language model":
        fail(f"{name_or_path} is a policy (it has a language-model head), not a reward model: "
             "pass reward_model.py's output")
    if not scalar_head and saved_head == "scalar":
        fail(f"{name_or_path} is a reward model (a scalar head, no language-model head), not a policy")
    auto_class = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
    head = dict(num_labels=1, use_safetensors=True, trust_remote_code=trust_remote_code) if scalar_head else dict(
        use_safetensors=True, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left",
                                                  trust_remote_code=trust_remote_code)
        if is_adapter:  # the base model the adapter was trained on, with the adapter merged into its weights
            from peft import PeftConfig, PeftModel

            base_path = PeftConfig.from_pretrained(name_or_path).base_model_name_or_path
            base = (load_gguf(base_path, scalar_head)[0] if str(base_path).endswith(".gguf")
                    else auto_class.from_pretrained(base_path, **head, dtype=torch.float32))
            model = PeftModel.from_pretrained(base, name_or_path).merge_and_unload()
        else:
            model = auto_class.from_pretrained(name_or_path, **head, dtype=torch.float32)
    except Exception as error:  # not on disk, not reachable on the hub, or not a model
        fail(f"could not load a model from {name_or_path!r} ({_first_line(error)})")
    if tokenizer.pad_token is None:  # e.g. Llama tokenizers: pad with EOS, the mask tells them apart
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        fail(f"the tokenizer of {name_or_path} has no chat template, and every prompt is a chat: use a chat (instruct) "
             "model, or add a chat_template to its tokenizer_config.json")
    return model, tokenizer


def _saved_head(folder: str) -> str | None:
    """'scalar' for a reward model's (or critic's) folder, 'language model' for a policy's, None if unknown."""
    for name, key in (("adapter_config.json", "task_type"), ("config.json", "architectures")):
        try:
            with open(os.path.join(folder, name)) as f:
                value = str(json.load(f).get(key))
        except (OSError, ValueError, AttributeError):
            continue
        return "scalar" if ("SEQ_CLS" in value or "SequenceClassification" in value) else (
            "language model" if ("CAUSAL_LM" in value or "CausalLM" in value) else None)
    return None


def load_gguf(path: str, scalar_head: bool = False):
    """(model, tokenizer) from a .gguf file, llama.cpp's one-file format: the weights dequantised to
    a plain fp32 model (save_pretrained writes it as safetensors; scalar_head=True puts a new
    random N -> 1 head on the transformer, as from an SFT checkpoint), and the tokenizer, special
    tokens and chat template that the file stores."""
    if not os.path.isfile(path):
        fail(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":  # every GGUF file starts with these 4 bytes
            fail(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        import gguf  # noqa: F401  (transformers reads the file with it)
    except ImportError:
        fail(f"reading {path} needs the gguf package: pip install gguf")
    path = os.path.abspath(path)
    folder, file = os.path.split(path)
    auto_class = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
    head = dict(num_labels=1) if scalar_head else {}
    try:  # dequantize=True: plain weights, and no GGUF quantizer left on the model (with one, save_pretrained refuses)
        model = auto_class.from_pretrained(folder, gguf_file=file, **head, dtype=torch.float32,
                                           quantization_config=transformers.GgufConfig(dequantize=True))
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=file, padding_side="left")
    except Exception as error:  # e.g. an architecture transformers has no GGUF mapping for
        fail(f"transformers could not load {path} ({_first_line(error)})")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        fail(f"{path} stores no chat template, and every prompt is a chat: use a chat (instruct) model")
    model.config.pad_token_id = tokenizer.pad_token_id  # a scalar head's forward finds each row's last token with it
    model.name_or_path = model.config.name_or_path = path  # peft writes this into adapter_config.json as the base
    return model, tokenizer


def _first_line(error: Exception) -> str:
    """The first line of an exception's message (its class name if it has none), for one-sentence errors."""
    return (str(error).splitlines() or [type(error).__name__])[0]


def save_checkpoint(model, tokenizer, output_dir: str, merge_lora: bool = False):
    """Write model + tokenizer to a temporary folder first, then move the files into place, so a
    crash while writing never leaves a half-written checkpoint over a good one. With LoRA this
    is the adapter only (adapter_config.json names the base model; load_model merges them), and
    with merge_lora also the adapter merged into a copy of its base, in <output_dir>/merged.
    Rank 0 writes; a sharded model (--fsdp) is first gathered whole, from every process."""
    state_dict = full_state_dict(model) if is_sharded(model) else None  # FSDP: every process sends its shards
    if not is_main_process():
        return
    if merge_lora and hasattr(model, "merge_and_unload"):
        os.makedirs(os.path.join(output_dir, "merged"), exist_ok=True)
        save_checkpoint(copy.deepcopy(model).merge_and_unload(), tokenizer, os.path.join(output_dir, "merged"))
    tmp = os.path.join(output_dir, ".checkpoint_tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # The scripts never resize the vocabulary, so peft need not read the base's config.json to check
    # whether to save the embeddings too (a .gguf base has none, and peft would warn).
    model.save_pretrained(tmp, **(dict(save_embedding_layers=False) if hasattr(model, "peft_config") else {}),
                          **(dict(state_dict=state_dict) if state_dict is not None else {}))
    tokenizer.save_pretrained(tmp)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


# ---------------------------------------------------------------------------------------------
# Robustness: settings that cannot work, sequences too long, NaN/inf, resumable checkpoints
# ---------------------------------------------------------------------------------------------
def setting(default, usable, must_be: str):
    """A Config field with its check beside it: `lr: float = setting(1e-3, lambda v: v > 0, "positive")`.
    check_settings stops with "--lr must be positive, not -1.0" when usable(value) is false."""
    return dataclasses.field(default=default, metadata={"usable": usable, "must_be": must_be})



def check_settings(cfg):
    """One clear sentence for the first setting that cannot work (before anything is loaded or written):
    every float must be finite, and each field declared with `setting` must pass its own check."""
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name} must be a finite number, not {value}")
        if "usable" in field.metadata and not field.metadata["usable"](value):
            fail(f"--{field.name} must be {field.metadata['must_be']}, not {value}")


def check_fits_context(model, num_tokens: int, what: str):
    """Refuse sequences longer than the model's context (its position embeddings), in one sentence,
    rather than let them fail deep inside a forward pass."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and num_tokens > context:
        fail(f"{what} needs {num_tokens} tokens, more than the model's context of {context}: "
             "shorten the prompts or --max_completion_length")


def check_system_prompt(model, tokenizer, system_prompt: str):
    """Refuse a --system_prompt that alone fills the model's context, before thousands of prompts
    are made with it (a 100k-character one would exhaust memory before any other check speaks)."""
    if system_prompt:
        tokens = len(tokenizer(make_prompt(tokenizer, "", system_prompt), add_special_tokens=False)["input_ids"])
        check_fits_context(model, tokens + 1, "--system_prompt")


def longest_prompt(tokenizer, questions, system_prompt: str) -> int:
    """Tokens in the longest chat prompt made from `questions`."""
    prompts = [make_prompt(tokenizer, q, system_prompt) for q in questions]
    return max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])


def check_finite(step: int, run_dir: str, **values):
    """Stop at a NaN or infinite loss or gradient norm, naming the step, before the update is
    applied. A checkpoint counts as good only once the weights it holds gave finite values: the
    one written after the previous step is promoted here when they are finite, and dropped when
    they are not, so --resume never restarts from weights that already diverged. Pass the
    gradient norm first: under torchrun it is the same on every process, so all stop together."""
    for name, value in values.items():
        value = float(value.detach()) if torch.is_tensor(value) else float(value)
        if not math.isfinite(value):
            if is_main_process():
                shutil.rmtree(os.path.join(run_dir, "checkpoint.new"), ignore_errors=True)
            kept = newest_checkpoint(run_dir)
            fail(f"step {step}: the {name.replace('_', ' ')} is {value}; stopped before applying this update "
                 + (f"({kept} holds the last weights that gave finite values). " if kept else "")
                 + "A lower --learning_rate usually helps (in a new run: --overwrite_output_dir true)")
    if is_main_process():
        _promote_checkpoint(run_dir)


def newest_checkpoint(run_dir: str) -> str | None:
    """The newest whole checkpoint folder of a run: checkpoint.new (written, not yet promoted),
    checkpoint, or checkpoint.old (a kill fell between the two renames of a promotion)."""
    for name in ("checkpoint.new", "checkpoint", "checkpoint.old"):
        if os.path.isfile(os.path.join(run_dir, name, "state.pt")):
            return os.path.join(run_dir, name)
    return None


def _promote_checkpoint(run_dir: str):
    """checkpoint.new -> checkpoint, by two renames (the previous one waits as checkpoint.old)."""
    new, final, old = (os.path.join(run_dir, name) for name in ("checkpoint.new", "checkpoint", "checkpoint.old"))
    if not os.path.isdir(new):
        return
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(final):
        os.rename(final, old)
    os.rename(new, final)
    shutil.rmtree(old, ignore_errors=True)


def save_training_state(run_dir: str, cfg, step: int, results: dict, models, optimizers, schedulers, rng):
    """A resumable checkpoint: the weights, optimizer and scheduler states, every random generator
    (of every process), the step, the metrics logged so far and run.json (script, model,
    settings), so that --resume continues exactly where the run was, bit for bit on the same
    machine, and knows whose run it continues.

    Written whole into checkpoint.tmp, then renamed to checkpoint.new; check_finite promotes it
    to checkpoint once its weights gave finite values. A kill at any moment leaves a whole
    checkpoint (newest_checkpoint finds it). With --fsdp every process writes the shards of the
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
    sharded, tmp = is_sharded(models[0]), os.path.join(run_dir, "checkpoint.tmp")
    try:
        if is_main_process():
            _promote_checkpoint(run_dir)  # an older checkpoint.new that no check_finite came after
            shutil.rmtree(tmp, ignore_errors=True)
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
        write_json(os.path.join(tmp, RUN_FILE), run_record(cfg))
    except OSError as error:  # e.g. a full disk: the checkpoints before this one stay as they were
        shutil.rmtree(tmp, ignore_errors=True)
        fail(f"could not write a checkpoint to {tmp} ({error.strerror or error})")
    os.rename(tmp, os.path.join(run_dir, "checkpoint.new"))


def _sharded_state(models, optimizers) -> dict:
    """The weights and AdamW states of sharded models (this process's shards), named as
    torch.distributed.checkpoint saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {**{f"model_{i}": get_model_state_dict(m) for i, m in enumerate(models)},
            **{f"optimizer_{i}": get_optimizer_state_dict(m, o) for i, (m, o) in enumerate(zip(models, optimizers))}}


def load_training_state(run_dir: str, models, optimizers, schedulers, rng) -> tuple[int, dict]:
    """Restore the newest checkpoint (weights_only: tensors and plain values, no pickled code),
    and metrics.jsonl as it was at its step (a missing or torn metrics file does not matter).
    prepare_output_dir has checked that it is this script's and model's. Returns (step, results)."""
    path = newest_checkpoint(run_dir)
    try:
        state = torch.load(os.path.join(path, "state.pt"), weights_only=True, map_location="cpu")
    except Exception as error:
        fail(f"{path}/state.pt cannot be read ({_first_line(error)}): it was damaged after it was written; "
             "start a new run (--overwrite_output_dir true)")
    if is_sharded(models[0]):  # FSDP: each process reads its own shards
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        sharded = _sharded_state(models, optimizers)  # the shapes to read into
        dcp.load(sharded, checkpoint_id=os.path.join(path, "sharded"))
        for i, (model, optimizer) in enumerate(zip(models, optimizers)):
            set_model_state_dict(model, sharded[f"model_{i}"])
            set_optimizer_state_dict(model, optimizer, sharded[f"optimizer_{i}"])
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
    if is_main_process():  # the metrics as they were at the checkpoint: what was logged after it is logged again
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.writelines(state["metrics"])
        completions = os.path.join(run_dir, "completions.jsonl")  # the same for the samples logged after it
        if os.path.isfile(completions):
            with open(completions) as f:
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= state["step"]]
            with open(completions, "w") as f:
                f.writelines(kept)
    log(f"resumed from {path} at step {state['step']}")
    return state["step"], state["results"]


# ---------------------------------------------------------------------------------------------
# LoRA (peft), precision and memory
# ---------------------------------------------------------------------------------------------
def add_lora(model, cfg, scalar_head: bool = False):
    """Freeze the model and train low-rank adapters instead (LoRA, Hu et al. 2021): each target
    linear layer W becomes W x + (alpha / r) * B A x, with A [r, d_in] and B [d_out, r], B = 0 at
    the start, so training begins from the unchanged model. Only A and B (and, for a reward model
    or critic, its scalar head: peft's SEQ_CLS task trains it too) get gradients and AdamW states.
    A d_in x d_out layer gets r (d_in + d_out) adapter parameters, a share r (1/d_in + 1/d_out) of
    it: 2r / d_model for a square projection (note 002's rule of thumb), less for the MLP's wide
    ones, more for the narrow k/v projections of grouped-query attention; embeddings get none.
    So Qwen2.5-3B at r = 16 trains 29.9M parameters (the README's table), not 2r / d_model x 3.09B
    = 48M. The frozen base is also the reference policy: see reference_model."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [t for t in targets.split(",") if t.strip() not in linear] if targets != "all-linear" else []
    if missing:  # peft says nothing when one name of a list matches nothing
        fail(f"--lora_target_modules: the model has no linear layer named {missing[0]!r} "
             f"(it has {', '.join(sorted(linear))})")
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
                        task_type="SEQ_CLS" if scalar_head else "CAUSAL_LM")
    return get_peft_model(model, config)


@contextlib.contextmanager
def reference_model(model, frozen_copy):
    """The reference policy pi_ref of the KL terms: the frozen copy of the starting model if there
    is one. With LoRA there is none: the policy with its adapter switched off (peft's
    disable_adapter) *is* the starting model, so no second copy of the weights is held."""
    if frozen_copy is not None:
        yield frozen_copy
    else:
        with model.disable_adapter():
            yield model


def autocast(model):
    """bf16 autocast on a GPU that supports it: matrix products in bf16, weights, gradients and
    AdamW states stay fp32 (mixed precision). Nothing on the CPU, where it was no faster here."""
    device = next(model.parameters()).device
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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

    An upper bound for GRPO, whose prompt_cache runs each distinct prompt once, not once per row.

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


# ---------------------------------------------------------------------------------------------
# Data: GSM8K schema (question, answer = reasoning + "#### <number>") and the chat prompt
# ---------------------------------------------------------------------------------------------
def load_split(dataset: str, split: str, columns=("question", "answer"), config_name: str = "main"):
    """One split as a datasets.Dataset: `<dataset>/<split>.jsonl` if `dataset` is a local folder,
    else the hub dataset (openai/gsm8k has config 'main' and splits 'train' / 'test'). Every row
    is checked for the columns asked for (check_rows)."""
    if dataset.startswith(("/", ".", "~")) and not os.path.isdir(dataset):  # a path, not a hub id
        fail(f"no dataset folder {dataset} (a folder of train.jsonl / test.jsonl, or a hub dataset id)")
    if os.path.isdir(dataset):
        path = os.path.join(dataset, f"{split}.jsonl")
        if not os.path.isfile(path):
            fail(f"dataset folder {dataset} has no {split}.jsonl")
        return load_jsonl(path, columns)
    try:
        data = datasets.load_dataset(dataset, config_name, split=split)
    except Exception as error:
        fail(f"could not load dataset {dataset!r} split {split!r} ({_first_line(error)})")
    keep = check_rows(data.to_list(), f"{dataset} {split}", columns, [f"row {i}" for i in range(1, len(data) + 1)])
    return data if len(keep) == len(data) else data.select(keep)


def load_jsonl(path: str, columns=()):
    """A local .jsonl file (one JSON object per line, UTF-8) as a datasets.Dataset, its rows
    checked (check_rows). A missing or empty file, a line that is not UTF-8 or not a JSON object
    is one sentence naming the file and the line."""
    if not os.path.isfile(path):
        fail(f"no data file {path}")
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                fail(f"{path} line {number} is not UTF-8 text: save the file as UTF-8")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                fail(f"{path} line {number} is not valid JSON")
            if not isinstance(row, dict):
                fail(f"{path} line {number} is not a JSON object")
            records.append((number, row))
    if not records:
        fail(f"{path} is empty")
    keep = check_rows([row for _, row in records], path, columns, [f"line {number}" for number, _ in records])
    labels, records = [f"line {records[i][0]}" for i in keep], [records[i][1] for i in keep]
    names = list(dict.fromkeys(key for row in records for key in row))  # every column, in order of appearance
    for name in names:  # a table needs one type per column: name the first line that breaks it
        kinds = [(label, type(row[name]).__name__) for label, row in zip(labels, records) if row.get(name) is not None]
        other = next(((label, kind) for label, kind in kinds if kind != kinds[0][1]), None)
        if other:
            fail(f"{path} {other[0]}: {name!r} is {other[1]}, where {kinds[0][0]} has {kinds[0][1]}: "
                 "give each column one type")
    return datasets.Dataset.from_dict({name: [row.get(name) for row in records] for name in names})


# Data checks: a row is usable when each column the script needs passes its check (None = usable).
def _text_problem(value) -> str | None:
    if value is None:
        return "is missing"
    if not isinstance(value, str):
        return f"is {type(value).__name__}, not text"
    return "is empty" if not value.strip() else None


def _answer_problem(value) -> str | None:  # GSM8K: the reasoning, then '#### <final answer>'
    if _text_problem(value):
        return _text_problem(value)
    return None if "####" in value and value.rpartition("####")[2].strip() else "has no final answer after '####'"


def _chat_problem(value) -> str | None:  # [{"role": ..., "content": ...}, ...], the last the assistant's answer
    if not isinstance(value, list) or not value:
        return "is not a list of messages"
    for message in value:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            return "has a message whose role is not system, user or assistant"
        if _text_problem(message.get("content")):
            return f"has a message from the {message['role']} whose content {_text_problem(message.get('content'))}"
    return None if value[-1]["role"] == "assistant" else "does not end with an assistant message (the expert's answer)"


COLUMN_CHECKS = {"question": _text_problem, "prompt": _text_problem, "chosen": _text_problem,
                 "rejected": _text_problem, "answer": _answer_problem, "messages": _chat_problem}
MAX_BAD_SHARE = 0.01  # a file with more unusable rows than this is refused; fewer are skipped with a count


def check_rows(records: list[dict], name: str, columns, labels: list[str]) -> list[int]:
    """Refuse data a script cannot learn from: a missing column, or more than MAX_BAD_SHARE of the
    rows with a column that is missing, not text, empty, or (answer) without a final answer, or
    (messages) not a chat ending with the assistant's answer; or a preference pair whose chosen and
    rejected are the same text. The sentence names the first bad row (labels: "line 7"). A smaller
    share of bad rows is dropped, with a count in the log. Returns the indices of the usable ones."""
    if not records:
        fail(f"{name} is empty")
    present = set().union(*records)
    for column in columns:
        if column not in present:
            fail(
                f"{name} has no column {column!r} "
                f"(it has {', '.join(dict.fromkeys(k for row in records for k in row))})"
            )
    checks = [(column, COLUMN_CHECKS[column]) for column in columns if column in COLUMN_CHECKS]
    bad = []  # (row index, what is wrong)
    for index, row in enumerate(records):
        problem = next((f"{column!r} {check(row.get(column))}" for column, check in checks if check(row.get(column))),
                       None)
        if problem is None and "rejected" in columns and row.get("chosen") == row["rejected"]:
            problem = "'chosen' and 'rejected' are the same text (the pair teaches nothing)"
        if problem:
            bad.append((index, problem))
    if not bad:
        return list(range(len(records)))
    index, problem = bad[0]
    if len(bad) > MAX_BAD_SHARE * len(records):
        fail(f"{name} {labels[index]}: {problem}; {len(bad)} of {len(records)} rows are unusable, more than "
             f"{MAX_BAD_SHARE:.0%}: fix the data")
    log(f"{name}: skipped {len(bad)} of {len(records)} unusable rows (the first, {labels[index]}: {problem})")
    skipped = {index for index, _ in bad}
    return [i for i in range(len(records)) if i not in skipped]


def make_prompt(tokenizer, question: str, system_prompt: str = "") -> str:
    """The chat-formatted prompt, ending where the assistant's answer starts."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def split_gsm8k_answer(answer: str) -> tuple[str, str]:
    """'reasoning\\n#### 42' -> ('reasoning', '42'); GSM8K's <<48/2=24>> calculator notes are dropped."""
    reasoning, _, final = answer.rpartition("####")
    return re.sub(r"<<.*?>>", "", reasoning).strip(), final.strip()


def format_completion(reasoning: str, final: str) -> str:
    """The answer format of note 002: <think>reasoning</think><answer>number</answer>."""
    return f"<think>{reasoning}</think><answer>{final}</answer>"


def extract_answer(completion: str) -> str | None:
    """The text inside the first <answer>...</answer>, or None if there is none."""
    match = re.search(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    return match.group(1).strip() if match else None


def same_number(predicted: str | None, gold: str) -> bool:
    """Numeric equality, ignoring commas, '$' and a trailing '.' ('1,000' == '1000.0')."""
    clean = lambda s: s.replace(",", "").replace("$", "").strip().rstrip(".")  # noqa: E731
    if predicted is None or not clean(predicted) or not clean(gold):  # an empty answer is never right
        return False
    try:
        return float(clean(predicted)) == float(clean(gold))
    except ValueError:
        return clean(predicted) == clean(gold)


def is_correct(completion: str, answer: str) -> bool:
    """Rule-based check of a completion against a GSM8K answer column."""
    return same_number(extract_answer(completion), split_gsm8k_answer(answer)[1])


# ---------------------------------------------------------------------------------------------
# Rollout and log-probs
# ---------------------------------------------------------------------------------------------
def pad_left(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids [B, P], mask [B, P]); prompts are left padded so that every
    row's completion starts at the same column P."""
    ids = pad_sequence([torch.tensor(s) for s in sequences], batch_first=True, padding_value=pad_id,
                       padding_side="left")
    mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in sequences], batch_first=True,
                        padding_side="left")
    return ids, mask


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (ids [B, T], mask [B, T]); completions are right padded."""
    ids = pad_sequence([torch.tensor(s) for s in sequences], batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in sequences], batch_first=True)
    return ids, mask


@torch.no_grad()  # not inference_mode: the ids it returns go into forward passes that need grads
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0, greedy=False):
    """Rollout: the policy writes a completion for each prompt, one token at a time (KV cache).

    At each step: logits of the last position -> sample a token from softmax(logits / temperature)
    (or take the argmax when greedy) -> feed it back. Prompts are left padded, so all completions
    start at the same column P. A row that emits EOS stops there and is padded after it; its mask
    keeps the first EOS (the model chose to stop: that is an action too) and drops what follows.

    Returns prompt_ids [B, P], prompt_mask [B, P], completion_ids [B, T], completion_mask [B, T].
    """
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    # [B, max_new_tokens]
    completion_ids = torch.full((len(prompts), max_new_tokens), tokenizer.pad_token_id, device=device)
    was_training = model.training
    model.eval()  # no dropout while sampling; and gradient checkpointing would switch the KV cache off
    with autocast(model):
        cache, logits = prompt_cache(model, prompt_ids, prompt_mask)  # the prompts' keys/values; logits [B, 1, V]
        rows = torch.arange(len(prompts), device=device)  # the rows still writing
        # [b, P + t], [b]: the last token's position
        attention_mask, positions = prompt_mask, prompt_mask.sum(dim=1) - 1
        for t in range(max_new_tokens):
            next_logits = logits[:, -1].float()  # [b, V]
            if greedy:
                next_tokens = next_logits.argmax(dim=-1)  # [b]
            else:  # sample the raw policy: no top-k / top-p, so these are the log-probs we train on
                next_tokens = torch.multinomial(torch.softmax(next_logits / temperature, dim=-1), 1).squeeze(1)  # [b]
            completion_ids[rows, t] = next_tokens
            writing = next_tokens != tokenizer.eos_token_id  # [b]
            if t == max_new_tokens - 1 or not writing.any():
                break
            if not writing.all():  # Speed: rows that emitted EOS leave the batch, and their cache rows with them
                rows, next_tokens, positions = rows[writing], next_tokens[writing], positions[writing]
                attention_mask = attention_mask[writing]
                cache.batch_select_indices(writing.nonzero().squeeze(1))
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            positions = positions + 1
            logits = model(input_ids=next_tokens[:, None], attention_mask=attention_mask,
                           position_ids=positions[:, None],
                           past_key_values=cache, use_cache=True).logits  # [b, 1, V]
    model.train(was_training)
    completion_ids = completion_ids[:, : t + 1]  # [B, T]: up to the longest completion
    return prompt_ids, prompt_mask, completion_ids, mask_after_eos(completion_ids, tokenizer.eos_token_id)


def mask_after_eos(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including each row's first EOS, 0 after it: [B, T] -> [B, T].

    e.g. tokens [a, b, EOS, pad, pad] -> [1, 1, 1, 0, 0]; a row with no EOS is all ones."""
    is_eos = (completion_ids == eos_token_id).long()  # [B, T]
    eos_before = is_eos.cumsum(dim=1) - is_eos  # number of EOS strictly before each position
    return (eos_before == 0).long()


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position: logits [B, T, V], labels [B, T] -> [B, T].

    Written as logit[label] - logsumexp(logits) so no [B, T, V] log-softmax is kept."""
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def prompt_cache(model, prompt_ids, prompt_mask):
    """Run each distinct prompt once and hand every row its prompt's keys and values (a KV cache).

    GRPO samples G completions per prompt, so its B*G rows hold only B distinct prompts: running
    each once instead of G times removes (G-1)/G of the prompt work from the rollout and from
    every log-prob pass, with the same results (gradients flow back through the copies).
    Returns (the cache, one entry per row; the logits of each row's last prompt position [B, 1, V]).
    """
    distinct, row_to_prompt = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [U, P], [B]
    first_row = torch.zeros(len(distinct), dtype=torch.long, device=prompt_ids.device)
    first_row.scatter_(0, row_to_prompt, torch.arange(len(prompt_ids), device=prompt_ids.device))  # a row of each
    mask = prompt_mask[first_row]  # [U, P]
    out = model(input_ids=prompt_ids[first_row], attention_mask=mask,
                position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
                use_cache=True, logits_to_keep=1)
    out.past_key_values.reorder_cache(row_to_prompt)  # entry u -> each row whose prompt is u: [B, heads, P, head_dim]
    return out.past_key_values, out.logits[row_to_prompt]


def prompts_repeat(prompt_ids) -> bool:
    """True if some rows share a prompt (then prompt_cache saves work)."""
    return len(torch.unique(prompt_ids, dim=0)) < len(prompt_ids)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                        with_entropy: bool = False, length_chunks: int = 2):
    """Per-token log-probs [B, T] of the last T tokens of input_ids [B, P+T] (the completion).

    The logit at position t predicts token t+1, so the T completion tokens are predicted by the
    positions P-1 .. P+T-2: we ask the model for the last T+1 positions only (logits_to_keep) and
    drop the final one. Logits are divided by the sampling temperature, so these are the
    log-probs of the distribution the completions were sampled from. Positions after a row's
    last real token (attention_mask 0) hold junk or 0: every loss masks them.

    with_entropy=True also returns the policy's entropy at each position [B, T] (no gradient),
    -sum_v p(v) log p(v): a falling entropy means the policy grows more certain.
    """
    T = num_completion_tokens
    if length_chunks == 1:  # one pass over the batch as it is
        logprobs, entropy = chunk_logprobs(model, input_ids, attention_mask, T, temperature, with_entropy)
        return (logprobs, entropy) if with_entropy else logprobs
    positions = torch.arange(1, T + 1, device=input_ids.device)
    lengths = (attention_mask[:, -T:] * positions).amax(dim=1)  # [B]: where each row's completion ends
    # Speed: rows sorted by completion length, in chunks cut to their own longest completion, so no
    # forward or backward work is spent on the padding after the shorter ones.
    logprobs = torch.zeros(len(input_ids), T, device=input_ids.device)  # [B, T]
    entropy = torch.zeros(len(input_ids), T, device=input_ids.device)  # [B, T]
    for rows in lengths.argsort().chunk(length_chunks):  # rows [b] of one chunk
        t = max(int(lengths[rows].max()), 1)
        width = input_ids.shape[1] - T + t  # prompt + this chunk's longest completion
        logprobs[rows, :t], entropy[rows, :t] = chunk_logprobs(  # [b, t] each; gradients flow into logprobs
            model, input_ids[rows, :width], attention_mask[rows, :width], t, temperature, with_entropy)
    return (logprobs, entropy) if with_entropy else logprobs


def chunk_logprobs(model, input_ids, attention_mask, T: int, temperature: float, with_entropy: bool):
    """completion_logprobs of rows that end together: (log-probs [b, T], entropy [b, T] or 0)."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: count real tokens
    with autocast(model):
        # Speed: rows that share a prompt (GRPO's groups) run it once, then only their completions.
        # One pass over prompt + completion; always so with gradient checkpointing, and under --fsdp,
        # where every process must run the same passes (each pass gathers weights from all of them).
        if model.is_activation_checkpointing or is_sharded(model) or not prompts_repeat(input_ids[:, :-T]):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           logits_to_keep=T + 1).logits[:, :-1]  # [b, T, V]
        else:  # the last prompt position predicts the first completion token; the completion the rest
            cache, last_prompt_logits = prompt_cache(model, input_ids[:, :-T], attention_mask[:, :-T])  # [b, 1, V]
            completion_logits = model(input_ids=input_ids[:, -T:], attention_mask=attention_mask,
                                      position_ids=position_ids[:, -T:], past_key_values=cache).logits
            logits = torch.cat([last_prompt_logits, completion_logits[:, :-1]], dim=1)  # [b, T, V]
    logits = logits / temperature
    logprobs = gather_logprobs(logits, input_ids[:, -T:])
    if not with_entropy:
        return logprobs, 0.0
    with torch.no_grad():
        log_p = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(dim=-1)  # [b, T]
    return logprobs, entropy


def last_hidden_states(model, input_ids, attention_mask):
    """The transformer's last hidden states [B, L, H], without the head (reward model, critic).
    Position ids count real tokens only, as in completion_logprobs, so left padding changes nothing."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    transformer = (model.get_base_model() if hasattr(model, "get_base_model") else model).base_model  # peft wraps it
    with autocast(model):
        return transformer(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state.float()


# ---------------------------------------------------------------------------------------------
# Held-out evaluation: exact-match accuracy, greedy and sampled
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, tokenizer, dataset, max_new_tokens: int, system_prompt="", samples_per_problem=4, batch_size=512):
    """Held-out exact-match accuracy: of greedy decoding, and of sampling at temperature 1
    (the mean over `samples_per_problem` samples of each problem, to halve the noise of one).

    Greedy is the model's best guess; sampled accuracy is what the policy earns in RL. Under
    torchrun each process evaluates its share of the problems and the counts are summed."""
    model.eval()
    dataset = process_share(dataset)
    correct_greedy = correct_sampled = 0
    rows_per_batch = max(1, batch_size // samples_per_problem)
    with gathered(model):  # FSDP: the full weights, gathered once for the whole evaluation
        for start in range(0, len(dataset), rows_per_batch):
            batch = dataset[start : start + rows_per_batch]
            prompts = [make_prompt(tokenizer, q, system_prompt) for q in batch["question"]]
            *_, completion_ids, _ = generate(model, tokenizer, prompts, max_new_tokens, greedy=True)
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            correct_greedy += sum(is_correct(text, answer) for text, answer in zip(texts, batch["answer"]))
            repeated = [p for p in prompts for _ in range(samples_per_problem)]
            *_, completion_ids, _ = generate(model, tokenizer, repeated, max_new_tokens, temperature=1.0)
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            answers = [a for a in batch["answer"] for _ in range(samples_per_problem)]
            correct_sampled += sum(is_correct(text, answer) for text, answer in zip(texts, answers))
    model.train()
    counts = (len(dataset), correct_greedy, correct_sampled)
    n, correct_greedy, correct_sampled = (int(global_sum(float(x))) for x in counts)
    return {"accuracy_greedy": correct_greedy / n, "accuracy_sampled": correct_sampled / (n * samples_per_problem),
            "n": n}


# ---------------------------------------------------------------------------------------------
# The output folder: one writer at a time, and a new run replaces an old one only when it is whole
# ---------------------------------------------------------------------------------------------
NEXT_RUN = ".next_run"  # where a run that replaces an old one writes until it finishes
RUN_FILE = "run.json"  # the script, model and settings of a run: in each checkpoint, and in the finished folder
# A new run's weights never sit beside an old run's: these go when a run replaces another.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "adapter_config.json",
                "merged", "critic", "checkpoint", "checkpoint.new", "checkpoint.old")
# The settings --resume lets change: how a run is watched and saved, not what it trains.
RESUME_MAY_CHANGE = {"output_dir", "resume", "overwrite_output_dir", "logging_steps", "save_steps", "eval_steps",
                     "num_eval_examples", "eval_samples_per_problem", "per_device_eval_batch_size", "eval_on_start",
                     "gradient_checkpointing", "merge_lora", "trust_remote_code", "log_completions_steps"}
_locks = {}  # folder -> the open descriptor that holds its lock until this process ends


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


def run_record(cfg) -> dict:
    """What a checkpoint must know of its run: the script, the model, the settings, the processes."""
    model = cfg.model if not os.path.exists(cfg.model) else os.path.realpath(cfg.model)
    return {"script": os.path.basename(inspect.getfile(type(cfg))), "model": model,
            "processes": int(os.environ.get("WORLD_SIZE", "1")), "settings": dataclasses.asdict(cfg)}


def prepare_output_dir(cfg, inputs: dict) -> str:
    """Check --output_dir before anything is loaded or written, lock it, and return the folder the
    run writes into: --output_dir itself for a new run into an empty folder and for --resume;
    <output_dir>/.next_run for a run that replaces an old one (--overwrite_output_dir), so the old
    one stays whole until the new one finishes and finish_output_dir moves it in.
    `inputs` maps a flag to the path it reads (--model, --dataset, ...): none may be in the output."""
    out = cfg.output_dir
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
    if cfg.resume and cfg.overwrite_output_dir:
        fail("--resume continues the run in --output_dir and --overwrite_output_dir replaces it: pass one of them")
    if not os.path.isdir(out):
        return out
    _lock(out)
    next_run = os.path.join(out, NEXT_RUN)
    if os.path.isfile(os.path.join(next_run, ".complete")) and _rank0():  # a kill fell inside the last move-in
        _move_in(out)
    if cfg.resume:
        run_dir = next_run if os.path.isdir(next_run) else out
        checkpoint = newest_checkpoint(run_dir)
        if checkpoint is None and run_dir == next_run:
            fail(f"the run started over {out} stopped before its first checkpoint: "
                 "start it again with --overwrite_output_dir true")
        if checkpoint is None:
            fail(f"--resume: no checkpoint in {out} (one is written every --save_steps steps)")
        _check_same_run(cfg, checkpoint)
        return run_dir
    held = sorted(name for name in os.listdir(out) if not name.startswith("."))
    if held and not cfg.overwrite_output_dir:
        fail(f"--output_dir {out} already holds a run ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
             "--resume true continues it, --overwrite_output_dir true replaces it when the new run finishes, "
             "or choose another folder")
    return next_run if held else out


def _check_same_run(cfg, checkpoint: str):
    """--resume continues the run it finds, as that run was set: another script's or model's
    checkpoint, or a changed setting that shapes training, is refused; a changed setting of
    RESUME_MAY_CHANGE (or a new split of the same step batch) applies from the resumed step."""
    try:
        with open(os.path.join(checkpoint, RUN_FILE)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        fail(f"{checkpoint} has no readable {RUN_FILE}, so it cannot say whose run it is: start a new run")
    now = run_record(cfg)
    if saved["script"] != now["script"]:
        fail(f"the checkpoint in {checkpoint} is {saved['script']}'s, not {now['script']}'s: "
             f"resume it with {saved['script']}")
    if saved["model"] != now["model"]:
        fail(f"the checkpoint in {checkpoint} was trained from --model {saved['model']}, not {cfg.model}")
    if saved["processes"] != now["processes"]:
        fail(f"the checkpoint in {checkpoint} was written by {saved['processes']} processes, not {now['processes']}: "
             "resume with the same number")
    old, new = saved["settings"], now["settings"]
    changed = [key for key in new if key != "model" and old.get(key) != new[key]]
    batch = ("per_device_train_batch_size", "gradient_accumulation_steps")
    same_step_batch = math.prod(old.get(k, 1) for k in batch) == math.prod(new.get(k, 1) for k in batch)
    refused = [k for k in changed if k not in RESUME_MAY_CHANGE and not (k in batch and same_step_batch)]
    if refused:
        changes = ", ".join(f"--{k} was {old.get(k)}, now {new[k]}" for k in refused)
        fail(f"--resume continues the run as it was set, and {changes}: resume with the run's values, "
             "or start a new run (--overwrite_output_dir true)")
    for key in changed:
        if _rank0():
            tqdm.write(f"resume: --{key} {new[key]} (was {old.get(key)}) applies from here")


def start_output_dir(run_dir: str):
    """Create the folder this run writes into, lock it, and start an empty metrics.jsonl (rank 0).
    A .next_run left by an earlier run that was stopped is cleared: this run replaces it too."""
    if not is_main_process():
        return
    os.makedirs(run_dir, exist_ok=True)
    output_dir = os.path.dirname(run_dir) if os.path.basename(run_dir) == NEXT_RUN else run_dir
    _lock(output_dir)
    if run_dir != output_dir:
        shutil.rmtree(run_dir)
        os.makedirs(run_dir)
    open(os.path.join(run_dir, "metrics.jsonl"), "w").close()


def finish_output_dir(run_dir: str, cfg):
    """The end of a run: its last checkpoint counts as good, run.json lists what it wrote, and a
    run that replaces an old one moves into --output_dir (rank 0)."""
    if not is_main_process():
        return
    _promote_checkpoint(run_dir)
    files = sorted(name for name in os.listdir(run_dir) if not name.startswith("."))
    write_json(os.path.join(run_dir, RUN_FILE), {**run_record(cfg), "files": sorted({*files, RUN_FILE})})
    if os.path.basename(run_dir) == NEXT_RUN:
        write_json(os.path.join(run_dir, ".complete"), {"files": sorted({*files, RUN_FILE})})  # from here on, a kill is
        _move_in(cfg.output_dir)  # finished by the next run into the folder (prepare_output_dir)
    descriptor = _locks.pop(os.path.realpath(cfg.output_dir), None)
    if descriptor is not None:
        os.close(descriptor)


def _move_in(output_dir: str):
    """Replace the old run in output_dir by the finished one in .next_run. Repeatable: a kill in
    the middle is completed by running it again. Only the old run's own files go (those its
    run.json lists, and any weights), never other files of the folder."""
    next_run = os.path.join(output_dir, NEXT_RUN)
    with open(os.path.join(next_run, ".complete")) as f:
        new = set(json.load(f)["files"])
    if os.path.exists(os.path.join(next_run, RUN_FILE)):  # the old run's files are still there: they go first
        try:
            with open(os.path.join(output_dir, RUN_FILE)) as f:
                old = set(json.load(f)["files"])
        except (OSError, ValueError, KeyError):  # a folder of an older version, or of another program
            old = set()
        for name in sorted((old | set(WEIGHT_FILES)) - new):
            path = os.path.join(output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else (os.remove(path) if os.path.exists(path) else None)
    for name in sorted(new - {RUN_FILE}) + [RUN_FILE]:  # run.json last: while it waits, the old run's files may remain
        source, target = os.path.join(next_run, name), os.path.join(output_dir, name)
        if os.path.exists(source):
            if os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(source, target)
    shutil.rmtree(next_run)


# ---------------------------------------------------------------------------------------------
# Logging: metrics.jsonl (one JSON object per logged step), eval.json, a PNG of the curves
# ---------------------------------------------------------------------------------------------
def log_metrics(output_dir: str, metrics: dict):
    """Append one JSON object to <output_dir>/metrics.jsonl (rank 0 only)."""
    if not is_main_process():
        return
    with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in metrics.items()}) + "\n")


def log_completions(output_dir: str, step: int, prompts: list[str], completions: list[str], **columns):
    """Append what the policy wrote at this step to <output_dir>/completions.jsonl, one JSON object
    per completion: step, prompt, completion and each of `columns` (its rewards, its advantage), as
    TRL's log_completions and nano-aha-moment's episode dumps keep them (rank 0's share only)."""
    if not is_main_process():
        return
    with open(os.path.join(output_dir, "completions.jsonl"), "a") as f:
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            row = {"step": step, "prompt": prompt, "completion": completion, **{k: v[i] for k, v in columns.items()}}
            f.write(json.dumps({k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in row.items()}) + "\n")


def write_json(path: str, obj: dict):
    if not is_main_process():
        return
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def plot_metrics(output_dir: str, panels: dict[str, list[str]], title: str):
    """One subplot per panel (its metric names vs step) from metrics.jsonl -> <output_dir>/<title>.png;
    returns the file's name."""
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
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # a panel whose metrics were never logged has none
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(output_dir, name), dpi=110)
    plt.close(fig)
    return name
