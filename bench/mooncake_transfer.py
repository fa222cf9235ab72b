"""What moving one online-training sample through Mooncake Store costs (eagle3/online/mooncake.py,
the client the cross-host online transport builds on), and what signing it would add.

One message is one sample at the 8B shape (Llama-3.1-8B: 2048 tokens x (3 aux layers + the last) x
hidden 4096): bf16, 64 MiB; fp8, 32 MiB of values + a float32 scale per token and layer (32 KiB).
Two processes (multiprocessing "spawn", each its own Mooncake client) and a local master
(MasterProcess, 127.0.0.1), laid out as the transport will be:

- the consumer (the trainer) holds the segment; the producer is a pure client and puts each message
  into the consumer's segment (``put(..., segment=consumer.segment)``: the network hop, TCP);
- the consumer then reads it from its own segment (a local copy) into a new array (what ``get``
  returns by default), again into a reused one (``get(out=)``), and into the reused one followed by a
  copy (the other way to hand the caller an array of its own), checks its xxh3_64 against the
  producer's, and removes it;
- the consumer also times the hashes the application would compute over a message: xxh3_64 (the
  store's checksum) and keyed blake3 (a MAC: ``blake3.blake3(data, key=<32 bytes>, max_threads=...)``)
  on one thread and on ``blake3.AUTO`` threads.

Then the same samples as the transport sends them (eagle3/online/mooncake_exchange.py): a one-sample
shard in the store's format staged on disk, sealed into a message (``pack_sample``: the file read into
the message, the tag over key and bytes: xxh3-128, or keyed BLAKE3 with a secret), put into the
trainer's segment; the trainer gets it, checks the seal, the header and the shard header and views its
tensors (``unpack_sample`` + ``payload_item``: no copy). "end to end" is the producer's pack and put plus
the trainer's get and open, one message after the other.

    python bench/mooncake_transfer.py                # ~15 s on 2 cores
    python bench/mooncake_transfer.py --reps 50 --out /tmp/mooncake_transfer.json

Needs the mooncake package (scripts/install.sh), numpy, xxhash and blake3. Prints a table last; times
are medians over ``--reps`` (after one warm-up); GB/s are 10^9 bytes per second.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

TOKENS, LAYERS, HIDDEN = 2048, 4, 4096
MiB = 1 << 20
KINDS = {  # message name -> bytes
    "bf16 sample": TOKENS * LAYERS * HIDDEN * 2,
    "fp8 sample": TOKENS * LAYERS * HIDDEN + TOKENS * LAYERS * 4,
}


def _message(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sample_spec():
    from eagle3.store import one_sample_shard

    return one_sample_shard("train", 0, 1, list(range(TOKENS)), [1] * TOKENS)


def sample_layout(dtype: str):
    from eagle3.store import StoreLayout

    return StoreLayout(layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=HIDDEN, dtype=dtype)


def staged_shard(path: Path, dtype: str) -> None:
    """A one-sample shard file of the 8B shape in the store's format (random states, scales 1)."""
    from eagle3.store import shard_header

    spec, layout = sample_spec(), sample_layout(dtype)
    blob, offs = shard_header(spec, layout)
    buf = _message(offs["__end__"], seed=7)
    buf[:len(blob)] = np.frombuffer(blob, np.uint8)
    head = json.loads(blob[8:])

    def put(name, arr):
        a, b = head[name]["data_offsets"]
        buf[len(blob) + a:len(blob) + b] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)

    put("offsets", np.array([0, TOKENS], np.int64))
    put("sample_index", np.array([0], np.int64))
    put("input_ids", np.arange(TOKENS, dtype=np.int32))
    put("loss_mask", np.ones(TOKENS, np.uint8))
    if layout.is_fp8:
        put("aux_scales", np.ones((TOKENS, 3), np.float32))
        put("last_scales", np.ones(TOKENS, np.float32))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.tobytes())


WIRE = {"bf16 message": "bfloat16", "fp8 message": "fp8"}
SEALS = {"xxh3-128": None, "blake3-keyed": b"k" * 32}


def producer(master: str, to_consumer, from_consumer, results, reps: int) -> None:
    import xxhash

    from eagle3.online.mooncake import MooncakeClient

    segment = from_consumer.get()  # the consumer's segment name
    times = {}
    with MooncakeClient.connect(master, segment_bytes=0) as c:
        for kind, nbytes in KINDS.items():
            msg = _message(nbytes, seed=nbytes)
            digest = xxhash.xxh3_64_intdigest(msg)
            for r in range(reps + 1):
                key = f"bench/{kind}/{r}"
                t0 = time.perf_counter()
                c.put(key, msg, segment=segment)
                if r:  # r == 0: warm-up
                    times.setdefault(f"{kind}|put (into the consumer's segment)", []).append(time.perf_counter() - t0)
                to_consumer.put((kind, key, nbytes, digest, r > 0))
                assert from_consumer.get() == key  # read and removed: the segment is free again
        to_consumer.put(None)
        from eagle3.online.mooncake_exchange import Sealer, pack_sample

        staged = Path(tempfile.mkdtemp(prefix="mooncake_bench_stage_"))
        for kind, dtype in WIRE.items():
            path = staged / f"{dtype}.safetensors"
            staged_shard(path, dtype)
            for seal, secret in SEALS.items():
                sealer = Sealer(secret)
                for r in range(reps + 1):
                    key = f"bench/{kind}/{seal}/{r}"
                    t0 = time.perf_counter()
                    msg = pack_sample(key, {"index": 0}, path, sealer)
                    t1 = time.perf_counter()
                    c.put(key, msg, segment=segment)
                    t2 = time.perf_counter()
                    if r:
                        times.setdefault(f"{kind}|{seal}: pack (staged file read + seal)", []).append(t1 - t0)
                        times.setdefault(f"{kind}|{seal}: put", []).append(t2 - t1)
                    to_consumer.put((kind, key, msg.nbytes, seal, r > 0))
                    assert from_consumer.get() == key
        to_consumer.put(None)
    results.put(times)


def consumer(master: str, segment_bytes: int, from_producer, to_producer, results, reps: int) -> None:
    import blake3
    import xxhash

    from eagle3.online.mooncake import MooncakeClient

    key32 = bytes(range(32))
    hashes = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "blake3 keyed, 1 thread": lambda b: blake3.blake3(b, key=key32, max_threads=1).digest(),
        "blake3 keyed, AUTO threads": lambda b: blake3.blake3(b, key=key32, max_threads=blake3.blake3.AUTO).digest(),
    }
    times, bad = {}, 0

    def timed(name, f, *a, **kw):
        t0 = time.perf_counter()
        r = f(*a, **kw)
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return r

    with MooncakeClient.connect(master, segment_bytes=segment_bytes) as c:
        to_producer.put(c.segment)
        reused = np.empty(max(KINDS.values()), np.uint8)
        while (m := from_producer.get()) is not None:
            kind, key, nbytes, digest, warm = m
            if not warm:  # the warm-up: read, check, not timed
                got = c.get(key)
                bad += got is None or xxhash.xxh3_64_intdigest(got) != digest
                c.remove(key)
                to_producer.put(key)
                continue
            got = timed(f"{kind}|get (new array)", c.get, key)
            view = timed(f"{kind}|get (into a reused array)", c.get, key, out=reused)
            timed(f"{kind}|get (into a reused array) + copy", lambda k, v: c.get(k, out=v).copy(), key, reused)
            bad += got is None or got.nbytes != nbytes or xxhash.xxh3_64_intdigest(got) != digest
            bad += view is None or xxhash.xxh3_64_intdigest(view) != digest
            for name, f in hashes.items():
                timed(f"{kind}|{name}", f, got)
            timed(f"{kind}|remove", c.remove, key)
            to_producer.put(key)
        # small control objects (plan, position, heartbeat): ~100 B of JSON written and read; a poll of 64 keys
        small = {"plan_id": "0123456789abcdef", "consumed": 12345, "pid": os.getpid(), "time": time.time()}
        keys = [f"bench/poll/{i}" for i in range(64)]
        for _ in range(reps * 10):
            timed("control JSON|put_json", c.put_json, "bench/position", small, segment=c.segment)
            timed("control JSON|get_json", c.get_json, "bench/position")
            timed("control JSON|exists (64 keys)", c.exists, keys)
        c.remove("bench/position")
        from eagle3.online.mooncake_exchange import Sealer, payload_item, unpack_sample

        sealers = {k: Sealer(v) for k, v in SEALS.items()}
        while (m := from_producer.get()) is not None:
            kind, key, nbytes, seal, warm = m
            t0 = time.perf_counter()
            got = c.get(key)
            t1 = time.perf_counter()
            _, payload = unpack_sample(key, got, sealers[seal])
            item = payload_item(payload, sample_spec(), sample_layout(WIRE[kind]), key)
            t2 = time.perf_counter()
            bad += item["input_ids"].shape[0] != TOKENS
            c.remove(key)
            if warm:
                times.setdefault(f"{kind}|{seal}: get (new array)", []).append(t1 - t0)
                times.setdefault(f"{kind}|{seal}: open (seal, header, tensors)", []).append(t2 - t1)
                times.setdefault(f"{kind}|bytes", []).append(nbytes)
            to_producer.put(key)
    results.put({"times": times, "bad": int(bad)})


def table(times: dict, bad: int, reps: int) -> str:
    rows = [f"Mooncake Store on loopback TCP, {reps} messages of each kind (medians); digest mismatches: {bad}",
            f"{'message':<13} | {'MiB':>6} | {'what':<36} | {'ms':>8} | {'GB/s':>6}", "-" * 81]
    order = ["put (into the consumer's segment)", "get (new array)", "get (into a reused array)",
             "get (into a reused array) + copy", "remove",
             "xxh3_64", "blake3 keyed, 1 thread", "blake3 keyed, AUTO threads", "put_json", "get_json",
             "exists (64 keys)"]
    for kind in [*KINDS, "control JSON"]:
        nbytes = KINDS.get(kind)
        for op in order:
            v = times.get(f"{kind}|{op}")
            if not v:
                continue
            med = statistics.median(v)
            rate = f"{nbytes / med / 1e9:6.2f}" if nbytes and op != "remove" else f"{'':>6}"
            mib = f"{nbytes / MiB:6.2f}" if nbytes else f"{'':>6}"
            rows.append(f"{kind:<13} | {mib} | {op:<36} | {med * 1e3:8.3f} | {rate}")
    rows += ["", "through the transport (eagle3.online.mooncake_exchange: staged shard -> sealed message -> trainer's "
             "segment -> checked item)",
             f"{'message':<13} | {'MiB':>6} | {'what':<48} | {'ms':>8} | {'GB/s':>6}", "-" * 93]
    for kind in WIRE:
        if not times.get(f"{kind}|bytes"):
            continue
        nbytes = times[f"{kind}|bytes"][0]
        for seal in SEALS:
            steps = ["pack (staged file read + seal)", "put", "get (new array)", "open (seal, header, tensors)"]
            total = 0.0
            for op in steps:
                v = times.get(f"{kind}|{seal}: {op}")
                if not v:
                    continue
                med = statistics.median(v)
                total += med
                rows.append(f"{kind:<13} | {nbytes / MiB:6.2f} | {seal + ': ' + op:<48} | {med * 1e3:8.3f} | "
                            f"{nbytes / med / 1e9:6.2f}")
            rows.append(f"{kind:<13} | {nbytes / MiB:6.2f} | {seal + ': end to end (sum of the medians)':<48} | "
                        f"{total * 1e3:8.3f} | {nbytes / total / 1e9:6.2f}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="messages of each kind (after one warm-up; default 20)")
    ap.add_argument("--segment-mib", type=int, default=256, help="the consumer's segment (default 256 MiB)")
    ap.add_argument("--out", default="", help="JSON file for the raw times")
    args = ap.parse_args()

    from importlib.metadata import version

    from eagle3.online.mooncake import MasterProcess

    log = Path(tempfile.mkdtemp(prefix="mooncake_bench_")) / "master.log"
    ctx = mp.get_context("spawn")
    with MasterProcess(log) as master:
        to_c, to_p, cons_out, prod_out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
        cons = ctx.Process(target=consumer, args=(master.address, args.segment_mib * MiB, to_c, to_p, cons_out,
                                                  args.reps))
        prod = ctx.Process(target=producer, args=(master.address, to_c, to_p, prod_out, args.reps))
        cons.start()
        prod.start()
        prod_times = prod_out.get(timeout=900)
        out = cons_out.get(timeout=900)
        prod.join(60)
        cons.join(60)
    times = {**prod_times, **out["times"]}
    versions = {p: version(p) for p in ("mooncake-transfer-engine-non-cuda", "numpy", "xxhash", "blake3")
                if _installed(p)}
    print(f"versions: {versions}; master log: {log}")
    if args.out:
        Path(args.out).write_text(json.dumps({"versions": versions, "reps": args.reps, "bad": out["bad"],
                                              "times_s": times}, indent=1))
    print(table(times, out["bad"], args.reps))
    if out["bad"] or prod.exitcode or cons.exitcode:
        sys.exit(f"mismatches {out['bad']}, exit codes producer {prod.exitcode} consumer {cons.exitcode}")


def _installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
