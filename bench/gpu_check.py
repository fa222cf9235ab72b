"""The GPU check in one command: eagle3's vLLM paths on this machine's GPU, then a table.

    python3 bench/gpu_check.py                 # run tests/gpu (one pytest process per target family,
                                               # side by side on GPU 0), print the table
    python3 bench/gpu_check.py --table ROWS    # print the table of an earlier run's rows.jsonl

Needs a CUDA GPU and GPU vLLM (the versions eagle3 runs on: eagle3/vllm_compat.py). Writes
``rows.jsonl`` and one log per family under ``--out`` (default ``$OUT`` or workspace/gpu_check).
Exit status 0 when every check passed. tests/gpu/test_vllm_gpu.py says what each check does.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# one pytest process each, side by side on the GPU (the pipeline is the longest: ~8 engine starts)
GROUPS = {"llama": "((llama and not pipeline) or async) and not quantized", "qwen3_moe": "qwen3_moe",
          "deepseek_v3": "deepseek_v3", "pipeline": "pipeline", "quantized": "quantized"}


def _g(x, nd=3):
    return "" if x is None else f"{x:.{nd}g}"


def _engine(e: dict) -> str:
    if not e or "error" in e:
        return "?"
    eager = "eager" if e.get("enforce_eager") else f"compiled, graphs {str(e.get('cudagraph_mode', '?')).split('.')[-1]}"
    attn = ",".join(b for b in e.get("attention_backends", []) if b != "CACHE_ONLY_ATTN")
    return f"{eager}; {attn}{'; async' if e.get('async_scheduling') else ''}"


def table(rows: list[dict]) -> str:
    head = ["check", "target", "mode", "ok", "engine", "steps / max per step / chunks", "shards", "parity (of allowed)",
            "error vs fp32 (mean/max)", "hf bf16 noise", "vs hf store", "6% off", "KV tokens (B/token)"]
    out, quantized = [], [r for r in rows if r.get("check") == "quantized"]
    for r in (r for r in rows if r.get("check") != "quantized"):
        p = r.get("parity") or {}
        last = "last 4"
        err = (p.get("error") or {}).get(last)
        noise = (p.get("noise") or {}).get(last)
        vs = (r.get("vs_hf") or {}).get(last)
        st = r.get("stats") or {}
        kv = (r.get("engine") or {}).get("kv_cache") or {}
        kv = kv if isinstance(kv, dict) else {}
        out.append([
            r.get("check", ""), r.get("family", ""), r.get("mode", ""), "yes" if r.get("ok") else "NO",
            (f"refused: {r['refused']}" if r.get("refused") else _engine(r.get("engine")))
            if r.get("check") not in ("stage", "pipeline") else f"rc {r.get('rc')}, {r.get('seconds')} s",
            f"{st.get('steps', '')} / {st.get('max_samples_per_step', '')} / {st.get('continued_chunks', '')}" if st.get("steps") else "",
            "/".join(str(v) for v in (r.get("shards") or {}).values()),
            _g(p.get("max")) if p.get("method") else (_g(p.get("max")) + f" (tol {p.get('tolerance')})" if p else ""),
            f"{_g(err[0])} / {_g(err[1])}" if err else "", f"{_g(noise[0])} / {_g(noise[1])}" if noise else "",
            f"{_g(vs[0])} / {_g(vs[1])}" if vs else "",
            {"caught": "caught", None: ""}.get(r.get("perturbed_6pct"), str(r.get("perturbed_6pct")))
            + (f" (fixed tol: {r['perturbed_fixed_tolerance']['max']:.3g} < {r['perturbed_fixed_tolerance']['tolerance']:g})"
               if r.get("perturbed_fixed_tolerance") else ""),
            f"{kv.get('tokens', '')} ({kv.get('bytes_per_token', '')})" if kv.get("tokens") else "",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *out)] if out else [len(h) for h in head]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    lines = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(c) for c in out]
    errors = [f"- {r.get('family')} {r.get('mode')}: {r.get('error', '')[:600]}" for r in rows if not r.get("ok")]
    served = [f"- served ({r.get('family')}, {r.get('mode')}): vLLM acceptance by k {r.get('acceptance_by_k')}, "
              f"lossless {r.get('lossless')} (near-ties {sum(len(v) for v in (r.get('near_ties') or {}).values())}), "
              f"prompt lookup {r.get('prompt_lookup_tokens_per_step')} tokens/step, per domain "
              f"{ {c: d.get('acceptance_length') for c, d in (r.get('by_domain') or {}).items()} } "
              f"(counted {r.get('domain_counting')})" for r in rows if r.get("check") == "pipeline" and r.get("ok")]
    quant = [f"- quantized {r.get('family')} ({r.get('quantization')}), {r.get('mode')}, {r.get('engine_mode')}: "
             f"{'ok' if r.get('ok') else 'NO'}; parity {_g((r.get('parity') or {}).get('max'))} of allowed, aux ids one "
             f"lower {_g(min([v for k, v in (r.get('off_by_one') or {}).items() if k.startswith('aux')] or [float('nan')]))}"
             f"{'; ' + r['note'][:160] if r.get('note') else ''}{'; refused: ' + r['refused'][:160] if r.get('refused') else ''}"
             for r in quantized]
    info = rows[0] if rows else {}
    return "\n".join([f"GPU check: vLLM {info.get('vllm')}, torch {info.get('torch')}, {info.get('device')}; "
                      "error columns: the last state (id 4), per-token relative error", *lines, *served, *quant, *errors])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", help="print the table of this rows.jsonl and exit")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "workspace" / "gpu_check"))
    ap.add_argument("--families", default=",".join(GROUPS))
    ap.add_argument("--timeout", type=int, default=540, help="seconds for each family's pytest")
    a = ap.parse_args()
    if a.table:
        print(table([json.loads(x) for x in Path(a.table).read_text().splitlines() if x.strip()]))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    env = dict(os.environ, GPU_CHECK_OUT=str(out), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    procs = {}
    t0 = time.time()
    for fam in a.families.split(","):
        log = open(out / f"gpu_check_{fam}.log", "w")
        procs[fam] = (subprocess.Popen([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider",
                                        "-k", GROUPS[fam]], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT),
                      log)
    rc = 0
    for fam, (p, log) in procs.items():
        try:
            code = p.wait(timeout=max(10, a.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            code = "timeout"
        log.close()
        print(f"gpu_check: {fam}: pytest exit {code} after {time.time() - t0:.0f} s (log {out / f'gpu_check_{fam}.log'})")
        rc = rc or (code != 0)
    rows = [json.loads(x) for x in rows_path.read_text().splitlines() if x.strip()] if rows_path.exists() else []
    print(table(rows))
    return 1 if rc or not rows or not all(r.get("ok") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
