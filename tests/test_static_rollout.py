"""The rollout's static cache (rollout.decode_static): a KV cache of fixed size, each token one replay
of a captured CUDA graph on a GPU. A CPU has no graphs, so here the same step runs uncaptured
(static_cache=True), against the plain loop: the same greedy tokens up to a near-tie, the same
log-probs to float32 rounding; and with LoRA, the merged copy it reads against the adapter, the
trained weights untouched."""
import pytest
import torch
import transformers

import common
from lib import rollout
from floats import assert_close, forward_terms, tolerance


def recorded_logits(monkeypatch) -> list:
    """Every [b, V] that generate's loops hand rollout.next_token, in order (the plain loop's and
    decode_static's alike: both pick each token there)."""
    seen, pick = [], rollout.next_token
    monkeypatch.setattr(rollout, "next_token", lambda logits, *args: seen.append(logits.clone()) or pick(logits, *args))
    return seen


def greedy_both_ways(monkeypatch, model, tokenizer, prompts, max_new_tokens):
    """Greedy completions of the plain loop (drop_finished off, so every step holds every row) and of
    the static cache: (ids, mask, the logits of each step [T, N, V]) for each."""
    runs = []
    for static_cache in (False, True):
        seen = recorded_logits(monkeypatch)
        *_, ids, mask = rollout.generate(model, tokenizer, prompts, max_new_tokens, greedy=True, drop_finished=False,
                                         static_cache=static_cache)
        runs.append((ids, mask, torch.stack(seen)))
        monkeypatch.undo()
    return runs


def assert_same_greedy_decoding(plain, static, config, min_compared=0.9):
    """The same tokens where the plain loop's top two logits are further apart than float32 rounding
    (a row is compared up to its first near-tie), and the same log-prob of each token there."""
    (ids, mask, logits), (static_ids, static_mask, static_logits) = plain, static
    assert static_ids.shape == ids.shape and static_logits.shape == logits.shape
    logits, static_logits = logits.transpose(0, 1), static_logits.transpose(0, 1)  # [N, T, V]
    top2 = logits.topk(2, dim=-1).values
    near_tie = top2[..., 0] - top2[..., 1] <= tolerance(forward_terms(config), top2[..., 0].abs().max().item())
    compared = (near_tie.long().cumsum(1) == 0) & (mask == 1)  # before the row's first near-tie, up to its EOS
    assert compared.sum() >= min_compared * mask.sum(), "too many near-ties for the check to mean anything"
    assert torch.equal(static_ids[compared], ids[compared]) and torch.equal(static_mask[compared], mask[compared])
    logprobs, static_logprobs = (torch.log_softmax(x, -1).gather(-1, ids[..., None]).squeeze(-1)
                                 for x in (logits, static_logits))  # [N, T]: of the plain loop's tokens
    assert_close(static_logprobs[compared], logprobs[compared], terms=forward_terms(config))


def test_static_cache_decodes_as_the_plain_loop(sft_folder, monkeypatch):
    """Prompts of different lengths, repeated and not, rows that stop at different steps: the static
    cache (uncaptured on the CPU) writes the plain loop's greedy tokens with its log-probs; a row
    that wrote EOS keeps its slot, and what it writes after is padding. A second call of the same
    shape reuses the first one's step (and its cache's length, rounded up to STATIC_BUCKET)."""
    model, tokenizer = common.load_model(sft_folder)
    prompts = [common.make_prompt(tokenizer, q) for q in ("12+345=", "7-80=", "123+456=", "1-999=") for _ in range(2)]
    prompts += [common.make_prompt(tokenizer, q) for q in ("5+5=", "999-1=")]
    plain, static = greedy_both_ways(monkeypatch, model, tokenizer, prompts, 40)
    assert_same_greedy_decoding(plain, static, model.config)
    ids, mask, _ = static
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max() and (ids[mask == 0] == tokenizer.pad_token_id).all()
    assert torch.equal(mask, rollout.mask_after_eos(ids, tokenizer.eos_token_id))
    rollout.generate(model, tokenizer, prompts, 41, greedy=True, static_cache=True)
    (shape,) = rollout.static_states[model].steps  # one step made, for both calls
    assert shape[0] == len(prompts) and shape[1] % rollout.STATIC_BUCKET == 0


def test_static_cache_is_off_on_the_cpu_unless_asked_for(saved_tiny):
    """On the CPU the default (static_cache=None) is the plain loop, bit for bit, and no static step is
    made; asked for, the static cache samples completions laid out as the plain loop's."""
    path, _, _ = saved_tiny
    model, tokenizer = common.load_model(str(path))
    prompts = [common.make_prompt(tokenizer, "What is 1 + 2?")] * 6 + [common.make_prompt(tokenizer, "9-3=")] * 2
    runs = []
    for static_cache in (None, False, True):
        torch.manual_seed(0)
        runs.append(rollout.generate(model, tokenizer, prompts, 12, static_cache=static_cache))
        if static_cache is None:
            assert model not in rollout.static_states
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    prompt_ids, prompt_mask, ids, mask = runs[2]
    assert torch.equal(prompt_ids, runs[0][0]) and ids.shape[0] == len(prompts) and ids.shape[1] <= 12
    assert torch.equal(mask, rollout.mask_after_eos(ids, tokenizer.eos_token_id))
    assert (ids[mask == 0] == tokenizer.pad_token_id).all()


class Lora:  # what common.add_lora reads of a script's config
    lora_r, lora_alpha, lora_dropout, lora_target_modules = 4, 8.0, 0.0, "all-linear"


@pytest.fixture
def lora_model(saved_tiny):
    """A tiny model with grouped-query attention (4 heads, 2 key/value heads: as Qwen2.5's 14 and 2)
    and tied embeddings, LoRA r=4 on every linear layer, its B random (peft starts it at 0, which
    would make the merged weight W exactly)."""
    _, tokenizer, _ = saved_tiny
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = common.add_lora(transformers.LlamaForCausalLM(config), Lora)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return model, tokenizer


def test_merged_lora_weight_computes_what_the_adapter_does(lora_model):
    """merged_weight(layer) x = W x + (alpha / r) B (A x), the adapted layer's output, to the float32
    rounding of its sums (in + r terms, of size sum |W| |x| + (alpha / r) |B| |A| |x|)."""
    model, _ = lora_model
    layers = [module for module in model.modules() if rollout.is_lora_layer(module)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    torch.manual_seed(1)
    for layer in layers:
        x = torch.randn(5, layer.in_features)
        with torch.no_grad():
            merged = rollout.merged_weight(layer)
            A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            scale = (layer.base_layer.weight.abs() + Lora.lora_alpha / Lora.lora_r * B.abs() @ A.abs()) @ x.abs().T
            assert_close(x @ merged.T, layer(x), terms=layer.in_features + Lora.lora_r, scale=scale.max().item())
        assert not torch.equal(merged, layer.base_layer.weight)  # the adapter is in it


def test_lora_rollout_reads_merged_weights_and_never_writes_the_trained_ones(lora_model, monkeypatch):
    """Rollouts on the static cache interleaved with optimizer steps on the adapter: each decodes as
    the plain loop does through the adapter, so the merged copy follows every update, and no rollout
    writes to a trained tensor. After all the steps the frozen base is bit for bit what it was."""
    model, tokenizer = lora_model
    prompts = [common.make_prompt(tokenizer, q) for q in ("12+345=", "7-80=", "1-999=") for _ in range(2)]
    base = {name: p.clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    previous = None  # the last rollout's logits
    for step in range(4):
        before = {name: p.clone() for name, p in model.named_parameters()}
        plain, static = greedy_both_ways(monkeypatch, model, tokenizer, prompts, 16)
        assert_same_greedy_decoding(plain, static, model.config, min_compared=0.8)
        assert all(torch.equal(p, before[name]) for name, p in model.named_parameters()), f"step {step}"
        if previous is not None:  # (so the update changed what the comparison compares)
            assert not torch.equal(static[2], previous), "the rollout did not follow the update"
        previous = static[2]
        ids, mask, _ = plain  # one optimizer step: raise the log-prob of the greedy tokens
        prompt_ids, prompt_mask = rollout.pad_left([tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                                                   tokenizer.pad_token_id)
        logprobs = rollout.completion_logprobs(model, torch.cat([prompt_ids, ids], 1),
                                               torch.cat([prompt_mask, mask], 1), ids.shape[1])
        optimizer.zero_grad()
        (-(logprobs * mask).sum()).backward()
        optimizer.step()
    assert all(torch.equal(p, base[name]) for name, p in model.named_parameters() if name in base)
    assert len(base) == 2 * 7 + 2 * 2 + 2  # 14 linear weights, 4 layer norms, the final norm, the embeddings


def test_gpu_track_rollout_part_runs_on_the_cpu_and_saves_after_every_measurement(monkeypatch, tmp_path):
    """benchmarks/gpu.py's part (d) with a small layout on the CPU (the static cache uncaptured,
    transformers' generate uncompiled): every measurement ends in save(); both paths decode the same
    greedy tokens wherever no logits nearly tie; grpo.py runs full and LoRA, each with the static
    cache on and off, saving no weights."""
    import types

    from conftest import load_benchmark

    gpu = load_benchmark("gpu")
    runs = []
    monkeypatch.setattr(gpu, "run_script", lambda script, args, output_dir, **options: runs.append(
        (script, "--lora_r" in args, options)) or {"s_per_step": 1.0, "generation_s": 0.5})
    small = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    saved = []
    args = types.SimpleNamespace(completions=8, max_completion_length=6, steps=2, tiny_model=None)
    figures = gpu.part_d(args, lambda so_far: saved.append(sum(len(so_far.get(k, [])) for k in
                                                               ("greedy", "rollout", "grpo"))), shapes=small)
    assert len(figures["greedy"]) == 3 and len(figures["rollout"]) == 6 and len(figures["grpo"]) == 4
    assert saved == [1, 1, *range(2, 14)]  # after each measurement (and once the model is built)
    assert not any("error" in row for kind in ("greedy", "rollout") for row in figures[kind])
    for row in figures["greedy"]:
        assert row["parted_not_at_near_tie"] == 0 and row["compared_identical"] <= 1.0
    assert [(lora, options["plain_rollout"], options["no_saves"]) for _, lora, options in runs] == [
        (False, False, True), (False, True, True), (True, False, True), (True, True, True)]
    assert "| static cache, LoRA r=16 |" in gpu.rollout_tables(figures)


def test_static_cache_computes_qwen2_with_its_biases(saved_tiny, monkeypatch):
    """decode_step also computes Qwen2's decoder (q, k, v with biases, an untied LM head): the plain
    loop's greedy tokens and log-probs."""
    _, tokenizer, _ = saved_tiny
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)  # (they start at 0)
    prompts = [common.make_prompt(tokenizer, q) for q in ("12+345=", "7-80=", "1-999=") for _ in range(2)]
    plain, static = greedy_both_ways(monkeypatch, model, tokenizer, prompts, 16)
    assert_same_greedy_decoding(plain, static, model.config, min_compared=0.5)


def test_scaling_page_quotes_the_committed_rollout_run():
    """docs/scaling.md's tables of the static cache on the H100 are benchmarks/gpu.py's, as it printed
    them from the committed gpu.json."""
    import json
    import os

    from conftest import ROOT, load_benchmark

    gpu = load_benchmark("gpu")
    with open(os.path.join(ROOT, "docs", "gpu_runs", "h100-2026-11-26", "call2", "gpu.json")) as f:
        run = json.load(f)
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        page = f.read()
    assert run["device"] == "NVIDIA H100 80GB HBM3" and run["date"] == "2026-11-26"
    for table in gpu.rollout_tables(run["d"]).split("\n\n"):
        assert table in page
