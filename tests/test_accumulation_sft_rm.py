"""--gradient_accumulation_steps in sft.py and reward_model.py: micro-batches whose losses are divided by
the whole step's count (answer tokens, or pairs) give the loss, gradient and update of one pass over the
step's batch, up to float rounding; the naive per-micro-batch means do not."""
import math
import os

import torch
from safetensors.torch import load_file

import common
from lib import rollout
import reward_model
import sft
from conftest import read_metrics, run_main
from floats import assert_close, forward_terms, tolerance


def _gradient(model) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector, and the gradients reset."""
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def _random_tokens(generator, lengths) -> list[list[int]]:
    """Token lists of the given lengths, drawn from `generator` among the 256 byte tokens (none special)."""
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


# --- function level: the losses' num_tokens / num_pairs -----------------------------------------
def test_sft_micro_batches_with_the_step_mean_denominator_give_the_one_pass_gradient():
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    model = common.build_tiny_model(tokenizer)
    pad = tokenizer.pad_token_id
    # 8 answers of very different lengths: the 4 micro-batches of 2 hold 3, 7, 30 and 100 of the 140 tokens
    generator = torch.Generator().manual_seed(0)
    prompts = _random_tokens(generator, [5, 9, 3, 12, 7, 4, 10, 6])
    examples = list(zip(prompts, _random_tokens(generator, [1, 2, 3, 4, 10, 20, 40, 60])))
    micro_batches = [sft.collate(examples[i : i + 2], pad) for i in range(0, 8, 2)]

    def logprobs(input_ids, attention_mask, answer_mask):
        return rollout.completion_logprobs(model, input_ids, attention_mask, answer_mask.shape[1], length_chunks=1)

    input_ids, attention_mask, answer_mask = sft.collate(examples, pad)
    loss = sft.sft_loss(logprobs(input_ids, attention_mask, answer_mask), answer_mask)  # one pass, today's call
    loss.backward()
    one_pass = _gradient(model)

    num_tokens = common.mean_denominator(answer_mask)  # the whole step's 140 answer tokens
    assert num_tokens.item() == 140
    shares = []
    for batch in micro_batches:
        share = sft.sft_loss(logprobs(*batch), batch[2], num_tokens)
        share.backward()  # the gradients add up
        shares.append(share.item())
    accumulated = _gradient(model)
    # the same sums over the same tokens, added in another order: a forward pass, then the batch's tokens
    terms = forward_terms(model.config) + input_ids.numel()
    assert_close(sum(shares), loss.item(), terms, msg="loss")
    assert_close(accumulated, one_pass, terms, msg="gradient")

    # Negative controls: each micro-batch's own token mean, summed, or averaged (loss / accumulation steps,
    # the usual recipe) weighs a token of a short micro-batch 140/3 resp. 140/12 times too much.
    bound = tolerance(terms, one_pass.abs().max().item())
    for name, divide in (("summed", 1), ("averaged", len(micro_batches))):
        for batch in micro_batches:
            (sft.sft_loss(logprobs(*batch), batch[2]) / divide).backward()
        naive = _gradient(model)
        assert (naive - one_pass).abs().max().item() > 1000 * bound, name


def _scalar_head_model():
    """A small transformer with a random N -> 1 head, as reward_model.py trains (see test_rlhf_math.py)."""
    torch.manual_seed(0)
    tokenizer = common.build_tokenizer()
    config = common.build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2).config
    config.num_labels = 1
    return common.AutoModelForSequenceClassification.from_config(config).eval(), tokenizer


def test_preference_micro_batches_with_the_step_pair_count_give_the_one_pass_gradient():
    model, tokenizer = _scalar_head_model()
    pad = tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(1)
    pairs = list(zip(*(_random_tokens(generator, lengths) for lengths in  # prompts, chosen, rejected
                       ([5, 9, 3, 12, 7, 4, 10, 6], [1, 3, 8, 20, 2, 30, 5, 40], [2, 25, 1, 6, 35, 4, 12, 3]))))

    def loss_of(batch, num_pairs=None):
        chosen, rejected = reward_model.sequence_scores(model, *reward_model.collate(batch, pad)).chunk(2)
        return reward_model.preference_loss(chosen, rejected, num_pairs)

    loss = loss_of(pairs)  # one pass, today's call: the mean over the 8 pairs
    loss.backward()
    one_pass = _gradient(model)
    shares = []
    for i in range(0, 8, 2):
        share = loss_of(pairs[i : i + 2], num_pairs=8)  # its 2 pairs' sum / the step's 8 pairs
        share.backward()
        shares.append(share.item())
    accumulated = _gradient(model)
    terms = forward_terms(model.config) + reward_model.collate(pairs, pad)[0].numel()
    assert_close(sum(shares), loss.item(), terms, msg="loss")
    assert_close(accumulated, one_pass, terms, msg="gradient")

    # Negative control: each micro-batch's own mean, summed, counts every pair 4 times. (Here every
    # micro-batch has the same number of pairs, so means divided by the 4 steps would be right.)
    for i in range(0, 8, 2):
        loss_of(pairs[i : i + 2]).backward()
    naive = _gradient(model)
    assert (naive - one_pass).abs().max().item() > 1000 * tolerance(terms, one_pass.abs().max().item())


# --- end to end: 16 examples in one pass vs 4 micro-batches of 4 --------------------------------
def _logged_close(a: float, b: float, terms: int, scale: float):
    """Two logged values agree to the float bound, plus metrics.jsonl's rounding to 6 significant digits
    (each value is off by at most half a unit of its 6th digit, so the two by at most one unit)."""
    assert abs(a - b) <= tolerance(terms, scale) + 10 ** (math.floor(math.log10(abs(b))) - 5), (a, b)


def _assert_same_first_update(start: dict, a: dict, b: dict, learning_rate: float):
    """The one-step weights a and b of two runs whose gradients agree to float rounding.

    AdamW's first step moves each weight by learning_rate * g / (|g| + 1e-8), about +-learning_rate
    whatever |g|: an entry whose gradient is below float rounding can move by up to learning_rate either
    way in the two runs. So the runs are compared by norms: they differ by a tiny fraction of the step."""
    keys = sorted(set(start) & set(a))
    step_a = torch.cat([(a[k] - start[k]).flatten() for k in keys])
    apart = torch.cat([(a[k] - b[k]).flatten() for k in keys])
    # `start` is where the run started: a weight moves by at most lr (1 + weight_decay |w|) (a wrong start is ~0.02 off)
    assert step_a.abs().max() <= 2 * learning_rate
    assert step_a.norm() > 0.1 * learning_rate * math.sqrt(len(step_a))  # most weights moved by about lr
    assert apart.norm() <= 1e-3 * step_a.norm(), (apart.norm().item(), step_a.norm().item())


def test_sft_accumulation_gives_the_one_pass_step(tmp_path):
    runs = {}
    for batch_size, accumulation in ((16, 1), (4, 4)):
        out = str(tmp_path / f"{batch_size}x{accumulation}")
        run_main("sft.py", "--output_dir", out, "--max_steps", "1", "--learning_rate", "1e-3", "--warmup_steps", "0",
                 "--per_device_train_batch_size", str(batch_size), "--gradient_accumulation_steps", str(accumulation),
                 "--eval_steps", "100", "--num_eval_examples", "8")
        runs[accumulation] = read_metrics(out)[0], load_file(os.path.join(out, "model.safetensors"))
    (one_pass, weights_a), (accumulated, weights_b) = runs[1], runs[4]
    assert one_pass["step"] == accumulated["step"] == 1

    common.set_seed(0)  # sft.py's start: the tiny model built after set_seed(seed)
    tokenizer = common.build_tokenizer()
    start = common.build_tiny_model(tokenizer)
    longest = max(len(p) + len(a) for p, a in sft.tokenize_examples(
        tokenizer, common.load_split("data/demos", "train", ("question", "answer")), "", 64))
    terms = forward_terms(start.config) + 16 * longest  # a forward pass, then the step's tokens
    _logged_close(accumulated["loss"], one_pass["loss"], terms, one_pass["loss"])
    _logged_close(accumulated["grad_norm"], one_pass["grad_norm"], terms, one_pass["grad_norm"])
    _assert_same_first_update(start.state_dict(), weights_a, weights_b, learning_rate=1e-3)


def test_reward_model_accumulation_gives_the_one_pass_step(sft_folder, tmp_path):
    runs = {}
    for batch_size, accumulation in ((16, 1), (4, 4)):
        out = str(tmp_path / f"{batch_size}x{accumulation}")
        run_main("reward_model.py", "--model", sft_folder, "--output_dir", out, "--max_steps", "1",
                 "--learning_rate", "1e-3", "--warmup_steps", "0", "--policy_prompts", "0",
                 "--per_device_train_batch_size", str(batch_size), "--gradient_accumulation_steps", str(accumulation),
                 "--eval_steps", "100", "--num_eval_examples", "8")
        runs[accumulation] = read_metrics(out)[0], load_file(os.path.join(out, "model.safetensors"))
    (one_pass, weights_a), (accumulated, weights_b) = runs[1], runs[4]
    assert one_pass["step"] == accumulated["step"] == 1

    common.set_seed(0)  # reward_model.py's start: the SFT weights and a head drawn after set_seed(seed)
    start, _ = common.load_model(sft_folder, scalar_head=True)
    # the step's scores are means over its 16 pairs in both runs (not over the last micro-batch's 4)
    for name in ("score/chosen", "score/rejected", "margin"):
        _logged_close(accumulated[name], one_pass[name], forward_terms(start.config) + 16, scale=1.0)  # O(1) scores
    terms = forward_terms(start.config) + 16 * 2 * reward_model.Config.max_length  # 32 sequences of <= max_length
    _logged_close(accumulated["loss"], one_pass["loss"], terms, one_pass["loss"])
    _logged_close(accumulated["grad_norm"], one_pass["grad_norm"], terms, one_pass["grad_norm"])
    _assert_same_first_update(start.state_dict(), weights_a, weights_b, learning_rate=1e-3)
