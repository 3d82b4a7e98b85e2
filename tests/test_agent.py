"""agent.py: the calculator and its refusals, the rollout with the calculator's turns (the forced tokens,
the budget, the mask; the same greedy tokens as a rollout that prefills the reply, and with each speed-up
switched off), the loss that leaves the calculator's tokens out, and a run."""
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agent
import common
import grpo
from lib import distributed, rollout
from conftest import read_metrics, run, run_main
from floats import assert_close, forward_terms


# --- the calculator ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, reply", [
    ("62+94", "156"), ("47-85", "-38"), (" 12 * 3 ", "36"), ("-5-7", "-12"), ("999999999999+1", "1000000000000"),
    ("2**10", "error: write integer op integer, e.g. 62+94"), ("1+2+3", "error: write integer op integer, e.g. 62+94"),
    ("7/2", "error: write integer op integer, e.g. 62+94"), ("", "error: write integer op integer, e.g. 62+94"),
    ("__import__('os')", "error: write integer op integer, e.g. 62+94"),
    ("1.5+2", "error: write integer op integer, e.g. 62+94"),
    ("1234567890123+1", "error: numbers of at most 12 digits"),
    ("9" * 5000 + "*9", "error: numbers of at most 12 digits"),
])
def test_calculator_answers_integer_op_integer_and_refuses_the_rest_in_words(call, reply):
    assert agent.calculator(call) == reply


def test_calculator_never_raises_on_junk():
    rng = random.Random(0)
    alphabet = "0123456789+-*/()<>. eE_x"
    for _ in range(2000):
        reply = agent.calculator("".join(rng.choice(alphabet) for _ in range(rng.randrange(12))))
        assert isinstance(reply, str) and (reply.startswith("error:") or reply.lstrip("-").isdigit())


@pytest.mark.parametrize("text, made, limit, reply", [
    ("<think>4+8=12", 0, 2, None),  # no call
    ("<think><calc>47+85</calc>", 0, 2, "<result>132</result>"),
    ("<calc>1+1</calc><result>2</result> then <calc>2*21</calc>", 1, 2, "<result>42</result>"),  # the last call
    ("<calc>1+1</calc><result>2</result> then <calc>2*21</calc>", 1, 1, "<result>error: no calls left</result>"),
    ("<calc>1+1</calc><result>2</result>", 1, 2, None),  # answered already
    ("<think>47+85</calc>", 0, 2, "<result>error: no <calc> before </calc></result>"),
    ("<calc>1+</calc>", 0, 0, "<result>error: no calls left</result>"),  # --max_tool_calls 0: every call refused
    ("<calc>4+5</calc><", 0, 2, "result>9</result>"),  # the token that closed the call opened the reply's tag
    ("<calc>4+5</calc><re", 0, 2, "sult>9</result>"),
    ("<calc>4+5</calc>\n", 0, 2, "<result>9</result>"),  # other text after the call: the reply whole
])
def test_tool_reply_answers_each_closed_call_once(text, made, limit, reply):
    assert agent.tool_reply(text, made, limit) == reply


# --- the rollout with the calculator ------------------------------------------------------------------------------
def scripted_policy(monkeypatch, tokenizer, scripts: list[str], replies: list[list[str]]):
    """Replace the sampler by a script: each row writes its script's tokens, then EOS, and after each of them that
    closes a call ('</calc>' in the script's text for the k-th time) the rollout forces the k-th of the row's
    replies, a token a step, without the sampler. So at step t the sampler sees the rows whose t-th token is
    the script's (the rows keep their order; a row whose script has ended has left the batch), and gives each
    its token. The model still computes the logits, so the sampler's log-probs are its log-probs of the
    scripted tokens. replies: per row, the calculator's replies in order, as the rollout will force them."""
    steps = []  # per row, per step: the script's token, or None where the calculator's is forced
    for script, row_replies in zip(scripts, replies):
        ids = tokenizer(script, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        row, closed = [], 0
        for k, token in enumerate(ids):
            row.append(token)
            if tokenizer.decode(ids[: k + 1]).count("</calc>") > closed:
                row += [None] * len(tokenizer(row_replies[closed], add_special_tokens=False)["input_ids"])
                closed += 1
        steps.append(row)
    step = iter(range(max(len(row) for row in steps)))

    def next_token(logits, temperature, greedy):
        t = next(step)
        sampled = [row[t] for row in steps if len(row) > t and row[t] is not None]
        assert len(sampled) == len(logits)
        return torch.tensor(sampled, dtype=torch.long)

    monkeypatch.setattr(rollout, "next_token", next_token)


@pytest.mark.parametrize("static_cache", [False, True])
def test_rollout_appends_each_reply_and_masks_exactly_the_calculators_tokens(saved_tiny, monkeypatch, static_cache):
    """Three rows in one batch: one that calls once, one that never calls (and finishes first, leaving the
    batch and the cache), one that calls three times with --max_tool_calls 2. Each completion reads as the
    episode (the replies in place), reply_mask is 1 on the replies' tokens and nowhere else, and the
    sampler's log-probs of the policy's tokens, computed with the replies forced into the KV cache a token a
    step beside rows that did not call, equal the plain log-prob pass's over the finished [prompt | completion]
    (one forward pass, no cache): the speed-ups of the loop (each prompt run once, finished rows leaving the
    batch; or the static cache's decode_step) change no number beyond float rounding."""
    path, tokenizer, _ = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    scripts = ["<think><calc>47+85</calc></think><answer>132</answer>", "<think>7+5=12</think><answer>12</answer>",
               "<think><calc>1+1</calc><calc>2*21</calc><calc>3-4</calc></think><answer>42</answer>"]
    scripted_policy(monkeypatch, tokenizer, scripts, [["<result>132</result>"], [], ["<result>2</result>",
                                                     "<result>42</result>", "<result>error: no calls left</result>"]])
    prompts = [common.make_prompt(tokenizer, q) for q in ("What is 47 + 85?", "What is 7 + 5?", "What is 1 + 1?")]
    episodes = agent.generate_with_tools(model, tokenizer, prompts, 200, max_tool_calls=2, static_cache=static_cache)

    texts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(episodes.completion_ids, episodes.completion_mask)]
    expected = [scripts[0].replace("</calc>", "</calc><result>132</result>", 1), scripts[1],
                scripts[2].replace("2*21</calc>", "2*21</calc><result>42</result>")
                .replace("1+1</calc>", "1+1</calc><result>2</result>")
                .replace("3-4</calc>", "3-4</calc><result>error: no calls left</result>")]
    assert texts == [t + tokenizer.eos_token for t in expected]
    assert episodes.calls.tolist() == [1, 0, 3]
    for ids, tool, text in zip(episodes.completion_ids, episodes.reply_mask, expected):
        assert tokenizer.decode(ids[tool.bool()]) == "".join(re.findall(r"<result>.*?</result>", text))
    assert episodes.reply_mask[1].sum() == 0
    assert (episodes.reply_mask <= episodes.completion_mask).all()

    input_ids = torch.cat([episodes.prompt_ids, episodes.completion_ids], dim=1)
    attention_mask = torch.cat([episodes.prompt_mask, episodes.completion_mask], dim=1)
    with torch.no_grad():
        logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, episodes.completion_ids.shape[1])
    policy = agent.action_mask(episodes.completion_mask, episodes.reply_mask).bool()
    assert_close(episodes.sampler_logprobs[policy], logprobs[policy], terms=forward_terms(model.config),
                 scale=logprobs[policy].abs().max().item())
    assert (episodes.sampler_logprobs[~policy] == 0).all()


@pytest.mark.parametrize("script, budget, text, calls", [
    # a call left open at the token limit: no reply, the completion stops there
    ("<think><calc>47+85+1+2+3+4", 12, "<think><calc>47+85", 0),
    # a call closed on the last token of the budget: no room for a reply
    ("<think><calc>4+5</calc>", 17, "<think><calc>4+5</calc>", 0),
    # a reply cut where the budget ends: the calculator's tokens count
    ("<think><calc>4+5</calc>", 23, "<think><calc>4+5</calc><resul", 1),
])
@pytest.mark.parametrize("static_cache", [False, True])
def test_the_token_budget_counts_the_calculators_tokens(saved_tiny, monkeypatch, script, budget, text, calls,
                                                        static_cache):
    path, tokenizer, _ = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    scripted_policy(monkeypatch, tokenizer, [script + "x" * 40], [["<result>9</result>"]])  # longer than the budget
    episodes = agent.generate_with_tools(model, tokenizer, [common.make_prompt(tokenizer, "What is 4 + 5?")], budget,
                                         max_tool_calls=2, static_cache=static_cache)
    assert episodes.completion_ids.shape[1] == budget == int(episodes.completion_mask.sum())
    assert tokenizer.decode(episodes.completion_ids[0]) == text
    assert episodes.calls.tolist() == [calls]
    assert int(episodes.reply_mask.sum()) == (len(tokenizer("<resul")["input_ids"]) if calls else 0)


ORPHAN = "<result>error: no <calc> before </calc></result>"  # the reply to a </calc> with no <calc>: both tags


def test_policy_text_is_the_policys_tokens_without_the_calculators():
    """The text tool_reply reads: the policy's turns joined, the replies between them left out. The reply to
    an orphan </calc> holds a '</calc>' of its own; read from the whole completion it would be a second call."""
    tokenizer = common.build_tokenizer()
    turns = ["<think>47+85</calc>", ORPHAN, "</think><answer>132</answer>"]
    pieces = [tokenizer(turn, add_special_tokens=False)["input_ids"] for turn in turns]
    ids = torch.tensor([token for piece in pieces for token in piece])  # [t]
    reply_mask = torch.tensor([0] * len(pieces[0]) + [1] * len(pieces[1]) + [0] * len(pieces[2]))  # [t]
    text = agent.policy_text(tokenizer, ids, reply_mask)
    assert text == "<think>47+85</calc>\n</think><answer>132</answer>"  # its two turns, joined by a newline
    assert agent.tool_reply(text, 1, 2) is None  # the one call is answered
    assert agent.tool_reply(tokenizer.decode(ids), 1, 2) is not None  # what reading the reply as the policy's gives


def test_two_of_the_policys_turns_never_join_into_a_tag_it_did_not_write():
    """A turn that ends in '<' (SmolLM2's '><' token closes a call and opens the reply's tag) and a next turn
    that starts with '/calc>': the policy wrote no second '</calc>', and its text holds one."""
    tokenizer = common.build_tokenizer()
    turns = ["<calc>4+5</calc><", "result>9</result>", "/calc></think>"]
    pieces = [tokenizer(turn, add_special_tokens=False)["input_ids"] for turn in turns]
    ids = torch.tensor([token for piece in pieces for token in piece])  # [t]
    reply_mask = torch.tensor([0] * len(pieces[0]) + [1] * len(pieces[1]) + [0] * len(pieces[2]))  # [t]
    text = agent.policy_text(tokenizer, ids, reply_mask)
    assert text == "<calc>4+5</calc><\n/calc></think>" and text.count("</calc>") == 1
    assert agent.tool_reply(text, 1, 2) is None


@pytest.mark.parametrize("script, replies, calls", [
    # the policy closes a call it never opened, then answers: one call, the answer's tags right after </think>
    ("<think>47+85</calc></think><answer>132</answer>", [ORPHAN], 1),
    # the orphan, then a call of its own: the second reply is 42, not a reply to the tags quoted in the first
    ("<think>47+85</calc> so <calc>2*21</calc></think><answer>42</answer>", [ORPHAN, "<result>42</result>"], 2),
])
def test_an_orphan_closing_tag_is_one_call_whose_reply_is_never_read_as_the_policys(saved_tiny, monkeypatch, script,
                                                                                      replies, calls):
    """The reply to an orphan </calc> quotes both tags. The calls are counted in the policy's tokens only:
    the reply comes once, right after the policy's </calc>, and every token after it is the policy's."""
    path, tokenizer, _ = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    scripted_policy(monkeypatch, tokenizer, [script], [replies])
    episodes = agent.generate_with_tools(model, tokenizer, [common.make_prompt(tokenizer, "What is 47 + 85?")], 200,
                                         max_tool_calls=2)
    ids, tool = episodes.completion_ids[0], episodes.reply_mask[0]  # [T], [T]
    pieces = script.split("</calc>")
    expected = "".join(piece + "</calc>" + reply for piece, reply in zip(pieces, replies)) + pieces[-1]
    assert tokenizer.decode(ids) == expected + tokenizer.eos_token
    assert episodes.calls.tolist() == [calls]
    assert tokenizer.decode(ids[tool.bool()]) == "".join(replies)
    assert tokenizer.decode(ids[tool == 0]) == script + tokenizer.eos_token
    last_reply = int(tool.nonzero().max())
    assert (tool[last_reply + 1 :] == 0).all() and (episodes.sampler_logprobs[0, last_reply + 1 :] != 0).all()


def test_a_token_that_closes_a_call_and_opens_the_reply_still_does_after_an_orphan(saved_tiny, monkeypatch):
    """SmolLM2's BPE writes '</calc><' as '</', 'calc', '><': one token closes the call and opens the
    reply's tag. Here the tiny tokenizer gets a '><' token: after an orphan </calc> and its reply, the
    policy calls 4+5 and closes with '><'; the reply goes on from the policy's '<' ('result>9</result>')."""
    path, _, _ = saved_tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["><"])
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.resize_token_embeddings(len(tokenizer))
    script = "<think>47+85</calc> so <calc>4+5</calc><</think><answer>9</answer>"
    assert "><" in tokenizer.convert_ids_to_tokens(tokenizer(script, add_special_tokens=False)["input_ids"])
    scripted_policy(monkeypatch, tokenizer, [script], [[ORPHAN, "result>9</result>"]])
    episodes = agent.generate_with_tools(model, tokenizer, [common.make_prompt(tokenizer, "What is 4 + 5?")], 200,
                                         max_tool_calls=2)
    ids, tool = episodes.completion_ids[0], episodes.reply_mask[0]  # [T], [T]
    assert tokenizer.decode(ids) == ("<think>47+85</calc>" + ORPHAN + " so <calc>4+5</calc><result>9</result>"
                                     "</think><answer>9</answer>" + tokenizer.eos_token)
    assert episodes.calls.tolist() == [2]
    assert tokenizer.decode(ids[tool.bool()]) == ORPHAN + "result>9</result>"


# --- the rollout against the prefill rollout, and each of its speed-ups switched off -- -----------------------------
# A random tiny model pulled toward one episode: an orphan </calc>, a call, a call past --max_tool_calls 2. The pull
# is as strong as the model's own logits, so the rows (prompts of two lengths, so at two offsets of the episode)
# stray from it in different places: some close calls, some orphans, some stop at EOS early, some run on.
EPISODE = ("<think>47+85</calc><result>error: no <calc> before </calc></result> so <calc>47+85</calc>"
           "<result>132</result> and <calc>1+1</calc><result>error: no calls left</result></think><answer>132</answer>")
QUESTIONS = ["What is 47 + 85?", "What is 7 + 5?", "What is 12 + 34?", "What is 1 + 1?", "What is 47 + 85?",
             "What is 100 - 3?"]


def rigged_model(monkeypatch, path, tokenizer, strength: float = 1.5):
    """The saved tiny model, with `strength` added to the logit of EPISODE's token at each position (by the
    position ids, counted from the first question's prompt): in its forward pass (a hook) and in the static
    cache's decode_step, so every path of the rollout sees the same pull."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer(EPISODE, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    start = len(tokenizer(common.make_prompt(tokenizer, QUESTIONS[0]), add_special_tokens=False)["input_ids"])
    bias = torch.zeros(start + len(ids), len(tokenizer))  # [positions, V]: the pull at each position
    bias[torch.arange(len(ids)) + start - 1, torch.tensor(ids)] = strength  # position p predicts the token at p + 1
    pull = lambda positions: bias[positions.clamp(max=len(bias) - 1)]  # noqa: E731

    def hook(module, args, kwargs, output):  # logits [b, w, V] of the last w positions
        output.logits += pull(kwargs["position_ids"][:, -output.logits.shape[1]:])

    model.register_forward_hook(hook, with_kwargs=True)
    decode_step = rollout.decode_step
    monkeypatch.setattr(rollout, "decode_step", lambda weights, rotary, cache, tokens, positions, *rest:  # [N, V]
                        decode_step(weights, rotary, cache, tokens, positions, *rest) + pull(positions[:, 0]))
    return model


@pytest.mark.parametrize("budget", [60, 200])  # replies cut by the budget; every row ends (EOS at different steps)
def test_greedy_tokens_are_the_prefill_rollouts(saved_tiny, monkeypatch, budget):
    """The forced tokens change the arithmetic (a reply's keys and values computed a token a step, not in one
    prefill beside padding), not the episodes: greedy, the same tokens, replies, calls and masks as the
    rollout that prefills the reply (prefill_generate_with_tools, below), and the sampler's log-probs within
    rounding."""
    path, tokenizer, _ = saved_tiny
    model = rigged_model(monkeypatch, path, tokenizer)
    prompts = [common.make_prompt(tokenizer, q) for q in QUESTIONS]
    new = agent.generate_with_tools(model, tokenizer, prompts, budget, 2, greedy=True)
    old = prefill_generate_with_tools(model, tokenizer, prompts, budget, 2, greedy=True)
    for name in ("completion_ids", "completion_mask", "reply_mask", "calls"):
        assert torch.equal(getattr(new, name), getattr(old, name)), name
    assert torch.allclose(new.sampler_logprobs, old.sampler_logprobs, atol=1e-5)
    texts = tokenizer.batch_decode(new.completion_ids)
    assert 0 < new.reply_mask.sum() and any("</calc><result>error: no <calc>" in text for text in texts)
    if budget == 200:  # rows that called 1, 2 and 3 times, all ended by EOS, at different steps
        assert set(new.calls.tolist()) >= {2, 3} and (new.completion_mask.sum(dim=1).unique().numel() > 1)
    else:  # every row cut by the budget, some inside a reply
        assert new.completion_mask.all() and (new.reply_mask[:, -1] == 1).any()


SWITCHED_OFF = [{"share_prompts": False}, {"drop_finished": False}, {"grow_in_place": False},
                {"only_after_gt": False}, {"static_cache": True},
                {"share_prompts": False, "drop_finished": False, "grow_in_place": False, "only_after_gt": False,
                 "static_cache": False}]  # the plain loop


DEFAULT_EPISODES = {}  # (model folder, greedy) -> the default path's episodes, made once for the six switch settings


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("switches", SWITCHED_OFF)
def test_each_speed_up_switched_off_takes_the_same_tokens(saved_tiny, monkeypatch, switches, greedy):
    """Each speed-up of generate_with_tools switched off, and the static cache switched on (as on a CUDA GPU;
    here its step runs uncaptured), and all of them off: the same tokens, replies, calls and masks as the
    default's, the sampler's log-probs within rounding. Greedy; and sampled from the same seed (at temperature
    0.1, where the pull still makes calls): every path draws random numbers for the same rows, those the policy
    writes for (not a forced row, not a finished one), so no switch changes a draw."""
    path, tokenizer, _ = saved_tiny
    model = rigged_model(monkeypatch, path, tokenizer)
    prompts = [common.make_prompt(tokenizer, q) for q in QUESTIONS]
    if (path, greedy) not in DEFAULT_EPISODES:  # Speed: the default path is the same in all six, computed once
        torch.manual_seed(1)
        DEFAULT_EPISODES[path, greedy] = agent.generate_with_tools(model, tokenizer, prompts, 200, 2, 0.1, greedy)
    default = DEFAULT_EPISODES[path, greedy]
    torch.manual_seed(1)
    other = agent.generate_with_tools(model, tokenizer, prompts, 200, 2, 0.1, greedy, **switches)
    for name in ("completion_ids", "completion_mask", "reply_mask", "calls"):
        assert torch.equal(getattr(other, name), getattr(default, name)), name
    assert torch.allclose(other.sampler_logprobs, default.sampler_logprobs, atol=1e-5)
    assert len(set(default.calls.tolist())) > 1  # rows that call and rows that do not (or not as often)


# A rollout that prefills the reply, kept as the reference of
# test_greedy_tokens_are_the_prefill_rollouts: the calculator's reply prefilled with the row's sampled token, one
# forward pass of width 1 + the longest reply, padding holes in the cache. Not used by agent.py.
@torch.no_grad()
def prefill_generate_with_tools(model, tokenizer, prompts: list[str], max_new_tokens: int, max_tool_calls: int,
                                 temperature: float = 1.0, greedy: bool = False) -> agent.Episodes:
    """Episodes with the calculator: rollout.generate's loop (KV cache, a token per row per step) with
    the environment's turn inside it. After each step, a row whose own text closes a call (tool_reply) gets
    the reply's tokens. They go into the cache with the row's sampled token, one forward pass of width
    1 + the longest reply: a short prefill. Rows that call and rows that do not stay in one batch; a row
    that does not call pads the extra columns, masked out of attention (holes in the cache that its
    position ids skip). So each row's completion is contiguous, and the log-prob pass over
    [prompt | completion] sees the positions the sampler saw. The token budget counts the calculator's
    tokens: a reply is cut at max_new_tokens, and a call closed on the last token gets none."""
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    N = len(prompts)
    completion_ids = torch.full((N, max_new_tokens), tokenizer.pad_token_id, device=device)  # [N, max_new_tokens]
    reply_mask = torch.zeros_like(completion_ids)
    sampler_logprobs = torch.zeros(N, max_new_tokens, device=device)
    lengths = torch.zeros(N, dtype=torch.long, device=device)  # tokens written per row, the calculator's included
    calls = [0] * N
    may_close = agent.tokens_with_gt(tokenizer).to(device)  # [V]: tokens that may end '</calc>' (only then: decode)
    was_training = model.training
    model.eval()
    with distributed.gathered(model), rollout.autocast(model):
        # Speed: each distinct prompt run once, its rows sharing its keys and values (rollout.generate's share_prompts)
        cache, logits = rollout.rows_of(rollout.distinct_prompts(model, prompt_ids, prompt_mask))  # logits [N, 1, V]
        rows = torch.arange(N, device=device)  # the rows still writing: [b]
        attention_mask, positions = prompt_mask, prompt_mask.sum(dim=1) - 1  # [b, columns of the cache], [b]
        while True:
            # the policy's turn: one token per row
            last_logits = logits[:, -1].float()  # [b, V]
            next_tokens = rollout.next_token(last_logits, temperature, greedy)  # [b]
            sampler_logprobs[rows, lengths[rows]] = rollout.logprobs_of_tokens(last_logits, next_tokens, temperature)
            completion_ids[rows, lengths[rows]] = next_tokens
            lengths[rows] += 1
            finished = (next_tokens == tokenizer.eos_token_id) | (lengths[rows] >= max_new_tokens)  # [b]
            # the calculator's turn: rows whose text now closes a call get the reply's tokens
            replies = [[] for _ in rows]
            for i, row in enumerate(rows.tolist()):
                if finished[i] or not may_close[next_tokens[i]]:
                    continue
                written = slice(0, int(lengths[row]))
                text = agent.policy_text(tokenizer, completion_ids[row, written], reply_mask[row, written])
                reply = agent.tool_reply(text, calls[row], max_tool_calls)
                if reply is not None:
                    calls[row] += 1
                    room = max_new_tokens - int(lengths[row])  # the budget counts the calculator's tokens
                    replies[i] = tokenizer(reply, add_special_tokens=False)["input_ids"][:room]
                    span = slice(int(lengths[row]), int(lengths[row]) + len(replies[i]))
                    completion_ids[row, span], reply_mask[row, span] = torch.tensor(replies[i], device=device), 1
                    lengths[row] += len(replies[i])
                    finished[i] = lengths[row] >= max_new_tokens
            if finished.all():
                break
            if finished.any():  # Speed: finished rows leave the batch and the cache (rollout.generate's drop_finished)
                writing = ~finished
                rows, next_tokens, positions, attention_mask = (rows[writing], next_tokens[writing],
                                                                positions[writing], attention_mask[writing])
                replies = [reply for reply, keep in zip(replies, writing.tolist()) if keep]
                cache.batch_select_indices(writing.nonzero().squeeze(1))
            # the next forward pass: each row's sampled token, then its reply if it called; padding masked
            width = 1 + max(len(reply) for reply in replies)
            new_ids = torch.full((len(rows), width), tokenizer.pad_token_id, device=device)  # [b, width]
            new_mask = torch.zeros_like(new_ids)
            new_ids[:, 0], new_mask[:, 0] = next_tokens, 1
            for i, reply in enumerate(replies):
                new_ids[i, 1 : 1 + len(reply)], new_mask[i, 1 : 1 + len(reply)] = torch.tensor(reply), 1
            attention_mask = torch.cat([attention_mask, new_mask], dim=1)
            new_positions = positions[:, None] + new_mask.cumsum(dim=1)  # real tokens count; padding repeats one
            logits = model(input_ids=new_ids, attention_mask=attention_mask, position_ids=new_positions,
                           **{rollout.CACHE: cache}, use_cache=True).logits  # [b, width, V]
            last = new_mask.sum(dim=1) - 1  # [b]: each row's last real column
            logits = logits[torch.arange(len(rows), device=device), last][:, None]  # [b, 1, V]
            positions = positions + new_mask.sum(dim=1)
    model.train(was_training)
    T = int(lengths.max())
    completion_mask = (torch.arange(T, device=device) < lengths[:, None]).long()  # [N, T]
    return agent.Episodes(prompt_ids, prompt_mask, completion_ids[:, :T], completion_mask, reply_mask[:, :T],
                    sampler_logprobs[:, :T], torch.tensor(calls, device=device))


# --- the mask: the calculator's tokens take no loss, KL, entropy or ratio -----------------------------------------
def test_the_action_mask_is_1_on_the_policys_tokens_only():
    """By hand: the calculator's tokens (reply_mask 1) and the padding (completion_mask 0) get 0."""
    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    reply_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0]])
    assert agent.action_mask(completion_mask, reply_mask).tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]]


def test_the_loss_and_its_gradient_ignore_the_calculators_tokens():
    """The loss as a function of the per-token log-probs (pi, pi_old, pi_ref) with policy_mask: whatever
    the values at the calculator's positions (what a changed tool token would change there), the loss and
    its gradient are the same, and the gradient there is exactly 0. (A tool token also enters the input of
    every later token, as a prompt does: that is the observation the policy acts on, not an action.)"""
    torch.manual_seed(0)
    N, T = 4, 10
    completion_mask = torch.ones(N, T, dtype=torch.long)
    completion_mask[1, 7:] = 0
    reply_mask = torch.zeros(N, T, dtype=torch.long)
    reply_mask[0, 3:6] = reply_mask[2, 1:4] = 1
    policy_mask = agent.action_mask(completion_mask, reply_mask)
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])
    old, ref = torch.randn(N, T) - 2, torch.randn(N, T) - 2
    for loss_type in ("grpo", "dapo", "dr_grpo", "bnpo"):
        losses, grads = [], []
        for seed in (1, 2):
            noise = torch.Generator().manual_seed(seed)
            change = lambda x: torch.where(reply_mask.bool(), torch.randn(N, T, generator=noise) * 5, x)  # noqa: E731
            logprobs = change(old + 0.1 * torch.randn(N, T, generator=torch.Generator().manual_seed(0)))
            logprobs.requires_grad_(True)
            loss = grpo.grpo_loss(logprobs, change(old), change(ref), advantages, policy_mask,
                                  grpo.Config(beta=0.04, loss_type=loss_type, max_completion_length=T))
            loss.backward()
            losses.append(loss.item())
            grads.append(logprobs.grad)
        assert losses[0] == losses[1] and torch.equal(grads[0], grads[1]), loss_type
        assert (grads[0][reply_mask.bool()] == 0).all() and (grads[0][policy_mask.bool()] != 0).all()


def test_no_gradient_reaches_the_logits_that_predict_the_calculators_tokens(saved_tiny, monkeypatch):
    """Through the model: the loss's gradient on the logits at each position that predicts a calculator's
    token is exactly 0, and not at the positions that predict the policy's."""
    path, tokenizer, _ = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(path)
    scripted_policy(monkeypatch, tokenizer, ["<think><calc>47+85</calc></think><answer>132</answer>"],
                    [["<result>132</result>"]])
    episodes = agent.generate_with_tools(model, tokenizer, [common.make_prompt(tokenizer, "What is 47 + 85?")], 64, 2)
    T = episodes.completion_ids.shape[1]
    input_ids = torch.cat([episodes.prompt_ids, episodes.completion_ids], dim=1)
    logits = model(input_ids=input_ids).logits
    logits.retain_grad()
    logprobs = rollout.gather_logprobs(logits[:, -T - 1 : -1], episodes.completion_ids)  # [1, T]
    policy_mask = agent.action_mask(episodes.completion_mask, episodes.reply_mask)
    grpo.grpo_loss(logprobs, logprobs.detach(), logprobs.detach() - 0.1, torch.tensor([1.0]), policy_mask,
                   grpo.Config(beta=0.04)).backward()
    grad = logits.grad[0, -T - 1 : -1].abs().sum(dim=-1)  # [T]: at the position predicting each completion token
    assert (grad[episodes.reply_mask[0].bool()] == 0).all() and (grad[policy_mask[0].bool()] > 0).all()


# --- the script ---------------------------------------------------------------------------------------------------
SHORT = ["--max_steps", "2", "--eval_steps", "2", "--num_eval_examples", "8", "--per_device_train_batch_size", "16",
         "--num_generations", "4", "--warmup_steps", "1", "--eval_samples_per_problem", "2"]


def test_call_rates_by_kind():
    questions = ["What is 47 + 85?", "What is 41 + 15?", "What is 12 - 30?", "What is 47 + 85?"]
    rates = agent.call_rates(questions, torch.tensor([1, 0, 2, 0]))
    assert rates == {"call_rate": 0.5, "call_rate/carry": 0.5, "call_rate/no carry": 0.0, "call_rate/negative": 1.0}
    assert agent.kind_of("Natalia sold clips to 48 of her friends") is None


def test_dynamic_sampling_is_refused_in_one_sentence():
    result = run("agent.py", "--dynamic_sampling", "true", check=False)
    assert result.returncode != 0 and "agent.py does not implement --dynamic_sampling" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_run_logs_the_calls_and_the_policys_tokens_only(sft_checkpoint, tmp_path):
    out = str(tmp_path / "agent")
    run_main("agent.py", "--model", sft_checkpoint, "--output_dir", out, *SHORT)
    rows = read_metrics(out)
    steps = [row for row in rows if "loss" in row]
    assert len(steps) == 2 and all("call_rate" in row and "reply_tokens" in row for row in steps)
    assert "eval/call_rate" in rows[-1] and "eval/accuracy_greedy" in rows[-1]
    from test_sampler_mismatch import assert_float32_gap

    for row in steps:  # its own rollout's log-probs against the trainer's, over the policy's tokens
        assert_float32_gap(row, sft_checkpoint)


def advantage_error(price: float, groups: int, seed: int = 0) -> float:
    """The largest error of float32 group advantages against float64's over groups of 8 rewards, each the
    points (2.25, 0.25, 0 or -2) less up to 2 calls at a price drawn in [0.1, 1.1), all offset by price."""
    g = torch.Generator().manual_seed(seed)
    points = torch.tensor([2.25, 0.25, 0.0, -2.0], dtype=torch.float64)
    worst = 0.0
    for _ in range(groups):
        cost = 0.1 + torch.rand(1, generator=g, dtype=torch.float64)
        rewards = points[torch.randint(0, 4, (8,), generator=g)] - cost * torch.randint(0, 3, (8,), generator=g) - price
        if rewards.std() > 0:
            exact = grpo.group_advantages(rewards, 8)
            worst = max(worst, float((grpo.group_advantages(rewards.float(), 8).double() - exact).abs().max()))
    return worst


def test_a_price_that_float32_cannot_hold_beside_a_point_is_refused_where_settings_are_checked():
    """The most a completion can pay, tool_call_cost x max_completion_length (one call per token at most), must
    be at most agent.MAX_PRICE, 1e4: there float32's advantages stay within 0.0034 of float64's (agent.py's
    comment, 5,000 groups), at 1e5 by up to 0.05 and at 1e6 by up to 0.44."""
    from lib import checks
    assert agent.MAX_PRICE == 1e4
    # Bounds with room for another CPU's summation order (measured here: 0.0034, 0.050, 0.44); each fails if the
    # bound moves to the next power of ten, or float32 stops losing the points beside a large price.
    assert advantage_error(1e4, 5000) < 0.01
    assert 0.02 < advantage_error(1e5, 5000) < 0.1
    assert advantage_error(1e6, 5000) > 0.2
    checks.check_settings(agent.Config(tool_call_cost=1e4 / 64, max_completion_length=64))  # at the bound
    with pytest.raises(SystemExit, match=r"--tool_call_cost x --max_completion_length \(100 x 128\), the most"):
        checks.check_settings(agent.Config(tool_call_cost=100, max_completion_length=128))


def test_a_price_float32_cannot_hold_exits_1_in_one_sentence_before_loading_anything(tmp_path):
    """From the command line: one sentence, exit status 1, no traceback, before the model (absent here)
    is loaded and before the output folder is made."""
    out = tmp_path / "o"
    result = run("agent.py", "--tool_call_cost", "1e39", "--output_dir", str(out), "--model", str(tmp_path / "none"),
                 check=False)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --tool_call_cost x --max_completion_length (1e+39 x 64)"), last
    assert result.returncode == 1 and "rounded away" in last and "Traceback" not in result.stderr
    assert not out.exists()


def test_the_calculators_settings_are_checked_where_they_are_declared():
    from lib import checks
    for name in ("max_tool_calls", "tool_call_cost"):
        assert checks.declared_check(agent.Config, name)
    with pytest.raises(SystemExit, match="--max_tool_calls must be 0 or more"):
        checks.check_settings(agent.Config(max_tool_calls=-1))
