"""What checking every sample as it is read costs: the store's per-sample checksum
(eagle3.hashing.sample_hasher, xxh3_64) against the other checksums at hand, and against the train
step's data rate.

A sample at the 8B shape (Llama-3.1-8B: 2048 tokens x (3 aux layers + the last) x hidden 4096,
bf16) is 64 MiB of hidden states; an 8B-shaped step on one H200 takes ~61 ms per 2048 tokens
(bench/results/train_step_h200_202612.md), so the loader must deliver ~1.0 GiB/s of states, and a
check on its path must run well above that on the loader's threads or workers. Measured:

- each checksum over one sample's bytes in memory (numpy), on 1 thread and on N threads at once
  (each its own sample: whether it releases the GIL and scales, as DataLoader threads would);
- the store's reader itself (eagle3.store.HiddenStates, a shard written by eagle3's writer, warm in
  the page cache): a whole sample read with its checksum verified and without (the check's cost
  where it runs), for ``--dtypes bfloat16,fp8`` (fp8: values + a float32 scale per token and layer).
  Unchecked, a read costs next to nothing: safetensors' slices are views of the mapped shard, whose
  bytes are first touched by the checksum (checked) or by the batch's copy (collate, either way);
- with ``--device cuda``: copying a read sample to the GPU (pinned), for comparison.

    python bench/sample_checksum.py                      # CPU: ~1 minute on 2 cores
    python bench/sample_checksum.py --device cuda --threads 1,4,8 --out $OUT/sample_checksum.json

Needs torch, numpy, safetensors and xxhash (zlib, hashlib stdlib; blake3 if installed). Prints a
table last; ``--out``: the raw numbers as JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

STEP_S = 0.061  # an 8B-shaped step on one H200, per 2048 tokens
TOKENS, N_AUX, HIDDEN = 2048, 3, 4096
GIB = 2**30


def checksums() -> dict:
    """name -> f(buffer) for every checksum available here."""
    out = {"crc32 (zlib)": zlib.crc32, "adler32 (zlib)": zlib.adler32,
           "sha256 (hashlib)": lambda b: hashlib.sha256(b).digest(),
           "blake2b (hashlib)": lambda b: hashlib.blake2b(b).digest(),
           "md5 (hashlib)": lambda b: hashlib.md5(b).digest()}
    try:
        import xxhash

        out.update({"xxh3_64 (xxhash) *": xxhash.xxh3_64_intdigest, "xxh3_128 (xxhash)": xxhash.xxh3_128_intdigest,
                    "xxh64 (xxhash)": xxhash.xxh64_intdigest, "xxh32 (xxhash)": xxhash.xxh32_intdigest})
    except ImportError:
        pass
    out["memcpy (numpy, for scale)"] = lambda b: np.copy(b)  # what collating a batch does to each sample once
    try:
        import blake3

        out["blake3 (blake3)"] = lambda b: blake3.blake3(b).digest()
    except ImportError:
        pass
    return out


def rate(fn, buffers, repeat: int) -> float:
    """Aggregate bytes/s of ``fn`` over ``buffers``, one thread each, ``repeat`` times each."""
    fn(buffers[0])  # warm up
    barrier = threading.Barrier(len(buffers) + 1)

    def work(b):
        barrier.wait()
        for _ in range(repeat):
            fn(b)

    threads = [threading.Thread(target=work, args=(b,)) for b in buffers]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return len(buffers) * repeat * len(buffers[0]) / (time.perf_counter() - t0)


def write_store(root: Path, dtype: str, samples: int):
    """A store of ``samples`` 8B-shaped samples in one shard, written by eagle3's writer."""
    import torch

    from eagle3.extract.writer import CapturedBatch, ShardWriter
    from eagle3.store import ShardSpec, StoreLayout, finalize_store

    layout = StoreLayout(layer_ids=(2, 16, 29), last_layer_id=32, hidden_size=HIDDEN, dtype=dtype)
    ids = [[1] * TOKENS] * samples
    writer = ShardWriter(root, layout)
    writer.begin(ShardSpec("train", 0, 1, 0, ids, ids))
    g = torch.Generator().manual_seed(0)
    for j in range(samples):
        s = torch.randn(TOKENS, N_AUX + 1, HIDDEN, generator=g)
        writer.write(CapturedBatch([(("train", 0), j, 0, 0, TOKENS)], s[:, :-1].contiguous(), s[:, -1].contiguous()))
    writer.end(("train", 0))
    writer.close()
    finalize_store(root, layout, {"train": [TOKENS] * samples}, samples)


def read_rate(root: Path, repeat: int, check: bool, device: str) -> tuple:
    """(state bytes/s, s per sample) reading every sample of the store ``repeat`` times, warm, with or
    without the per-sample check; with a cuda ``device`` each sample is then copied there (pinned)."""
    import torch

    from eagle3.store import HiddenStates

    hs = HiddenStates(root, "train", fp8="raw")
    if not check:
        hs._checksums = [None] * len(hs._checksums)
    assert hs.checks_samples == check
    names = ("aux_hidden_states", "last_hidden_state", "aux_scales", "last_scales")
    hs[0]  # the shard opened
    nbytes, t0 = 0, time.perf_counter()
    for _ in range(repeat):
        for i in range(len(hs)):
            item = hs[i]
            nbytes += sum(item[n].numel() * item[n].element_size() for n in names if n in item)
            if device.startswith("cuda"):
                for n in names:
                    if n in item:
                        item[n].pin_memory().to(device, non_blocking=True)
                torch.cuda.synchronize(device)
    s = time.perf_counter() - t0
    return nbytes / s, s / (repeat * len(hs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts for the checksums (default 1,2)")
    ap.add_argument("--repeat", type=int, default=8, help="passes over each buffer / the store (default 8)")
    ap.add_argument("--samples", type=int, default=4, help="samples in the reader's store (64 MiB each in bf16)")
    ap.add_argument("--dtypes", default="bfloat16,fp8", help="store dtypes for the reader (default bfloat16,fp8)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:i]: also copy each read sample to it")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the reader's store is written")
    ap.add_argument("--out", default="", help="JSON file for the raw numbers")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",") if t]
    sample = TOKENS * (N_AUX + 1) * HIDDEN * 2
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, sample, dtype=np.uint8) for _ in range(max(threads))]
    rows = []
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; a sample: {TOKENS} tokens x {N_AUX + 1} layers x "
          f"{HIDDEN} x bf16 = {sample / 2**20:.0f} MiB", flush=True)
    for name, fn in checksums().items():
        for t in threads:
            r = rate(fn, buffers[:t], args.repeat)
            rows.append({"what": name, "threads": t, "bytes_per_s": r})
            print(f"  {name:<22} {t} threads {r / GIB:7.2f} GiB/s", flush=True)
    for dtype in [d for d in args.dtypes.split(",") if d]:
        root = Path(tempfile.mkdtemp(prefix="eagle3-sample-checksum-", dir=args.dir))
        try:
            write_store(root, dtype, args.samples)
            for check in (False, True):
                r, per = read_rate(root, args.repeat, check, args.device)
                what = f"read {dtype} sample{', checked' if check else ''}{' + copy to ' + args.device if args.device != 'cpu' else ''}"
                rows.append({"what": what, "threads": 1, "bytes_per_s": r, "s_per_sample": per})
                print(f"  {what:<22} {r / GIB:7.2f} GiB/s, {per * 1e3:.1f} ms a sample", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nper 8B-shaped sample ({sample / 2**20:.0f} MiB of bf16 states; fp8 rows: half the values + scales); "
          f"the step needs {sample / STEP_S / GIB:.2f} GiB/s (a {STEP_S * 1e3:.0f} ms step); * = the store's checksum")
    print(f"{'what':<46} | {'threads':>7} | {'GiB/s':>7} | {'ms / sample':>11} | {'of a step':>9}")
    print("-" * 92)
    for r in rows:
        ms = r.get("s_per_sample", sample / (r["bytes_per_s"] / r["threads"])) * 1e3  # one thread's time
        print(f"{r['what']:<46} | {r['threads']:>7} | {r['bytes_per_s'] / GIB:7.2f} | {ms:11.1f} | "
              f"{ms / (STEP_S * 1e3):8.0%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"sample_bytes": sample, "step_s": STEP_S, "cores": os.cpu_count(),
                                              "device": args.device, "runs": rows}, indent=2) + "\n")
        print(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
