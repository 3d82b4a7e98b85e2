"""Bad input gets one clear sentence and exit status 1, never a traceback (fail), before anything is
written: a setting out of its range (check_settings), data rows a script cannot learn from
(check_rows), a sharding request that cannot work (check_fsdp). The loaders in common.py call these
as they read, and check the models they load themselves (the context, a half-replaced run folder);
docs/troubleshooting.md says what each means, and tests/test_robustness.py's table holds every case.
"""
import dataclasses
import math

from lib.distributed import log


NEXT_RUN = ".next_run"  # where a run that replaces an old one writes until it finishes (lib/harness.py)


def fail(message: str):
    """Stop with one clear sentence and exit status 1 (no traceback): for bad input, not for bugs."""
    raise SystemExit(f"error: {message}")


def check_settings(cfg):
    """One clear sentence for the first setting that cannot work (before anything is loaded or written):
    every float must be finite, each field declared with `setting` must pass its own check, and the
    settings that only work together must agree (the Config's check_together)."""
    for field in dataclasses.fields(cfg):
        value, check = getattr(cfg, field.name), declared_check(type(cfg), field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{field.name} must be a finite number, not {value}")
        if check and value is not None and not check["usable"](value):  # None: left unset, as its default
            fail(f"--{field.name} must be {check['must_be']}, not {value!r}" if isinstance(value, str)
                 else f"--{field.name} must be {check['must_be']}, not {value}")
    if hasattr(cfg, "check_together"):  # settings that only work together: a training script's Config says which
        cfg.check_together()


def declared_check(config_class, name: str) -> dict | None:
    """The check a field was declared with (`setting`), in the script's Config or in the harness.RunConfig
    it extends (a script that only changes a run setting's default keeps the run's check)."""
    for cls in config_class.__mro__:
        field = getattr(cls, "__dataclass_fields__", {}).get(name)
        if field is not None and "usable" in field.metadata:
            return field.metadata
    return None


def check_fsdp(cfg, world_size: int):
    """--fsdp shards over processes, so it needs torchrun; --merge_lora would need the whole model on one process."""
    if cfg.fsdp and cfg.merge_lora:
        fail("--merge_lora does not work with --fsdp: the adapter is saved alone, and every script's --model "
             "merges it into its base when loading")
    if cfg.fsdp and world_size == 1:
        fail("--fsdp shards the model over processes: run the script under torchrun --nproc_per_node 2 (or more)")


def check_finite_scores(scores, what: str):
    """Stop at a NaN or infinite score from a learned judge or reward model: compared or summed as
    numbers they would pass silently (NaN != NaN: every pair would count, its second sample chosen)."""
    if not bool(scores.isfinite().all()):
        bad = scores[~scores.isfinite()][0].item()
        fail(f"{what} gave a score of {bad}: its scores must be finite numbers (a reward model written by "
             "reward_model.py that did not diverge)")


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
    final = value.rpartition("####")[2].strip()
    if "####" not in value or not final:
        return "has no final answer after '####'"
    try:  # 'nan' is never equal to an answer, 'inf' equal to any huge one ('1e999'): neither can be checked
        number = float(final.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:
        return None
    return None if math.isfinite(number) else f"has a final answer that is not a finite number ({final!r})"


def _chat_problem(value) -> str | None:  # [{"role": ..., "content": ...}, ...], the last the assistant's answer
    if not isinstance(value, list) or not value:
        return "is not a list of messages"
    for message in value:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            return "has a message whose role is not system, user or assistant"
        if _text_problem(message.get("content")):
            return f"has a message from the {message['role']} whose content {_text_problem(message.get('content'))}"
    if value[-1]["role"] != "assistant":
        return "does not end with an assistant message (the expert's answer)"
    if not any(message["role"] == "user" for message in value[:-1]):
        return "has no user message before the expert's answer (the prompt it answers)"
    return None


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


def check_length_drops(name: str, kept: int, total: int, limit: str):
    """Rows too long for a length limit (the answer for --max_completion_length, the pair for
    --max_length) are dropped under the same rule as unusable rows: more than MAX_BAD_SHARE of them
    is refused in one sentence; fewer are skipped with a count in the log."""
    dropped = total - kept
    if dropped > MAX_BAD_SHARE * total:
        fail(f"{name}: {dropped} of {total} rows are longer than {limit} allows, more than {MAX_BAD_SHARE:.0%}: "
             "raise the limit, or shorten the data")
    if dropped:
        log(f"{name}: skipped {dropped} of {total} rows longer than {limit} allows")
