"""Asynchronous RL: the explorer and the trainer apart (Trinity-RFT's layout, in which note 001 runs MIX).

grpo.py samples a batch, trains on it, samples the next: while one part works the other waits. Here
the two are processes of their own, as in Trinity-RFT (and TRL's AsyncGRPO, verl's asynchronous
trainer, prime-rl):

    explorer  holds a copy of the policy, weights version v; samples B prompts x G completions, scores
              them, and sends the batch (with v, the sampler's log-probs and, by default, the reference
              policy's: --reference_pass) to the trainer's buffer;
              it also runs the held-out evaluation of the versions it loads, as Trinity's explorer does
    buffer    the batches on their way, oldest first (the pair's messages: lib/synchronizer.py);
              MIX's expert rows come from a second buffer, the expert file the trainer reads
    trainer   takes the oldest batch, trains one step (GRPO's loss, or MIX's); the new version is sent to
              the explorer when the schedule says it will load it
    synchronizer  the explorer loads new weights every --sync_interval batches and runs --sync_offset
              batches ahead (Trinity-RFT's names): batch i is sampled by version v(i) and is
              staleness(i) = i - 1 - v(i) versions old when the trainer uses it (synchronizer.version_for_batch)

With --sync_offset 0 (and --sync_interval 1) the explorer waits for every version: grpo.py's loop;
with the correction off as well, grpo.py's numbers at the same seed and threads, bit for bit. With --sync_offset 1,
the default, it samples batch i + 1 while the trainer trains on batch i: the two overlap, and every
batch after the first is one update stale. A stale batch was drawn from an older policy;
--vllm_importance_sampling_correction (on here) weighs each token by pi_old / pi_sampler, truncated
(decoupled PPO's split: the ratio is clipped around the trainer's pi_old, the proximal policy; the
sampler's log-probs are the behaviour policy's). At one update per batch pi_old is the policy itself,
the ratio is 1 and no clip acts: the step is the policy gradient with that weight. docs/async.md.

    python sft.py && python async_rl.py              # starts the trainer and the explorer, out/async_rl
    python async_rl.py --sync_offset 0 --vllm_importance_sampling_correction false   # grpo.py's run
    python async_rl.py --algorithm mix               # MIX's loss (note 001), expert rows from data/expert.jsonl
    torchrun --nproc_per_node 2 async_rl.py          # the same two processes, started by torchrun
    torchrun --nnodes 2 --nproc_per_node 1 ... async_rl.py   # the trainer on one machine, the explorer on another

One trainer step (the numbered comments of trainer()):
  1. take the oldest batch from the buffer (the explorer sampled and scored it with version v)
  2. advantages: (r - group mean) / (group std); MIX: E expert rows join the batch
  3. pi_ref's log-probs (beta > 0) came from the explorer (--reference_pass trainer: an inference pass here);
     an inference pass for pi_old (num_iterations > 1)
  4. num_iterations gradient steps on GRPO's (or MIX's) loss, each token weighted by pi_old / pi_sampler
  5. publish the new weights when the explorer will load them

Left out, and why: more than one explorer or trainer process (the trainer's data parallelism is
grpo.py's; here the pair is the lesson), dropping stale batches (a batch's staleness is fixed by the
schedule, so none is sampled that would be dropped: the explorer waits instead, as Trinity's explorer
waits at its sync points and verl's rollouter pauses), partial rollouts cut at a weights change (verl,
AReaL), and nccl between GPUs (the weights go through the host over gloo: at the 0.5B layout 2 GB a
sync). With --algorithm mix, --sync_offset 0 is not mix.py's run: the prompts come from the explorer's
random stream and the expert rows from the trainer's, where mix.py draws both from one.
"""
import copy
import dataclasses
import math
import random
import sys
import time

import torch
import torch.nn.functional as F

import common
import grpo
import mix
from common import setting
from lib import distributed, harness, rollout, synchronizer
from lib.checks import check_settings
from lib.synchronizer import EXPERIENCE, SCORES, START

ALGORITHMS = ("grpo", "mix")
PLACES = ("explorer", "trainer")  # --reference_pass


@dataclasses.dataclass
class Config(mix.Config):
    """The pair's settings, then MIX's and the GRPO settings it runs (--algorithm grpo: no expert rows)."""
    algorithm: str = setting("grpo", lambda v: v in ALGORITHMS, "one of " + ", ".join(ALGORITHMS))
    """the trainer's loss: 'grpo' (grpo.py's, no expert rows) or 'mix' (mix.py's: --mu, --expert_data_ratio)"""
    sync_interval: int = setting(1, lambda v: v >= 1, "at least 1")
    """the explorer loads new weights every this many batches (Trinity-RFT's name)"""
    sync_offset: int = setting(1, lambda v: v >= 0, "0 or more")
    """how many batches the explorer runs ahead of the trainer's weights (Trinity-RFT's name): 0 with
    --sync_interval 1 is the synchronous loop (grpo.py's); after the first sync_offset batches a batch is
    sync_offset to sync_offset + sync_interval - 1 versions (trainer steps) stale (synchronizer.version_for_batch)"""
    max_staleness: int | None = setting(None, lambda v: v is None or v >= 0, "0 or more (leave it out for no bound)")
    """no batch is sampled by weights more than this many versions (trainer steps) older than the trainer's: the
    explorer waits for newer ones (TRL's name; TRL's AsyncGRPO and Trinity's staleness_control sampler skip an older
    sample instead)"""
    pair_timeout_minutes: float = setting(30.0, lambda v: v > 0, "positive")
    """how long one process waits for the other's message before it stops (a peer that died is noticed at once; one
    that is alive but stuck, only after this)"""
    reference_pass: str = setting("explorer", lambda v: v in PLACES, "one of " + ", ".join(PLACES))
    """which process computes pi_ref's log-probs for the KL term (beta > 0): 'explorer' (the explorer computes them and
    the trainer only trains) or 'trainer' (grpo.py's place for them); the same pass either way, the same numbers"""
    vllm_importance_sampling_correction: bool = True
    """on here: the sampler is an older version of the policy (decoupled PPO's behaviour policy)"""
    output_dir: str = "out/async_rl"

    def check_together(self):
        harness.PolicyGradientConfig.check_together(self)  # the sampler's correction
        if self.algorithm == "grpo":
            for name in ("mu", "expert_data_ratio", "expert_dataset"):
                if self.changed(name):
                    common.fail(f"--{name} belongs to --algorithm mix: add it, or leave --{name} out")
        num_expert, num_prompts = rows_per_step(self)
        if num_prompts < 1 or (self.per_device_train_batch_size * self.gradient_accumulation_steps - num_expert) % \
                self.num_generations:
            common.fail("the usual rows of a step (the rows minus the expert rows) must be a positive multiple of "
                        f"--num_generations ({self.num_generations})")
        if self.fsdp:
            common.fail("--fsdp shards a trainer over data-parallel processes; async_rl.py's trainer is one "
                        "process (grpo.py --fsdp true shards)")


def rows_per_step(cfg) -> tuple[int, int]:
    """(E expert rows, B prompts) of a step: B x G rollouts + E expert rows = the step's rows."""
    rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    num_expert = math.ceil(cfg.expert_data_ratio * rows) if cfg.algorithm == "mix" else 0
    return num_expert, (rows - num_expert) // cfg.num_generations


def schedule(cfg) -> tuple:
    return cfg.sync_interval, cfg.sync_offset, cfg.max_staleness


def is_evaluated(version: int, cfg) -> bool:
    """The versions the held-out evaluation scores: every --eval_steps, and the last."""
    return version % cfg.eval_steps == 0 or version == cfg.max_steps


# ---------------------------------------------------------------------------------------------
# The explorer: sample with the weights it holds, send, load new weights when the schedule says
# ---------------------------------------------------------------------------------------------
def explorer(cfg: Config, pair: synchronizer.Pair):
    start = pair.receive_object(START)  # the trainer checked the settings and the output folder first
    common.set_seed(cfg.seed)  # the random streams of grpo.py's process: the same draws at staleness 0
    data_rng = random.Random(cfg.seed)
    _, num_prompts = rows_per_step(cfg)
    train_data, test_data, model, tokenizer, _ = common.load_policy_and_prompts(cfg, per_step=num_prompts)
    if cfg.lora_r is not None:
        model = common.add_lora(model, cfg)
    model.to(distributed.get_device()).train()
    # pi_ref, the frozen starting policy (or, with LoRA, the policy with its adapter off): by default its pass is
    # here, moved off the trainer, the slower half while it held the pass (docs/async.md, "Balance").
    reference_here = cfg.beta > 0 and cfg.reference_pass == "explorer"
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if reference_here and cfg.lora_r is None else None
    synchronizer.load_flat_weights(model, pair.receive_weights(synchronizer.flat_weights(model)))
    version = start["version"]  # the trainer's version 0, or at --resume the one this batch was sampled with
    if start["generators"] is not None:  # --resume: the random streams as they were after that batch
        set_generators(start["generators"], data_rng)
    published = iter([v for v in synchronizer.published_versions(cfg.max_steps, cfg.eval_steps, *schedule(cfg))
                      if v > version])

    def evaluate():
        return common.evaluate(model, tokenizer, test_data, cfg.max_completion_length, cfg.system_prompt,
                               cfg.eval_samples_per_problem, cfg.per_device_eval_batch_size)

    def load_next_version() -> int:  # the next weights the trainer publishes; scored when due
        new_version = next(published)
        synchronizer.load_flat_weights(model, pair.receive_weights(synchronizer.flat_weights(model)))
        if is_evaluated(new_version, cfg):
            pair.send_object(evaluate(), SCORES)
        return new_version

    if start["evaluate"]:  # --eval_on_start: the start's scores
        pair.send_object(evaluate(), SCORES)
    for i in range(start["first_batch"], cfg.max_steps + 1):
        while version < synchronizer.version_for_batch(i, *schedule(cfg)):  # wait for the weights batch i needs
            version = load_next_version()
        started = time.perf_counter()
        step_data = train_data[data_rng.sample(range(len(train_data)), num_prompts)]  # {column: [B values]}
        batch = grpo.sample_and_score(model, tokenizer, step_data, cfg)  # grpo.py's steps 1 and 2
        ref_logprobs = reference_logprobs(model, ref_model, batch, cfg) if reference_here else None  # [B*G, T]
        pair.send_object({"batch": moved(batch, "cpu"), "ref_logprobs": ref_logprobs, "version": version,
                          "generators": generators(data_rng), "seconds": time.perf_counter() - started},
                         EXPERIENCE)  # into the buffer; the explorer goes on at once
    while version < cfg.max_steps:  # the last versions, for their scores
        version = load_next_version()
    pair.close()


def reference_logprobs(model, ref_model, batch: grpo.Rollout, cfg) -> torch.Tensor:
    """log pi_ref(y_t | x, y_<t) of each completion token [B*G, T] (0 at padding), for the trainer's KL term:
    grpo.py's step-4 pass, in the same micro-batches, so the same numbers; the explorer's or the trainer's
    (--reference_pass)."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [B*G, P+T]
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)  # [B*G, P+T]
    micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)
    with common.reference_model(model, ref_model) as reference:
        return rollout.inference(rollout.completion_logprobs, reference, input_ids, attention_mask,
                                 batch.completion_ids.shape[1], cfg.temperature, micro_batches=micro_batches).cpu()


def all_rows(rollout_logprobs: torch.Tensor, T: int, num_expert: int) -> torch.Tensor:
    """[B*G, t] log-probs of the rollouts -> [B*G+E, T]: 0 past a completion's end and on the E expert rows."""
    return torch.cat([F.pad(rollout_logprobs, (0, T - rollout_logprobs.shape[1])),
                      rollout_logprobs.new_zeros(num_expert, T)])


def moved(batch: grpo.Rollout, device) -> grpo.Rollout:
    """The batch with its tensors on `device` (the CPU for the wire)."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if torch.is_tensor(getattr(batch, f.name))})


def generators(data_rng) -> dict:
    """The explorer's random streams (sampling and prompt order): kept in the trainer's checkpoint."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "data": data_rng.getstate()}


def set_generators(saved: dict, data_rng):
    torch.set_rng_state(saved["torch"])
    if saved["cuda"]:
        torch.cuda.set_rng_state_all(saved["cuda"])
    data_rng.setstate(saved["data"])


# ---------------------------------------------------------------------------------------------
# The trainer: take the oldest batch, train, publish
# ---------------------------------------------------------------------------------------------
def trainer(cfg: Config, pair: synchronizer.Pair):
    run = harness.Run(cfg, inputs={"--model": cfg.model, "--dataset": cfg.dataset,
                                   **({"--expert_dataset": cfg.expert_dataset} if cfg.algorithm == "mix" else {})})
    G = cfg.num_generations
    num_expert, num_prompts = rows_per_step(cfg)
    _, _, model, tokenizer, longest = common.load_policy_and_prompts(cfg, per_step=num_prompts)
    model = run.prepare(model)  # gradient checkpointing, LoRA, device
    expert_examples = mix.load_expert_data(cfg, model, tokenizer, num_expert) if num_expert else []
    ref_model = (copy.deepcopy(model).eval().requires_grad_(False)
                 if cfg.beta > 0 and cfg.reference_pass == "trainer" and cfg.lora_r is None else None)
    run.log_memory([model], [ref_model], rows=cfg.per_device_train_batch_size,
                   sequence_length=longest + cfg.max_completion_length, completion_length=cfg.max_completion_length)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = common.warmup_cosine_schedule(optimizer, cfg.warmup_steps * cfg.num_iterations,
                                              cfg.max_steps * cfg.num_iterations, cfg.min_lr_rate)
    published = set(synchronizer.published_versions(cfg.max_steps, cfg.eval_steps, *schedule(cfg)))
    # What a checkpoint needs to restart the explorer where it was: its random streams after the last batch
    # trained on, and the weights versions it has still to load (restored in place by run.steps at --resume).
    state = {"explorer": None, "versions": {}}
    explorer_started, scores_to_skip = False, [0]

    def start_explorer(step: int):  # the first batch it samples, and the weights it samples with
        nonlocal explorer_started
        explorer_started = True
        if step == 0:  # a new run: version 0, the trainer's starting weights
            state["versions"] = {0: synchronizer.flat_weights(model)}
            pair.send_object({"first_batch": 1, "version": 0, "generators": None, "evaluate": cfg.eval_on_start},
                             START)
            pair.send_weights(state["versions"][0])
            return
        # --resume after step k = step: the explorer as it was after batch k, with the version v(k) that sampled
        # it; then the versions after v(k) it had still to load, again; the scores of those it evaluates again
        # were logged before the checkpoint and are skipped.
        sampled_with = synchronizer.version_for_batch(step, *schedule(cfg))
        pair.send_object({"first_batch": step + 1, "version": sampled_with, "generators": state["explorer"],
                          "evaluate": False}, START)
        pair.send_weights(state["versions"][sampled_with])
        for version in sorted(v for v in published if sampled_with < v <= step):
            pair.send_weights(state["versions"][version])
            scores_to_skip[0] += is_evaluated(version, cfg)

    def evaluate():  # the explorer scores the versions it loads; the trainer waits for the scores
        if not explorer_started:
            start_explorer(0)
        for _ in range(scores_to_skip[0]):
            pair.receive_object(SCORES)
        scores_to_skip[0] = 0
        return pair.receive_object(SCORES)

    for step in run.steps([model], [optimizer], [scheduler], evaluate, state):
        if not explorer_started:
            start_explorer(step - 1)
        # 1. The oldest batch in the buffer: B prompts x G samples, scored by the explorer with version v.
        waited = time.perf_counter()
        message = pair.receive_object(EXPERIENCE)
        rollout.seconds["waiting"] += time.perf_counter() - waited  # time/waiting: the trainer idle
        batch, state["explorer"] = moved(message["batch"], run.device), message["generators"]
        rewards = batch.rewards_per_func.sum(dim=1)  # [B*G]

        # 2. Group-relative advantages; MIX: E expert answers join the batch below the rollouts.
        advantages = grpo.group_advantages(rewards, G).to(run.device)  # [B*G]
        expert_rows = [expert_examples[i] for i in run.rng.sample(range(len(expert_examples)), num_expert)]
        prompt_ids, prompt_mask, completion_ids, completion_mask = mix.append_rows(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, expert_rows,
            tokenizer.pad_token_id)  # [B*G+E, P], [B*G+E, P], [B*G+E, T], [B*G+E, T]
        expert_mask = torch.arange(len(completion_ids), device=run.device) >= len(rewards)  # [B*G+E], True: expert
        advantages = F.pad(advantages, (0, num_expert))  # [B*G+E]; 0 on expert rows

        # 3. pi_ref's log-probs (beta > 0): the explorer's, sent with the batch, or an inference pass here; pi_old,
        #    if it will differ from pi, an inference pass of the trainer's weights before this step's updates.
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B*G+E, P+T]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B*G+E, P+T]
        T = completion_ids.shape[1]
        sampler_logprobs = all_rows(batch.sampler_logprobs, T, num_expert)  # [B*G+E, T]: the behaviour policy's
        micro_batches = torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size)  # gradient accumulation
        ref_logprobs = old_logprobs = None  # [B*G+E, T] each, where needed
        if cfg.beta > 0:  # the rollouts' [B*G, t], from the explorer or computed here; expert rows carry no KL term
            rollout_ref = (message["ref_logprobs"] if message["ref_logprobs"] is not None
                           else reference_logprobs(model, ref_model, batch, cfg))
            ref_logprobs = all_rows(rollout_ref.to(run.device), T, num_expert)  # 0 on the expert rows
        if cfg.num_iterations > 1:  # the proximal policy pi_old: the trainer's weights before this step's updates
            old_logprobs = rollout.inference(rollout.completion_logprobs, model, input_ids, attention_mask, T,
                                             cfg.temperature, micro_batches=micro_batches)

        # 4. num_iterations gradient steps: the clipped ratio pi / pi_old, each token weighted by pi_old / pi_sampler.
        for _ in range(cfg.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            logprobs, entropy = (torch.zeros_like(completion_mask, dtype=torch.float) for _ in range(2))  # [B*G+E, T]
            for rows in micro_batches:
                micro_logprobs, entropy[rows] = rollout.completion_logprobs_and_entropy(
                    model, input_ids[rows], attention_mask[rows], T, cfg.temperature)  # [n, T] each
                micro_old = micro_logprobs.detach() if old_logprobs is None else old_logprobs[rows]  # pi_old [n, T]
                weights = (rollout.sampler_importance_weights(  # the off-policy correction, truncated
                    micro_old, sampler_logprobs[rows], completion_mask[rows], cfg.vllm_importance_sampling_mode,
                    cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min)
                    if cfg.vllm_importance_sampling_correction else None)
                if cfg.algorithm == "mix":  # (1 - mu) x GRPO's loss on the rollouts + mu x the expert rows' NLL
                    micro_loss = mix.mix_loss(micro_logprobs, micro_old, grpo.rows_or_none(ref_logprobs, rows),
                                              advantages[rows], completion_mask[rows], expert_mask[rows], cfg,
                                              (completion_mask, expert_mask), weights)
                else:  # GRPO's loss: the clipped ratio times the group advantage, plus beta x k3
                    micro_loss = grpo.grpo_loss(micro_logprobs, micro_old, grpo.rows_or_none(ref_logprobs, rows),
                                                advantages[rows], completion_mask[rows], cfg, completion_mask, weights)
                micro_loss.backward()
                loss = loss + micro_loss.detach()
                logprobs[rows] = micro_logprobs.detach()
            grad_norm = run.clip_gradients(model, loss)  # a NaN or inf stops here
            optimizer.step()
            scheduler.step()

        # 5. Publish version `step` when the explorer will load it; keep what a checkpoint needs.
        if step in published:
            state["versions"][step] = synchronizer.flat_weights(model)
            pair.send_weights(state["versions"][step])
        oldest = synchronizer.version_for_batch(step, *schedule(cfg))  # the explorer will never ask for older ones
        state["versions"] = {v: w for v, w in state["versions"].items() if v >= oldest}

        if cfg.algorithm == "mix":
            metrics, completions = mix.step_log(batch, expert_mask, advantages, logprobs, old_logprobs, ref_logprobs,
                                                entropy, completion_mask, loss, grad_norm, scheduler, cfg,
                                                sampler_logprobs)
        else:
            metrics, completions = grpo.step_log(batch, advantages, logprobs, old_logprobs, ref_logprobs, entropy,
                                                 loss, grad_norm, scheduler, cfg)
        run.end_step({**metrics, "off_policy/mean": step - 1 - message["version"],  # staleness (prime-rl's name)
                      "time/explorer": message["seconds"]}, completions)  # evaluate, save

    plots = {"reward": ["reward", "rewards/correctness_reward", "rewards/format_reward"],
             "held-out accuracy": ["eval/accuracy_greedy", "eval/accuracy_sampled"],
             "staleness (updates)": ["off_policy/mean"], "seconds per step": ["time/step", "time/waiting"]}
    run.finish(tokenizer, {"": model}, plots, f"asynchronous {cfg.algorithm.upper()}")
    pair.close()
    return model


def main(cfg: Config, rank: int, address: str, port: int):
    pair = synchronizer.Pair(rank, address, port, cfg.pair_timeout_minutes)
    (trainer if rank == synchronizer.TRAINER else explorer)(cfg, pair)


if __name__ == "__main__":
    config = common.parse_config(Config)
    check_settings(config)  # --help and bad settings are answered before any process starts
    me = synchronizer.role()  # (rank, address, port) in one of the pair; None: start the pair
    if me is None:
        sys.exit(synchronizer.launch())
    main(config, *me)
