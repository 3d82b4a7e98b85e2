"""Where a GRPO step's training passes spend their time, full fine-tuning against LoRA.

    python benchmarks/profile_step.py                     # on a CUDA GPU: Qwen2.5-0.5B's shapes, random weights
    python benchmarks/profile_step.py --small             # anywhere (the CPU too): a tiny layout, to try the script
    python benchmarks/profile_step.py --output out/profile_step --repeats 5 --variants full peft fused

The model is benchmarks/gpu.py's: Qwen2.5-0.5B's shapes as a Llama model with random weights
(build_random_model), fp32 weights under bf16 autocast, as grpo.py runs it on a GPU. One rollout
(rollout.generate, the static cache on a GPU) of --prompts prompts x 8 samples of --tokens tokens
is made once and reused; the rollout is not what is measured. What is measured is the rest of one
grpo.py step at its defaults (beta 0.04, num_iterations 1, one micro-batch), built from grpo.py's
and lib/rollout.py's own functions: the reference pass (rollout.inference of completion_logprobs under
common.reference_model), the policy's log-prob pass with its entropy, grpo.grpo_loss, the backward
pass, clip_grad_norm_ and AdamW's step, ending with the loss's .item() as grpo.py's logging does.
The advantages come from random rewards (grpo.advantages_of): the arithmetic does not depend on them.

Each variant ("setup") is warmed up, then timed --repeats times (torch.cuda.synchronize before and
after; the median is reported), then profiled once (torch.profiler, CPU and CUDA, record_shapes).
The profile's kernels are put into groups a reader knows (matmuls of the base layers and of the LM
head, the adapters' own work, attention, casts, the log-probs over the vocabulary, other elementwise
work, the optimizer), and the GPU's idle time is the profiled pass's wall time less the union of its
kernels' intervals (launch overhead: the GPU waiting for the CPU). The adapters' share is found by
name ranges (torch.profiler.record_function) put around each adapted layer and its base product
during the profiled pass only; backward work is traced back to the forward op that created its
autograd node (the profiler's sequence numbers).

Variants (--variants; the LoRA ones share one model, r = 16 on every linear layer, common.add_lora):
  full            full fine-tuning, the reference a frozen deep copy (grpo.py's)
  peft            LoRA as the repo runs it (peft's lora.Linear.forward)
  peft_nocast     peft's own switch, peft.helpers.disable_input_dtype_casting (no fp32 copy of a bf16 input)
  peft_cast_once  peft's forward, the frozen base weights (and the tied LM head) cast to bf16 once, not at every call
  fused           each adapted layer's forward replaced: the input cast to bf16 once, the base product,
                  then the adapter added by one addmm (y + s (x A^T) B^T): 3 products, no separate scale or add
  fused_cast_once both
  merged_delta    y = x (W + s B A)^T: the adapter folded into the weight at every call (one small addmm),
                  the weight's full gradient computed in the backward, as in full fine-tuning; bf16 base cast once
  compiled        peft's layers with each decoder layer torch.compile'd (last, skipped when time runs short;
                  its profile has no name ranges, so its adapters' work is counted with the base's)
  full_again, peft_again   the baselines once more, to show how much two runs of the same thing differ
Each LoRA variant is also checked against peft's: the same adapter weights, one policy pass, the
largest difference of the log-probs and the relative difference of the adapters' gradients.

Writes, into --output (default out/profile_step): profile_step.json (after every measurement, so a
run cut short keeps what it measured), tables.txt (each variant's key_averages tables: CUDA time and
CPU time) and log.txt (what it printed).
"""
import argparse
import contextlib
import copy
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu  # noqa: E402  benchmarks/gpu.py: import_repo, build_random_model, QWEN25_05B, LoraSettings

SMALL = dict(vocab_size=512, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
VARIANTS = ["full", "peft", "peft_nocast", "peft_cast_once", "fused", "fused_cast_once", "merged_delta", "full_again",
            "peft_again",
            "compiled"]
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation", "aten::matmul",
           "aten::linear", "aten::addbmm"}
CASTS = {"aten::to", "aten::_to_copy", "aten::copy_"}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
PHASES = ("ref pass", "policy forward", "loss", "backward", "optimizer")
GROUPS = ["base: matmuls of the layers", "base: LM head matmul", "adapters: matmuls (rank r)",
          "adapters: casts, scaling, adds", "attention (SDPA)", "casts (autocast, fp32<->bf16) and copies",
          "log-probs over the vocabulary", "elementwise and other", "optimizer (clip, AdamW, zero_grad)"]
RANGES = "named ranges' own CPU time (Python between ops; the main thread waiting for the backward)"
TAGS = {"on": False}  # name ranges around the adapted layers: only during the profiled pass
LOG = []


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


# ---------------------------------------------------------------------------------------------
# One step's training passes, from grpo.py's and lib/rollout.py's functions
# ---------------------------------------------------------------------------------------------
def make_batch(model, tokenizer, cfg, prompts_n: int, tokens: int, device) -> dict:
    """One rollout (grpo.py's step 1, rollout.generate), then the tensors grpo.py's steps 3-5 use."""
    import torch

    common, rollout = gpu.import_repo()
    import grpo

    with open(os.path.join(gpu.ROOT, "data", "arithmetic", "test.jsonl")) as f:
        questions = [json.loads(line)["question"] for line in f][:prompts_n]
    G = cfg.num_generations
    prompts = [common.make_prompt(tokenizer, q) for q in questions for _ in range(G)]
    torch.manual_seed(0)
    started = time.perf_counter()
    prompt_ids, prompt_mask, completion_ids, completion_mask = rollout.generate(model, tokenizer, prompts, tokens,
                                                                               cfg.temperature)
    gpu.synchronize()
    rollout_s = time.perf_counter() - started
    rewards = torch.randn(len(prompts), generator=torch.Generator().manual_seed(0))  # the passes do not read them
    advantages = grpo.advantages_of(rewards, G, cfg.advantage_estimator, cfg.scale_rewards).to(device)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return dict(input_ids=input_ids, attention_mask=attention_mask, T=completion_ids.shape[1], advantages=advantages,
                loss_mask=completion_mask,
                micro_batches=torch.arange(len(input_ids)).split(cfg.per_device_train_batch_size),
                rollout_s=rollout_s, questions=questions,
                prompt_tokens=prompt_ids.shape[1], completion_tokens=int(completion_mask.sum()))


def training_passes(model, ref_model, batch: dict, cfg, optimizer, named: bool = False):
    """grpo.py's steps 4 and 5 for one batch (num_iterations 1), as its loop runs them; named: each
    part inside a profiler range (PHASES). Returns (loss, grad_norm) as floats (grpo.py logs both)."""
    import torch
    from torch.profiler import record_function

    common, rollout = gpu.import_repo()
    import grpo

    part = record_function if named else (lambda name: contextlib.nullcontext())
    b = batch
    input_ids, attention_mask, T, micro_batches = b["input_ids"], b["attention_mask"], b["T"], b["micro_batches"]
    ref_logprobs = None
    with part("ref pass"):
        if cfg.beta > 0:
            with common.reference_model(model, ref_model) as reference:
                ref_logprobs = rollout.inference(rollout.completion_logprobs, reference, input_ids, attention_mask, T,
                                                 cfg.temperature, micro_batches=micro_batches)
    optimizer.zero_grad(set_to_none=True)
    (logprobs, entropy), loss = torch.zeros(2, *b["loss_mask"].shape, device=input_ids.device), 0.0
    for rows in micro_batches:
        with part("policy forward"):
            micro_logprobs, entropy[rows] = rollout.completion_logprobs_and_entropy(
                model, input_ids[rows], attention_mask[rows], T, cfg.temperature)
        with part("loss"):
            micro_loss = grpo.grpo_loss(
                micro_logprobs, micro_logprobs.detach(), ref_logprobs[rows] if ref_logprobs is not None else None,
                b["advantages"][rows], b["loss_mask"][rows], cfg, step_mask=b["loss_mask"])
        with part("backward"):
            micro_loss.backward()
        logprobs[rows], loss = micro_logprobs.detach(), loss + micro_loss.detach()
    with part("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
    return loss.item(), grad_norm.item()


# ---------------------------------------------------------------------------------------------
# The LoRA variants: forwards put on each adapted layer (instances only; peft's class is untouched)
# ---------------------------------------------------------------------------------------------
def lora_layers(model) -> list:
    from peft.tuners.lora import Linear as LoraLinear

    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def tag(name: str):
    from torch.profiler import record_function

    return record_function(name) if TAGS["on"] else contextlib.nullcontext()


def compute_dtype(x):
    import torch

    return torch.get_autocast_dtype("cuda" if x.is_cuda else "cpu") if torch.is_autocast_enabled(x.device.type) \
        else x.dtype


def adapter_tensors(layer):
    name = layer.active_adapters[0]
    return layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]


def fused_forward(self, x, *args, **kwargs):
    """The base product and the adapter, with the input cast once and the adapter added by one addmm:
    y = x W^T + b, then y + s (x A^T) B^T. Its value is peft's (up to where bf16 rounds)."""
    import torch
    import torch.nn.functional as F

    base = self.base_layer
    if self.disable_adapters or not self.active_adapters:
        return base(x)
    A, B, s = adapter_tensors(self)
    with tag("base_linear"):
        xh = x.to(compute_dtype(x))
        weight = getattr(self, "_weight_once", None)
        y = F.linear(xh, weight if weight is not None else base.weight,
                     getattr(self, "_bias_once", base.bias) if weight is not None else base.bias)
    h = F.linear(xh, A)  # [.., r]
    out = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), B.t(), alpha=s)
    return out.view(y.shape)


def merged_delta_forward(self, x, *args, **kwargs):
    """y = x (W + s B A)^T + b: the adapter folded into the weight by one small addmm at each call
    (the frozen weight cast to bf16 once); the backward computes the weight's full gradient."""
    import torch
    import torch.nn.functional as F

    base = self.base_layer
    if self.disable_adapters or not self.active_adapters:
        return base(x)
    A, B, s = adapter_tensors(self)
    weight = getattr(self, "_weight_once", base.weight)
    effective = torch.addmm(weight, B, A, alpha=s)
    with tag("base_linear"):
        return F.linear(x.to(compute_dtype(x)), effective, getattr(self, "_bias_once", base.bias))


def tagged(forward, name: str):
    def call(*args, **kwargs):
        with tag(name):
            return forward(*args, **kwargs)
    return call


def install_tags(model) -> list:
    """Name ranges lora_layer (each adapted layer) and base_linear (its base product) for the
    profiler; returns what to undo."""
    undo = []
    for layer in lora_layers(model):
        undo.append((layer, layer.__dict__.get("forward")))
        layer.forward = tagged(layer.forward, "lora_layer")
        undo.append((layer.base_layer, layer.base_layer.__dict__.get("forward")))  # peft's forward calls it
        layer.base_layer.forward = tagged(layer.base_layer.forward, "base_linear")
    return undo


def uninstall(undo: list):
    for module, forward in reversed(undo):
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward


def set_forward(model, forward) -> list:
    undo = []
    for layer in lora_layers(model):
        undo.append((layer, layer.__dict__.get("forward")))
        layer.forward = types.MethodType(forward, layer)
    return undo


def cast_once(model) -> list:
    """The frozen base weights of the adapted layers, and the LM head (tied to the frozen embedding),
    kept as copies in autocast's dtype (bf16 on a GPU), made once: each base product then reads its
    copy instead of casting the fp32 weight again at every call, as autocast does (it keeps a cast
    only within one autocast region, and only of a weight that requires a gradient). Their
    base_layer's forward (the reference pass and peft's forward call it) and the LM head's read the
    copies. Returns what to undo."""
    import torch
    import torch.nn.functional as F

    def dtype_for(weight):
        return torch.bfloat16 if weight.is_cuda and torch.cuda.is_bf16_supported() else weight.dtype

    def reading(weight, bias):
        def forward(x):
            return F.linear(x.to(compute_dtype(x)), weight, bias)
        return forward

    undo = []
    for layer in lora_layers(model):
        base = layer.base_layer
        layer._weight_once = base.weight.detach().to(dtype_for(base.weight))
        layer._bias_once = base.bias.detach().to(dtype_for(base.weight)) if base.bias is not None else None
        undo.append(("attr", layer))
        undo.append((base, base.__dict__.get("forward")))
        base.forward = reading(layer._weight_once, layer._bias_once)
    head = model.get_output_embeddings()
    if head is not None and not head.weight.requires_grad:
        undo.append((head, head.__dict__.get("forward")))
        head.forward = reading(head.weight.detach().to(dtype_for(head.weight)), None)
    return undo


def undo_all(undo: list):
    """Undo what the installs did, last first: ("attr", layer) drops the cast-once copies,
    ("compile", layer) drops the compiled call, (module, forward) puts the forward back."""
    for what, value in reversed(undo):
        if isinstance(what, str) and what == "attr":
            for name in ("_weight_once", "_bias_once"):
                value.__dict__.pop(name, None)
        elif isinstance(what, str) and what == "compile":
            value._compiled_call_impl = None
        else:
            uninstall([(what, value)])


# ---------------------------------------------------------------------------------------------
# The profile, in groups
# ---------------------------------------------------------------------------------------------
def ancestors(event):
    chain = [event]
    while chain[-1].cpu_parent is not None:
        chain.append(chain[-1].cpu_parent)
    return chain


def has_dim(event, size: int) -> bool:
    return any(size in shape for shape in (event.input_shapes or []) if isinstance(shape, (list, tuple)))


def classify(event, chain, owner_of_seq: dict, vocab: int, owner_by_seq: dict | None = None) -> tuple[str, str]:
    """(phase, group) of one CPU event."""
    names = [e.name for e in chain]
    backward_node = next((e for e in chain if e.name.startswith("autograd::engine::evaluate_function")), None)
    phase = "backward" if backward_node is not None else next((n for n in names if n in PHASES), "other")
    if phase == "optimizer" or any(n.startswith("Optimizer.") for n in names):
        return "optimizer", GROUPS[8]
    if backward_node is not None:
        owner = owner_of_seq.get((backward_node.sequence_nr, backward_node.fwd_thread))
        if owner is None and owner_by_seq is not None:  # thread ids that do not match: the number alone
            owner = owner_by_seq.get(backward_node.sequence_nr)
        adapter = owner == "adapter"
    else:
        adapter = forward_owner(names) == "adapter"
    attention = any("attention" in n for n in names)
    matmul = any(n in MATMULS for n in names) and not attention
    if adapter:
        return phase, GROUPS[2] if matmul else GROUPS[3]
    if attention:
        return phase, GROUPS[4]
    if matmul:
        return phase, GROUPS[1] if any(has_dim(e, vocab) for e in chain[:3]) else GROUPS[0]
    if any(n in CASTS for n in names):
        return phase, GROUPS[5]
    if any(has_dim(e, vocab) for e in chain[:4]):
        return phase, GROUPS[6]
    return phase, GROUPS[7]


def forward_owner(names: list) -> str:
    """adapter: inside an adapted layer's range but not inside its base product's (names: innermost first)."""
    if "lora_layer" not in names:
        return "base"
    return "base" if "base_linear" in names[:names.index("lora_layer")] else "adapter"


def gpu_busy_us(prof) -> tuple[float | None, int]:
    """The union of the GPU's kernel (and memcpy/memset) intervals in microseconds, and their number. The
    named ranges also appear on the GPU's timeline (user annotations), spanning their kernels and the gaps
    between them: they are left out (the run of 2026-11-27 counted them, so its gpu_busy_ms is too high)."""
    try:
        from torch.autograd import DeviceType

        spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                       if e.device_type() == DeviceType.CUDA and not e.is_user_annotation())  # not the ranges
    except Exception:
        return None, 0
    busy, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            busy, end = busy + (stop - start), stop
        elif stop > end:
            busy, end = busy + (stop - end), stop
    return busy / 1000, len(spans)


def analyse(prof, vocab: int, cuda: bool, wall_s: float, rank: int | None = None) -> dict:
    """Device time (own kernels) and CPU time (self) per phase and group, the launches, the GPU's idle time."""
    events = [e for e in prof.events() if not e.is_async and str(e.device_type).endswith("CPU")]
    chains = {id(e): ancestors(e) for e in events}
    owner_of_seq, owner_by_seq = {}, {}
    for e in events:
        if getattr(e, "sequence_nr", -1) >= 0 and not any(
                c.name.startswith("autograd::engine::evaluate_function") for c in chains[id(e)]):
            owner = forward_owner([c.name for c in chains[id(e)]])
            for table, key in ((owner_of_seq, (e.sequence_nr, e.thread)), (owner_by_seq, e.sequence_nr)):
                if table.get(key) != "adapter":
                    table[key] = owner
    device = {}  # phase -> group -> ms
    cpu = {}
    launches = launch_us = kernels = 0
    rank_unattributed = 0.0  # a diagnostic: time of products with a dimension of size r not put with the adapters
    for e in events:
        if e.name in LAUNCHES:
            launches += 1
            launch_us += e.self_cpu_time_total
        phase, group = classify(e, chains[id(e)], owner_of_seq, vocab, owner_by_seq)
        own_kernels = sum(k.duration for k in e.kernels) if cuda else 0.0
        if rank and e.name in MATMULS and has_dim(e, rank) and group != GROUPS[2]:
            rank_unattributed += (own_kernels if cuda else e.self_cpu_time_total) / 1000
        kernels += len(e.kernels) if cuda else 0
        if cuda and own_kernels:
            device.setdefault(phase, {}).setdefault(group, 0.0)
            device[phase][group] += own_kernels / 1000
        runtime = e.name.startswith(("cuda", "cu")) and not e.name.startswith("aten")
        if e.name in PHASES or e.name in ("lora_layer", "base_linear"):  # a range's own time: Python, or waiting
            group = RANGES                                                # for the backward thread ("backward")
        if not runtime:
            cpu.setdefault(phase, {}).setdefault(group, 0.0)
            cpu[phase][group] += e.self_cpu_time_total / 1000
    busy_us, spans = gpu_busy_us(prof) if cuda else (None, 0)
    ranges = {}
    for e in events:
        if e.name in PHASES:
            ranges[e.name] = ranges.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1000
    totals = lambda table: {g: sum(t.get(g, 0.0) for t in table.values()) for g in GROUPS + [RANGES]}  # noqa: E731
    return {"wall_ms": 1000 * wall_s, "gpu_busy_ms": busy_us / 1000 if busy_us is not None else None,
            "gpu_idle_ms": 1000 * wall_s - busy_us / 1000 if busy_us is not None else None,
            "device_ms_by_group": totals(device), "cpu_self_ms_by_group": totals(cpu),
            "device_ms": device, "cpu_self_ms": cpu, "phase_ranges_cpu_ms": ranges,  # cpu_self_ms: all threads
            "kernels": kernels, "gpu_spans": spans, "launch_calls": launches, "launch_cpu_ms": launch_us / 1000,
            "aten_ops": sum(1 for e in events if e.name.startswith("aten::")),
            "rank_dim_matmul_ms_not_with_adapters": rank_unattributed,
            "device_ms_total": sum(sum(t.values()) for t in device.values())}


# ---------------------------------------------------------------------------------------------
# Measuring one variant
# ---------------------------------------------------------------------------------------------
def measure(name, model, ref_model, batch, cfg, args, vocab, tables, context=contextlib.nullcontext):
    import torch

    cuda = torch.cuda.is_available()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    row = {"variant": name, "trained_parameters": sum(p.numel() for p in trained)}
    with context():
        started = time.perf_counter()
        for _ in range(args.warmup):
            training_passes(model, ref_model, batch, cfg, optimizer)
        gpu.synchronize()
        row["warmup_s"] = time.perf_counter() - started
        seconds = []
        for _ in range(args.repeats):
            gpu.synchronize()
            start = time.perf_counter()
            training_passes(model, ref_model, batch, cfg, optimizer)
            gpu.synchronize()
            seconds.append(time.perf_counter() - start)
        row.update(seconds=seconds, median_s=statistics.median(seconds))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        undo = install_tags(model) if name not in ("full", "full_again") and not name.startswith("compiled") else []
        TAGS["on"] = True
        try:
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                gpu.synchronize()
                start = time.perf_counter()
                training_passes(model, ref_model, batch, cfg, optimizer, named=True)
                gpu.synchronize()
                wall = time.perf_counter() - start
        finally:
            TAGS["on"] = False
            uninstall(undo)
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        started = time.perf_counter()
        row["profile"] = analyse(prof, vocab, cuda, wall, args.rank_check)
        averages = prof.key_averages()
        row["analysis_s"] = time.perf_counter() - started
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        tables.append(f"===== {name}: median {1000 * row['median_s']:.1f} ms over {args.repeats}, profiled pass "
                      f"{1000 * wall:.1f} ms =====\n-- sorted by {sort} --\n"
                      + averages.table(sort_by=sort, row_limit=args.rows)
                      + ("\n-- sorted by self_cpu_time_total --\n"
                         + averages.table(sort_by="self_cpu_time_total", row_limit=args.rows // 2) if cuda else ""))
    del optimizer
    return row


def check(model, ref_model, batch, cfg, state: dict, context=contextlib.nullcontext) -> dict:
    """One policy pass with the adapters at `state`: its log-probs and the adapters' gradients."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name])
    model.zero_grad(set_to_none=True)
    with context():
        common, rollout = gpu.import_repo()
        b = batch
        with common.reference_model(model, ref_model) as reference:
            ref = rollout.inference(rollout.completion_logprobs, reference, b["input_ids"], b["attention_mask"], b["T"],
                                    cfg.temperature, micro_batches=b["micro_batches"])
        logprobs = rollout.completion_logprobs(model, b["input_ids"], b["attention_mask"], b["T"], cfg.temperature)
        import grpo

        loss = grpo.grpo_loss(logprobs, logprobs.detach(), ref, b["advantages"], b["loss_mask"],
                              grpo.Config(epsilon=cfg.epsilon, beta=cfg.beta), step_mask=b["loss_mask"])
        loss.backward()
    grads = torch.cat([p.grad.flatten().float() for n, p in model.named_parameters() if n in state])
    mask = b["loss_mask"].bool()
    model.zero_grad(set_to_none=True)
    return {"logprobs": logprobs.detach()[mask].float(), "ref": ref[mask].float(), "grads": grads}


def compare(mine: dict, base: dict) -> dict:
    return {"logprob_max_abs_diff": (mine["logprobs"] - base["logprobs"]).abs().max().item(),
            "ref_logprob_max_abs_diff": (mine["ref"] - base["ref"]).abs().max().item(),
            "grad_rel_diff": ((mine["grads"] - base["grads"]).norm() / base["grads"].norm().clamp(min=1e-30)).item()}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
class Alarm(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise Alarm after `seconds` (the main thread's SIGALRM), for a step that may hang in compilation."""
    def ring(signum, frame):
        raise Alarm(f"over {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def summary_table(rows: list) -> str:
    header = ["variant", "median (ms)", "profiled wall", "GPU busy", "GPU idle", "kernels"] + GROUPS
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        p = row.get("profile")
        if not p:
            lines.append(f"| {row['variant']} | {row.get('error', '-')} |")
            continue
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        groups = p["device_ms_by_group"] if p["device_ms_total"] else p["cpu_self_ms_by_group"]
        lines.append("| " + " | ".join([row["variant"], fmt(1000 * row["median_s"]), fmt(p["wall_ms"]),
                                        fmt(p["gpu_busy_ms"]), fmt(p["gpu_idle_ms"]), str(p["kernels"])]
                                       + [fmt(groups.get(g)) for g in GROUPS]) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join(gpu.ROOT, "out", "profile_step"), help="output folder")
    parser.add_argument("--small", action="store_true", help="a tiny layout (2 layers, hidden 96, vocabulary 512), "
                        "2 prompts x 8 of 12 tokens unless given: to try the script on a CPU")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts (x 8 samples each); default 8, 2 with --small")
    parser.add_argument("--tokens", type=int, default=None,
                        help="sampled tokens per completion; default 128, 12 with --small")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes per variant first")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (the median is reported)")
    parser.add_argument("--rows", type=int, default=40, help="rows of each key_averages table")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--time_budget", type=float, default=330, help="seconds: later variants are skipped past it")
    parser.add_argument("--rollout_repeats", type=int, default=2, help="timed rollouts per model, for scale")
    parser.add_argument("--rank_check", type=int, default=16, help="the adapters' rank, for the profile's diagnostic")
    parser.add_argument("--compile_limit", type=float, default=150, help="seconds the compiled variant may take")
    args = parser.parse_args()

    import torch
    import transformers

    common, rollout = gpu.import_repo()
    import grpo
    import peft

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shapes = SMALL if args.small else gpu.QWEN25_05B
    prompts_n = args.prompts or (2 if args.small else 8)
    tokens = args.tokens or (12 if args.small else 128)
    os.makedirs(args.output, exist_ok=True)
    json_path, tables_path = os.path.join(args.output, "profile_step.json"), os.path.join(args.output, "tables.txt")
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "cuda": torch.version.cuda, "transformers": transformers.__version__, "peft": peft.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "settings": vars(args), "variants": []}
    tables = []

    def save():
        results["elapsed_s"] = time.perf_counter() - t0
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        with open(tables_path, "w") as f:
            f.write("\n\n".join(tables) + "\n\n" + summary_table(results["variants"]) + "\n")
        with open(os.path.join(args.output, "log.txt"), "w") as f:
            f.write("\n".join(LOG) + "\n")

    say(f"{results['device']}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{transformers.__version__}, peft {peft.__version__}")
    cfg = grpo.Config(per_device_train_batch_size=prompts_n * 8, max_completion_length=tokens)
    with tempfile.TemporaryDirectory() as workdir:
        folder = os.path.join(workdir, "model")
        results["model"] = gpu.build_random_model(folder, shapes)
        vocab = results["model"]["vocab_size"]
        full, tokenizer = common.load_model(folder)
        lora, _ = common.load_model(folder)
    say(f"model: {results['model']['parameters'] / 1e6:.1f}M parameters, built in {time.perf_counter() - t0:.0f} s")
    full.to(device).train()
    ref_full = copy.deepcopy(full).eval().requires_grad_(False)
    lora = common.add_lora(lora, gpu.LoraSettings)
    lora.to(device).train()
    with torch.no_grad():  # B starts at 0: random, as after some training
        torch.manual_seed(1)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    state = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    results["lora_trained_parameters"] = sum(p.numel() for p in state.values())
    batch = make_batch(full, tokenizer, cfg, prompts_n, tokens, device)
    results["batch"] = {"rows": len(batch["input_ids"]), "prompt_columns": batch["prompt_tokens"], "T": batch["T"],
                        "completion_tokens": batch["completion_tokens"], "rollout_s": batch["rollout_s"]}
    say(f"batch: {results['batch']}")
    save()
    results["rollout"] = {}  # for scale only: rollout.generate on the same prompts, the first call apart
    for label, model in (("full", full), ("LoRA r=16", lora)):
        try:
            prompts = [common.make_prompt(tokenizer, q) for q in batch["questions"] for _ in range(cfg.num_generations)]
            results["rollout"][label] = gpu.seconds_of(
                lambda: rollout.generate(model, tokenizer, prompts, tokens, cfg.temperature), args.rollout_repeats)
        except Exception as error:
            results["rollout"][label] = {"error": f"{type(error).__name__}: {error}"}
    say(f"rollout.generate (s): {results['rollout']}")
    save()

    base_check = None
    setups = {  # name -> (model, reference, install() -> undo(), context)
        "full": (full, ref_full, None, contextlib.nullcontext),
        "full_again": (full, ref_full, None, contextlib.nullcontext),
        "peft": (lora, None, None, contextlib.nullcontext),
        "peft_again": (lora, None, None, contextlib.nullcontext),
        "peft_nocast": (lora, None, None, lambda: peft.helpers.disable_input_dtype_casting(lora)),
        "peft_cast_once": (lora, None, lambda: cast_once(lora), contextlib.nullcontext),
        "fused": (lora, None, lambda: set_forward(lora, fused_forward), contextlib.nullcontext),
        "fused_cast_once": (lora, None, lambda: cast_once(lora) + set_forward(lora, fused_forward),
                            contextlib.nullcontext),
        "merged_delta": (lora, None, lambda: cast_once(lora) + set_forward(lora, merged_delta_forward),
                         contextlib.nullcontext),
        "compiled": (lora, None, "compile", contextlib.nullcontext),
    }
    order = [v for v in VARIANTS if v in args.variants]
    if "peft" in order:  # the reference of the checks first among the LoRA variants
        order.remove("peft")
        order.insert(order.index("full") + 1 if "full" in order else 0, "peft")
    for name in order:
        elapsed = time.perf_counter() - t0
        if elapsed > args.time_budget or (name == "compiled" and elapsed + args.compile_limit > args.time_budget + 60):
            say(f"{name}: skipped (elapsed {elapsed:.0f} s, budget {args.time_budget:.0f} s)")
            results["variants"].append({"variant": name, "error": "skipped: time budget"})
            save()
            continue
        model, reference, install, context = setups[name]
        undo = []
        try:
            if install == "compile":
                for option in ("cache_size_limit", "recompile_limit"):  # 24 layers, several shapes
                    if hasattr(torch._dynamo.config, option):
                        setattr(torch._dynamo.config, option, 64)
                for layer in model.get_base_model().model.layers:
                    layer.compile()
                    undo.append(("compile", layer))
            elif install is not None:
                undo = install()
            limit = time_limit(args.compile_limit) if name == "compiled" else contextlib.nullcontext()
            with limit:
                row = {}
                if model is lora:
                    mine = check(model, None, batch, cfg, state, context)
                    if name == "peft":
                        base_check = mine
                    row["check_against_peft"] = compare(mine, base_check) if base_check is not None else None
                row = {**measure(name, model, reference, batch, cfg, args, vocab, tables, context), **row}
        except Exception as error:  # a failing variant is reported, and the run goes on
            traceback.print_exc()
            first = str(error).splitlines()[0] if str(error) else ""
            row = {"variant": name, "error": f"{type(error).__name__}: {first}"}
        finally:
            undo_all(undo)
            if cuda:
                torch.cuda.empty_cache()
        results["variants"].append(row)
        p = row.get("profile")
        if p:
            repeats = ", ".join(f"{1000 * s:.0f}" for s in row["seconds"])
            say(f"{name}: median {1000 * row['median_s']:.1f} ms ({repeats}),"
                f" profiled {p['wall_ms']:.0f} ms, GPU busy {p['gpu_busy_ms'] or 0:.0f} ms, {p['kernels']} kernels, "
                f"{p['aten_ops']} aten ops" + (f"; check {row['check_against_peft']}" if row.get("check_against_peft")
                                               else ""))
        else:
            say(f"{name}: {row.get('error')}")
        save()
    say(summary_table(results["variants"]))
    save()
    say(f"done in {time.perf_counter() - t0:.0f} s; {json_path}")


if __name__ == "__main__":
    main()
