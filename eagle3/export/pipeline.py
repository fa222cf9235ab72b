"""The export stage's steps (the stage: stages/export.py): what an export run reads (which
``export.out_dir`` must stay clear of), the export section as hashed, the draft written and
verified into the run's directory, with the :class:`eagle3.contracts.ExportFacts` that the export
marker and the model card are derived from, and the lines the stage prints."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from ..atomic import fsync_dir

log = logging.getLogger("eagle3.export")


def run_inputs(cfg, target_path, exp_dir) -> dict:
    """{what: path} of everything an export run reads, which export.out_dir must stay clear of."""
    out = {"the target": target_path, "the experiment directory (every stage's artifacts and the manifest)": exp_dir}
    if cfg.target.gguf:
        out["the target's GGUF file"] = cfg.target.gguf
    paths = [cfg.data.path] + [s.path for s in cfg.data.sources]
    for i, p in enumerate(x for x in paths if x and not str(x).startswith("builtin")):
        out[f"the data file {i + 1}"] = p
    if cfg.export.prompts:
        out["the prompts file (export.prompts)"] = cfg.export.prompts
    if cfg.export.extra_prompts and not cfg.export.extra_prompts.startswith("builtin:"):
        out["the extra prompts file (export.extra_prompts)"] = cfg.export.extra_prompts
    if cfg.export.from_:
        out["the draft to export (export.from)"] = cfg.export.from_
    return out


def export_semantics(export_cfg, semantic_dict) -> dict:
    """The export section as hashed: the temperatures and their seed only when a temperature other
    than greedy is asked for (the context-length buckets only when not the default), so runs recorded
    before they existed keep their config hash."""
    out = semantic_dict(export_cfg)  # (context_buckets: in HASH_OMIT_DEFAULTS)
    if [float(t) for t in export_cfg.eval_temperatures] == [0.0]:
        out.pop("eval_temperatures", None)
        out.pop("eval_seed", None)
    return out


def check_kv_fits(export_cfg, target, ckpt) -> None:
    """A KV cache that cannot fit, named by its eagle3 key, before any engine starts."""
    from ..kv_cache import check_fits, weights_bytes

    draft_bytes = sum(t.numel() * t.element_size() for t in ckpt.tensors.values())
    check_fits("export.kv_cache_gb", export_cfg.kv_cache_gb, weights_bytes(target.path) + draft_bytes)


def export_verified(cfg, job, target, ckpt, inputs, prep, dtype: str, final_dir: Path):
    """The export written and verified in a hidden sibling of ``final_dir``, copied from there to
    ``export.out_dir`` (when set), and renamed to ``final_dir`` once both succeeded: a failed export
    (verification, a full disk in the workspace or in export.out_dir) leaves no complete-looking
    model directory behind. Returns its facts."""
    from ..errors import Eagle3Error, disk_full
    from .errors import ExportError
    from .outdir import no_space_message, publish

    if final_dir.exists():  # a failed earlier attempt of this same config (before partial exports)
        shutil.rmtree(final_dir)
    model_dir = final_dir.parent / f".{final_dir.name}.partial"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    try:
        facts = write_and_verify(cfg, job, target, ckpt, inputs, prep, dtype, model_dir, final_dir)
        if cfg.export.out_dir:
            publish(model_dir, cfg.export.out_dir, cfg.export.overwrite)
            facts.exported_to = str(cfg.export.out_dir)
    except BaseException as e:
        shutil.rmtree(model_dir, ignore_errors=True)
        if not isinstance(e, Eagle3Error) and disk_full(e):  # safetensors' "os error 28" names no path
            needed = export_bytes(ckpt, cfg.export, dtype, target.path)
            raise ExportError(f"export: {no_space_message(model_dir, needed, model_dir.parent)}. The partial export "
                              f"was removed; the run is recorded failed. Free space there, or set workspace= to a "
                              f"directory on a larger disk, then run the same command again.") from e
        raise
    os.replace(model_dir, final_dir)
    fsync_dir(final_dir.parent)
    return facts


def export_bytes(ckpt, export_cfg, dtype: str, target_path: Path) -> int:
    """About what an export of ``ckpt`` takes on disk: its tensors in ``dtype``, the vocabulary
    mapping, the embedding when included, and the target's tokenizer files."""
    import torch

    from ..target import TOKENIZER_FILES

    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    n = sum(t.numel() for t in ckpt.tensors.values())
    if export_cfg.include_embedding and ckpt.embed is not None:
        n += ckpt.embed.numel()
    mapping = 0 if ckpt.identity_mapping else ckpt.d2t.numel() * 8 + ckpt.t2d.numel()
    tokenizer = sum((Path(target_path) / f).stat().st_size for f in TOKENIZER_FILES if (Path(target_path) / f).is_file())
    return n * size + mapping + tokenizer


def write_and_verify(cfg, job, target, ckpt, inputs, prep, dtype: str, model_dir: Path, final_dir: Path):
    """The export written into ``model_dir`` and verified there; returns its ExportFacts (which name
    ``final_dir``, where it will be). The marker and the README are derived from them, each written
    once, last."""
    from ..artifacts import EXPORT_MARKER
    from ..contracts import ExportFacts
    from .formats import ExportSpec, write_format
    from .model_card import model_card
    from .outdir import file_digests, fingerprint

    export_cfg = cfg.export
    spec = ExportSpec(target_path=str(target.path), target_config=target.config, dtype=dtype,
                      num_speculative_tokens=export_cfg.num_speculative_tokens,
                      include_embedding=export_cfg.include_embedding)
    written = write_format(ckpt, export_cfg.format, model_dir, spec)
    c = ckpt.config
    facts = ExportFacts(format=export_cfg.format, layer_ids=list(c.aux_layer_ids), draft_vocab_size=c.draft_vocab_size,
                        vocab_size=c.vocab_size, dtype=dtype, fingerprint=fingerprint(model_dir),
                        model_dir=str(final_dir.relative_to(job.manifest.exp_dir)), source=ckpt.source)
    identity, run = target.identity(), job.config_hash[:12]
    if export_cfg.verify:
        facts = dataclasses.replace(facts, **dataclasses.asdict(
            verify(cfg, target, ckpt, prep, dtype, model_dir, export_marker(facts, identity, run))))
    store = inputs.get("extract") if ckpt.source.get("kind") == "train" else None
    facts.train_expected_acceptance_length = compare_with_training(facts.acceptance_length, ckpt.source,
                                                                   export_cfg.num_speculative_tokens, store)
    meta = {"target": {**identity, "name": target.path.name}, "draft": c.to_dict(),
            "architectures": written.get("architectures") or written.get("transformer_layer_config", {}).get(
                "architectures"), "num_speculative_tokens": export_cfg.num_speculative_tokens,
            "coverage": prep.facts.coverage if prep else None,
            "data": ({"prepare run": prep.config_hash[:12], "train samples": prep.facts.num_train,
                      "eval samples": prep.facts.num_eval} if prep else None)}
    (model_dir / "README.md").write_text(model_card(meta, facts))
    # the marker records every other file's size and sha256: a copy in export.out_dir is checked against them
    (model_dir / EXPORT_MARKER).write_text(json.dumps({**export_marker(facts, identity, run),
                                                       "files": file_digests(model_dir)}, indent=2,
                                                      sort_keys=True) + "\n")
    return facts


# the verification figures the marker carries
MARKER_VERIFICATION = ("acceptance_length", "acceptance_by_k", "tokens_per_step", "num_prompts", "max_tokens")


def export_marker(facts, target_identity: dict, export_run: str) -> dict:
    """The export marker (eagle3.artifacts.EXPORT_MARKER) of an export with ``facts``: what was
    exported, from what, and what verification measured (empty when not verified)."""
    return {"format": facts.format, "fingerprint": facts.fingerprint, "target": target_identity,
            "layer_ids": list(facts.layer_ids),
            "layer_id_convention": "sglang" if facts.format == "sglang" else "vllm",
            "draft_vocab_size": facts.draft_vocab_size, "vocab_size": facts.vocab_size, "dtype": facts.dtype,
            "source": facts.source, "export_run": export_run,
            "verification": {k: getattr(facts, k) for k in MARKER_VERIFICATION if getattr(facts, k) is not None}}


def verify(cfg, target, ckpt, prep, dtype: str, model_dir: Path, marker: dict):
    """export.verify on the held-out prompts (eagle3.export.verify.verify_export): a Verification."""
    from ..kv_cache import translate
    from .prompts import held_out_prompts, stop_token_ids
    from .verify import verify_export

    export_cfg = cfg.export
    categories: list = []
    trust = target.trust_remote_code
    prompts = held_out_prompts(export_cfg, prep, target.path, categories=categories, trust_remote_code=trust)
    try:
        return verify_export(
            model_dir, target_path=target.path, target_config=target.config, target_dtype=dtype,
            reference=ckpt, prompts=prompts, k=export_cfg.num_speculative_tokens, eval_ks=export_cfg.eval_ks,
            max_tokens=export_cfg.eval_max_tokens, stop_ids=stop_token_ids(target.path, trust),
            kv_cache_gb=export_cfg.kv_cache_gb, gpu_memory_utilization=export_cfg.gpu_memory_utilization,
            tolerance=export_cfg.verify_tolerance, device=export_cfg.device,
            progress=cfg.progress, categories=categories, temperatures=export_cfg.eval_temperatures,
            seed=export_cfg.eval_seed, marker=marker, tie_margin=export_cfg.tie_margin, trust_remote_code=trust,
            shared_engines=export_cfg.shared_engines, context_buckets=export_cfg.context_buckets,
            prompt_lookup=export_cfg.prompt_lookup)
    except Exception as e:  # vLLM's "KV cache does not fit" names its own flags: name ours
        if (named := translate(e, "export.kv_cache_gb", export_cfg.kv_cache_gb)) is not None:
            raise named from e
        raise


def compare_with_training(acceptance_length: Optional[float], source: dict, k: int, store=None) -> Optional[float]:
    """The train stage's acceptance estimate at k (teacher-forced, on its eval split), to record next
    to vLLM's ``acceptance_length``; None when either is missing. Warns when vLLM's is far below it.
    ``store``: the extract run the draft was trained on, whose checks the warning quotes."""
    expected = source.get("train_expected_acceptance_length") or []
    if acceptance_length is None or len(expected) < k or expected[k - 1] is None:
        return None
    if acceptance_length - 1 < 0.5 * (expected[k - 1] - 1):
        checks = ""
        if store is not None and store.facts is not None:
            checks = (f" The hidden states it was trained on (extract run {store.config_hash[:12]}): "
                      f"{store.facts.checks_line()}; a low agreement or a large parity error there means the draft "
                      f"learnt from states the target does not produce when serving.")
        log.warning("export: vLLM accepts %.3f tokens per step at k=%d, the train stage expected %.3f from its "
                    "held-out accuracies. Both measure the same draft (the offline evaluator agrees with vLLM), so the "
                    "served prompts differ from the training data: responses not written by the target (use "
                    "prepare.regenerate=true), another chat template, or another domain.%s",
                    acceptance_length, k, expected[k - 1], checks)
    return round(float(expected[k - 1]), 4)


def print_summary(rec) -> None:
    f = rec.facts
    print(f"export: {f.format} draft at {rec.exp_dir / f.model_dir}" +
          (f" (copied to {f.exported_to})" if f.exported_to else ""))
    if f.acceptance_length is not None:
        print(f"export: vLLM acceptance length {f.acceptance_length:.3f} at k={f.k} "
              f"(per position {f.acceptance_per_position}), by k {f.acceptance_by_k}; "
              f"{f.tokens_per_step:.3f} tokens per target step vs {f.ngram['tokens_per_step']:.3f} for prompt lookup; "
              f"offline evaluator (greedy) {f.offline['acceptance_length']:.3f}; lossless on {f.num_prompts} prompts")
    if f.lookup_summary:
        print(f"export: {f.lookup_summary}")
    for cat, d in (f.by_domain or {}).items():
        print(f"export: domain {cat} ({d['num_prompts']} prompts): vLLM acceptance length {d['acceptance_length']:.3f} "
              f"at k={f.k}, by k {d['acceptance_by_k']}")
    if f.by_context_length:
        from .context_length import summary_line

        print(f"export: vLLM {summary_line(f.by_context_length, f.k)} (counted {f.context_counting})")
    for t, row in (f.by_temperature or {}).items():
        if float(t) > 0:
            print(f"export: temperature {t} (seeded {f.sampling_seed}+i): vLLM acceptance length by k "
                  f"{row['acceptance_by_k']}; prompt lookup {row['ngram_tokens_per_step']:.3f} tokens per target step")
