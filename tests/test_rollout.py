"""The rollout and the log-prob pass (lib/rollout.py): log-probs line up with what generation sampled,
and every speed-up computes what its plain path computes: the same tokens (greedy, up to a
near-tie) and the same log-probs and gradients to float32 rounding."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import common
from lib import rollout
from floats import assert_close, forward_terms, tolerance


def test_completion_logprobs_match_generation_scores(saved_tiny):
    """The log-probs we train on are those of the tokens generation sampled, at the same positions,
    despite left padding (prompts of different lengths)."""
    path, tokenizer, _ = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [common.make_prompt(tokenizer, q) for q in ("What is 1 + 2?", "What is 47 + 85 + 1000?")]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**encoded, max_new_tokens=6, do_sample=True, top_k=0, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=-1)
    completion_ids = out.sequences[:, encoded["input_ids"].shape[1]:]
    scores = torch.stack(out.logits, dim=1)  # [B, T, V]: what generation sampled from
    expected = torch.log_softmax(scores.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    mask = torch.cat([encoded["attention_mask"], torch.ones_like(completion_ids)], dim=1)
    with torch.no_grad():
        got = rollout.completion_logprobs(model, out.sequences, mask, completion_ids.shape[1])
    assert_close(got, expected, terms=forward_terms(model.config))  # generate's cached passes vs one pass


def test_completion_logprobs_equal_full_forward(saved_tiny):
    _, _, model = saved_tiny
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [B, 9, V]
        full = torch.log_softmax(logits[:, 5:8], -1).gather(-1, input_ids[:, 6:9].unsqueeze(-1)).squeeze(-1)
        got = rollout.completion_logprobs(model, input_ids, attention_mask, 3)
    assert_close(got, full, terms=forward_terms(model.config))


@pytest.mark.parametrize("drop_finished", [True, False])
def test_generate_masks_after_first_eos(saved_tiny, drop_finished):
    path, tokenizer, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    torch.manual_seed(0)
    prompts = [common.make_prompt(tokenizer, "What is 1 + 2?")] * 16
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 12,
                                                                                        drop_finished=drop_finished)
    assert prompt_ids.shape == prompt_mask.shape and completion_ids.shape == completion_mask.shape
    assert torch.equal(completion_mask, rollout.mask_after_eos(completion_ids, tokenizer.eos_token_id))
    # whatever follows a row's mask is padding
    assert (completion_ids[completion_mask == 0] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("length_chunks", [1, 2, 3])
def test_prompt_sharing_gives_the_same_logprobs_and_gradients(saved_tiny, length_chunks):
    """Rows that share a prompt (GRPO's groups) run it once (rollout.distinct_prompts), once for all
    the length chunks: the log-probs and the gradients are those of one plain forward pass over every row."""
    path, tokenizer, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    prompts = [common.make_prompt(tokenizer, q) for q in ("1+2=", "47+85+1000=", "9-3=") for _ in range(3)]
    prompt_ids, prompt_mask = rollout.pad_left([tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                                              tokenizer.pad_token_id)
    torch.manual_seed(0)
    completion_ids = torch.randint(0, 256, (len(prompts), 5))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = 0  # a completion that ended early
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    assert rollout.prompts_repeat(prompt_ids) and not rollout.prompts_repeat(prompt_ids[::3])

    def logprobs_and_grads(shared):
        model.zero_grad()
        if shared is not None:  # completion_logprobs with the prompt cache on or off (its plain pass)
            logprobs = rollout.completion_logprobs(model, input_ids, attention_mask, 5, share_prompts=shared,
                                                   length_chunks=length_chunks)
        else:  # the plain pass, by hand
            position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
            logprobs = rollout.gather_logprobs(logits[:, -6:-1], completion_ids)
        (logprobs * completion_mask).sum().backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    widths = []  # the width of each forward pass's input_ids
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                           with_kwargs=True)
    by_hand, by_hand_grads = logprobs_and_grads(None)
    widths.clear()
    got, _ = logprobs_and_grads(True)
    hook.remove()
    # the 3 distinct prompts in one pass, then each chunk's completions only (at most 5 tokens)
    assert widths[0] == (3, prompt_ids.shape[1]) and len(widths) == 1 + length_chunks
    assert sorted(rows for rows, _ in widths[1:]) == sorted(len(c) for c in torch.arange(9).chunk(length_chunks))
    assert all(width <= 5 for _, width in widths[1:])
    for shared in (True, False):
        got, got_grads = logprobs_and_grads(shared)
        assert_close(got * completion_mask, by_hand * completion_mask, terms=forward_terms(model.config))
        for a, b in zip(got_grads, by_hand_grads):  # a gradient also sums over the batch's positions
            assert_close(a, b, terms=forward_terms(model.config) + input_ids.numel())


ALL_ON = dict(share_prompts=True, drop_finished=True, grow_in_place=True)
SPEED_UPS = ([ALL_ON] + [{**ALL_ON, name: False} for name in ALL_ON]
             + [dict.fromkeys(ALL_ON, False)])  # all, each off, none


@pytest.mark.parametrize("speed_ups", SPEED_UPS, ids=lambda s: "+".join(k for k, on in s.items() if on) or "plain")
def test_generate_greedy_equals_hf_generate(sft_folder, speed_ups):
    """Our rollout loop decodes exactly what transformers' generate does, greedy, with repeated and
    unique prompts of different lengths: the plain loop, and with each speed-up (the prompt cache,
    rows leaving the batch at EOS, the KV cache written in place) on or off.
    Both compute the same logits in another order, so a near-tie (top two logits closer than
    float32 rounding) may break either way: a row is compared up to its first near-tie."""
    from transformers import GenerationConfig

    model, tokenizer = common.load_model(sft_folder)
    prompts = [common.make_prompt(tokenizer, q) for q in ("12+345=", "7-80=", "123+456=", "1-999=") for _ in range(2)]
    prompts += [common.make_prompt(tokenizer, q) for q in ("5+5=", "999-1=")]
    _, _, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, 40, greedy=True,
                                                            **speed_ups)
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, output_logits=True, return_dict_in_generate=True)
    out = model.generate(**encoded, generation_config=config)
    expected = out.sequences[:, encoded["input_ids"].shape[1]:]
    expected_mask = rollout.mask_after_eos(expected, tokenizer.eos_token_id)
    top2 = torch.stack(out.logits, dim=1).float().topk(2, dim=-1).values  # [B, T, 2]
    gap = top2[..., 0] - top2[..., 1]
    near_tie = gap <= tolerance(forward_terms(model.config), top2[..., 0].abs().max().item())
    compared = (near_tie.long().cumsum(1) == 0)  # positions before the row's first near-tie
    assert completion_ids.shape[1] == expected.shape[1]
    ours, theirs = completion_ids * completion_mask, expected * expected_mask
    assert torch.equal(ours[compared], theirs[compared])
    assert compared.float().mean() > 0.9, "too many near-ties for the check to mean anything"
    lengths = completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows stopped at different steps (the batch shrank, with drop_finished)


def test_growing_cache_gives_the_same_logits_as_concatenation(saved_tiny):
    """rollout.GrowingLayer writes each token's keys and values into room kept for them where
    transformers' DynamicLayer concatenates: the attention reads the same values, so the logits are
    the same to the bit, token after token, also after rows leave the batch (drop_finished)."""
    _, _, model = saved_tiny
    torch.manual_seed(0)
    prompt_ids = torch.randint(0, 256, (4, 7))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = 0  # a left-padded prompt
    caches = []
    with torch.no_grad():
        for grow in (False, True):
            out = model(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True,
                        position_ids=rollout.position_ids(prompt_mask))
            cache = getattr(out, rollout.CACHE)
            if grow:
                rollout.make_room(cache, 6)
            caches.append(cache)
        rows, mask, positions = torch.arange(4), prompt_mask, prompt_mask.sum(1) - 1
        for t in range(6):
            if t == 3:  # rows 1 and 2 leave the batch
                rows, mask, positions = rows[[0, 3]], mask[[0, 3]], positions[[0, 3]]
                for cache in caches:
                    cache.batch_select_indices(torch.tensor([0, 3]))
            mask, positions = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1), positions + 1
            tokens = torch.randint(0, 256, (len(rows), 1))
            step = [model(input_ids=tokens, attention_mask=mask, position_ids=positions[:, None], use_cache=True,
                          **{rollout.CACHE: cache}).logits for cache in caches]
            assert torch.equal(step[0], step[1]), f"token {t}"
    assert all(isinstance(layer, rollout.GrowingLayer) for layer in caches[1].layers)
    assert caches[1].get_seq_length() == 7 + 6
    assert caches[1].layers[0].key_room.shape[2] == 7 + 6  # it never grew past the room it was given


def test_length_chunks_change_nothing_but_the_padding(saved_tiny):
    """completion_logprobs sorts rows by completion length into chunks cut to their own longest
    completion: the log-probs of real tokens are those of one pass, whatever the chunks."""
    _, _, model = saved_tiny
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (6, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, :2] = torch.tensor([0, 1]).repeat(6, 1)  # some left padding in the prompts
    ends = torch.tensor([6, 1, 3, 6, 2, 5])  # completion lengths (of T = 6)
    attention_mask[:, -6:] = (torch.arange(6) < ends[:, None]).long()
    with torch.no_grad():
        one = rollout.completion_logprobs(model, input_ids, attention_mask, 6, length_chunks=1)
        for chunks in (2, 3, 6):
            got = rollout.completion_logprobs(model, input_ids, attention_mask, 6, length_chunks=chunks)
            mask = attention_mask[:, -6:].bool()
            assert_close(got[mask], one[mask], terms=forward_terms(model.config)) and torch.isfinite(got).all()
