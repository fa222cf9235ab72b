"""README.md of an export: what the draft is for, how to serve it, and what it measured."""
from __future__ import annotations

import json


def _fmt(x, nd=3):
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def model_card(meta: dict, facts) -> str:
    """The card of the export whose :class:`eagle3.contracts.ExportFacts` are ``facts``; ``meta``: what
    the facts do not hold (``target``: its identity and name, ``draft``: the draft's config,
    ``architectures``, ``num_speculative_tokens``, ``coverage`` and ``data``: the prepare run's)."""
    t = meta["target"]
    cfg = meta["draft"]
    fmt = facts.format
    lines = [f"# EAGLE-3 draft for `{t.get('name') or t['path']}`", "",
             f"Exported by eagle3 in the `{fmt}` layout. The draft predicts the target's next tokens from the "
             f"target's own hidden states; it only works with this target.", "",
             "## Target", "",
             f"- path: `{t['path']}`",
             f"- identity: `{t['hash'][:16]}` (config, tokenizer, weight file contents), tokenizer `{str(t.get('tokenizer_hash'))[:16]}`",
             f"- quantization of the checkpoint the draft was trained against: "
             f"{(t.get('quantization') or {}).get('summary', 'not quantized')}",
             f"- aux layer ids (vLLM convention: id k = the residual stream entering decoder layer k): "
             f"`{cfg['aux_layer_ids']}`" + (f" (written as `{[i - 1 for i in cfg['aux_layer_ids']]}` in SGLang's "
                                            f"convention in config.json)" if fmt == "sglang" else ""),
             "", "## Draft", "",
             f"- architecture: `{meta['architectures']}`, hidden {cfg['hidden_size']}, "
             f"{cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} kv), intermediate {cfg['intermediate_size']}",
             f"- draft vocabulary: {cfg['draft_vocab_size']} of {cfg['vocab_size']} target tokens"
             + (f" (coverage of training tokens {meta['coverage']:.3f})" if meta.get("coverage") is not None else ""),
             f"- norm_before_residual: {cfg['norm_before_residual']}; tensors stored as {facts.dtype}",
             f"- source: {json.dumps(facts.source, sort_keys=True)}"]
    eagle31 = [name for name in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(name)]
    if eagle31:  # absent at their defaults: a default draft's card is unchanged
        lines.insert(len(lines) - 1, f"- EAGLE-3.1 options: {', '.join(f'{n}=true' for n in eagle31)}")
    if meta.get("data"):
        lines += ["", "## Training data", ""] + [f"- {k}: {v}" for k, v in meta["data"].items()]
    lines += ["", "## Serving", ""]
    k = meta["num_speculative_tokens"]
    if fmt == "speculators":
        lines += ["```bash", f"vllm serve {t['path']} --speculative-config "
                  f"'{{\"method\": \"eagle3\", \"model\": \"<this directory>\", \"num_speculative_tokens\": {k}}}'",
                  "# or: vllm serve <this directory>   (the config names the verifier)", "```"]
    elif fmt == "sglang":
        lines += ["```bash", f"python -m sglang.launch_server --model {t['path']} --speculative-algorithm EAGLE3 \\",
                  f"    --speculative-draft-model-path <this directory> --speculative-num-steps {k} "
                  f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}", "```",
                  "", "vLLM also loads this layout, but reads the layer ids in `eagle_config` as its own ids (off by "
                      "one): export with `export.format=vllm` for vLLM."]
    else:
        lines += ["```bash", f"vllm serve {t['path']} --speculative-config "
                  f"'{{\"method\": \"eagle3\", \"model\": \"<this directory>\", \"num_speculative_tokens\": {k}}}'",
                  "```"]
    lines += ["", "## Measured acceptance", ""]
    if facts.acceptance_length is None:
        lines += ["Not measured (export.verify=false)."]
    else:
        lines += [f"Greedy decoding on {facts.num_prompts} held-out prompts (the prepare stage's eval split, "
                  f"prompt part), up to {facts.max_tokens} new tokens, in vLLM {facts.vllm_version or ''}. "
                  f"Acceptance length = 1 + accepted / drafts (vLLM's definition, bonus token included).", "",
                  "| method | k | acceptance length | tokens per target step |", "|---|---|---|---|"]
        for kk, al in sorted((facts.acceptance_by_k or {}).items(), key=lambda x: int(x[0])):
            tps = (facts.tokens_per_step_by_k or {}).get(kk)
            lines.append(f"| EAGLE-3 (this draft) | {kk} | {_fmt(al)} | {_fmt(tps)} |")
        ng = facts.ngram
        if ng:
            lines.append(f"| prompt lookup (ngram 2-4) | {ng['k']} | {_fmt(ng['acceptance_length'])} "
                         f"(over {ng['num_drafts']} steps with a match) | {_fmt(ng['tokens_per_step'])} |")
        pos = ", ".join(_fmt(p) for p in facts.acceptance_per_position or [])
        lines += ["", f"Per-position acceptance at k={facts.k}: {pos}.",
                  "Lossless: speculative output equals plain greedy output token for token on every prompt."]
        if facts.train_expected_acceptance_length is not None:
            lines.append(f"The train stage expected {_fmt(facts.train_expected_acceptance_length)} at k={facts.k} "
                         f"from its held-out (teacher-forced) accuracies.")
        off = facts.offline
        if off:
            lines.append(f"Offline PyTorch evaluator (trained draft, HF target, greedy): acceptance length "
                         f"{_fmt(off['acceptance_length'])}; relative difference to vLLM {_fmt(facts.offline_vs_vllm, 4)}.")
        if facts.lookup_summary:
            lines += ["", facts.lookup_summary + "."]
        if facts.by_domain:
            lines += ["", f"Per domain of the held-out prompts, k={facts.k}:", "",
                      "| domain | prompts | acceptance length | tokens per target step | prompt lookup |",
                      "|---|---|---|---|---|"]
            for cat, d in facts.by_domain.items():
                lines.append(f"| {cat} | {d['num_prompts']} | {_fmt(d['acceptance_length'])} | "
                             f"{_fmt(d['tokens_per_step'])} | {_fmt(d['ngram_tokens_per_step'])} |")
        if facts.by_context_length:
            lines += ["", f"By prompt context length (tokens, export.context_buckets; counted {facts.context_counting}), "
                          f"k={facts.k}:", "",
                      "| context length | prompts | mean prompt tokens | acceptance length | tokens per target step "
                      "| prompt lookup |", "|---|---|---|---|---|---|"]
            from .context_length import ordered

            for label, d in ordered(facts.by_context_length):
                lines.append(f"| {label} | {d['num_prompts']} | {_fmt(d.get('mean_prompt_tokens'), 1)} | "
                             f"{_fmt(d.get('acceptance_length'))} | {_fmt(d.get('tokens_per_step'))} | "
                             f"{_fmt(d.get('ngram_tokens_per_step'))} |")
        temps = facts.by_temperature or {}
        if len(temps) > 1:
            ks = sorted(facts.acceptance_by_k, key=int)
            lines += ["", f"Acceptance length under sampling (vLLM's speculative sampling, request i seeded "
                          f"{facts.sampling_seed or 0} + i):", "",
                      "| temperature | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
            for t, row in temps.items():
                lines.append(f"| {t} | " + " | ".join(_fmt(row["acceptance_by_k"].get(k)) for k in ks) + " |")
    return "\n".join(lines) + "\n"
