"""Export verification timed in its three designs: one engine per k, two shared engines, one engine.

    python3 bench/export_verify.py                            # the embedded default (SmolLM2, CPU)
    python3 bench/export_verify.py debug=fast                 # any eagle3 overrides
    python3 bench/export_verify.py --tiny-llama 4 debug=fast  # a random 4-layer Llama target, built here
                                                              # (bf16 on a GPU, float32 on CPU)
    # split over two calls (a GPU machine's 10-minute limit): the second adds the first's rows
    python3 bench/export_verify.py --arms one --out $OUT ...
    python3 bench/export_verify.py --arms per_k --against $OUT/results_one.json --out $OUT ...

Runs prepare, extract and train of the composed config where they are not complete yet (a workspace
reuses them: ``workspace=DIR``), then the export's verification of the trained draft (what the export
stage spends its time on: eagle3.export.pipeline.verify) in each arm, ``--repeats`` times, alternated:

- ``per_k``: ``export.shared_engines=false export.prompt_lookup=served``: plain decoding, each k of
  eval_ks and prompt lookup, one vLLM engine start each (seven for k = 1..5);
- ``two``: ``export.shared_engines=true export.prompt_lookup=served``: the draft's engine (plain
  decoding at 0 draft tokens, then every k) and prompt lookup's;
- ``one``: the defaults, the draft's engine alone, prompt lookup replayed on the greedy path.

The table gives wall time, engine starts, the figures, and whether every arm's figures are identical.
The offline evaluator runs on vLLM's greedy path in every arm; the code before that change (its own
greedy decoding in transformers, before the engines) is another commit's: time it with that commit's
copy of this script. Raw results go to ``--out`` (default ``$OUT`` or workspace/bench_export_verify).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = {"per_k": ["export.shared_engines=false", "export.prompt_lookup=served"],
        "two": ["export.shared_engines=true", "export.prompt_lookup=served"],
        "one": ["export.shared_engines=true", "export.prompt_lookup=replay"]}
FIGURES = ("acceptance_by_k", "tokens_per_step_by_k", "acceptance_per_position_by_k", "ngram", "vllm",
           "offline", "lossless", "near_ties", "hf_greedy_equals_vllm_greedy", "by_domain")


def build_tiny_llama(out: Path, layers: int) -> Path:
    """A random Llama (head_dim 64, hidden 512) with the embedded default's tokenizer-free setup: a
    byte-level tokenizer trained here, as tests/conftest.py builds them."""
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_llama as build

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if not (out / "config.json").is_file():
        build(out, num_layers=layers, hidden=512, tokenizer_vocab=2048, head_dim=64, num_attention_heads=8,
              num_key_value_heads=2, torch_dtype=dtype)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each arm, alternated (default 1)")
    ap.add_argument("--arms", default="per_k,one",
                    help=f"the arms, in order, of {sorted(ARMS)} (default per_k,one; one arm alone splits a "
                         "measurement over calls: results.json gets a suffix per arm)")
    ap.add_argument("--against", default="",
                    help="an earlier call's results*.json: its rows join the table and the identity check")
    ap.add_argument("--tiny-llama", type=int, default=0, metavar="LAYERS",
                    help="build a random Llama of LAYERS layers as the target (under the workspace)")
    ap.add_argument("--out", default="", help="where results.json goes")
    ap.add_argument("overrides", nargs="*", help="eagle3 overrides (key=value, group=option)")
    args = ap.parse_args()

    from eagle3.__main__ import compose_config
    from eagle3.runner import run as run_stage

    overrides = list(args.overrides)
    ws = next((o.split("=", 1)[1] for o in overrides if o.startswith("workspace=")), "")
    if not ws:
        ws = str(REPO / "workspace" / "bench_export_verify")
        overrides.append(f"workspace={ws}")
    if args.tiny_llama:
        target = build_tiny_llama(Path(ws).resolve() / f"tiny_llama_{args.tiny_llama}", args.tiny_llama)
        # random weights: the target's best tokens are all but tied everywhere, so vLLM's and transformers'
        # roundings part often and the store's agreement check (meant for a trained target) would refuse it
        overrides += [f"target.path={target}", "extract.min_agreement=0"]
    out = Path(args.out or os.environ.get("OUT") or Path(ws) / "bench_export_verify")
    out.mkdir(parents=True, exist_ok=True)
    stage_s = {}
    for stage in ("prepare", "extract", "train"):
        t0 = time.perf_counter()
        run_stage(compose_config([f"stage={stage}", *overrides]))
        stage_s[stage] = time.perf_counter() - t0

    rows = []
    arms = [a.strip() for a in args.arms.split(",")]
    if unknown := [a for a in arms if a not in ARMS]:
        ap.error(f"--arms: unknown {unknown}; the arms are {sorted(ARMS)}")
    arms = arms * args.repeats
    _timed_engine_starts()
    for arm in arms:
        cfg = compose_config(["stage=export", *ARMS[arm], *overrides])
        load_before = _load()
        t, f = time_verification(cfg)
        rows.append({"arm": arm, **t, "figures": {k: f.get(k) for k in FIGURES}, "load": f"{load_before}-{_load()}"})
        print(f"export verification, {arm} ({' '.join(ARMS[arm])}): {t['seconds']:.1f} s, {t['engine_starts']} engine "
              f"starts {t['engine_start_seconds']:.1f} s (load {rows[-1]['load']})", flush=True)
    result = {"overrides": overrides, "stages_s": stage_s, "rows": rows, "versions": _versions()}
    name = "results.json" if len(set(arms)) > 1 else f"results_{arms[0]}.json"
    (out / name).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.against:
        rows = json.loads(Path(args.against).read_text())["rows"] + rows
    print(table(rows))
    return 0 if _same(rows) else 1


def time_verification(cfg):
    """The export's verification of the trained draft (eagle3.export.pipeline.verify), on a copy
    written to a temporary directory; (seconds, its figures)."""
    import dataclasses

    import torch

    from eagle3.contracts import ExportFacts
    from eagle3.cpu import new_stage, phase_threads
    from eagle3.export.formats import ExportSpec, write_format
    from eagle3.export.outdir import fingerprint
    from eagle3.export.pipeline import export_marker, verify
    from eagle3.export.sources import load_source
    from eagle3.manifest import Manifest
    from eagle3.target import resolve

    target = resolve(cfg.target, cfg.workspace)
    ckpt, _, prep, _ = load_source(cfg, Manifest(cfg.experiment_dir), target, needs_prompts=True)
    dtype = target.run_dtype(cfg.target.dtype)
    with tempfile.TemporaryDirectory(dir=cfg.workspace) as d:
        spec = ExportSpec(target_path=str(target.path), target_config=target.config, dtype=dtype,
                          num_speculative_tokens=cfg.export.num_speculative_tokens,
                          include_embedding=cfg.export.include_embedding)
        model_dir = Path(d) / "model"
        write_format(ckpt, cfg.export.format, model_dir, spec)
        c = ckpt.config
        facts = ExportFacts(format=cfg.export.format, layer_ids=list(c.aux_layer_ids),
                            draft_vocab_size=c.draft_vocab_size, vocab_size=c.vocab_size, dtype=dtype,
                            fingerprint=fingerprint(model_dir), model_dir="model", source=ckpt.source)
        new_stage()  # the thread count measured afresh for each run, as the runner does for a stage
        starts.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        with phase_threads("decode", on_cpu=not torch.cuda.is_available()):
            v = verify(cfg, target, ckpt, prep, dtype, model_dir, export_marker(facts, target.identity(), "bench"))
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": seconds, "cpu_seconds": cpu_s, "engine_start_seconds": sum(starts),
            "engine_starts": len(starts)}, dataclasses.asdict(v)


starts: list = []  # seconds of each engine start (eagle3.vllm_engine.build_llm) in the current run


def _timed_engine_starts() -> None:
    import eagle3.vllm_engine as engine

    build = engine.build_llm

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return build(*a, **kw)
        finally:
            starts.append(time.perf_counter() - t0)

    engine.build_llm = timed


def _same(rows) -> bool:
    return all(r["figures"] == rows[0]["figures"] for r in rows)


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def _versions() -> dict:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def table(rows) -> str:
    def fmt(d):
        return " ".join(f"{float(v):.3f}" for _, v in sorted(d.items(), key=lambda kv: int(kv[0])))

    lines = ["| arm | engine starts | their wall s | verification wall s | its CPU s | load (1 min, "
             "before-after) | acceptance k=1..5 | tokens/step k=1..5 | prompt lookup tokens/step | lossless |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        f = r["figures"]
        lines.append(f"| {r['arm']} | {r['engine_starts']} | {r['engine_start_seconds']:.1f} | "
                     f"{r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['load']} | "
                     f"{fmt(f['acceptance_by_k'])} | {fmt(f['tokens_per_step_by_k'])} | "
                     f"{f['ngram']['tokens_per_step']:.3f} | {f['lossless']} |")
    fastest = {}
    for r in rows:
        fastest[r["arm"]] = min(fastest.get(r["arm"], r["seconds"]), r["seconds"])
    if "per_k" in fastest and len(fastest) > 1:
        b = fastest["per_k"]
        lines.append("\nfastest of each: " + ", ".join(f"{arm} {s:.1f} s ({s / b:.2f} of per_k)" for arm, s in
                                                       fastest.items()) +
                     f"; figures identical in every run: {'yes' if _same(rows) else 'NO'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
