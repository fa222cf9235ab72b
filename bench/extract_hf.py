"""Benchmark + check of the HF extraction backend on a GPU (or CPU): the GPU paths of the store
writer (pinned host buffers, copies that do not wait, CUDA events, disk writes in the writer thread),
which the vLLM worker uses on GPU too.

- ``--check``: a tiny float32 random Llama extracted on the GPU and on the CPU; every stored layer
  must match within 1e-4 relative (max |gpu - cpu| / max |cpu|).
- Throughput: a random Llama of the given shape (default Llama-3.1-8B's, bf16); plain forward of
  the base model over the same batches (no hooks, nothing copied) vs extraction into a store on
  local disk (hooks, stack + cast on the GPU, D2H into pinned buffers, pwrite, fsync, sha256).

    python bench/extract_hf.py --check
    python bench/extract_hf.py --samples 64 --length 2048 --batch 4

Needs torch, transformers, safetensors, numpy, tqdm (not vLLM, hydra or datasets). Prints a table
last; writes raw numbers to $OUT/bench_extract_hf.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3.extract import Samples, extract_store  # noqa: E402
from eagle3.extract.hf_backend import HFExtractor  # noqa: E402
from eagle3.extract.layers import default_layer_ids  # noqa: E402
from eagle3.store import StoreLayout, open_hidden_states  # noqa: E402


def random_base_model(hidden, layers, heads, kv_heads, intermediate, vocab, dtype, device):
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=8192, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    return model.eval()


def ecfg(device, batch, sps=256):
    return SimpleNamespace(device=device, batch_size=batch, samples_per_shard=sps)


def check(root: Path) -> float:
    model = random_base_model(128, 6, 4, 2, 256, 512, torch.float32, "cpu")
    layout = StoreLayout(layer_ids=(0, 2, 4), last_layer_id=6, hidden_size=128, dtype="float32")
    rng = random.Random(0)
    ids = [[rng.randrange(512) for _ in range(n)] for n in (1, 7, 64, 129, 300, 33, 2, 90, 17, 256)]
    rel = 0.0
    stores = {}
    for device in ("cpu", "cuda"):
        ex = HFExtractor(None, layout, "float32", ecfg(device, 3, sps=4), model=model)
        stores[device] = root / f"check-{device}"
        extract_store(stores[device], {"train": Samples(ids)}, layout, backend="hf", target_path=None,
                      target_dtype="float32", ecfg=ecfg(device, 3, sps=4), progress=False, extractor=ex)
    a, b = open_hidden_states(stores["cuda"]), open_hidden_states(stores["cpu"])
    for i in range(len(ids)):
        assert a[i]["input_ids"].tolist() == ids[i]
        for key in ("aux_hidden_states", "last_hidden_state"):
            x, y = a[i][key].float(), b[i][key].float()
            rel = max(rel, float((x - y).abs().max() / y.abs().max()))
    return rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="GPU vs CPU correctness on a tiny model first")
    ap.add_argument("--only-check", action="store_true")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--store-dir", default="", help="where the store is written (default: a temp dir)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(a.store_dir) if a.store_dir else Path(tempfile.mkdtemp(prefix="eagle3-bench-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    if a.check or a.only_check:
        if device != "cuda":
            sys.exit("--check compares GPU with CPU; no GPU here")
        rel = check(root)
        result["check_max_rel_diff"] = rel
        print(f"check: GPU vs CPU extraction, float32, max relative diff {rel:.2e} "
              f"({'OK' if rel <= 1e-4 else 'FAIL'})", flush=True)
        if rel > 1e-4:
            sys.exit(1)
        if a.only_check:
            return
    dtype = torch.bfloat16
    model = random_base_model(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, dtype, device)
    layout = StoreLayout(layer_ids=default_layer_ids(a.layers), last_layer_id=a.layers, hidden_size=a.hidden,
                         dtype="bfloat16")
    rng = random.Random(0)
    ids = [[rng.randrange(a.vocab) for _ in range(a.length)] for _ in range(a.samples)]
    n_tokens = a.samples * a.length
    cfg = ecfg(device, a.batch, sps=max(1, a.samples // 4))
    ex = HFExtractor(None, layout, "bfloat16", cfg, model=model)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def plain():
        for h in ex._hooks:
            h.remove()
        ex._hooks = []
        with torch.inference_mode():
            for s in range(0, a.samples, a.batch):
                x = torch.tensor(ids[s:s + a.batch], device=device)
                model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
        sync()

    def extract(rep):
        ex2 = HFExtractor(None, layout, "bfloat16", cfg, model=model)  # hooks installed afresh
        store = root / f"store-{rep}"
        shutil.rmtree(store, ignore_errors=True)
        extract_store(store, {"train": Samples(ids)}, layout, backend="hf", target_path=None,
                      target_dtype="bfloat16", ecfg=cfg, progress=False, extractor=ex2)
        ex2.close()
        size = sum(p.stat().st_size for p in store.rglob("*.safetensors"))
        shutil.rmtree(store, ignore_errors=True)
        return size

    plain()  # warm-up
    times = {"plain": [], "extract": []}
    size = 0
    for rep in range(a.reps):
        for what in (("plain", "extract") if rep % 2 == 0 else ("extract", "plain")):
            t0 = time.perf_counter()
            if what == "plain":
                plain()
            else:
                size = extract(rep)
            times[what].append(time.perf_counter() - t0)
        print(f"rep {rep}: " + ", ".join(f"{k} {n_tokens / v[-1]:.0f} tok/s" for k, v in times.items()), flush=True)
    best = {k: min(v) for k, v in times.items()}
    result.update(shape=vars(a), tokens=n_tokens, seconds=times, bytes_per_token=size / n_tokens,
                  overhead_pct=round(100 * (best["extract"] / best["plain"] - 1), 1),
                  write_gb_per_s=size / best["extract"] / 1e9)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "bench_extract_hf.json").write_text(json.dumps(result, indent=2))
    if not a.store_dir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nHF backend on {result['device']}: random Llama H={a.hidden} L={a.layers} bf16, {a.samples} x {a.length} "
          f"tokens, batch {a.batch}, layers {list(layout.layer_ids)}+[{a.layers}], best of {a.reps}")
    print(f"{'run':<36}{'tokens/s':>10}{'overhead':>10}{'B/token':>9}{'store GB/s':>12}")
    print(f"{'plain forward (base model)':<36}{n_tokens / best['plain']:>10.0f}")
    print(f"{'extract (hooks + D2H + disk)':<36}{n_tokens / best['extract']:>10.0f}{result['overhead_pct']:>+9.1f}%"
          f"{result['bytes_per_token']:>9.0f}{result['write_gb_per_s']:>12.2f}")


if __name__ == "__main__":
    main()
