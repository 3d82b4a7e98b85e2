"""Agentic GRPO: a policy that may call a calculator in the middle of its answer, trained by GRPO.

The policy is an agent and the calculator its environment. While it writes, the policy may open a
call, `<calc>47+85</calc>`; the rollout stops at the closing tag, the calculator answers, its reply
`<result>132</result>` is appended to the completion, and the policy writes on. One completion is an
episode of several turns:

    <think><calc>47+85</calc><result>132</result></think><answer>132</answer><EOS>
    ^^^^^^^^^^^^^^^^^^^^^^^^^                    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^  the policy's actions
                             ^^^^^^^^^^^^^^^^^^^^                                   the calculator's (reply_mask 1)

(With a tokenizer whose one token '><' closes the call and opens the reply, as SmolLM2's, the reply's first
'<' is the policy's token, and the calculator's tokens start after it: tool_reply.)

The calculator's tokens are observations, as the prompt is: they are in the input of every later
token, but the policy did not choose them, so they are never read as a call (calls are read from the
policy's tokens only, policy_text) and they take no loss, no KL, no entropy and no importance ratio
(step 5's mask, action_mask). The reward is grpo.py's (the number, the format), minus --tool_call_cost per
call; GRPO's advantage is one number per episode, given to every action token of every turn.

    python sft.py --dataset data/tool_demos --output_dir out/sft_tool   # the teacher calls it in half its demos
    python agent.py                                  # out/sft_tool -> out/agent
    python agent.py --max_tool_calls 0               # every call refused: the start still calls and must unlearn
                                                     # it (GRPO without a calculator is grpo.py from sft.py)
    python agent.py --tool_call_cost 0.25            # a call costs a quarter point of reward

One training step, grpo.py's five with two changes (marked in main()'s loop):
  1. rollout with the calculator (generate_with_tools)  completion_ids, completion_mask, reply_mask  [B*G, T]
  2. rewards: grpo.py's reward functions, and -tool_call_cost x calls   rewards  [B*G]
  3. advantages: grpo.advantages_of                     advantages  [B*G]
  4. reference log-probs (beta > 0), old log-probs (num_iterations > 1)
  5. grpo.grpo_loss on the policy's tokens only: mask = completion_mask x (1 - reply_mask)  (action_mask)

The calculator's reply is written as the policy's tokens are, one token per row per step through the
same one-token forward pass (forced from a per-row queue, as in nanochat's engine, nanochat/engine.py), so the
rollout has rollout.generate's speed-ups, the static cache of a CUDA GPU included.

Every GRPO setting of grpo.py works here (loss types, advantage estimators, clip ranges, LoRA,
torchrun) except --dynamic_sampling. What is left out, and why: one tool (a second is one more
branch in tool_reply); asynchronous rollouts, where episodes wait on slow tools while others run
(verl, OpenRLHF), which an in-process calculator does not need; rewards per turn (the outcome is
scored once, at the end).
docs/agent.md explains the episode, the mask, credit over turns, and how TRL, verl and OpenRLHF
lay out the same loop.
"""
import collections
import copy
import functools
import re
from dataclasses import dataclass

import torch

import common
import grpo
from common import setting
from lib import distributed, harness, rollout
from data.make_data import problem_kind

KINDS = ("carry", "no carry", "borrow", "no borrow", "negative")  # data/make_data.py's problem_kind
# The most a completion may pay for its calls. Rewards and advantages are float32, and beside a large price the
# group's mean and standard deviation round the points away. Groups of 8 whose every reward is offset by the price
# (5,000 each, the points and up to 2 calls at a price drawn in [0.1, 1.1)): advantages within 0.0034 of float64's
# at 1e4, 0.05 at 1e5 and 0.44 at 1e6 (tests/test_agent.py's advantage_error).
MAX_PRICE = 1e4


@dataclass
class Config(grpo.Config):
    """grpo.py's settings, and the calculator's."""
    max_tool_calls: int = setting(2, lambda v: v >= 0, "0 or more")
    """calculator calls answered per completion; a call beyond them is answered 'error: no calls left'
    (0: every call refused in words; the start still calls and must unlearn calling: not GRPO without a
    calculator, which is grpo.py from sft.py)"""
    tool_call_cost: float = setting(0.0, lambda v: v >= 0, "0 or more")
    """reward taken off per call (refused calls too): the price of asking. A completion makes at most one call per
    token, so it pays at most tool_call_cost x max_completion_length, which must be at most 1e4: rewards and
    advantages are float32, and beside a larger price the answer's and format's points are lost to rounding"""
    model: str = "out/sft_tool"
    output_dir: str = "out/agent"

    def check_together(self):
        super().check_together()
        if self.dynamic_sampling:
            common.fail("agent.py does not implement --dynamic_sampling (grpo.py does): leave it out")
        most_paid = self.tool_call_cost * self.max_completion_length  # every call ends on one of the policy's tokens
        if most_paid > MAX_PRICE:
            common.fail(f"--tool_call_cost x --max_completion_length ({self.tool_call_cost:g} x "
                        f"{self.max_completion_length}), the most a completion can pay for its calls, must be at most "
                        f"{MAX_PRICE:g}: rewards and advantages are float32, and beside a larger price the answer's "
                        "and the format's points are rounded away (at 1e5 the advantages move by up to 0.05)")


# ---------------------------------------------------------------------------------------------
# The environment: a calculator that parses `integer op integer` and nothing else
# ---------------------------------------------------------------------------------------------
CALL = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")
MAX_DIGITS = 12  # operands longer than this are refused: no huge numbers, no long replies


def calculator(call: str) -> str:
    """The reply to the text between <calc> and </calc>: the value of `a op b` for integers a, b of at
    most MAX_DIGITS digits and op one of + - *, else an error string. It never raises and never
    evaluates anything else: '62+94' -> '156', '2**10' -> 'error: ...'."""
    match = CALL.fullmatch(call)
    if match is None:
        return "error: write integer op integer, e.g. 62+94"
    a, op, b = match.groups()
    if max(len(a.lstrip("-")), len(b.lstrip("-"))) > MAX_DIGITS:
        return f"error: numbers of at most {MAX_DIGITS} digits"
    a, b = int(a), int(b)
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def tool_reply(text: str, calls_made: int, max_tool_calls: int) -> str | None:
    """The calculator's turn after the policy's own text so far (policy_text: the calculator's replies left
    out, so that a reply quoting a tag is never read as a call): None if no call waits for a reply (every
    </calc> in the text has one), else '<result>...</result>' for the last call, the text between
    the last <calc> and the last </calc>; a call beyond max_tool_calls gets an error. Text the policy
    wrote after </calc> in the same token that is the reply's start ('<') is not repeated."""
    if text.count("</calc>") <= calls_made:
        return None
    end = text.rfind("</calc>")
    if calls_made >= max_tool_calls:
        reply = "<result>error: no calls left</result>"
    else:
        call = text[:end].rpartition("<calc>")
        reply = f"<result>{calculator(call[2]) if call[1] else 'error: no <calc> before </calc>'}</result>"
    # A subword token may close the call and open the reply's tag at once (SmolLM2's BPE writes '</calc><'
    # as '</', 'calc', '><'): the reply then goes on from where the policy's text stops.
    tail = text[end + len("</calc>"):]
    return reply[len(tail):] if reply.startswith(tail) else reply


def policy_text(tokenizer, ids: torch.Tensor, reply_mask: torch.Tensor) -> str:
    """The policy's own text in one episode so far, what tool_reply reads for calls: ids [t] without the
    calculator's tokens (reply_mask [t], 1 on them). The replies are observations, not actions: the reply
    'error: no <calc> before </calc>' holds a '</calc>' the policy did not write. Its turns (the runs of its
    tokens between replies) are decoded one by one and joined by a newline, which no tag holds, so that two
    turns never join into a tag the policy did not write (with SmolLM2's '><' token a turn can end in '<')."""
    turns, turn = [], []
    for token, by_calculator in zip(ids.tolist(), reply_mask.tolist()):
        if not by_calculator:
            turn.append(token)
        elif turn:
            turns, turn = turns + [turn], []
    return "\n".join(tokenizer.decode(turn) for turn in [*turns, turn] if turn)


# ---------------------------------------------------------------------------------------------
# Step 1: the rollout, with the calculator's replies forced into the completion a token at a time
# ---------------------------------------------------------------------------------------------
@dataclass
class Episodes:
    """N episodes, laid out as rollout.generate's batch [left-padded prompt | right-padded completion],
    the completion holding the policy's tokens and the calculator's, in the order written."""
    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T]
    completion_mask: torch.Tensor  # [N, T]: 1 on every written token, the EOS included
    reply_mask: torch.Tensor  # [N, T]: 1 on the calculator's tokens
    sampler_logprobs: torch.Tensor  # [N, T]: log-prob of each policy token when it was sampled; 0 elsewhere
    calls: torch.Tensor  # [N]: calls made, refused ones included


@rollout.timed("generation")
@torch.no_grad()
def generate_with_tools(model, tokenizer, prompts: list[str], max_new_tokens: int, max_tool_calls: int,
                        temperature: float = 1.0, greedy: bool = False, share_prompts=True, drop_finished=True,
                        grow_in_place=True, static_cache=None, only_after_gt=True) -> Episodes:
    """Episodes with the calculator: rollout.generate's loop (KV cache, one token per row per step) with
    the environment's turn inside it. After a row's token, the calculator reads the row's own text
    (policy_text); if it closes a call (tool_reply), the reply's tokens wait in the row's queue, and at
    each of the next steps the row writes the queue's next token instead of a sample: forced, reply_mask 1,
    no sample and log-prob 0 (nanochat's engine keeps such a queue per row, RowState.forced_tokens, but
    samples every row and then overwrites the forced ones). Every step is the same one-token forward
    for every row, so each completion is contiguous, and the log-prob pass over [prompt | completion]
    sees the positions the sampler saw. The token budget counts the calculator's tokens: a reply is cut
    at max_new_tokens, and a call closed on the last token gets none.
    The speed-ups are rollout.generate's (share_prompts, drop_finished, grow_in_place, static_cache: on by
    default on a CUDA GPU, for the decoders rollout.static_cache_refusal accepts), and only_after_gt: a row's
    text is read for a call only after a token holding '>' (tokens_with_gt). On the CPU, each switched off gives the
    same tokens, greedy or sampled from the same seed: the sampler draws for the same rows on every path, those the
    policy writes for (tests/test_agent.py). On a GPU the static cache decodes from a bf16 copy of the weights: the
    same greedy tokens up to near-ties, sampled ones from nearly the same distribution (bf16 rounding)."""
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    N, P = prompt_ids.shape
    completion_ids = torch.full((N, max_new_tokens), tokenizer.pad_token_id, device=device)  # [N, max_new_tokens]
    reply_mask = torch.zeros_like(completion_ids)
    sampler_logprobs = torch.zeros(N, max_new_tokens, device=device)
    queues = [collections.deque() for _ in range(N)]  # per row: the calculator's tokens still to write
    calls = [0] * N
    may_close = tokens_with_gt(tokenizer).to(device)  # [V]: tokens that may end '</calc>'
    was_training = model.training
    model.eval()
    with distributed.gathered(model), rollout.autocast(model):
        if not share_prompts:  # the prompts' keys and values (the KV cache), and the logits of their last position
            out = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                        position_ids=rollout.position_ids(prompt_mask), use_cache=True, logits_to_keep=1)
            cache, logits = getattr(out, rollout.CACHE), out.logits  # logits [N, 1, V]
        else:  # Speed: the same, each distinct prompt run once, its rows sharing its keys and values
            cache, logits = rollout.rows_of(rollout.distinct_prompts(model, prompt_ids, prompt_mask))  # [N, 1, V]
        if static_cache is None:
            static_cache = rollout.static_cache_fits(model, cache)
        if static_cache:  # Speed: a KV cache of fixed size, each token one replay of a CUDA graph (decode_static's)
            step = rollout.static_step(model, N, P + max_new_tokens)
            step.start(cache, prompt_mask)
        elif grow_in_place:  # Speed: each new token's keys and values are written into room kept for them
            rollout.make_room(cache, max_new_tokens)
        rows = torch.arange(N, device=device)  # the rows in the batch: [b]
        done = torch.zeros(N, dtype=torch.bool, device=device)  # rows that have written EOS: [N]
        attention_mask, positions = prompt_mask, prompt_mask.sum(dim=1) - 1  # [b, P + t], [b]: the last position
        for t in range(max_new_tokens):
            next_tokens = torch.full_like(rows, tokenizer.pad_token_id)  # [b]: a row that is done writes padding
            # the calculator's turn: a row with a reply still to write takes its next token (forced)
            forced = torch.tensor([len(queues[row]) > 0 for row in rows.tolist()], device=device)  # [b]
            next_tokens[forced] = torch.tensor([queues[row].popleft() for row in rows[forced].tolist()],
                                               dtype=torch.long, device=device)
            reply_mask[rows[forced], t] = 1
            # the policy's turn: every other row still writing samples its token
            policy = ~forced & ~done[rows]  # [b]
            last_logits = logits[policy, -1].float()  # [b', V]
            next_tokens[policy] = rollout.next_token(last_logits, temperature, greedy)
            sampler_logprobs[rows[policy], t] = rollout.logprobs_of_tokens(last_logits, next_tokens[policy],
                                                                           temperature)
            completion_ids[rows, t] = next_tokens
            done[rows] |= next_tokens == tokenizer.eos_token_id
            if t == max_new_tokens - 1 or done.all():
                break
            # a row whose own token closes a call: the reply queued, forced from the next step on
            reading = policy & ~done[rows]  # [b]
            if only_after_gt:  # Speed: only a token holding '>' can end '</calc>'; the others are not decoded
                reading &= may_close[next_tokens]
            for row in rows[reading].tolist():
                text = policy_text(tokenizer, completion_ids[row, : t + 1], reply_mask[row, : t + 1])
                reply = tool_reply(text, calls[row], max_tool_calls)
                if reply is not None:
                    calls[row] += 1
                    queues[row].extend(tokenizer(reply, add_special_tokens=False)["input_ids"])
            # the next forward: one token per row, the policy's or the calculator's
            if drop_finished and not static_cache and done[rows].any():  # Speed: rows that wrote EOS leave
                writing = ~done[rows]  # the batch, and the cache
                rows, next_tokens, positions = rows[writing], next_tokens[writing], positions[writing]
                attention_mask = attention_mask[writing]
                cache.batch_select_indices(writing.nonzero().squeeze(1))
            if static_cache:  # every row stays in the batch: the cache has a fixed size
                logits = step(model, next_tokens, P + t)  # [N, 1, V]
            else:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
                positions = positions + 1
                logits = model(input_ids=next_tokens[:, None], attention_mask=attention_mask,
                               position_ids=positions[:, None], **{rollout.CACHE: cache}, use_cache=True).logits
    model.train(was_training)
    completion_ids = completion_ids[:, : t + 1]  # [N, T]: up to the longest completion
    completion_mask = rollout.mask_after_eos(completion_ids, tokenizer.eos_token_id)  # [N, T]
    return Episodes(prompt_ids, prompt_mask, completion_ids, completion_mask, reply_mask[:, : t + 1],
                    sampler_logprobs[:, : t + 1], torch.tensor(calls, device=device))


@functools.lru_cache(maxsize=4)
def tokens_with_gt(tokenizer) -> torch.Tensor:
    """[V] bool: the tokens whose text holds '>', the only ones that can end a '</calc>' (once per tokenizer)."""
    return torch.tensor(['>' in token for token in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))])


# ---------------------------------------------------------------------------------------------
# Step 2: the rewards, and what the run measures of the calls
# ---------------------------------------------------------------------------------------------
def tool_cost_reward(calls: torch.Tensor, cost: float) -> torch.Tensor:
    """-cost x calls of each completion: calls [N] -> [N]. With cost 0 the calculator is free."""
    return -cost * calls.float()


def kind_of(text: str) -> str | None:
    """data/make_data.py's kind of the arithmetic question in a question or prompt ('What is 47 + 85?' ->
    'carry'), None for any other question (a hub dataset's)."""
    match = re.search(r"What is (\d+) ([-+]) (\d+)\?", text)
    return problem_kind(int(match[1]), match[2], int(match[3])) if match else None


def call_rates(questions: list[str], calls: torch.Tensor) -> dict:
    """The share of completions with at least one call, over all and per kind of problem: questions (or
    prompts) [N], calls [N] -> {'call_rate': .., 'call_rate/carry': .., ...} (a kind with no question this
    time is left out)."""
    called = (calls > 0).float().tolist()
    rates = {"call_rate": sum(called) / len(called)}
    for kind in KINDS:
        of_kind = [c for c, question in zip(called, questions) if kind_of(question) == kind]
        if of_kind:
            rates[f"call_rate/{kind}"] = sum(of_kind) / len(of_kind)
    return rates


def evaluate_with_tools(model, tokenizer, dataset, cfg) -> dict:
    """Held-out accuracy with the calculator (common.evaluate, sampling with generate_with_tools), and the
    sampled episodes' call rates (call_rates; under torchrun the accuracies count every process's problems,
    the call rates this process's)."""
    sampled = []  # (prompt, calls) of each sampled episode

    def generate(prompts, greedy):
        episodes = generate_with_tools(model, tokenizer, prompts, cfg.max_completion_length, cfg.max_tool_calls,
                                       1.0, greedy)
        if not greedy:
            sampled.extend(zip(prompts, episodes.calls.tolist()))
        return episodes.completion_ids

    scores = common.evaluate(model, tokenizer, dataset, cfg.max_completion_length, cfg.system_prompt,
                             cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size, generate)
    prompts, calls = zip(*sampled)
    n = scores.pop("n")
    return {**scores, **call_rates(list(prompts), torch.tensor(calls)), "n": n}


# ---------------------------------------------------------------------------------------------
# Step 5's mask: the loss on the policy's tokens only
# ---------------------------------------------------------------------------------------------
def action_mask(completion_mask: torch.Tensor, reply_mask: torch.Tensor) -> torch.Tensor:
    """[N, T]: 1 on the policy's own tokens (its actions), 0 on the calculator's and on padding:
    completion_mask [N, T] x (1 - reply_mask [N, T]). The calculator's tokens are observations, as the
    prompt is: the policy did not choose them, so they take no loss, no KL, no entropy and no ratio.
    completion_mask [1,1,1,1,1,0], reply_mask [0,0,1,1,0,0] -> [1,1,0,0,1,0]."""
    return completion_mask * (1 - reply_mask)


# ---------------------------------------------------------------------------------------------
# Training loop: grpo.py's, with the calculator in step 1 and the mask in step 5
# ---------------------------------------------------------------------------------------------
def main(cfg: Config):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset})
    G = cfg.num_generations
    num_prompts = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G  # B

    train_data, test_data, model, tokenizer, longest = common.load_policy_and_prompts(cfg, per_step=num_prompts)
    model = run.prepare(model)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 and cfg.lora_r is None else None
    run.shard(model, ref_model)
    run.log_memory([model], [ref_model], rows=cfg.per_device_train_batch_size,
                   sequence_length=longest + cfg.max_completion_length, completion_length=cfg.max_completion_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps * cfg.num_iterations,
                                              cfg.max_steps * cfg.num_iterations, cfg.min_lr_rate)

    for step in run.steps([model], [optimizer], [scheduler], lambda: evaluate_with_tools(model, tokenizer, test_data,
                                                                                          cfg)):
        step_data = train_data[run.rng.sample(range(len(train_data)), num_prompts)]
        # 1. Rollout with the calculator: G episodes of each of B prompts, groups contiguous.
        prompts = [common.make_prompt(tokenizer, q, cfg.system_prompt) for q in step_data["question"] for _ in range(G)]
        episodes = generate_with_tools(model, tokenizer, prompts, cfg.max_completion_length, cfg.max_tool_calls,
                                       cfg.temperature)
        completions = tokenizer.batch_decode(episodes.completion_ids, skip_special_tokens=True)
        # 2. Rewards: grpo.py's reward functions, minus the price of the calls.
        columns = {name: [value for value in values for _ in range(G)] for name, values in step_data.items()}
        rewards_per_func = torch.tensor([f(prompts, completions, **columns) for f in grpo.REWARD_FUNCS]).T  # [B*G, F]
        rewards = rewards_per_func.sum(dim=1) + tool_cost_reward(episodes.calls.cpu(), cfg.tool_call_cost)  # [B*G]

        # 3. Group-relative advantages.
        advantages = grpo.advantages_of(rewards, G, cfg.advantage_estimator, cfg.scale_rewards).to(run.device)
        # The tokens that carry loss: the policy's own, not the calculator's.
        policy_mask = action_mask(episodes.completion_mask, episodes.reply_mask)  # [B*G, T]
        if cfg.mask_truncated_completions:
            policy_mask = grpo.drop_truncated(episodes.completion_ids, policy_mask, tokenizer.eos_token_id)

        # 4. Inference passes: the reference policy, and pi_old if it will differ from pi.
        input_ids = torch.cat([episodes.prompt_ids, episodes.completion_ids], dim=1)  # [B*G, P+T]
        attention_mask = torch.cat([episodes.prompt_mask, episodes.completion_mask], dim=1)  # [B*G, P+T]
        T = episodes.completion_ids.shape[1]
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)
        ref_logprobs = old_logprobs = None
        if cfg.beta > 0:
            with common.reference_model(model, ref_model) as reference:
                ref_logprobs = rollout.inference(rollout.completion_logprobs, reference, input_ids, attention_mask, T,
                                                 cfg.temperature, micro_batches=micro_batches)
        if cfg.num_iterations > 1:
            old_logprobs = rollout.inference(rollout.completion_logprobs, model, input_ids, attention_mask, T,
                                             cfg.temperature, micro_batches=micro_batches)

        # 5. Gradient steps on GRPO's loss over the policy's tokens (policy_mask: no loss, KL, ratio on the tool's).
        for _ in range(cfg.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            logprobs, entropy = (torch.zeros_like(policy_mask, dtype=torch.float) for _ in range(2))  # [B*G, T]
            for rows in micro_batches:
                micro_logprobs, micro_entropy = rollout.completion_logprobs_and_entropy(
                    model, input_ids[rows], attention_mask[rows], T, cfg.temperature,
                    entropy_grad=cfg.entropy_coeff > 0)
                micro_old = micro_logprobs.detach() if old_logprobs is None else old_logprobs[rows]  # pi_old [n, T]
                weights = (rollout.sampler_importance_weights(  # TIS: w = pi_old / pi_sampler, bounded
                    micro_old, episodes.sampler_logprobs[rows], policy_mask[rows], cfg.vllm_importance_sampling_mode,
                    cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min)
                    if cfg.vllm_importance_sampling_correction else None)
                micro_loss = (grpo.grpo_loss(micro_logprobs, micro_old, grpo.rows_or_none(ref_logprobs, rows),
                                             advantages[rows], policy_mask[rows], cfg, policy_mask, weights)
                              - cfg.entropy_coeff * grpo.aggregate(torch.where(policy_mask[rows].bool(), micro_entropy,
                                                                               0.0), policy_mask[rows], cfg.loss_type,
                                                                   policy_mask, cfg.max_completion_length))
                micro_loss.backward()
                loss = loss + micro_loss.detach()
                logprobs[rows], entropy[rows] = micro_logprobs.detach(), micro_entropy.detach()
            grad_norm = run.clip_gradients(model, loss)
            optimizer.step()
            scheduler.step()

        run.end_step(*step_log(step_data["question"], completions, episodes, rewards_per_func, rewards, advantages,
                               logprobs, old_logprobs, ref_logprobs, entropy, policy_mask, loss, grad_norm, scheduler,
                               cfg))

    run.finish(tokenizer, {"": model}, {"reward": ["reward", "rewards/correctness_reward", "rewards/format_reward"],
                                        "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"],
                                        "share of episodes that call": ["call_rate",
                                                                        *(f"call_rate/{k}" for k in KINDS)],
                                        "completion length": ["completion_length", "reply_tokens"]},
               "GRPO with a calculator")
    return model


def step_log(questions, completions, episodes, rewards_per_func, rewards, advantages, logprobs, old_logprobs,
             ref_logprobs, entropy, policy_mask, loss, grad_norm, scheduler, cfg) -> tuple[dict, dict]:
    """run.end_step's two arguments: the step's metrics and completions.jsonl's columns. The metrics are
    grpo.step_metrics' over the policy's tokens (kl, entropy, clip_fraction), then four of them replaced: the
    reward and its spread after the price of the calls, and the length counting the calculator's tokens;
    and the calls, their rates by kind, the calculator's tokens per episode; the sampler's gap to the trainer."""
    G, old = cfg.num_generations, logprobs if old_logprobs is None else old_logprobs  # pi_old by the trainer
    metrics = {"loss": loss.item(),
               **grpo.step_metrics(rewards_per_func, policy_mask, logprobs, old, ref_logprobs, advantages, cfg,
                                   entropy),
               "reward": rewards.mean().item(), "reward_std": rewards.view(-1, G).std(dim=1).mean().item(),
               "frac_reward_zero_std": (rewards.view(-1, G).std(dim=1) == 0).float().mean().item(),
               "completion_length": episodes.completion_mask.sum(dim=1).float().mean().item(),
               "reply_tokens": episodes.reply_mask.sum(dim=1).float().mean().item(),
               "calls": episodes.calls.float().mean().item(),
               **call_rates([q for q in questions for _ in range(G)], episodes.calls),
               "grad_norm": grad_norm.item(), "learning_rate": scheduler.get_last_lr()[0],
               **rollout.sampler_mismatch(old, episodes.sampler_logprobs, policy_mask,  # pi_old's gap
                                          rollout.sampler_importance_weights(
                                              old, episodes.sampler_logprobs, policy_mask,
                                              cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_max,
                                              cfg.vllm_importance_sampling_clip_min)
                                          if cfg.vllm_importance_sampling_correction else None)}
    logged = {"prompt": [q for q in questions for _ in range(G)], "completion": completions,
              "advantage": advantages.tolist(), "calls": episodes.calls.tolist(), "reward": rewards.tolist()}
    return metrics, logged


if __name__ == "__main__":
    main(common.parse_config(Config))
