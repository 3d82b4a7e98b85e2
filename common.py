"""The helpers every script shares: config parsing, the embedded tokenizer and tiny model, model
loading (a folder, a hub id, a LoRA adapter, a .gguf file), LoRA and its reference policy, the data
(GSM8K's schema, loaded and checked with the policy in load_policy_and_prompts) and the chat prompt,
the answer checker, the denominator of a token mean, the learning-rate schedule and held-out evaluation.

Each algorithm (SFT, reward model, PPO, GRPO, MIX, DPO and KTO, RFT, on-policy distillation, GRPO with a
calculator, GRPO with Clip-Cov/KL-Cov) lives in its own script, as does best-of-N sampling (best_of_n.py);
the rollout and the log-prob pass in lib/rollout.py. What a training run needs that is not the algorithm
lives apart: lib/harness.py (output folder, checkpoints, logging),
lib/distributed.py (several processes), lib/checks.py (bad input: one sentence).
"""
import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import re
import sys
import types
import warnings

import numpy as np
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import datasets  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
)

from lib import distributed, rollout  # noqa: E402
from lib.checks import NEXT_RUN, check_finite_scores, check_length_drops, check_rows, fail  # noqa: E402, F401
from lib.distributed import global_min, global_sum, log  # noqa: E402, F401  (over processes; rank 0's line)

transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars around our own tqdm bar
transformers.utils.logging.set_verbosity_error()
datasets.disable_progress_bars()


# ---------------------------------------------------------------------------------------------
# Config: a dataclass per script, parsed from the command line; a setting and its check
# ---------------------------------------------------------------------------------------------
def parse_config(config_class, args=None):
    """Build an argparse parser from a dataclass, CleanRL style: each field's help text is the
    string literal written under it, so `python grpo.py --help` documents every field. A script's
    Config extends harness.RunConfig: its own fields are listed first, then the run's; a run
    setting whose default the script changes may add a sentence of its own below the new default."""
    docs = field_help(config_class)
    script_doc = sys.modules["__main__"].__doc__
    parser = argparse.ArgumentParser(description=script_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = next((c for c in config_class.__mro__[1:] if dataclasses.is_dataclass(c) and c.__module__ == "lib.harness"),
                None)  # the run's; those of an algorithm the script extends (grpo.Config, mix.Config) come first
    run_fields = {f.name for f in dataclasses.fields(base)} if base else set()
    for field in dataclasses.fields(config_class):  # harness.run_setting: a run's setting in another Config
        if "run_setting" in field.metadata:
            run_fields.add(field.name)
            docs.setdefault(field.name, [field.metadata["help"]])
    groups = {False: parser.add_argument_group(f"{os.path.basename(inspect.getfile(config_class))}'s settings"),
              True: parser.add_argument_group("the run's settings (lib/harness.py)")}
    for field in dataclasses.fields(config_class):
        kind = field.type
        if isinstance(kind, types.UnionType):  # `int | None`: parse an int, None when left out
            kind = next(t for t in kind.__args__ if t is not type(None))
        kind = _to_bool if kind is bool else kind  # argparse's bool("False") would be True
        groups[field.name in run_fields].add_argument(
            f"--{field.name}",
            type=kind,
            default=field.default,
            help=f"{'; '.join(docs.get(field.name, []))} (default: %(default)s)",
        )
    return config_class(**vars(parser.parse_args(args)))


def field_help(config_class) -> dict:
    """{field: [the help text of its declaration, the sentence each class that extends it adds]}."""
    docs = {}
    for cls in reversed([c for c in config_class.__mro__ if dataclasses.is_dataclass(c)]):
        for name, text in _field_docs(cls).items():
            docs.setdefault(name, []).append(text)
    return docs


def _field_docs(cls) -> dict:
    """{field: the string literal written under it} in this class's own source (empty without one)."""
    try:
        body = _classes_in(inspect.getfile(cls))[cls.__qualname__].body
    except (OSError, TypeError, KeyError):  # no source file (e.g. a class typed into a REPL): no help texts
        return {}
    return {
        node.target.id: nxt.value.value
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


@functools.lru_cache(maxsize=None)
def _classes_in(path: str) -> dict:
    """{name: its ast.ClassDef} for the classes at the top level of a source file.
    Speed: inspect.getsource(cls) would search the file and every loaded module for the class (about 0.1 s a
    class with torch and transformers loaded); the file is parsed once here instead."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _to_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def setting(default, usable, must_be: str):
    """A Config field with its check beside it: `lr: float = setting(1e-3, lambda v: v > 0, "positive")`.
    check_settings stops with "--lr must be positive, not -1.0" when usable(value) is false."""
    return dataclasses.field(default=default, metadata={"usable": usable, "must_be": must_be})


def set_seed(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


TINY_SIZES = {"tiny": {}, "tiny-small": {"hidden_size": 64}}  # sft.py --model: the embedded models it builds


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


# ---------------------------------------------------------------------------------------------
# Loading and saving models: a folder, a hub id, a LoRA adapter, a .gguf file
# ---------------------------------------------------------------------------------------------
def load_model(name_or_path: str, missing_hint: str = "", scalar_head: bool = False, trust_remote_code: bool = False,
               reward_model: bool = False, flag: str = ""):
    """(model, tokenizer) from a local folder or a hub id; a missing folder is one clear sentence.
    Weights are read from safetensors only (no pickle), and a model's own Python code runs only
    with trust_remote_code (--trust_remote_code). Every model it returns holds finite weights
    (check_finite_weights); flag, the setting that named the model (e.g. "--model"), goes in that refusal.

    scalar_head=True loads the transformer with a linear N -> 1 head instead of the LM head
    (AutoModelForSequenceClassification, num_labels=1): the reward model and the critic. From an
    SFT checkpoint the head starts random; from a reward-model checkpoint it is the trained one.
    reward_model=True refuses a folder that holds a policy (its head would start random), and
    a policy is never loaded from a reward model's folder.

    A .gguf file (llama.cpp's format) loads too: see load_gguf."""
    if name_or_path.endswith(".gguf") or os.path.isfile(name_or_path):
        model, tokenizer = load_gguf(name_or_path, scalar_head)
        return check_loaded(model, tokenizer, name_or_path, flag)
    is_local = os.path.exists(name_or_path) or name_or_path.startswith((".", "/", "out", "data"))
    if is_local and os.path.isdir(name_or_path):
        check_whole_run(name_or_path)
    is_adapter = os.path.isfile(os.path.join(name_or_path, "adapter_config.json"))  # a LoRA run's output
    if is_local and not (is_adapter or os.path.isfile(os.path.join(name_or_path, "config.json"))):
        fail(f"no model found at {name_or_path}" + (f": {missing_hint}" if missing_hint else ""))
    saved_head = _saved_head(name_or_path) if is_local else None
    if reward_model and saved_head == "language model":
        fail(f"{name_or_path} is a policy (it has a language-model head), not a reward model: "
             "pass reward_model.py's output")
    folder = os.path.abspath(name_or_path)
    if reward_model and os.path.basename(folder) == "critic" and _written_by(os.path.dirname(folder)) == "ppo.py":
        fail(f"{name_or_path} is ppo.py's critic (a value model: the return expected after each token), not a "
             "reward model (a score of the whole answer): pass reward_model.py's output")
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
        fail(f"could not load a model from {name_or_path!r} ({first_line(error)})")
    if tokenizer.pad_token is None:  # e.g. Llama tokenizers: pad with EOS, the mask tells them apart
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        fail(f"the tokenizer of {name_or_path} has no chat template, and every prompt is a chat: use a chat (instruct) "
             "model, or add a chat_template to its tokenizer_config.json")
    return check_loaded(model, tokenizer, name_or_path, flag)


def check_loaded(model, tokenizer, name: str, flag: str = ""):
    """The checks of every model load_model returns, whatever it was loaded from: (model, tokenizer)."""
    check_vocabulary(model, tokenizer, name)
    check_finite_weights(model, name, flag)
    return model, tokenizer


def check_finite_weights(model, name: str, flag: str = ""):
    """A NaN or infinite weight or buffer (written by a run that diverged, or a damaged file) may make the first
    step's values NaN, and that stop could not say which model gave it: refused here, naming the model's path
    and the setting that named it. Cheap: one sum of each floating-point parameter and buffer (a NaN or inf
    makes its tensor's sum NaN or inf, and a sum costs much less than isfinite on a CPU), and isfinite only on
    a tensor whose sum is not finite (a sum of finite values that overflows: isfinite then counts none)."""
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    suspects = [t for t in tensors if not torch.isfinite(t.sum())]
    bad = sum(int((~torch.isfinite(t)).sum()) for t in suspects)
    if bad:
        total = sum(t.numel() for t in tensors)
        named = f"{name} ({flag})" if flag else name
        fail(f"the model at {named} holds NaN or infinite values in {bad:,} of its {total:,} weights and buffers: a "
             "run that diverged, or a damaged file, wrote it; train it again, or choose another")


def check_vocabulary(model, tokenizer, name: str):
    """A tokenizer with more tokens than the model has embedding rows would give ids the model cannot
    read (an IndexError mid-run): refused. More rows than tokens is usual (padded to a round size)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        fail(f"the tokenizer of {name} has {len(tokenizer)} tokens and its model's embedding {rows} rows: ids "
             f"from {rows} on have no embedding; use the tokenizer the model was trained with")
    return model, tokenizer


def _written_by(folder: str) -> str | None:
    """The script whose run wrote folder (its run.json), or None."""
    try:
        with open(os.path.join(folder, "run.json")) as f:
            return json.load(f).get("script")
    except (OSError, ValueError, AttributeError):
        return None


def same_tokenizer(a, b) -> bool:
    """Do two tokenizers turn the same chat into the same ids? The same vocabulary (token -> id), special
    tokens and chat template: then one model's ids can be fed to the other."""
    return (a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens
            and a.chat_template == b.chat_template)


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
        import gguf  # transformers reads the file with it
    except ImportError:
        fail(f"reading {path} needs the gguf package: pip install gguf")
    # Speed: transformers asks gguf for its table of tensor names once per submodule of the model (about 400
    # times for SmolLM2, half of a 28 s load on one core); the table depends on the architecture and the
    # number of layers alone, so it is built once per pair. And it opens the file with gguf.GGUFReader twice a
    # load (for the config, then for the weights), and a script that loads its policy and reference from one
    # file loads it twice: each opening parses every field of the file's header value by value, the tokenizer's
    # 49152 tokens and 48900 merges among them (about 4 s on one core), so the last file's reader is kept while
    # the file is unchanged. The weights loaded are the same (tests/test_gguf.py compares them with transformers'
    # load without either cache).
    if not hasattr(gguf.get_tensor_name_map, "cache_info"):
        gguf.get_tensor_name_map = functools.lru_cache(gguf.get_tensor_name_map)
        gguf.GGUFReader = last_file_kept(gguf.GGUFReader)
    path = os.path.abspath(path)
    folder, file = os.path.split(path)
    auto_class = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
    head = dict(num_labels=1) if scalar_head else {}
    try:  # dequantize=True: plain weights, and no GGUF quantizer left on the model (with one, save_pretrained refuses)
        model = auto_class.from_pretrained(folder, gguf_file=file, **head, dtype=torch.float32,
                                           quantization_config=transformers.GgufConfig(dequantize=True))
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=file, padding_side="left")
    except Exception as error:  # e.g. an architecture transformers has no GGUF mapping for
        fail(f"transformers could not load {path} ({first_line(error)})")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        fail(f"{path} stores no chat template, and every prompt is a chat: use a chat (instruct) model")
    model.config.pad_token_id = tokenizer.pad_token_id  # a scalar head's forward finds each row's last token with it
    model.name_or_path = model.config.name_or_path = path  # peft writes this into adapter_config.json as the base
    return model, tokenizer


def last_file_kept(open_file):
    """open_file(path, mode) (gguf.GGUFReader), its result for the last file kept and returned again while that
    file's modification time is unchanged; the uncached open_file is its __wrapped__."""
    @functools.lru_cache(maxsize=1)
    def opened(path: str, mode: str, modified_ns: int):
        return open_file(path, mode)

    def open_kept(path, mode="r"):
        return opened(os.path.abspath(path), mode, os.stat(path).st_mtime_ns)

    open_kept.__wrapped__ = open_file
    return open_kept


def first_line(error: Exception) -> str:
    """The first line of an exception's message (its class name if it has none), for one-sentence errors."""
    return (str(error).splitlines() or [type(error).__name__])[0]


def check_whole_run(folder: str):
    """Refuse to read a run folder (as --model, --reward_model, ...) while a finished run that replaces
    the old one is half moved into it: its files would be a mix of two runs. The next run of a script
    into the folder finishes the move (harness.prepare_output_dir)."""
    if os.path.isfile(os.path.join(folder, NEXT_RUN, ".complete")):
        fail(f"{folder} is half replaced: a finished run was being moved into it when it stopped, so it holds "
             "files of two runs; run a script into it again (the same command with --resume true) to finish "
             "the move, then read it")


def check_fits_context(model, num_tokens: int, what: str):
    """Refuse sequences longer than the model's context (its position embeddings), in one sentence,
    rather than let them fail deep inside a forward pass."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and num_tokens > context:
        fail(f"{what} needs {num_tokens} tokens, more than the model's context of {context}: "
             "shorten the prompts or --max_completion_length")


# ---------------------------------------------------------------------------------------------
# LoRA (peft) and the reference policy
# ---------------------------------------------------------------------------------------------
def add_lora(model, cfg, scalar_head: bool = False):
    """Freeze the model and train low-rank adapters instead (LoRA, Hu et al. 2021): each target
    linear layer W becomes W x + (alpha / r) * B A x, with A [r, d_in] and B [d_out, r], B = 0 at
    the start, so training begins from the unchanged model. Only A and B (and, for a reward model
    or critic, its scalar head: peft's SEQ_CLS task trains it too) get gradients and AdamW states.
    A d_in x d_out layer gets r (d_in + d_out) adapter parameters, a share r (1/d_in + 1/d_out) of
    it: 2r / d_model for a square projection (note 002's rule of thumb), less for the MLP's wide
    ones, more for the narrow k/v projections of grouped-query attention; embeddings get none.
    So Qwen2.5-3B at r = 16 trains 29.9M parameters (docs/scaling.md's memory table), not 2r / d_model x 3.09B
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
    with warnings.catch_warnings():  # peft reads transformers' old name for it, which warns from 5.24 on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
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


# ---------------------------------------------------------------------------------------------
# Data: GSM8K's schema (question, answer = reasoning + "#### <number>"), every row checked
# ---------------------------------------------------------------------------------------------
def load_splits(dataset: str, columns=("question", "answer"), num_eval_examples: int = 0, per_step: int = 0):
    """(train, test) of a dataset (load_split), the test split cut to its first num_eval_examples rows
    (0: all of them); a train split with fewer rows than a step samples (per_step) is refused."""
    train, test = load_split(dataset, "train", columns), load_split(dataset, "test", columns)
    if len(train) < per_step:
        fail(f"{dataset} has {len(train)} training prompts, fewer than the {per_step} a step samples")
    if num_eval_examples:
        test = test.select(range(min(num_eval_examples, len(test))))
    return train, test


def load_policy_and_prompts(cfg, per_step: int, columns=("question", "answer")):
    """What an RL script starts from, loaded and checked in one place: the prompts' train and test
    splits (load_splits: --dataset, cut to --num_eval_examples), the policy --model and its tokenizer
    (load_model), and the longest prompt in tokens, which must fit the model's context with
    --max_completion_length (check_prompts_fit). Returns (train, test, model, tokenizer, longest)."""
    train, test = load_splits(cfg.dataset, columns, cfg.num_eval_examples, per_step)
    model, tokenizer = load_model(cfg.model, missing_hint="run `python sft.py` first",
                                  trust_remote_code=cfg.trust_remote_code, flag="--model")
    questions = list(train[columns[0]]) + list(test[columns[0]])
    longest = check_prompts_fit(model, tokenizer, questions, cfg.system_prompt, cfg.max_completion_length, cfg.dataset)
    return train, test, model, tokenizer, longest


def load_split(dataset: str, split: str, columns=("question", "answer"), config_name: str = "main"):
    """One split as a datasets.Dataset: `<dataset>/<split>.jsonl` if `dataset` is a local folder,
    else the hub dataset (openai/gsm8k has config 'main' and splits 'train' / 'test'). Every row
    is checked for the columns asked for (check_rows)."""
    if os.path.isfile(dataset):  # e.g. --dataset data/x/train.jsonl
        fail(f"{dataset} is a file, and a dataset is a folder that holds train.jsonl and test.jsonl: pass "
             f"{os.path.dirname(dataset) or '.'} (or a hub dataset id)")
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
        fail(f"could not load dataset {dataset!r} split {split!r} ({first_line(error)})")
    keep = check_rows(data.to_list(), f"{dataset} {split}", columns, [f"row {i}" for i in range(1, len(data) + 1)])
    return data if len(keep) == len(data) else data.select(keep)


def _one_value_per_key(pairs: list) -> dict:
    """json.loads keeps the last of a key given twice; a data row that does so is refused instead."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise KeyError(key)
        row[key] = value
    return row


def load_jsonl(path: str, columns=()):
    """A local .jsonl file (one JSON object per line, UTF-8, with or without the byte-order mark some
    editors write) as a datasets.Dataset, its rows checked (check_rows). A missing or empty file, a
    line that is not UTF-8, not a JSON object, or that gives a key twice is one sentence naming the
    file and the line."""
    if not os.path.isfile(path):
        fail(f"no data file {path}")
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # utf-8-sig: without its BOM
            except UnicodeDecodeError:
                fail(f"{path} line {number} is not UTF-8 text: save the file as UTF-8")
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=_one_value_per_key)
            except json.JSONDecodeError:
                fail(f"{path} line {number} is not valid JSON")
            except KeyError as twice:
                fail(f"{path} line {number} gives the key {twice.args[0]!r} twice: keep one")
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


# ---------------------------------------------------------------------------------------------
# The chat prompt and the answer checker
# ---------------------------------------------------------------------------------------------
def make_prompt(tokenizer, question: str, system_prompt: str = "") -> str:
    """The chat-formatted prompt, ending where the assistant's answer starts."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, no special tokens added (a chat prompt already holds its own). Speed: one call for
    the list, not one per text: the same ids (tests/test_scripts.py), the tokenizer's batch encoder."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # (it refuses an empty list)


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


def check_system_prompt(model, tokenizer, system_prompt: str):
    """Refuse a --system_prompt that alone fills the model's context, before thousands of prompts
    are made with it (a 100k-character one would exhaust memory before any other check speaks)."""
    if system_prompt:
        tokens = len(tokenizer(make_prompt(tokenizer, "", system_prompt), add_special_tokens=False)["input_ids"])
        check_fits_context(model, tokens + 1, "--system_prompt")


def check_prompts_fit(model, tokenizer, questions, system_prompt: str, max_completion_length: int, dataset: str) -> int:
    """The tokens of the longest chat prompt made from `questions`, after checking that it fits the
    model's context with max_completion_length new tokens (and the system prompt alone first)."""
    check_system_prompt(model, tokenizer, system_prompt)
    prompts = [make_prompt(tokenizer, q, system_prompt) for q in questions]
    longest = max(len(ids) for ids in token_ids(tokenizer, prompts))
    check_fits_context(model, longest + max_completion_length,
                       f"the longest prompt of {dataset} plus --max_completion_length")
    return longest


# ---------------------------------------------------------------------------------------------
# Training and evaluation: the token mean, the schedule, held-out accuracy
# ---------------------------------------------------------------------------------------------
def mean_denominator(mask: torch.Tensor) -> torch.Tensor:
    """The denominator of a mean over the 1s of mask (tokens, or dpo.py's counted pairs): mask.sum()
    in one process; with N processes, the count of the whole batch divided by N. Each process
    divides its own sum by it, so the mean of the N losses, and of their gradients
    (distributed.average_gradients), is the sum over the whole global batch divided by its count:
    the loss of one process on all of it."""
    count = global_sum(mask.sum().float())
    return (count / distributed.world_size()).clamp(min=1)


def warmup_cosine_schedule(optimizer, warmup_steps: int, total_steps: int, min_lr_rate: float):
    """lr(t) = peak * (t + 1) / warmup for t < warmup (t counts from 0, so the first step already has a
    small learning rate, not 0), then a cosine from peak down to min_lr_rate * peak
    (transformers' cosine_with_min_lr schedule, written out, except that its warmup starts at lr 0:
    peak * t / warmup)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_rate + (1 - min_lr_rate) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def evaluate(model, tokenizer, dataset, max_new_tokens: int, system_prompt="", samples_per_problem=4, batch_size=512,
             generate=None):
    """Held-out exact-match accuracy: of greedy decoding, and of sampling at temperature 1
    (the mean over `samples_per_problem` samples of each problem, to halve the noise of one).

    Greedy is the model's best guess; sampled accuracy is what the policy earns in RL. Under
    torchrun each process evaluates its share of the problems and the counts are summed.
    generate(prompts, greedy) -> completion ids [n, T]: rollout.generate's by default (agent.py
    passes its rollout with the calculator)."""
    if generate is None:
        def generate(prompts, greedy):
            return rollout.generate(model, tokenizer, prompts, max_new_tokens, greedy=greedy)[2]
    model.eval()
    dataset = distributed.process_share(dataset)
    correct_greedy = correct_sampled = 0
    rows_per_batch = max(1, batch_size // samples_per_problem)
    for start in range(0, len(dataset), rows_per_batch):
        batch = dataset[start : start + rows_per_batch]
        prompts = [make_prompt(tokenizer, q, system_prompt) for q in batch["question"]]
        texts = tokenizer.batch_decode(generate(prompts, greedy=True), skip_special_tokens=True)
        correct_greedy += sum(is_correct(text, answer) for text, answer in zip(texts, batch["answer"]))
        repeated = [p for p in prompts for _ in range(samples_per_problem)]
        texts = tokenizer.batch_decode(generate(repeated, greedy=False), skip_special_tokens=True)  # temperature 1
        answers = [a for a in batch["answer"] for _ in range(samples_per_problem)]
        correct_sampled += sum(is_correct(text, answer) for text, answer in zip(texts, answers))
    model.train()
    counts = (len(dataset), correct_greedy, correct_sampled)
    n, correct_greedy, correct_sampled = (int(global_sum(float(x))) for x in counts)
    return {"accuracy_greedy": correct_greedy / n, "accuracy_sampled": correct_sampled / (n * samples_per_problem),
            "n": n}
