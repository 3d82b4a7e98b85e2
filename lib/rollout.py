"""The rollout and the log-prob pass: how the policy writes completions, and the log-probability it
gives each of their tokens. Every script calls these two; read them before any algorithm.

    prompt_ids, prompt_mask, completion_ids, completion_mask = generate(model, tokenizer, prompts, 64)
    logprobs = completion_logprobs(model, input_ids, attention_mask, T)          # [N, T]
    ref_logprobs = inference(completion_logprobs, ref_model, input_ids, attention_mask, T,
                             micro_batches=micro_batches)     # no gradient, a micro-batch at a time
    *_, sampler_logprobs = generate(..., return_logprobs=True)     # [N, T]: the sampler's own, for
    sampler_mismatch(logprobs, sampler_logprobs, completion_mask)  # the gap to the trainer's (and TIS)

A batch is laid out as [left-padded prompt | right-padded completion]: every completion starts at
column P, and position ids count real tokens only, so padding changes no value. Shapes: N rows (a
prompt and one completion each: B*G in GRPO, B in PPO), P prompt columns, T completion columns, V
the vocabulary.

Each function first does the plain thing, then has speed-ups that compute the same, each a named
step with a switch that turns it off (tests/test_rollout.py checks that each changes nothing):
  generate             share_prompts   each distinct prompt runs once (GRPO's G rows share it)
                       drop_finished   a row that wrote EOS leaves the batch and the KV cache
                       grow_in_place   the KV cache has room for every new token (no copy of it per token)
                       static_cache    a KV cache of fixed size, each token one replay of a captured CUDA
                                       graph (on by default on a GPU only: decode_static)
  completion_logprobs  length_chunks   rows sorted by length, each chunk cut to its longest completion
                       share_prompts   as in generate: each prompt once for all the chunks, then only the completions
  gather_logprobs      fused           LabelLogprob: its gradient written into one [N, T, V] buffer
With share_prompts=False, drop_finished=False, grow_in_place=False, static_cache=False, length_chunks=1 and
fused=False they are the textbook loop and the one forward pass (tiny-grpo's).

The time spent in each (time/generation, time/forward of metrics.jsonl) is counted by @timed.
"""
import collections
import contextlib
import copy
import functools
import inspect
import time
import types
import weakref

import torch
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.rnn import pad_sequence
from transformers.cache_utils import DynamicLayer

from lib import distributed

# The KV cache goes into forward() and comes out of it as `cache` from transformers 5.24 on, which
# deprecates the older name `past_key_values` (removed in 5.40); 5.0 to 5.23 know only that one.
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
seconds = collections.Counter()  # seconds spent per part ("generation", "forward") since the harness reset it


def timed(part: str):
    """Add the time spent in the decorated function to seconds[part] (the harness logs time/<part>)."""
    def decorate(function):
        @functools.wraps(function)
        def timed_function(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
        return timed_function
    return decorate


# ---------------------------------------------------------------------------------------------
# Rollout: the policy writes a completion for each prompt
# ---------------------------------------------------------------------------------------------
@timed("generation")
@torch.no_grad()  # not inference_mode: the ids it returns go into forward passes that need grads
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0, greedy=False,
             share_prompts=True, drop_finished=True, grow_in_place=True, static_cache=None, return_logprobs=False):
    """Rollout: the policy writes a completion for each prompt, one token at a time (KV cache).

    At each step: logits of the last position -> sample a token from softmax(logits / temperature)
    (or take the argmax when greedy) -> feed it back. Prompts are left padded, so all completions
    start at the same column P. A row that emits EOS is done: it is padded after it, and its mask
    keeps the first EOS (the model chose to stop: that is an action too) and drops what follows.
    Under --fsdp the full weights are gathered once for the whole loop (distributed.gathered).
    static_cache: None (the default) means on where the model is on a CUDA GPU (static_cache_refusal says
    where it fits), off on the CPU, where the loop below runs.

    Returns prompt_ids [N, P], prompt_mask [N, P], completion_ids [N, T], completion_mask [N, T],
    T the longest completion; with return_logprobs also sampler_logprobs [N, T], each sampled token's
    log-prob under the distribution it was drawn from, as the sampler computed it (0 after EOS): the
    trainer's pass computes the same numbers its own way, and sampler_mismatch says how far apart they are.
    """
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    # [N, max_new_tokens]
    completion_ids = torch.full((len(prompts), max_new_tokens), tokenizer.pad_token_id, device=device)
    sampler_logprobs = torch.zeros(len(prompts), max_new_tokens, device=device) if return_logprobs else None
    was_training = model.training
    model.eval()  # no dropout while sampling; and gradient checkpointing would switch the KV cache off
    with distributed.gathered(model), autocast(model):
        if not share_prompts:  # the prompts' keys and values (the KV cache), and the logits of their last position
            out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                        use_cache=True, logits_to_keep=1)
            cache, logits = getattr(out, CACHE), out.logits  # logits [N, 1, V]
        else:  # Speed: the same, each distinct prompt run once, its rows sharing its keys and values
            cache, logits = rows_of(distinct_prompts(model, prompt_ids, prompt_mask))  # logits [N, 1, V]
        if static_cache is None:
            static_cache = static_cache_fits(model, cache)
        if static_cache:  # Speed: the loop below on a KV cache of fixed size, each token one replay of a CUDA graph
            t = decode_static(model, tokenizer, cache, logits, prompt_mask, completion_ids, temperature, greedy,
                              sampler_logprobs)
        else:
            if grow_in_place:  # Speed: each new token's keys and values are written into room kept for them
                make_room(cache, max_new_tokens)
            rows = torch.arange(len(prompts), device=device)  # the rows in the batch: [b]
            done = torch.zeros(len(prompts), dtype=torch.bool, device=device)  # rows that have written EOS: [N]
            attention_mask, positions = prompt_mask, prompt_mask.sum(dim=1) - 1  # [b, P + t], [b]: the last position
            for t in range(max_new_tokens):
                next_tokens = next_token(logits[:, -1].float(), temperature, greedy)  # [b]
                completion_ids[rows, t] = torch.where(done[rows], tokenizer.pad_token_id, next_tokens)
                if return_logprobs:
                    sampler_logprobs[rows, t] = logprobs_of_tokens(logits[:, -1].float(), next_tokens, temperature)
                done[rows] |= next_tokens == tokenizer.eos_token_id
                if t == max_new_tokens - 1 or done.all():
                    break
                if drop_finished and done[rows].any():  # Speed: rows that wrote EOS leave the batch, and the cache
                    writing = ~done[rows]
                    rows, next_tokens, positions = rows[writing], next_tokens[writing], positions[writing]
                    attention_mask = attention_mask[writing]
                    cache.batch_select_indices(writing.nonzero().squeeze(1))
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
                positions = positions + 1
                logits = model(input_ids=next_tokens[:, None], attention_mask=attention_mask,
                               position_ids=positions[:, None], **{CACHE: cache}, use_cache=True).logits  # [b, 1, V]
    model.train(was_training)
    completion_ids = completion_ids[:, : t + 1]  # [N, T]: up to the longest completion
    completion_mask = mask_after_eos(completion_ids, tokenizer.eos_token_id)  # [N, T]
    if return_logprobs:
        return prompt_ids, prompt_mask, completion_ids, completion_mask, sampler_logprobs[:, : t + 1] * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def next_token(logits: torch.Tensor, temperature: float, greedy: bool) -> torch.Tensor:
    """Each row's next token from the logits of its last position: [b, V] -> [b]. The argmax when
    greedy, else a sample of the raw policy softmax(logits / temperature): no top-k / top-p, so
    these are the log-probs we train on."""
    if greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1).squeeze(1)


def logprobs_of_tokens(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[token] for each row: logits [b, V], tokens [b] -> [b]. The
    sampler's log-prob of the token it wrote (next_token's distribution; greedy rows score their argmax)."""
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def mask_after_eos(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including each row's first EOS, 0 after it: [N, T] -> [N, T].

    e.g. tokens [a, b, EOS, pad, pad] -> [1, 1, 1, 0, 0]; a row with no EOS is all ones."""
    is_eos = (completion_ids == eos_token_id).long()  # [N, T]
    eos_before = is_eos.cumsum(dim=1) - is_eos  # number of EOS strictly before each position
    return (eos_before == 0).long()


# ---------------------------------------------------------------------------------------------
# Log-probs: one forward pass scores every completion token
# ---------------------------------------------------------------------------------------------
@timed("forward")
def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                        length_chunks: int = 2, share_prompts: bool = True) -> torch.Tensor:
    """Per-token log-probs [N, T] of the last T tokens of input_ids [N, P+T] (the completion).

    The logit at position t predicts token t+1, so the T completion tokens are predicted by the
    positions P-1 .. P+T-2: we ask the model for the last T+1 positions only (logits_to_keep) and
    drop the final one. Logits are divided by the sampling temperature, so these are the
    log-probs of the distribution the completions were sampled from. Positions after a row's
    last real token (attention_mask 0) hold junk or 0: every loss masks them. The pass itself is
    log_probs_pass's: read its plain path first."""
    return log_probs_pass(model, input_ids, attention_mask, num_completion_tokens, temperature, False, length_chunks,
                          share_prompts)[0]


@timed("forward")
def completion_logprobs_and_entropy(model, input_ids, attention_mask, num_completion_tokens: int,
                                    temperature: float = 1.0, entropy_grad: bool = False
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_logprobs [N, T], and from the same logits the policy's entropy at each position
    [N, T], -sum_v p(v) log p(v): a falling entropy means the policy grows more certain. No gradient
    through the entropy unless entropy_grad (an entropy bonus in the loss)."""
    return log_probs_pass(model, input_ids, attention_mask, num_completion_tokens, temperature, True,
                          entropy_grad=entropy_grad)


def log_probs_pass(model, input_ids, attention_mask, T: int, temperature: float, with_entropy: bool,
                   length_chunks: int = 2, share_prompts: bool = True, entropy_grad: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [N, T], entropy [N, T] or None). Plainly one forward pass over prompt + completion
    (forward_logprobs); two speed-ups give the same numbers (tests/test_rollout.py):
      share_prompts   rows that share a prompt (GRPO's groups) run it once, then only their completions
                      (not with gradient checkpointing, nor under --fsdp, where every process must run
                      the same passes: each gathers weights from all)
      length_chunks   rows sorted by completion length, in chunks cut to their own longest completion,
                      so no forward or backward work is spent on the padding after the shorter ones"""
    shared = None
    if share_prompts and not checkpointing(model) and not isinstance(model, FSDPModule):  # FSDPModule: --fsdp
        shared = distinct_prompts_if_shared(model, input_ids[:, :-T], attention_mask[:, :-T])
    if length_chunks == 1 and shared is None:  # the plain path
        return forward_logprobs(model, input_ids, attention_mask, T, temperature, with_entropy, None, entropy_grad)
    if length_chunks == 1:
        return forward_logprobs(model, input_ids, attention_mask, T, temperature, with_entropy, rows_of(shared),
                                entropy_grad)
    # Speed: length_chunks (and share_prompts, when shared holds the prompts' pass)
    positions = torch.arange(1, T + 1, device=input_ids.device)
    lengths = (attention_mask[:, -T:] * positions).amax(dim=1)  # [N]: where each row's completion ends
    logprobs = torch.zeros(len(input_ids), T, device=input_ids.device)  # [N, T]
    entropy = torch.zeros(len(input_ids), T, device=input_ids.device) if with_entropy else None  # [N, T]
    for rows in lengths.argsort().chunk(length_chunks):  # rows [b] of one chunk
        t = max(int(lengths[rows].max()), 1)
        width = input_ids.shape[1] - T + t  # prompt + this chunk's longest completion
        logprobs[rows, :t], chunk_entropy = forward_logprobs(  # [b, t] each; gradients flow into logprobs
            model, input_ids[rows, :width], attention_mask[rows, :width], t, temperature, with_entropy,
            rows_of(shared, rows) if shared else None, entropy_grad)
        if with_entropy:
            entropy[rows, :t] = chunk_entropy
    return logprobs, entropy


@torch.no_grad()
def inference(fn, model, input_ids, attention_mask, *args, micro_batches: list) -> torch.Tensor:
    """An inference pass (no gradient): fn(model, input_ids[rows], attention_mask[rows], *args) for
    each micro-batch of rows (micro_batches: a list of row indices, so only one micro-batch's
    activations are in memory at a time), the results put back in row order [N, ...]. The RL
    scripts' passes of pi_ref, pi_old, the critic and the reward model:
        ref_logprobs = rollout.inference(rollout.completion_logprobs, ref_model, input_ids, attention_mask,
                                         T, temperature, micro_batches=micro_batches)   # [N, T]"""
    results = torch.cat([fn(model, input_ids[rows], attention_mask[rows], *args) for rows in micro_batches])
    return results[torch.cat(micro_batches).argsort()]


def forward_logprobs(model, input_ids, attention_mask, T: int, temperature: float, with_entropy: bool = False,
                     prompt=None, entropy_grad: bool = False):
    """completion_logprobs in one forward pass: (log-probs [n, T], entropy [n, T] or None; the entropy with its
    gradient if entropy_grad). prompt: None, or the rows' prompts already run (rows_of: their KV cache, and the
    logits of their last position)."""
    labels = input_ids[:, -T:]  # [n, T]: the completion tokens
    with autocast(model):
        if prompt is None:
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids(attention_mask), logits_to_keep=T + 1).logits[:, :-1]  # [n, T, V]
            pieces = [(logits, labels)]  # (logits [n, t, V], the labels they predict [n, t]), the t adding up to T
        else:  # the last prompt position predicts the first completion token; the completion the rest
            cache, last_prompt_logits = prompt  # [n, 1, V]
            completion_logits = model(input_ids=labels, attention_mask=attention_mask,
                                      position_ids=position_ids(attention_mask)[:, -T:], **{CACHE: cache}).logits
            # Speed: the two pieces are scored apart, not joined into one [n, T, V] copy; the last
            # completion position predicts nothing we score
            pieces = [(last_prompt_logits, labels[:, :1]), (completion_logits[:, :-1], labels[:, 1:])]
    if temperature != 1.0:  # Speed: no [n, T, V] copy (and none in the backward) at the default temperature 1
        pieces = [(logits / temperature, piece_labels) for logits, piece_labels in pieces]
    logprobs = torch.cat([gather_logprobs(logits, piece_labels) for logits, piece_labels in pieces], dim=1)
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # Speed: no graph kept unless needed
        entropy = torch.cat([entropy_of(logits) for logits, _ in pieces], dim=1)  # [n, T]
    return logprobs, entropy


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """The policy's entropy at each position, -sum_v p(v) log p(v): logits [n, T, V] -> [n, T]."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """log softmax(logits)[label] = logit[label] - logsumexp(logits), in float32: logits [N, T, V], labels [N, T]
    -> [N, T]."""
    if not fused:  # the plain expression
        return logits.float().gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits.float(), dim=-1)
    # Speed: LabelLogprob, a chunk of rows at a time, its backward written by hand (docs/speed.md#the-speed-ups)
    return LabelLogprob.apply(logits, labels)


class LabelLogprob(torch.autograd.Function):
    """logit[label] - logsumexp(logits) over the last dimension, and its gradient

        d logprob / d logits = onehot(label) - softmax(logits)

    written into one [N, T, V] buffer. Speed: autograd's chain for the plain expression makes five
    [N, T, V] tensors in the backward (logits - lse, its exp, that times the gradient, the gather's
    zeros, their sum); and with bf16 logits (autocast on a GPU) the plain .float() is a whole float32
    copy, where here a chunk of rows is converted at a time (at most CHUNK elements)."""
    CHUNK = 2**26  # float32 elements per chunk: 256 MB

    @staticmethod
    def rows_per_chunk(logits) -> int:
        return max(1, LabelLogprob.CHUNK // max(1, logits.shape[1:].numel()))

    @staticmethod
    def forward(ctx, logits, labels):  # logits [N, T, V], labels [N, T] -> logprobs [N, T]
        chunks = logits.split(LabelLogprob.rows_per_chunk(logits))
        lse = torch.cat([torch.logsumexp(part.float(), dim=-1) for part in chunks])  # [N, T]
        ctx.save_for_backward(logits, labels, lse)
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float() - lse

    @staticmethod
    def backward(ctx, grad):  # grad [N, T]: d loss / d logprob
        logits, labels, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)  # [N, T, V]
        n = LabelLogprob.rows_per_chunk(logits)
        for start in range(0, len(logits), n):
            rows, g = slice(start, start + n), grad[start:start + n].unsqueeze(-1)  # g [n, T, 1]
            part = (logits[rows].float() - lse[rows].unsqueeze(-1)).exp_().mul_(-g)  # -g * softmax  [n, T, V]
            grad_logits[rows] = part.scatter_add_(-1, labels[rows].unsqueeze(-1), g)  # + g at the label
        return grad_logits, None


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position among its row's real tokens [N, L] (left padding is not counted)."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


@timed("forward")
def last_hidden_states(model, input_ids, attention_mask):
    """The transformer's last hidden states [N, L, H], without the head (reward model, critic).
    Position ids count real tokens only, as in completion_logprobs, so left padding changes nothing."""
    transformer = (model.get_base_model() if hasattr(model, "get_base_model") else model).base_model  # peft wraps it
    with autocast(model):
        return transformer(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids(attention_mask)).last_hidden_state.float()


# ---------------------------------------------------------------------------------------------
# The sampler is not the trainer: their log-probs, how far apart, and the correction (TIS)
# ---------------------------------------------------------------------------------------------
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's names


@torch.no_grad()
def sampler_mismatch(trainer_logprobs, sampler_logprobs, mask, sampler_weights=None) -> dict:
    """How far the trainer's log-probs of the sampled tokens (trainer_logprobs [N, T]: its pass over the
    policy that sampled, pi_old) are from the sampler's own (sampler_logprobs [N, T], generate's), over
    the real tokens (mask [N, T]). With d_t = log pi_train(y_t) - log pi_sampler(y_t):

        sampling/sampling_logp_difference/mean   mean |d_t|     (TRL's names)
        sampling/sampling_logp_difference/max    max |d_t|      (under torchrun: each process's, averaged)
        sampling/kl                              mean of exp(d_t) - d_t - 1: the k3 estimate of
                                                 KL(pi_sampler || pi_train) (the tokens are the sampler's draws)
        sampling/importance_sampling_ratio/min, /mean, /max    the weights w the loss used, where it used
                                                 them (sampler_weights [N, T] or [N, 1]; TRL's names; under
                                                 torchrun /min and /max are each process's, averaged, where
                                                 TRL takes the min and the max over processes)

    0 where there is no real token (every process logs the same keys). On the CPU both are float32
    passes of the same weights, apart only by summation order; on a GPU the static cache samples from a
    bf16 copy, and the gap is what TIS corrects: docs/scaling.md#the-sampler-is-not-the-trainer"""
    mask = mask.bool()
    d = torch.where(mask, trainer_logprobs - sampler_logprobs, 0.0)[mask].double()  # [tokens]
    d = d if d.numel() else torch.zeros(1, dtype=torch.float64)
    gap = {"sampling/sampling_logp_difference/mean": d.abs().mean().item(),
           "sampling/sampling_logp_difference/max": d.abs().max().item(),
           "sampling/kl": (torch.expm1(d) - d).mean().item()}  # expm1: d ~ 1e-7 would cancel to 0 in exp(d) - 1
    if sampler_weights is not None:
        w = sampler_weights[mask] if sampler_weights.shape == mask.shape else sampler_weights.flatten()  # [N, 1]: rows
        w = w if w.numel() else torch.zeros(1)
        gap.update({f"sampling/importance_sampling_ratio/{name}": float(f(w)) for name, f in
                    (("min", torch.min), ("mean", torch.mean), ("max", torch.max))})
    return gap


@torch.no_grad()
def sampler_importance_weights(trainer_logprobs, sampler_logprobs, mask, mode: str = "token_truncate",
                               clip_max: float = 3.0, clip_min: float | None = None) -> torch.Tensor:
    """The weight that corrects the policy gradient for tokens drawn from the sampler, not from the
    policy the trainer computes (truncated importance sampling: Yao et al. 2025, "On the Rollout-Training
    Mismatch in Modern RL Systems", https://fengyao.notion.site/off-policy-rl; TRL's
    vllm_importance_sampling_correction, grpo_trainer.py's _generate_and_score_completions):

        rho_t = pi_train(y_t) / pi_sampler(y_t) = exp(trainer_logprobs - sampler_logprobs)   (detached: a weight)
        token_truncate     w_t = min(rho_t, C)               TIS (with clip_min c: clamp(rho_t, c, C))
        token_mask         w_t = rho_t where c <= rho_t <= C, else 0
        sequence_truncate  w_i = clamp(prod_t rho_t, c, C), the same for every token of completion i
        sequence_mask      w_i = prod_t rho_t where c <= it <= C, else 0

    C = clip_max, c = clip_min (None: no lower bound). trainer_logprobs is pi_old as the trainer computes
    it. The sequence modes take the product of the token ratios (the importance weight of the whole
    completion), not GSPO's geometric mean (grpo.py's --importance_sampling_level sequence). The scripts
    multiply each token's policy-gradient term by w: GRPO's and MIX's clipped term, not their KL penalty
    (as TRL's GRPO); PPO's clipped term, whose advantage holds its KL reward. The cap bounds the variance
    the weight adds; where the sampler is exact (rho = 1) every mode gives 1 (c <= 1 <= C: the settings'
    checks). trainer_logprobs, sampler_logprobs, mask [N, T] -> [N, T], or [N, 1] for the sequence modes
    (padding counts as rho 1; its loss is masked anyway)."""
    log_rho = torch.where(mask.bool(), trainer_logprobs - sampler_logprobs, 0.0)  # [N, T]
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(dim=1, keepdim=True)  # [N, 1]: log of the product of the token ratios
    rho = torch.exp(log_rho)
    low = 0.0 if clip_min is None else clip_min
    if mode.endswith("truncate"):
        return rho.clamp(min=low, max=clip_max)
    if mode.endswith("mask"):
        return torch.where((rho >= low) & (rho <= clip_max), rho, 0.0)
    raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}: one of {', '.join(IS_MODES)}")


# ---------------------------------------------------------------------------------------------
# The prompt cache (the speed-up share_prompts), the batch layout, precision
# ---------------------------------------------------------------------------------------------
def distinct_prompts(model, prompt_ids, prompt_mask):
    """Run each distinct prompt once (share_prompts: docs/speed.md#the-speed-ups); rows_of then hands every row its
    prompt's keys and values. prompt_ids, prompt_mask [N, P]. Returns (the KV cache of the U distinct prompts; the
    logits of their last position [U, 1, V]; row_to_prompt [N], each row's entry)."""
    distinct, row_to_prompt = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [U, P], [N]
    first_row = torch.zeros(len(distinct), dtype=torch.long, device=prompt_ids.device)
    first_row.scatter_(0, row_to_prompt, torch.arange(len(prompt_ids), device=prompt_ids.device))  # a row of each
    mask = prompt_mask[first_row]  # [U, P]
    out = model(input_ids=prompt_ids[first_row], attention_mask=mask, position_ids=position_ids(mask),
                use_cache=True, logits_to_keep=1)
    return getattr(out, CACHE), out.logits, row_to_prompt


def rows_of(prompts, rows=slice(None)):
    """From distinct_prompts' output, the given rows' (default: all) own copy of their prompts' KV cache
    [n, heads, P, head_dim] per layer, and their last prompt position's logits [n, 1, V]. The distinct
    cache is left as it was, so several chunks of rows can each take theirs from it."""
    cache, logits, row_to_prompt = prompts
    entry = row_to_prompt[rows]  # [n]
    rows_cache = copy.copy(cache)
    rows_cache.layers = [copy.copy(layer) for layer in cache.layers]
    rows_cache.reorder_cache(entry)  # each layer's keys and values indexed anew: entry u -> each row whose prompt is u
    return rows_cache, logits[entry]


def make_room(cache, room: int):
    """Give every plain layer of the KV cache room for `room` more positions (GrowingLayer, in place);
    a layer of another kind, such as a sliding window's, is left as it is."""
    cache.layers = [GrowingLayer(layer.keys, layer.values, room) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]


class GrowingLayer(DynamicLayer):
    """One layer of the KV cache with room for `room` more positions: keys and values [b, heads, L, head_dim]
    are views of buffers [b, heads, L + room, head_dim], and a new token's are written at position L.
    Speed: transformers' DynamicLayer concatenates instead, copying the whole cache of every layer at
    every token (11% of a SmolLM2 rollout); the views hold the same values, so attention computes the
    same (tests/test_rollout.py: the same logits to the bit as with concatenation)."""

    def __init__(self, keys, values, room: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        length = keys.shape[-2]
        self.key_room, self.value_room = (torch.cat([x, x.new_empty(*x.shape[:2], room, x.shape[3])], dim=2)
                                          for x in (keys, values))  # [b, heads, L + room, head_dim]
        self.keys, self.values = self.key_room[:, :, :length], self.value_room[:, :, :length]

    def update(self, key_states, value_states, *args, **kwargs):  # the new positions' [b, heads, t, head_dim]
        start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        self.key_room[:, :, start:end], self.value_room[:, :, start:end] = key_states, value_states
        self.keys, self.values = self.key_room[:, :, :end], self.value_room[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices):  # drop_finished: keep these rows, indices [b_kept] of the b
        length = self.keys.shape[-2]
        # Speed: index_select copies the kept rows faster than indexing with [indices] (the same values)
        self.key_room, self.value_room = (x.index_select(0, indices) for x in (self.key_room, self.value_room))
        self.keys, self.values = self.key_room[:, :, :length], self.value_room[:, :, :length]


def prompts_repeat(prompt_ids) -> bool:
    """True if some rows share a prompt (then distinct_prompts saves work)."""
    return len(torch.unique(prompt_ids, dim=0)) < len(prompt_ids)


def distinct_prompts_if_shared(model, prompt_ids, prompt_mask):
    """distinct_prompts' pass when some rows share a prompt (share_prompts), else None."""
    if not prompts_repeat(prompt_ids):
        return None
    with autocast(model):
        return distinct_prompts(model, prompt_ids, prompt_mask)  # (cache, [U, 1, V], [N])


def pad_left(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids [N, P], mask [N, P]); prompts are left padded so that every
    row's completion starts at the same column P."""
    ids = pad_sequence([torch.tensor(s) for s in sequences], batch_first=True, padding_value=pad_id,
                       padding_side="left")
    mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in sequences], batch_first=True,
                        padding_side="left")
    return ids, mask


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (ids [N, T], mask [N, T]); completions are right padded."""
    ids = pad_sequence([torch.tensor(s) for s in sequences], batch_first=True, padding_value=pad_id)
    mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in sequences], batch_first=True)
    return ids, mask


def checkpointing(model) -> bool:
    """Is gradient checkpointing on? (transformers' name for it from 5.24 on, and the older one before)"""
    on = getattr(model, "is_activation_checkpointing", None)
    return model.is_gradient_checkpointing if on is None else on


def autocast(model):
    """bf16 autocast on a GPU that supports it: matrix products in bf16, weights, gradients and
    AdamW states stay fp32 (mixed precision). Off on the CPU, where bf16 matrix products are not faster."""
    device = next(model.parameters()).device
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# The static cache and the captured step (the speed-up static_cache)
# ---------------------------------------------------------------------------------------------
STATIC_BUCKET = 64  # a static cache's length is rounded up to a multiple of this, so that its shape repeats
STATIC_STEPS_KEPT = 4  # captured steps kept per model (batch shapes); the least recently used is dropped
STATIC_MODELS = ("llama", "qwen2")  # the decoders decode_step computes (SmolLM2 and the tiny model are Llama)
static_states = weakref.WeakKeyDictionary()  # model -> its RolloutWeights and StaticSteps


def static_cache_fits(model, cache) -> bool:
    """generate's default for static_cache: on where it pays and fits. A CUDA GPU, where a decoded
    token costs the launches of its kernels (on the CPU the arithmetic dominates, and the plain loop
    is what the CPU's figures were measured with), and a model it can run (static_cache_refusal)."""
    return next(model.parameters()).device.type == "cuda" and static_cache_refusal(model, cache) is None


def static_cache_refusal(model, cache) -> str | None:
    """Why decode_step cannot run this model, or None: a Llama-style decoder (STATIC_MODELS), SiLU
    MLP, rotary positions that do not depend on the sequence's length, every layer attending to
    the whole sequence (a plain KV cache: no sliding window), not sharded (--fsdp gathers the
    weights anew for each rollout, where the static cache would hold a copy of them)."""
    config = model.config
    if isinstance(model, FSDPModule):  # a policy sharded by --fsdp is one at its root (distributed.shard_model)
        return "static_cache does not run a model sharded by --fsdp"
    if config.model_type not in STATIC_MODELS or config.hidden_act != "silu":
        return f"static_cache computes {' and '.join(STATIC_MODELS)} models with SiLU (not {config.model_type})"
    if "dynamic" in str(decoder_parts(model)[0].rotary_emb.rope_type):
        return "static_cache does not compute dynamic rotary scaling"
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return "static_cache needs a KV cache of plain layers (no sliding window)"
    return None


def decode_static(model, tokenizer, cache, logits, prompt_mask, completion_ids, temperature: float, greedy: bool,
                  sampler_logprobs=None):
    """generate's decode loop on a KV cache of fixed size, each new token one replay of a step
    captured once per batch shape as a CUDA graph (on the CPU, where the tests run it, uncaptured).
    cache and logits [N, 1, V]: the prompts' run (prefill, as in the plain loop); completion_ids
    [N, max_new_tokens] is filled in, and sampler_logprobs (the same shape) where given. Returns the last step t.
    Speed: one replay of decode_step (fewer, larger kernels) in place of the ~1,900 kernel launches a token
    of a 0.5B model's forward. Greedy tokens match the plain loop's up to near-ties; sampled ones come from the same
    distribution. The layout, and why tokens may differ: docs/scaling.md#the-rollout-on-a-gpu-the-static-cache"""
    refusal = static_cache_refusal(model, cache)
    if refusal:
        raise ValueError(refusal)
    N, P = prompt_mask.shape
    max_new_tokens = completion_ids.shape[1]
    step = static_step(model, N, P + max_new_tokens)
    step.start(cache, prompt_mask)
    done = torch.zeros(N, dtype=torch.bool, device=prompt_mask.device)  # rows that have written EOS: [N]
    for t in range(max_new_tokens):
        next_tokens = next_token(logits[:, -1].float(), temperature, greedy)  # [N]
        completion_ids[:, t] = torch.where(done, tokenizer.pad_token_id, next_tokens)
        if sampler_logprobs is not None:  # the bf16 copy's log-probs on a GPU: what the sampler drew from
            sampler_logprobs[:, t] = logprobs_of_tokens(logits[:, -1].float(), next_tokens, temperature)
        done |= next_tokens == tokenizer.eos_token_id
        if t == max_new_tokens - 1 or done.all():
            break
        logits = step(model, next_tokens, P + t)  # [N, 1, V]: the token written at column P + t, its logits
    return t


def static_step(model, rows: int, length: int):
    """The model's StaticStep for `rows` rows and a cache of `length` columns (rounded up to
    STATIC_BUCKET), made on first use, with the weights it reads refreshed from the model's now.
    It computes in autocast's dtype where autocast is on (bf16 on a GPU), else in the weights' own."""
    device = next(model.parameters()).device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.dtype
    state = static_states.get(model)
    if state is None or state.weights.dtype != dtype:  # (a benchmark may switch autocast off)
        state = static_states[model] = types.SimpleNamespace(weights=RolloutWeights(model, dtype),
                                                             steps=collections.OrderedDict())
    state.weights.refresh(model)  # the trained weights change after every optimizer step
    shape = (rows, -(-length // STATIC_BUCKET) * STATIC_BUCKET)
    if shape not in state.steps:
        state.steps[shape] = StaticStep(state.weights, *shape)
        if len(state.steps) > STATIC_STEPS_KEPT:
            state.steps.popitem(last=False)
    state.steps.move_to_end(shape)
    return state.steps[shape]


def decoder_parts(model):
    """(the decoder: embed_tokens, layers, norm, rotary_emb; the LM head) of a causal LM, or of the one peft wraps."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


class RolloutWeights:
    """The weights decode_step reads: the rollout's own copy of the policy's, in `dtype` (bf16 on a
    GPU). A captured graph reads its tensors at the addresses it was captured with, so refresh()
    writes the policy's current values into this copy, in place, at every generate call (the
    trained weights change after every optimizer step). Per layer, the matrices that read the same
    input are stacked into one (q, k, v: qkv; gate, up: gate_up), one product each.

    LoRA (peft): an adapted layer's copy is its merged weight W + (alpha / r) B A (merged_weight),
    computed from the trained tensors without writing to them. Merging into the trained weights
    and unmerging after the rollout would not give the same floats back (adding B A rounds, and
    subtracting it rounds again), so the frozen base would drift a little at every step."""

    def __init__(self, model, dtype):
        decoder, head = decoder_parts(model)
        config = model.config
        self.dtype, self.eps = dtype, config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = decoder.layers[0].self_attn.head_dim
        self.scale = decoder.layers[0].self_attn.scaling  # 1 / sqrt(head_dim)
        self.tied = head.weight is decoder.embed_tokens.weight  # the LM head is the embedding matrix

        def stacked(*tensors):  # an empty tensor for these tensors stacked (None for no bias)
            return None if tensors[0] is None else torch.empty(
                sum(len(x) for x in tensors), *tensors[0].shape[1:], dtype=dtype, device=tensors[0].device)

        self.embed, self.norm = stacked(decoder.embed_tokens.weight), stacked(decoder.norm.weight)
        self.head = self.embed if self.tied else stacked(weight_of(head))
        self.layers = [types.SimpleNamespace(**{name: stacked(*tensors)
                                                for name, tensors in layer_weights(layer).items()})
                       for layer in decoder.layers]

    @torch.no_grad()
    def refresh(self, model):
        """Write the policy's current weights into the copy (cast to its dtype, LoRA merged)."""
        decoder, head = decoder_parts(model)

        def write(into, *tensors):  # the tensors, stacked, into `into` (no temporary: each into its rows)
            start = 0
            for x in tensors if into is not None else ():
                into[start:start + len(x)] = x
                start += len(x)

        write(self.embed, decoder.embed_tokens.weight)
        write(self.norm, decoder.norm.weight)
        if not self.tied:
            write(self.head, weight_of(head))
        for mine, layer in zip(self.layers, decoder.layers):
            for name, tensors in layer_weights(layer).items():
                write(getattr(mine, name), *tensors)


def layer_weights(layer) -> dict:
    """The weights decode_step reads of one decoder layer, by name, each a tuple of tensors to stack:
    q, k, v's into qkv and gate, up's into gate_up, one product each (biases None where there are none)."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
    return {"input_norm": (layer.input_layernorm.weight,), "post_norm": (layer.post_attention_layernorm.weight,),
            "qkv": tuple(map(weight_of, qkv)), "qkv_bias": tuple(map(bias_of, qkv)),
            "o": (weight_of(attention.o_proj),), "o_bias": (bias_of(attention.o_proj),),
            "gate_up": tuple(map(weight_of, gate_up)), "gate_up_bias": tuple(map(bias_of, gate_up)),
            "down": (weight_of(mlp.down_proj),), "down_bias": (bias_of(mlp.down_proj),)}


def is_lora_layer(module) -> bool:
    """A layer peft's LoRA adapted (its base_layer, and lora_A, lora_B: modules per adapter)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def weight_of(linear) -> torch.Tensor:
    """A linear layer's weight [out, in]; an adapted one's with its adapters merged in (merged_weight)."""
    return merged_weight(linear) if is_lora_layer(linear) else linear.weight


def bias_of(linear) -> torch.Tensor | None:
    return (linear.base_layer if is_lora_layer(linear) else linear).bias


def merged_weight(layer) -> torch.Tensor:
    """A LoRA layer's weight with its active adapters merged in, W + (alpha / r) B A: [out, in], a new
    tensor (W, A [r, in] and B [out, r] are left as they are). The adapted layer computes the same,
    W x + (alpha / r) B (A x), up to rounding."""
    weight = layer.base_layer.weight
    for adapter in layer.active_adapters:
        if layer.use_dora.get(adapter) or getattr(layer, "fan_in_fan_out", False):
            raise ValueError("static_cache merges plain LoRA adapters only (not DoRA, not fan_in_fan_out)")
        weight = weight + layer.scaling[adapter] * (layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight)
    return weight


class StaticStep:
    """One decode step of `rows` rows on a KV cache of `length` columns, captured as a CUDA graph on a
    GPU. Its inputs are tensors at fixed addresses, written before each replay: tokens [N],
    positions [N, 1], bias [N, 1, 1, L] (0 on the columns a row attends to, -inf elsewhere) and
    column [1] (where this token's keys and values go); its output, logits [N, 1, V], is read after."""

    def __init__(self, weights: RolloutWeights, rows: int, length: int):
        device, dtype = weights.embed.device, weights.dtype
        self.weights, self.length = weights, length
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [N, 1]
        self.bias = torch.zeros(rows, 1, 1, length, dtype=dtype, device=device)  # [N, 1, 1, L]
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        # keys and values [N, kv_heads, L, head_dim] per layer; zeros, so that a masked column holds a
        # finite value (its attention weight 0 times NaN would be NaN)
        shape = (rows, weights.kv_heads, length, weights.head_dim)
        self.cache = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                      for _ in weights.layers]
        self.graph, self.logits = None, None

    def start(self, prompt_cache, prompt_mask):
        """The prompts' keys and values into columns 0 .. P-1 and the bias; positions at each row's last."""
        P = prompt_mask.shape[1]
        for (keys, values), prompt in zip(self.cache, prompt_cache.layers):
            keys[:, :, :P], values[:, :, :P] = prompt.keys, prompt.values
        self.bias.fill_(-torch.inf)
        self.bias[:, 0, 0, :P].masked_fill_(prompt_mask.bool(), 0.0)
        self.positions.copy_(prompt_mask.sum(dim=1, keepdim=True) - 1)

    def __call__(self, model, tokens, column: int):
        """Feed tokens [N] at `column` (each row's next position): the logits that follow them [N, 1, V].
        They are overwritten by the next call."""
        self.tokens.copy_(tokens)
        self.positions += 1
        self.bias[:, 0, 0, column] = 0.0
        self.column.fill_(column)
        if self.tokens.device.type != "cuda":
            return self.forward(model)
        if self.graph is None:
            self.capture(model)
        self.graph.replay()
        return self.logits

    def forward(self, model):
        rotary = decoder_parts(model)[0].rotary_emb
        with torch.autocast(self.tokens.device.type, enabled=False):  # all in the copy's dtype: no casts
            return decode_step(self.weights, rotary, self.cache, self.tokens, self.positions, self.bias,
                               self.column)[:, None]

    def capture(self, model):
        """Record the step as a CUDA graph. As torch.cuda.graph asks, warm-up runs on a side stream
        first, so that lazy set-ups (cuBLAS's workspace) happen outside the capture; they compute the
        step itself (writing the same column), so the replay that follows computes it once more."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(model)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.forward(model)
        self.graph, self.logits = graph, logits  # (only once the capture has succeeded)


def decode_step(w: RolloutWeights, rotary, cache, tokens, positions, bias, column) -> torch.Tensor:
    """One token per row through a Llama-style decoder, the keys and values of the tokens before it
    read from the fixed-size cache: tokens [N] -> the logits of the next token [N, V]. The model's
    own forward (transformers' modeling_llama.py) computes the same, each step in its own kernels;
    here q, k, v come from one product and gate, up from another, the rotary embedding turns queries
    and keys together, the residual is added by the product that makes it (torch.addmm), and the
    attention of one query per head is two batched products around a softmax. With n_kv key/value
    heads, each shared by g = heads / n_kv query heads (grouped-query attention), the queries are
    laid out [N n_kv, g, head_dim] against the keys [N n_kv, L, head_dim].
    cache: per layer (keys, values) [N, n_kv, L, head_dim]; bias [N, 1, 1, L]; column [1]."""
    N, d, L = len(tokens), w.embed.shape[1], cache[0][0].shape[2]
    heads, kv_heads, head_dim = w.heads, w.kv_heads, w.head_dim
    groups = heads // kv_heads
    x = F.embedding(tokens, w.embed)  # [N, d]: the residual stream
    cos, sin = rotary(x, positions)  # [N, 1, head_dim] each
    scores_bias = bias.expand(N, kv_heads, groups, L).reshape(N * kv_heads, groups, L)  # the same for every layer
    for layer, (keys, values) in zip(w.layers, cache):
        qkv = F.linear(F.rms_norm(x, (d,), layer.input_norm, w.eps), layer.qkv, layer.qkv_bias)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(N, heads + kv_heads, head_dim)
        qk = torch.addcmul(qk * cos, rotate_half(qk), sin)  # qk cos + rotate_half(qk) sin: rotary positions
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * head_dim:].view(N, kv_heads, head_dim)
        keys.index_copy_(2, column, k[:, :, None])  # this token's keys and values into column `column`
        values.index_copy_(2, column, v[:, :, None])
        scores = torch.baddbmm(scores_bias, q.reshape(N * kv_heads, groups, head_dim),
                               keys.view(N * kv_heads, L, head_dim).transpose(1, 2), alpha=w.scale)  # [N n_kv, g, L]
        attended = torch.softmax(scores, dim=-1) @ values.view(N * kv_heads, L, head_dim)  # [N n_kv, g, head_dim]
        x = torch.addmm(x, attended.view(N, heads * head_dim), layer.o.t())  # x + attention's output
        if layer.o_bias is not None:
            x = x + layer.o_bias
        gate, up = F.linear(F.rms_norm(x, (d,), layer.post_norm, w.eps), layer.gate_up, layer.gate_up_bias).chunk(2, -1)
        x = torch.addmm(x, F.silu(gate) * up, layer.down.t())  # x + the MLP's output
        if layer.down_bias is not None:
            x = x + layer.down_bias
    return F.linear(F.rms_norm(x, (d,), w.norm, w.eps), w.head)  # [N, V]


def rotate_half(x):
    """The rotary embedding's partner of each coordinate: [x1, x2] -> [-x2, x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
