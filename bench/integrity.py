"""What verifying a hidden-state store costs, against reading it: the train stage hashes every shard
it reads (its sha256 tree, eagle3.hashing.sha256_tree_files) before the first step, and the extract
stage does the same before it calls a store complete.

A store at the 8B shape (Llama-3.1-8B: hidden 4096, 3 aux layers + the last, bf16 = 32 KiB per
token) is written in eagle3's shard format (eagle3.store.shard_header; random values), ``--gib``
GiB over ``--shards`` shards of up to 256 samples of 2048 tokens (``--gib 128``: 8 shards of 256
samples x 2048 tokens, 16 GiB each; a smaller ``--gib`` has fewer samples per shard). Then, per
thread count:

- verify, cold: the page cache dropped for the shards first (fsync + posix_fadvise DONTNEED, no root
  needed), every shard's sha256 tree computed, its leaves on ``threads`` threads;
- verify, warm: the same again at once (what is left in the page cache);

and reading the store as the train stage's reader does (safetensors ``safe_open``, each sample's
rows of both state tensors, one thread), cold. The ratio verify/read says how much longer a run's
first pass over its store takes.

    python bench/integrity.py --gib 1 --out /tmp/integrity.json            # CPU, 2 cores: ~20 s
    python bench/integrity.py --gib 48 --dir /path/on/the/nvme --out $OUT/integrity.json   # GPU host

Needs torch, numpy and safetensors (no hydra, vllm or datasets). Prints a table last; the raw
numbers go to ``--out`` (JSON). ``--dir`` must have room for the store (it is removed afterwards
unless ``--keep``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from eagle3.hashing import TREE_CHUNK, hash_threads, sha256_tree_files  # noqa: E402
from eagle3.store import ShardSpec, StoreLayout, shard_header, shard_name  # noqa: E402

LAYOUT_8B = StoreLayout(layer_ids=(2, 16, 29), last_layer_id=32, hidden_size=4096, dtype="bfloat16")
SAMPLES_PER_SHARD = 256  # at most; fewer where --gib is too small for 256 samples of SAMPLE_TOKENS
SAMPLE_TOKENS = 2048
GB = 1e9


def write_store(root: Path, gib: float, shards: int) -> list:
    """``shards`` shard files of about ``gib`` GiB in all; random bytes in the 8B layout."""
    tokens = int(gib * 2**30 / shards / LAYOUT_8B.bytes_per_token)
    # samples of SAMPLE_TOKENS tokens (the reader's slices as in training), up to 256 a shard
    count = max(1, min(SAMPLES_PER_SHARD, round(tokens / SAMPLE_TOKENS)))
    length = max(1, tokens // count)
    rng = np.random.default_rng(0)
    (root / "train").mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(shards):
        samples = [range(length)] * count
        plan = ShardSpec("train", k, shards, k * count, samples, samples)
        header, offs = shard_header(plan, LAYOUT_8B)
        path = root / "train" / shard_name(k, shards)
        with open(path, "wb") as f:
            f.write(header)
            left = offs["__end__"] - len(header)
            while left:
                n = min(left, 64 << 20)
                f.write(rng.bytes(n))
                left -= n
            # the tensors a reader indexes by are real: offsets and sample ids (states and tokens random)
            for name, arr in (("offsets", plan.offsets),
                              ("sample_index", np.arange(plan.first, plan.first + plan.num_samples, dtype=np.int64))):
                f.seek(offs[name])
                f.write(arr.astype(np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    return paths


def _count(shard: Path, what: str = "samples") -> float:
    """Samples in a shard, or tokens per sample (from its header's metadata)."""
    with open(shard, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
    n = int(meta["num_samples"])
    return n if what == "samples" else int(meta["num_tokens"]) / n


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_like_the_trainer(paths) -> int:
    """Every sample's rows of both state tensors through safe_open, as eagle3.store.HiddenStates
    reads them; returns the bytes read."""
    from safetensors import safe_open

    nbytes = 0
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            offsets = f.get_tensor("offsets").numpy()
            aux, last = f.get_slice("aux_hidden_states"), f.get_slice("last_hidden_state")
            for a, b in zip(offsets[:-1], offsets[1:]):
                x, y = aux[int(a):int(b)], last[int(a):int(b)]
                nbytes += x.numel() * x.element_size() + y.numel() * y.element_size()
    return nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=16.0, help="store size (default 16; 128 = 8 x 256 x 2048 tokens)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--threads", default="", help="comma-separated thread counts (default 1,2,4,.. up to the cores)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the store is written")
    ap.add_argument("--out", default="", help="JSON file for the raw numbers")
    ap.add_argument("--keep", action="store_true", help="keep the store afterwards")
    args = ap.parse_args()

    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",") if t] or \
        sorted({t for t in (1, 2, 4, 8, 16, hash_threads()) if t <= max(hash_threads(), 1)})
    free = shutil.disk_usage(args.dir).free
    if free < args.gib * 2**30 * 1.05:
        sys.exit(f"{args.dir} has {free / 2**30:.1f} GiB free, the store needs {args.gib:.1f} GiB: lower --gib "
                 f"or give --dir on a larger disk")
    root = Path(tempfile.mkdtemp(prefix="eagle3-integrity-", dir=args.dir))
    rows, result = [], {"layout": LAYOUT_8B.to_json(), "bytes_per_token": LAYOUT_8B.bytes_per_token,
                        "samples_per_shard": SAMPLES_PER_SHARD, "tree_chunk": TREE_CHUNK, "cores": cores,
                        "dir": str(root), "runs": []}
    try:
        t0 = time.perf_counter()
        paths = write_store(root, args.gib, args.shards)
        write_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in paths)
        result.update(bytes=size, shards=len(paths), shard_bytes=paths[0].stat().st_size, write_s=write_s,
                      samples_per_shard=int(_count(paths[0])), sample_tokens=int(_count(paths[0], "tokens")))
        print(f"wrote {len(paths)} shards, {size / 2**30:.2f} GiB in {write_s:.1f} s ({size / write_s / GB:.2f} GB/s) "
              f"to {root}; {cores} cores", flush=True)
        reference = None
        for t in threads:
            for mode in ("cold", "warm"):
                if mode == "cold":
                    drop_cache(paths)
                t0 = time.perf_counter()
                digests = sha256_tree_files(paths, threads=t)
                s = time.perf_counter() - t0
                reference = reference or digests
                assert digests == reference, "the digests changed between passes"
                run = {"what": "verify", "mode": mode, "threads": t, "seconds": s, "gb_per_s": size / s / GB}
                result["runs"].append(run)
                print(f"verify {mode} {t:>2} threads: {s:7.2f} s {size / s / GB:6.2f} GB/s", flush=True)
        drop_cache(paths)
        t0 = time.perf_counter()
        nbytes = read_like_the_trainer(paths)
        s = time.perf_counter() - t0
        result["runs"].append({"what": "read", "mode": "cold", "threads": 1, "seconds": s, "gb_per_s": nbytes / s / GB,
                               "bytes": nbytes})
        print(f"read   cold  1 thread : {s:7.2f} s {nbytes / s / GB:6.2f} GB/s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    read = next(r for r in result["runs"] if r["what"] == "read")
    print(f"\nstore at the 8B shape ({LAYOUT_8B.bytes_per_token} B/token), {result['shards']} shards of "
          f"{result['shard_bytes'] / 2**30:.2f} GiB ({result['samples_per_shard']} samples x "
          f"{result['sample_tokens']} tokens), {cores} cores, leaves of {TREE_CHUNK >> 20} MiB")
    print(f"{'GiB':>7} | {'what':<12} | {'threads':>7} | {'s':>8} | {'GB/s':>6} | {'x read':>6}")
    print("-" * 62)
    for r in result["runs"]:
        rows.append(r)
        print(f"{size / 2**30:7.2f} | {r['what'] + ' ' + r['mode']:<12} | {r['threads']:>7} | {r['seconds']:8.2f} | "
              f"{r['gb_per_s']:6.2f} | {r['seconds'] / read['seconds']:6.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
