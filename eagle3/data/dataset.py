"""From conversations to the prepared dataset: read and weight the sources, de-duplicate, tokenize
with the chat template's assistant-only loss mask, split by content hash, count token frequencies,
and write the ``datasets`` DatasetDict the later stages read. The prepare stage
(``stages/prepare.py``) is these steps in order, with optional regeneration in between
(``eagle3.data.regenerate``).

Everything here is deterministic for a given config: the same sources and settings give the same
samples, splits and bytes.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path


def source_identity(path: str) -> str:
    """Content hash of a data source (file, directory, or a generated builtin: set), for the config hash."""
    from ..hashing import hash_files, sha256_file

    if str(path).startswith("builtin:"):  # a prompt set generated in memory (data.path=builtin:large)
        from .sources import generated_identity

        return generated_identity(str(path))
    p = Path(path).expanduser()
    if p.is_dir():
        return hash_files([f for f in p.rglob("*") if f.is_file()], p)
    return sha256_file(p) if p.exists() else "missing"


def prepare_config(cfg) -> dict:
    """The prepare stage's hashed config (``stages/prepare.py``; ``stage=plan`` looks its run up by it)."""
    from ..hashing import semantic_dict
    from .sources import source_list

    config = {"data": semantic_dict(cfg.data), "prepare": semantic_dict(cfg.prepare),
              "chat_template": cfg.target.chat_template,
              "sources": [source_identity(p) for p, *_ in source_list(cfg.data)]}
    if not cfg.prepare.regenerate:
        config["prepare"].pop("regen")
    else:
        # ids and splits hashed from the source conversations (:func:`split_of`); before, from the
        # regenerated ones: a run of the same config now holds out other prompts, so it is another run
        config["split_key"] = "source"
    return config


def conversation_key(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def load_conversations(cfg, report, drops: Counter, categories: list | None = None) -> list[list[dict]]:
    """Read, normalize, de-duplicate and weight every source; deterministic for a given config.

    ``categories``: a list to receive, parallel to the returned conversations, each one's category
    (the source record's ``category`` or ``domain`` field, :func:`record_category`; None without
    one). Weighting and ``data.max_samples`` draw the same conversations with or without it."""
    from .chat_template import normalize_messages
    from .sources import DataError, apply_weight, read_source, source_list

    rng = random.Random(cfg.prepare.seed)
    seen: set[str] = set()
    out: list[tuple[list[dict], str | None]] = []
    for path, fmt, weight, split in source_list(cfg.data):
        convs = []
        for rec in read_source(path, fmt, split, cfg.data.on_bad_record, report):
            report.records += 1
            try:
                msgs = normalize_messages(rec.raw)
            except ValueError as e:
                if cfg.data.on_bad_record == "skip":
                    report.bad(rec.origin, str(e))
                    report.records -= 1
                    continue
                raise DataError(f"{rec.origin}: {e}. Fix the record, or pass data.on_bad_record=skip "
                                f"to count and skip bad records.") from None
            if cfg.data.system_prompt and not any(m["role"] == "system" for m in msgs):
                msgs = [{"role": "system", "content": cfg.data.system_prompt}] + msgs
            if cfg.prepare.dedup:
                key = conversation_key(msgs)
                if key in seen:
                    drops["duplicate"] += 1
                    continue
                seen.add(key)
            convs.append((msgs, record_category(rec)))
        # (the rng draws depend only on the number of items: pairs select what messages alone would)
        out.extend(apply_weight(convs, weight, rng))
    if cfg.data.max_samples and len(out) > cfg.data.max_samples:
        rng.shuffle(out)
        drops["over_max_samples"] += len(out) - cfg.data.max_samples
        out = out[: cfg.data.max_samples]
    if categories is not None:
        categories.extend(c for _, c in out)
    return [m for m, _ in out]


CATEGORY_FIELDS = ("category", "domain")


def record_category(rec) -> str | None:
    """A source record's category: its top-level ``category`` (else ``domain``) field, as text; None
    when it has neither (or an empty one). Raises DataError for a value that is not a plain scalar."""
    from .sources import DataError

    raw = rec.raw if isinstance(rec.raw, dict) else {}
    for name in CATEGORY_FIELDS:
        value = raw.get(name)
        if value is None or value == "":
            continue
        if isinstance(value, (dict, list)):
            raise DataError(f"{rec.origin}: the {name!r} field must be a string (a category such as 'code'), "
                            f"got {type(value).__name__}")
        return str(value)
    return None


def split_of(key: str, seed: int) -> tuple[str, float]:
    """A sample's (sample_id, u) from its :func:`conversation_key`: the split (eval when u <
    eval_fraction) is stable when other samples are added. With regeneration the key is the source
    conversation's, not the regenerated one's: the target's answers (bf16 on another GPU, another
    batch size) may differ by a token between runs, and that must not move a prompt between splits."""
    u = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16) / 16**12
    return key[:16], u


def tokenize_all(conversations, tokenizer, cfg, drops: Counter, progress: bool, batch: int = 512,
                 categories: list | None = None, keys: list | None = None):
    """Rows (sample_id, u, input_ids, loss_mask; and ``category`` when ``categories``, parallel to
    ``conversations``, is given) and the number of samples cut at ``prepare.max_length``.
    ``keys``, parallel to ``conversations``: what each sample's id and split are hashed from (the
    source conversations' keys when the answers were regenerated); default: each conversation's own."""
    from tqdm.auto import tqdm

    from .chat_template import tokenize_conversations
    from .sources import DataError

    rows = []
    truncated = 0
    max_len = cfg.prepare.max_length
    with tqdm(total=len(conversations), desc="tokenize", disable=not progress, unit="conv") as bar:
        for start in range(0, len(conversations), batch):
            chunk = conversations[start:start + batch]
            errors: list = []
            encoded = tokenize_conversations(tokenizer, chunk, errors=errors)
            for k, e in errors:
                if cfg.data.on_bad_record != "skip":
                    raise DataError(f"conversation {start + k} (first message: "
                                    f"{chunk[k][0]['content'][:60]!r}) cannot be masked: {e}. Fix or drop it, "
                                    f"or pass data.on_bad_record=skip to count and skip such conversations.")
                drops["template_error"] += 1
            for j, (msgs, enc) in enumerate(zip(chunk, encoded)):
                if enc is None:
                    continue
                ids, mask = enc
                had_trainable = any(mask)
                if len(ids) > max_len:
                    ids, mask = ids[:max_len], mask[:max_len]
                    truncated += 1
                if not any(mask):
                    drops["trainable_tokens_beyond_max_length" if had_trainable else "no_trainable_tokens"] += 1
                    continue
                key = keys[start + j] if keys is not None else conversation_key(msgs)
                sid, u = split_of(key, cfg.prepare.seed)
                row = {"sample_id": sid, "u": u, "input_ids": ids, "loss_mask": mask}
                if categories is not None:
                    row["category"] = categories[start + j]
                rows.append(row)
            bar.update(len(chunk))
    return rows, truncated


# why prepare dropped samples (the keys of PrepareFacts.dropped), and what to change
DROP_REASONS = {
    "duplicate": ("identical to an earlier conversation", "prepare.dedup=false keeps duplicates"),
    "over_max_samples": ("beyond data.max_samples", "raise data.max_samples (0 = all)"),
    "regeneration_too_long": ("longer than prepare.regen.max_model_len when regenerated",
                              "raise prepare.regen.max_model_len"),
    "empty_regeneration": ("given an empty answer by the target", "check the target and its chat template"),
    "template_error": ("not renderable by the chat template", "fix the conversations or target.chat_template"),
    "no_trainable_tokens": ("without an assistant turn", "add assistant turns{regen}"),
    "trainable_tokens_beyond_max_length": ("with every assistant token beyond prepare.max_length",
                                           "raise prepare.max_length (now {max_length})"),
}


def nothing_to_train_message(cfg, report, drops: Counter) -> str:
    """One line for a preparation that kept no sample: how many records were read from where, how
    many were dropped for each reason, and what to change."""
    from .sources import source_list

    where = (f"data.path={cfg.data.path}" if cfg.data.path and not cfg.data.sources else
             f"data.sources ({', '.join(p for p, *_ in source_list(cfg.data))})" if cfg.data.sources else
             f"the built-in prompt set ({source_list(cfg.data)[0][0]})")
    reasons = sorted(((n, r) for r, n in drops.items() if n), reverse=True)
    counts = [f"{n} {DROP_REASONS.get(r, (r,))[0]}" for n, r in reasons]
    if report.bad_records:
        counts.append(f"{report.bad_records} bad record{'s' if report.bad_records != 1 else ''} "
                      f"(e.g. {report.bad_examples[0]})")
    regen = "" if cfg.prepare.regenerate else ", or set prepare.regenerate=true to have the target write them"
    fixes = [DROP_REASONS[r][1].format(regen=regen, max_length=cfg.prepare.max_length)
             for _, r in reasons if r in DROP_REASONS]
    if report.records == 0:
        fixes = ["give a file with conversations (JSONL: one {\"messages\": [...]} object a line)"] + fixes
    nothing = ""
    if report.records == 0 and not report.bad_records:
        paths = [Path(p).expanduser() for p, *_ in source_list(cfg.data)]
        nothing = " (the file is empty)" if all(p.is_file() and p.stat().st_size == 0 for p in paths) else \
            " (no record at all)"
    return (f"prepare kept no sample to train on: read {report.records} records from {where}{nothing}"
            f"{', dropped ' + ', '.join(counts) if counts else ''}. To fix: {'; '.join(fixes) or 'see the drops above'}.")


def assign_splits(rows, eval_fraction: float, eval_min: int):
    rows.sort(key=lambda r: r["u"])
    n_eval = sum(r["u"] < eval_fraction for r in rows)
    if eval_fraction > 0 and n_eval < eval_min and len(rows) > eval_min:
        n_eval = eval_min
    return rows[n_eval:], rows[:n_eval]


def write_dataset(train_rows, eval_rows, out: Path) -> None:
    """The DatasetDict (train, eval): sample_id, input_ids, loss_mask, and a ``category`` column (null
    where a sample has none) when any sample carries one."""
    import datasets

    columns = {"sample_id": datasets.Value("string"), "input_ids": datasets.Sequence(datasets.Value("int32")),
               "loss_mask": datasets.Sequence(datasets.Value("int8"))}
    if any(r.get("category") is not None for r in (*train_rows, *eval_rows)):
        columns["category"] = datasets.Value("string")
    features = datasets.Features(columns)

    def build(rows):
        rows = sorted(rows, key=lambda r: r["sample_id"])
        return datasets.Dataset.from_dict({k: [r.get(k) for r in rows] for k in columns}, features=features)

    datasets.DatasetDict({"train": build(train_rows), "eval": build(eval_rows)}).save_to_disk(str(out))


def category_counts(rows) -> dict:
    """{category: samples} over ``rows`` (None when no row carries a category)."""
    counts = Counter(r.get("category") for r in rows)
    if not any(c is not None for c in counts):
        return {}
    return {("(none)" if c is None else c): n for c, n in sorted(counts.items(), key=lambda kv: str(kv[0]))}


def token_frequencies(train_rows, vocab_size: int, target_path):
    """How often each target token is a trainable (assistant) token in the training split."""
    import numpy as np

    from .sources import DataError

    freq = np.zeros(vocab_size, dtype=np.int64)
    for r in train_rows:
        ids = np.asarray(r["input_ids"], dtype=np.int64)
        m = np.asarray(r["loss_mask"], dtype=bool)
        if ids.size and ids.max() >= vocab_size:
            raise DataError(f"token id {int(ids.max())} is outside the target vocabulary ({vocab_size}): the "
                            f"tokenizer does not belong to {target_path}")
        freq += np.bincount(ids[m], minlength=vocab_size)
    return freq
