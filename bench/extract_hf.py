"""Benchmark + check of the HF extraction backend on a GPU (or CPU): the GPU paths of the store
writer (pinned host buffers, copies that do not wait, CUDA events, disk writes in the writer thread),
which the vLLM worker uses on GPU too.

- ``--check``: a tiny float32 random Llama extracted on the GPU and on the CPU; every stored layer
  must match within 1e-4 relative (max |gpu - cpu| / max |cpu|), and every shard's sidecar digest
  (its sha256 tree) must be its file's.
- Throughput: a random Llama of the given shape (default Llama-3.1-8B's, bf16); plain forward of
  the base model over the same batches (no hooks, nothing copied) vs extraction into a store on
  local disk (hooks, stack + cast on the GPU, D2H into pinned buffers, pwrite, fsync, sha256 tree).
  Deleting the store is not timed. After the timed runs, the last store's shards are hashed again
  and compared with their sidecars, and a digest of the store (over the sidecars' digests) is
  printed per run: equal digests = byte-identical stores.
- ``--profile``: where the time goes, measured the same way for any version of the writer (the
  writer module's ``os`` and ``hashlib`` and the producer-side calls are wrapped with timers):
  the forward loop's time inside the stager and writer calls (waiting for a pinned buffer or a
  queue slot), ``close()`` (the tail after the last forward), and thread-seconds in sha256, in
  reading the file back for it, in fsync and in pwrite. It also measures this machine's ceilings:
  sha256 on one core, page-cache writes, fsync, device-to-pinned-host copies.
- ``--code DIR``: import eagle3 from DIR instead of this checkout (to profile another version
  with this script).
- ``--variants "default;early_writeback=0;stream_hash=0,early_writeback=0"``: extraction once per
  writer setting (``ShardWriter`` keywords stream_hash, early_writeback, row_threads, max_pending;
  ``depth`` = pinned buffers of the stager), each timed in every rep, one table row each.

    python bench/extract_hf.py --check
    python bench/extract_hf.py --samples 32 --length 2048 --batch 4 --profile
    python bench/extract_hf.py --hidden 256 --layers 4 --heads 4 --kv-heads 2 --intermediate 512 \\
        --vocab 1000 --samples 8 --length 128 --batch 2 --profile     # CPU: a quick local check

Needs torch, transformers, safetensors, numpy, tqdm (not vLLM, hydra or datasets). Prints a table
last; writes raw numbers to $OUT/bench_extract_hf[-TAG].json when OUT is set.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace


def _code_dir() -> Path:
    for i, arg in enumerate(sys.argv):
        if arg == "--code" and i + 1 < len(sys.argv):
            return Path(sys.argv[i + 1]).resolve()
        if arg.startswith("--code="):
            return Path(arg.split("=", 1)[1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_code_dir()))

import torch  # noqa: E402

import eagle3  # noqa: E402
import eagle3.extract.writer as writer_mod  # noqa: E402
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


def _digest(rec: dict) -> str:
    """A sidecar's digest: the sha256 tree (eagle3.hashing.sha256_tree_file), or the plain sha256 of
    a writer from before the tree (``--code`` of an older version)."""
    return rec.get("sha256_tree") or rec["sha256"]


def verify_store(store: Path) -> tuple[str, int]:
    """(digest over the sidecars' digests, number of shards); raises if a file's digest, computed
    again from the file, differs from its sidecar."""
    from eagle3.hashing import sha256_tree_file

    recs = []
    for side in sorted(store.glob("*/shard-*.json")):
        rec = json.loads(side.read_text())
        path = side.parent / rec["file"]
        if "sha256_tree" in rec:
            got = sha256_tree_file(path, rec["tree_chunk"])
        else:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
            got = h.hexdigest()
        if got != _digest(rec):
            raise SystemExit(f"FAIL: {path} has digest {got}, its sidecar says {_digest(rec)}")
        recs.append(f"{side.parent.name}/{rec['file']}:{_digest(rec)}")
    return hashlib.sha256("\n".join(recs).encode()).hexdigest(), len(recs)


def store_digest(store: Path) -> str:
    recs = [f"{s.parent.name}/{json.loads(s.read_text())['file']}:{_digest(json.loads(s.read_text()))}"
            for s in sorted(store.glob("*/shard-*.json"))]
    return hashlib.sha256("\n".join(recs).encode()).hexdigest()


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
        shutil.rmtree(stores[device], ignore_errors=True)
        extract_store(stores[device], {"train": Samples(ids)}, layout, backend="hf", target_path=None,
                      target_dtype="float32", extract_cfg=ecfg(device, 3, sps=4), progress=False, extractor=ex)
        verify_store(stores[device])
    a, b = open_hidden_states(stores["cuda"]), open_hidden_states(stores["cpu"])
    for i in range(len(ids)):
        assert a[i]["input_ids"].tolist() == ids[i]
        for key in ("aux_hidden_states", "last_hidden_state"):
            x, y = a[i][key].float(), b[i][key].float()
            rel = max(rel, float((x - y).abs().max() / y.abs().max()))
    return rel


# -- profile: timers around the writer module, the same for any version of it ------------------------

class Timers:
    def __init__(self):
        self.lock = threading.Lock()
        self.s: dict = {}
        self.main = threading.get_ident()

    def add(self, key: str, seconds: float) -> None:
        with self.lock:
            self.s[key] = self.s.get(key, 0.0) + seconds

    def timed(self, fn, key: str, main_only: bool = False):
        def wrapper(*args, **kwargs):
            if main_only and threading.get_ident() != self.main:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t0)
        return wrapper

    def take(self) -> dict:
        with self.lock:
            out, self.s = self.s, {}
        return out


def install_profile(timers: Timers) -> None:
    real_os, real_hashlib = writer_mod.os, writer_mod.hashlib

    class OsProxy:
        def __getattr__(self, name):
            return getattr(real_os, name)

    osp = OsProxy()
    for name, key in (("fsync", "fsync"), ("pwrite", "pwrite"), ("pread", "read_back"), ("preadv", "read_back")):
        if hasattr(real_os, name):
            setattr(osp, name, timers.timed(getattr(real_os, name), key))
    writer_mod.os = osp

    class Sha256:
        def __init__(self, data=b""):
            self._h = real_hashlib.sha256()
            if data:
                self.update(data)

        def update(self, data):
            t0 = time.perf_counter()
            self._h.update(data)
            timers.add("sha256", time.perf_counter() - t0)

        def hexdigest(self):
            return self._h.hexdigest()

        def digest(self):
            return self._h.digest()

    class HashlibProxy:
        sha256 = Sha256

        def __getattr__(self, name):
            return getattr(real_hashlib, name)

    writer_mod.hashlib = HashlibProxy()
    for name in ("begin", "write", "end", "poll"):
        setattr(writer_mod.ShardWriter, name, timers.timed(getattr(writer_mod.ShardWriter, name), "producer_wait", True))
    writer_mod.HostStager.stage = timers.timed(writer_mod.HostStager.stage, "producer_wait", True)
    if hasattr(writer_mod.HostStager, "capture"):  # the stager's entry since the fp8 store
        writer_mod.HostStager.capture = timers.timed(writer_mod.HostStager.capture, "producer_wait", True)
    writer_mod.ShardWriter.close = timers.timed(writer_mod.ShardWriter.close, "close")


class GpuTimeline:
    """CUDA events at the start and end of every forward of ``model`` (its own hooks): when the GPU
    began the first forward, how long the forwards ran, the gaps between them, and how long the run
    went on after the last forward ended (the store's tail)."""

    def __init__(self, model):
        self.events: list = []
        self.t0 = None
        model.register_forward_pre_hook(lambda m, args: self._rec())
        model.register_forward_hook(lambda m, args, out: self._rec())

    def _rec(self):
        if self.t0 is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)

    def start(self):
        torch.cuda.synchronize()
        self.events = []
        self.t0 = torch.cuda.Event(enable_timing=True)
        self.t0.record()

    def stop(self, wall: float) -> dict:
        torch.cuda.synchronize()
        ts = [self.t0.elapsed_time(e) / 1e3 for e in self.events]
        self.t0 = None
        starts, ends = ts[0::2], ts[1::2]
        busy = sum(e - s for s, e in zip(starts, ends))
        return {"first_start": starts[0], "forward_busy": busy, "gaps": ends[-1] - starts[0] - busy,
                "last_end": ends[-1], "after_last": wall - ends[-1], "forwards": len(starts)}


class NullSink:
    """A sink for ``sink=null``: waits for each batch's device-to-host copy and returns its buffer,
    writes nothing. Extraction with it = forward + hooks + pack + D2H, without the store."""

    def __init__(self):
        import queue

        self.q = queue.Queue()
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self):
        while (b := self.q.get()) is not None:
            if b.ready is not None:
                b.ready.synchronize()
            if b.release is not None:
                b.release()

    def begin(self, plan):
        pass

    def write(self, batch):
        self.q.put(batch)

    def end(self, key):
        pass

    def poll(self):
        return []

    def close(self):
        self.q.put(None)
        self.t.join()
        return []

    def abort(self):
        self.close()


def ceilings(root: Path, device: str) -> dict:
    """This machine's rates for the pieces of the writer path."""
    import numpy as np

    out = {}
    n = 256 << 20
    data = np.frombuffer(np.random.default_rng(0).bytes(n), dtype=np.uint8)
    best = min(_t(lambda: hashlib.sha256(data).digest()) for _ in range(2))
    out["sha256_1core_GBps"] = n / best / 1e9
    path = root / "ceiling.bin"
    for mode in ("plain", "early_writeback"):
        starter = writer_mod._writeback_starter() if mode == "early_writeback" and hasattr(
            writer_mod, "_writeback_starter") else None
        if mode == "early_writeback" and starter is None:
            continue
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        total = 4 * n
        os.posix_fallocate(fd, 0, total)
        t0 = time.perf_counter()
        piece = 16 << 20
        for off in range(0, total, piece):
            v = memoryview(data)[(off % n):(off % n) + piece]
            os.pwrite(fd, v, off)
            if starter is not None:
                starter(fd, off, piece)
        t1 = time.perf_counter()
        os.fsync(fd)
        t2 = time.perf_counter()
        os.close(fd)
        path.unlink()
        out[f"{mode}_pagecache_GBps"] = total / (t1 - t0) / 1e9
        out[f"{mode}_fsync_s"] = t2 - t1
        out[f"{mode}_write_fsync_GBps"] = total / (t2 - t0) / 1e9
    if device == "cuda":
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(_t(lambda: (dst.copy_(src, non_blocking=True), torch.cuda.synchronize())) for _ in range(3))
        out["d2h_pinned_GBps"] = n / best / 1e9
    return out


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="GPU vs CPU correctness on a tiny model first")
    ap.add_argument("--only-check", action="store_true")
    ap.add_argument("--profile", action="store_true", help="breakdown of the writer path and this machine's ceilings")
    ap.add_argument("--code", default="", help="import eagle3 from this directory (another version)")
    ap.add_argument("--store-dtype", default="bfloat16", help="the store's dtype: bfloat16 | fp8 | float16 | float32 "
                    "(a variant may set its own: 'store=fp8')")
    ap.add_argument("--tag", default="", help="label of this run in the table and the JSON file name")
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
    ap.add_argument("--variants", default="default", help="';'-separated writer settings, e.g. 'default;depth=2'")
    ap.add_argument("--store-dir", default="", help="where the store is written (default: a temp dir)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(a.store_dir) if a.store_dir else Path(tempfile.mkdtemp(prefix="eagle3-bench-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    tag = a.tag or "extract"
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "eagle3": eagle3.__file__,
              "tag": tag}
    print(f"eagle3 from {eagle3.__file__}; store under {root}", flush=True)
    if a.check or a.only_check:
        if device != "cuda":
            sys.exit("--check compares GPU with CPU; no GPU here")
        rel = check(root)
        result["check_max_rel_diff"] = rel
        print(f"check: GPU vs CPU extraction, float32, max relative diff {rel:.2e} "
              f"({'OK' if rel <= 1e-4 else 'FAIL'}); sidecar digest = file digest for both stores", flush=True)
        if rel > 1e-4:
            sys.exit(1)
        if a.only_check:
            return
    timers = Timers()
    if a.profile:
        result["ceilings"] = ceilings(root, device)
        print("ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in result["ceilings"].items()), flush=True)
        install_profile(timers)
    dtype = torch.bfloat16
    model = random_base_model(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, dtype, device)
    layout = StoreLayout(layer_ids=default_layer_ids(a.layers), last_layer_id=a.layers, hidden_size=a.hidden,
                         dtype=a.store_dtype)
    rng = random.Random(0)
    ids = [[rng.randrange(a.vocab) for _ in range(a.length)] for _ in range(a.samples)]
    n_tokens = a.samples * a.length
    cfg = ecfg(device, a.batch, sps=max(1, a.samples // 4))
    ex = HFExtractor(None, layout, "bfloat16", cfg, model=model)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    plain_batches = [torch.tensor(ids[s:s + a.batch], device=device) for s in range(0, a.samples, a.batch)]

    def plain():
        for h in ex._hooks:
            h.remove()
        ex._hooks = []
        with torch.inference_mode():
            for x in plain_batches:  # on the device already, no mask: nothing waits for the device
                model(input_ids=x, use_cache=False)
        sync()

    def variant(spec: str) -> dict:
        kw = {}
        for item in filter(None, spec.split(",")):
            if item != "default":
                k, v = item.split("=")
                kw[k.strip()] = v.strip() if k.strip() in ("store", "sink", "dir") else int(v)
        return kw

    variants = [v.strip() for v in a.variants.split(";") if v.strip()]

    def extract(rep, spec):
        """Timed: building the extractor (hooks) and extract_store (shards, fsync, sha256, index)."""
        import functools

        import eagle3.extract.hf_backend as hb

        kw = variant(spec)
        depth = kw.pop("depth", None)
        sink = kw.pop("sink", None)
        where = Path(kw.pop("dir")) if "dir" in kw else root
        lay = dataclasses.replace(layout, dtype=kw.pop("store")) if "store" in kw else layout
        real = hb.ShardWriter
        if kw:
            hb.ShardWriter = functools.partial(real, **kw)
        try:
            ex2 = HFExtractor(None, lay, "bfloat16", cfg, model=model)  # hooks installed afresh
            if depth:
                ex2.stager = writer_mod.HostStager(depth)
            if sink == "null":  # the same producer loop and D2H copies, nothing written
                ex2.run = lambda plans, store_dir, progress: writer_mod.write_shards(
                    NullSink(), plans, lambda plan: ex2._produce(plan, progress))
            elif sink:
                raise SystemExit(f"unknown sink={sink} (only sink=null)")
            store = where / f"store-{rep}-{variants.index(spec)}"
            shutil.rmtree(store, ignore_errors=True)
            res = extract_store(store, {"train": Samples(ids)}, lay, backend="hf", target_path=None,
                                target_dtype="bfloat16", extract_cfg=cfg, progress=False, extractor=ex2)
            ex2.close()
        finally:
            hb.ShardWriter = real
        return store, res

    plain()  # warm-up
    runs = ["plain"] + variants
    times = {k: [] for k in runs}
    prof: dict = {k: [] for k in runs}
    timeline = GpuTimeline(model) if a.profile and device == "cuda" else None
    digests: dict = {k: [] for k in variants}
    size: dict = {}
    for rep in range(a.reps):
        for what in (runs if rep % 2 == 0 else runs[::-1]):
            timers.take()
            if timeline:
                timeline.start()
            t0 = time.perf_counter()
            if what == "plain":
                plain()
            else:
                store, res = extract(rep, what)
            times[what].append(time.perf_counter() - t0)
            tl = timeline.stop(times[what][-1]) if timeline else {}
            if what == "plain":
                prof[what].append(tl)
            else:
                p = dict(timers.take(), **tl)
                p["writer_cpu"] = (res.stats or {}).get("writer_cpu_s", float("nan"))
                prof[what].append(p)
                size[what] = sum(f.stat().st_size for f in store.rglob("*.safetensors"))
                if "sink=null" in what:
                    size[what] = n_tokens * layout.bytes_per_token  # what it would have written
                    shutil.rmtree(store, ignore_errors=True)
                    continue
                digests[what].append(store_digest(store))
                if rep == a.reps - 1 and what == variants[0]:
                    verified, n_shards = verify_store(store)  # untimed: every file against its sidecar
                shutil.rmtree(store, ignore_errors=True)
        print(f"rep {rep}: " + ", ".join(f"{k} {n_tokens / v[-1]:.0f} tok/s" for k, v in times.items()), flush=True)
    best = {k: min(v) for k, v in times.items()}
    result.update(shape=vars(a), tokens=n_tokens, seconds=times, bytes_per_token={k: size[k] / n_tokens for k in variants},
                  ratio={k: best["plain"] / best[k] for k in variants},
                  write_gb_per_s={k: size[k] / best[k] / 1e9 for k in variants}, profile=prof, store_digests=digests)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        name = f"bench_extract_hf{'-' + a.tag if a.tag else ''}.json"
        (Path(os.environ["OUT"]) / name).write_text(json.dumps(result, indent=2))
    if not a.store_dir:
        shutil.rmtree(root, ignore_errors=True)
    for k, ds in digests.items():
        if not ds:  # sink=null: no store
            continue
        same = len(set(ds)) == 1
        print(f"\nstore {k}: {n_shards} shards, sidecar digest = file digest (re-hashed); digest {ds[-1][:16]} "
              f"({'identical in every run' if same else 'DIFFERS between runs: ' + ' '.join(d[:16] for d in ds)})")
    print(f"HF backend on {result['device']}: random Llama H={a.hidden} L={a.layers} bf16, {a.samples} x {a.length} "
          f"tokens, batch {a.batch}, layers {list(layout.layer_ids)}+[{a.layers}], store {a.store_dtype}, best of {a.reps}; "
          f"{tag}: eagle3 from {Path(eagle3.__file__).parents[1]}")
    print(f"{'run':<44}{'tokens/s':>10}{'x plain':>9}{'B/token':>9}{'store GB/s':>12}")
    print(f"{'plain forward (base model)':<44}{n_tokens / best['plain']:>10.0f}")
    for k in variants:
        name = f"{tag} {k}" if k != "default" else f"{tag} (hooks+D2H+disk)"
        print(f"{name:<44}{n_tokens / best[k]:>10.0f}{result['ratio'][k]:>9.2f}"
              f"{result['bytes_per_token'][k]:>9.0f}{result['write_gb_per_s'][k]:>12.2f}")
    if a.profile:
        print("breakdown of each row's best run, seconds (loop wait = forward loop inside stager/writer calls; "
              "tail = writer.close() after the last forward; the rest are thread-seconds, overlapping):")
        heads = ["wall s", "loop wait", "tail", "writer CPU", "sha256", "read-back", "fsync", "pwrite"]
        print(f"{'run':<44}" + "".join(f"{h:>11}" for h in heads))
        for k in variants:
            bp = prof[k][times[k].index(best[k])]
            vals = [best[k], bp.get("producer_wait", 0.0), bp.get("close", 0.0), bp["writer_cpu"],
                    bp.get("sha256", 0.0), bp.get("read_back", 0.0), bp.get("fsync", 0.0), bp.get("pwrite", 0.0)]
            print(f"{tag + ' ' + k:<44}" + "".join(f"{v:>11.3f}" for v in vals))
        if timeline:
            print("GPU timeline of each row's best run, seconds from its start (CUDA events at every forward's "
                  "start and end): first forward began, forwards ran, gaps between them, last ended, run went on")
            heads = ["first start", "forwards", "gaps", "last end", "after last"]
            print(f"{'run':<44}" + "".join(f"{h:>12}" for h in heads))
            for k in runs:
                bp = prof[k][times[k].index(best[k])]
                vals = [bp["first_start"], bp["forward_busy"], bp["gaps"], bp["last_end"], bp["after_last"]]
                print(f"{(tag + ' ' + k) if k != 'plain' else 'plain forward':<44}" + "".join(f"{v:>12.3f}" for v in vals))

if __name__ == "__main__":
    main()
