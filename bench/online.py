"""Benchmark of online training (train.hidden_states=online, eagle3/online/) against its ideals.

A random Llama-3.1-8B-shaped target (bf16, built from a config, random weights), a draft of the
same width (TTT 7), samples of 2048 random tokens (one per row). Everything timed is eagle3's own
code: the target forward is the hf backend's (eagle3.extract.hf_backend.HFExtractor), training is
eagle3.train.loop.train (Accelerate, data loader, metrics), the online store and its sources are
eagle3.online's.

    python bench/online.py                       # one GPU, colocated (the default layout)
    python bench/online.py --layout split        # two GPUs: target on cuda:0 (a producer process),
                                                 # trainer on cuda:1, shards through --dir
    python bench/online.py --layout split --producers 2 --trainers 6   # one 8-GPU host: two producers
                                                 # (GPUs 0-1), a torchrun trainer of six processes (2-7)
    python bench/online.py --layout split --same-gpu --producer vllm   # one GPU: a vLLM producer
                                                 # process (stage=produce's code) and the trainer share it
    python bench/online.py --tiny                # a tiny shape, on CPU too: checks the script runs
    python bench/online.py --layout split --same-gpu --producer vllm --transport mooncake [--store-dtype fp8]
                                                 # the same through a Mooncake master on loopback TCP

colocated, in one run on one device: f = the target's forward rate alone (tokens/s, one sample
per forward, as the online producer runs it), t = the train loop's rate on in-memory states,
online = the train loop's rate with the states computed by the colocated producer; the ideal of
running the two back to back is 1 / (1/f + 1/t), and online / ideal is the figure (goal >= 0.9).

split: t = the train loop's rate on the trainer GPU alone (in-memory states), online = its rate fed
by the producer process through the exchange directory; online / t is the figure (goal >= 0.9),
and the peak bytes of shards on disk (sampled every 2 ms) against the window.

split --same-gpu: the producer process(es) and the trainer share GPU 0, as `stage=produce` beside
`stage=train train.online.producer=external` on one GPU does; the producer's memory is set by
--producer-memory (extract.gpu_memory_utilization) and --producer-kv-gb (extract.kv_cache_gb).
f = the producer's own rate (its backend writing shards, the trainer not yet started), and the
figure is online / ideal as in the colocated layout. --producer vllm: the vllm backend (capture at
load time, compiled, CUDA graphs) on a config-only target of the bench shape (load_format=dummy:
random weights, which a rate does not depend on); --producer hf: the transformers backend.

--transport mooncake (split): samples, reading order and heartbeats through a Mooncake master
(eagle3/online/mooncake_exchange.py; the launcher starts one on 127.0.0.1) instead of the directory:
the peak is then the bytes of training samples in the store (sampled every 2 ms), and the table adds
the bytes a token on the wire. --store-dtype fp8: the store's fp8 layout (what the producer writes and
what travels).

Prints a markdown table last; writes the numbers to $OUT/bench_online.json when OUT is set.
Needs no hydra (the config is a namespace with TrainConfig's fields, as bench/train.py does).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import train as BT  # noqa: E402  (bench/train.py: the draft, the in-memory store, the loop config)

from eagle3.launch import launch  # noqa: E402

SHAPE_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
                draft_vocab=32000, n_aux=3, ttt=7, seq=2048, batch=1, layers=32)
SHAPE_TINY = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=512, draft_vocab=256,
                  n_aux=3, ttt=2, seq=128, batch=1, layers=8)


def args_shape(a) -> None:
    for k, v in (SHAPE_TINY if a.tiny else SHAPE_8B).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)


def layout_of(a):
    from eagle3.extract.layers import default_layer_ids
    from eagle3.store import StoreLayout

    dtype = "float32" if a.device == "cpu" else "bfloat16"
    if getattr(a, "store_dtype", "") == "fp8":
        dtype = "fp8"
    return StoreLayout(layer_ids=tuple(default_layer_ids(a.layers)), last_layer_id=a.layers, hidden_size=a.hidden,
                       dtype=dtype, target_hash="bench-random-target")


def target_config(a):
    """The Llama config of the bench shape (the transformers target's, and the vLLM producer's config.json)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       head_dim=a.head_dim, max_position_embeddings=max(8192, 2 * a.seq), rms_norm_eps=1e-5,
                       architectures=["LlamaForCausalLM"])


def target_model(a, device):
    """A random Llama base model of the bench shape (seeded: every process builds the same)."""
    from transformers import LlamaModel

    cfg = target_config(a)
    torch.manual_seed(0)
    dtype = torch.float32 if str(device) == "cpu" else torch.bfloat16
    with torch.device(device):
        model = LlamaModel(cfg).to(dtype)
    return model.eval()


def extractor(a, device):
    from eagle3.extract.hf_backend import HFExtractor

    ecfg = SimpleNamespace(device=str(device), batch_size=1, samples_per_shard=1)
    return HFExtractor(None, layout_of(a), "bfloat16", ecfg, model=target_model(a, device))


def samples(a):
    """``a.samples`` samples of ``a.seq`` random token ids (eagle3.extract.Samples), seeded."""
    from eagle3.extract import Samples

    rng = np.random.default_rng(0)
    ids = [rng.integers(0, a.vocab, size=a.seq).tolist() for _ in range(a.samples)]
    return Samples(ids, [[0] * 8 + [1] * (a.seq - 8) for _ in ids])


def tcfg(a):
    return BT.loop_config(a, "auto", max_steps=a.steps, num_workers=0, log_every=a.log_every, packing=False,
                          mixed_precision="no" if a.device == "cpu" else "auto")


def run_train(a, store, name: str, out_dir: Path | None = None) -> dict | None:
    """The train loop's rate on ``store`` (global tokens/s: all training processes). ``out_dir``: a
    directory the training processes share (a trainer of several processes); else a temporary one.
    Only the main process returns the summary (the others None)."""
    from eagle3.train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(out_dir or tmp)
        t0 = time.time()
        train(tcfg(a), BT.train_inputs(a, store, torch.float32 if a.device == "cpu" else torch.bfloat16), out,
              progress=False)
        wall = time.time() - t0
        if launch().rank:
            return None
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return BT.loop_summary(name, recs, a.batch * a.seq * launch().world_size, wall)


def forward_rate(ext, smp, reps: int) -> float:
    """Tokens/s of the target forward alone, one sample per forward (after one warm-up)."""
    def sync():
        if ext.device.type == "cuda":
            torch.cuda.synchronize(ext.device)

    ext._forward([(0, np.asarray(smp.input_ids[0]))])
    sync()
    t0, tokens = time.perf_counter(), 0
    for r in range(reps):
        x = np.asarray(smp.input_ids[r % len(smp)])
        ext._forward([(0, x)])
        tokens += len(x)
    sync()
    return tokens / (time.perf_counter() - t0)


def memory_items(ext, smp, layout, k: int = 4) -> list:
    from eagle3.online import ColocatedSource, OnlineHiddenStates

    src = ColocatedSource(ext, layout, None, 0)
    store = OnlineHiddenStates("train", smp, layout, src)
    # in host memory, as a store's items are (the colocated source leaves them on the GPU)
    return [{n: v.cpu() if torch.is_tensor(v) else v for n, v in store[i].items()} for i in range(min(k, len(smp)))]


def colocated(a) -> dict:
    from eagle3.online import ColocatedSource, OnlineHiddenStates

    device = torch.device(a.device)
    layout, smp = layout_of(a), samples(a)
    ext = extractor(a, device)
    f = forward_rate(ext, smp, a.forward_reps)
    t = run_train(a, BT.MemoryStore(memory_items(ext, smp, layout), a.samples, layout.layer_ids), "train only")
    online = run_train(a, OnlineHiddenStates("train", smp, layout, ColocatedSource(ext, layout, None, 0)),
                       "online (colocated)")
    ideal = 1 / (1 / f + 1 / t["tokens_per_s"])
    return {"layout": "colocated", "forward_tokens_per_s": f, "train_only": t, "online": online,
            "ideal_tokens_per_s": ideal, "ratio": online["tokens_per_s"] / ideal}


def identity(layout, backend: str = "hf") -> dict:
    return {**layout.to_json(), "target_dtype": "bfloat16", "backend": backend}


def vllm_extractor(a, layout, work_dir: Path):
    """The vllm backend (as stage=produce builds it) on a config-only target of the bench shape."""
    from eagle3.config import ExtractConfig
    from eagle3.extract import EngineSpec, make_extractor

    target = work_dir.parent / f"{work_dir.name}.target"
    target_config(a).save_pretrained(target)
    ecfg = ExtractConfig(backend="vllm", samples_per_shard=1, kv_cache_gb=a.producer_kv_gb,
                         gpu_memory_utilization=a.producer_memory)
    engine = EngineSpec(str(target), layout, "bfloat16", ecfg, -(-(a.seq + 1) // 16) * 16,
                        {"load_format": "dummy", "skip_tokenizer_init": True})
    return make_extractor(engine, work_dir)


def producer_rate(ext, smp, layout, scratch: Path, n: int) -> float:
    """Tokens/s of the producer's backend writing ``n`` one-sample shards (as produce() writes them)
    into ``scratch``, after one warm-up shard."""
    from eagle3.extract.backend import Progress
    from eagle3.store import one_sample_shard

    def plans(idx):
        return [one_sample_shard("train", i, len(smp), smp.input_ids[i], smp.loss_mask[i]) for i in idx]

    shutil.rmtree(scratch, ignore_errors=True)
    ext.run(plans([0]), scratch, Progress(len(smp.input_ids[0]), "", False))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    idx = [1 + i % (len(smp) - 1) for i in range(n)]
    t0 = time.perf_counter()
    tokens = sum(len(smp.input_ids[i]) for i in idx)
    ext.run(plans(idx), scratch, Progress(tokens, "", False))
    rate = tokens / (time.perf_counter() - t0)
    shutil.rmtree(scratch, ignore_errors=True)
    return rate


def role_producer(a) -> None:
    from eagle3.online import produce

    layout, smp = layout_of(a), samples(a)
    ext = vllm_extractor(a, layout, Path(a.dir)) if a.producer == "vllm" else extractor(a, torch.device(a.device))
    try:
        if a.same_gpu:  # the producer's own rate, before the trainer starts (the launcher waits for it)
            f = producer_rate(ext, smp, layout, Path(a.dir).parent / f"{Path(a.dir).name}.scratch{a.part}",
                              a.forward_reps)
            info = getattr(ext, "engine_info", None) or {}
            Path(f"{a.result}.producer{a.part}").write_text(json.dumps({"forward_tokens_per_s": f,
                                                                        "engine": info}, default=str))
        exchange = a.dir
        if a.transport == "mooncake":
            from eagle3.config import MooncakeConfig
            from eagle3.online.mooncake_exchange import MooncakeProducerLink

            exchange = MooncakeProducerLink(a.master, "bench", Path(a.dir) / f"staging-{a.part}", MooncakeConfig(),
                                            layout, timeout_s=600, poll_s=0.005)
        stats = produce(exchange, {"train": smp}, layout, ext, identity(layout, a.producer), poll_s=0.005,
                        progress=False, part=a.part, parts=a.producers)
        wire = {"stats": stats}
        if a.transport == "mooncake":
            wire.update(sent_bytes=exchange.sent_bytes, sent=exchange.sent, timings=exchange.timings)
        Path(f"{a.result}.wire{a.part}").write_text(json.dumps(wire))
    finally:
        ext.close()


def role_trainer(a) -> None:
    from eagle3.online import ExternalSource, OnlineHiddenStates

    layout, smp = layout_of(a), samples(a)
    # train-only: in-memory states of the layout's shape (random: the rate does not depend on them)
    items = BT.random_items(a, torch.float32 if a.device == "cpu" else torch.bfloat16, fp8=layout.is_fp8)
    # a trainer of several processes (torchrun): each rank its own rank-<r>/ in the directory
    rank, world = launch().rank, launch().world_size
    shared = (lambda kind: Path(a.dir).parent / f"{Path(a.dir).name}.{kind}") if world > 1 else (lambda kind: None)
    t = run_train(a, BT.MemoryStore(items, a.samples, layout.layer_ids), "train only", shared("train-only"))
    ocfg = SimpleNamespace(window_bytes=a.window_bytes, cache_bytes=0, timeout_s=600.0, poll_s=0.005)
    exchange = Path(a.dir)
    if a.transport == "mooncake":
        from eagle3.config import MooncakeConfig
        from eagle3.online.mooncake_exchange import MooncakeTrainerLink

        exchange = MooncakeTrainerLink(a.master, "bench", Path(a.dir) / f"trainer-{rank}", MooncakeConfig(), layout,
                                       identity(layout, a.producer), window_bytes=a.window_bytes, timeout_s=600,
                                       rank=rank, poll_s=0.005)
    src = ExternalSource(exchange, layout, ocfg, identity(layout, a.producer), rank=rank, world_size=world)
    store = OnlineHiddenStates("train", smp, layout, src)
    online = run_train(a, store, "online (producer processes)", shared("online"))
    waits = {"loop_wait_s": src.wait_s, **getattr(src.link, "timings", {})}
    store.close(finished=True)
    if rank == 0:
        Path(a.result).write_text(json.dumps({"train_only": t, "online": online, "trainer_timings": waits}))


def split(a) -> dict:
    """``a.producers`` producer processes on GPUs 0..P-1 (part p of P each), the trainer on the next
    ``a.trainers`` GPUs (one process, or a torchrun job of T processes), shards through a.dir."""
    from eagle3.online import disk_bytes

    d = Path(a.dir)
    P, T = a.producers, a.trainers
    for old in (d, d.parent / f"{d.name}.train-only", d.parent / f"{d.name}.online"):
        shutil.rmtree(old, ignore_errors=True)
    d.mkdir(parents=True)
    result = d.parent / f"{d.name}.result.json"
    for stale in [result, *d.parent.glob(f"{result.name}.producer*")]:
        stale.unlink(missing_ok=True)
    master = None
    if a.transport == "mooncake":
        from eagle3.online.mooncake import MasterProcess

        master = MasterProcess(d / "master.log")
    script = [__file__, *sys.argv[1:], "--dir", str(d), "--result", str(result)] + \
        (["--master", master.address] if master else [])
    gpu = a.device != "cpu"
    procs = []
    for part in range(P):
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": "0" if a.same_gpu else str(part)} if gpu else {}))
        procs.append(subprocess.Popen([sys.executable, *script, "--role", "producer", "--part", str(part),
                                       "--device", "cuda:0" if gpu else "cpu"], env=env))
    producers = {}
    if a.same_gpu:  # each producer measures its own rate and holds its memory before the trainer starts
        for part in range(P):
            path = Path(f"{result}.producer{part}")
            while not path.exists():
                if procs[part].poll() is not None:
                    sys.exit(f"bench/online.py: producer {part} exited ({procs[part].returncode}) before it was ready")
                time.sleep(0.2)
            producers[part] = json.loads(path.read_text())
    gpus = ",".join("0" if a.same_gpu else str(P + t) for t in range(T))
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpu else {}))
    launch = [sys.executable] if T == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                               f"--nproc_per_node={T}"]
    procs.append(subprocess.Popen([*launch, *script, "--role", "trainer",
                                   "--device", ("cuda:0" if T == 1 else "cuda") if gpu else "cpu"], env=env))
    peak, stop = [0], threading.Event()

    def in_store():  # the bytes of rank 0's training samples in the Mooncake store now
        from eagle3.online.mooncake import MooncakeClient
        from eagle3.online.mooncake_exchange import Sealer, sample_key

        client, sealer = MooncakeClient.connect(master.address, segment_bytes=0), Sealer(None)
        while not stop.is_set():
            raw = client.get("bench/rank-0/plan")
            if raw is None:
                yield 0
                continue
            plan = sealer.open_json("bench/rank-0/plan", raw)
            keys = [sample_key("bench", 0, plan["plan_id"], "train", i) for i in range(plan["num_samples"])]
            yield sum(max(0, client._store.get_size(k)) for k in keys)
        client.close()

    def watch():
        sizes = in_store() if master else None
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], next(sizes) if sizes else disk_bytes(d))
            except (FileNotFoundError, StopIteration):
                pass
            time.sleep(0.002)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    rcs = [p.wait() for p in reversed(procs)]
    stop.set()
    w.join()
    if master is not None:
        master.stop()
    if any(rcs):
        sys.exit(f"bench/online.py --layout split: a role failed (exit codes: trainer, then producers {P - 1}..0: "
                 f"{rcs})")
    r = json.loads(result.read_text())
    out = {"layout": "split", **r, "ratio": r["online"]["tokens_per_s"] / r["train_only"]["tokens_per_s"],
           "producers": P, "trainers": T, "peak_disk_bytes": peak[0], "window_bytes": a.window_bytes * T,
           "producer": a.producer, "same_gpu": a.same_gpu, "transport": a.transport,
           "store_dtype": layout_of(a).dtype}
    wire = [json.loads(Path(f"{result}.wire{p}").read_text()) for p in range(P)]
    out["producer_stats"] = [dict(w["stats"], **w.get("timings", {})) for w in wire]
    if master is not None:
        sent, n = sum(w["sent_bytes"] for w in wire), sum(w["sent"] for w in wire)
        out.update(wire_bytes=sent, wire_messages=n, wire_bytes_per_token=sent / max(1, n * a.seq),
                   online_vs_train_only=out["ratio"])
    if a.same_gpu:
        f = sum(v["forward_tokens_per_s"] for v in producers.values())
        out.update(forward_tokens_per_s=f, producer_engines={k: v["engine"] for k, v in producers.items()},
                   ideal_tokens_per_s=1 / (1 / f + 1 / r["train_only"]["tokens_per_s"]))
        out["online_vs_train_only"] = r["online"]["tokens_per_s"] / r["train_only"]["tokens_per_s"]
        out["ratio"] = r["online"]["tokens_per_s"] / out["ideal_tokens_per_s"]
    return out


def table(r: dict, a) -> str:
    mib = 2 ** 20
    shape = f"hidden {a.hidden}, {a.layers} layers, TTT {a.ttt}, {a.seq}-token rows, {a.steps} steps, {a.device}"
    lines = [f"online training, {r['layout']} ({shape})", "",
             "| rate | tokens/s |", "| --- | ---: |"]
    if r["layout"] == "colocated":
        lines += [f"| target forward alone (f) | {r['forward_tokens_per_s']:.0f} |",
                  f"| train loop alone (t) | {r['train_only']['tokens_per_s']:.0f} |",
                  f"| ideal back to back 1/(1/f+1/t) | {r['ideal_tokens_per_s']:.0f} |",
                  f"| online, colocated | {r['online']['tokens_per_s']:.0f} |",
                  f"| **online / ideal** (goal >= 0.9) | **{r['ratio']:.3f}** |"]
    elif r.get("same_gpu"):
        P = r.get("producers", 1)
        lines[0] = (f"online training, {P} {r['producer']} producer process(es) and the trainer on one GPU, "
                    f"{r.get('transport', 'dir')} transport, {r.get('store_dtype')} states ({shape})")
        lines += [f"| producer alone, {r['producer']} backend writing shards (f) | {r['forward_tokens_per_s']:.0f} |",
                  f"| train loop alone, producer idle beside it (t) | {r['train_only']['tokens_per_s']:.0f} |",
                  f"| ideal back to back 1/(1/f+1/t) | {r['ideal_tokens_per_s']:.0f} |",
                  f"| online, producer process beside the trainer | {r['online']['tokens_per_s']:.0f} |",
                  f"| **online / ideal** (goal >= 0.9) | **{r['ratio']:.3f}** |",
                  f"| online / train alone | {r['online_vs_train_only']:.3f} |",
                  f"| peak sample bytes {'in the store' if r.get('transport') == 'mooncake' else 'on disk'} / "
                  f"window | {r['peak_disk_bytes'] / 2 ** 20:.1f} / {r['window_bytes'] / 2 ** 20:.1f} MiB |"]
    else:
        P, T = r.get("producers", 1), r.get("trainers", 1)
        lines += [f"| train loop alone, {T} trainer GPU{'s' if T > 1 else ''} (t) | "
                  f"{r['train_only']['tokens_per_s']:.0f} |",
                  f"| online, {P} producer process{'es' if P > 1 else ''} on other GPUs | "
                  f"{r['online']['tokens_per_s']:.0f} |",
                  f"| **online / t** (goal >= 0.9) | **{r['ratio']:.3f}** |",
                  f"| peak sample bytes {'in the store' if r.get('transport') == 'mooncake' else 'on disk'} / window | {r['peak_disk_bytes'] / mib:.1f} / "
                  f"{r['window_bytes'] / mib:.1f} MiB |"]
    for p, st in enumerate(r.get("producer_stats", [])):
        lines.append(f"| producer {p}: samples / s computing / s handing over" +
                     (" / sender s sealing / putting (of which waiting for room)" if "pack_s" in st else "") +
                     f" | {st['written']} / {st['backend_s']:.1f} / {st['publish_s']:.1f}" +
                     (f" / {st['pack_s']:.1f} / {st['put_s']:.1f} ({st['room_wait_s']:.1f})" if "pack_s" in st else "")
                     + " |")
    tt = r.get("trainer_timings")
    if tt:
        lines.append("| trainer: s the online loop waited for a sample" +
                     (" / reader s getting / checking" if "get_s" in tt else "") + f" | {tt['loop_wait_s']:.1f}" +
                     (f" / {tt['get_s']:.1f} / {tt['open_s']:.1f}" if "get_s" in tt else "") + " |")
    if r.get("wire_bytes_per_token"):
        lines.append(f"| bytes a token on the wire ({r['wire_messages']} messages) | {r['wire_bytes_per_token']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=("colocated", "split"), default="colocated")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (runs on CPU): checks the script works")
    p.add_argument("--device", default=None, help="cuda (default when available) | cpu")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per measured loop run")
    p.add_argument("--log-every", type=int, default=5, help="steps per measured window (the first is left out)")
    p.add_argument("--samples", type=int, default=64, help="distinct samples (the loop cycles over them)")
    p.add_argument("--forward-reps", type=int, default=20)
    p.add_argument("--window-bytes", type=int, default=2 << 30, help="split: train.online.window_bytes")
    p.add_argument("--dir", default="/dev/shm/eagle3-online-bench", help="split: the exchange directory")
    for k in SHAPE_8B:
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    p.add_argument("--producers", type=int, default=1, help="split: producer processes, one GPU each (GPUs 0..P-1)")
    p.add_argument("--trainers", type=int, default=1,
                   help="split: training processes, one GPU each (the next T GPUs; a torchrun job when T > 1)")
    p.add_argument("--producer", choices=("hf", "vllm"), default="hf", help="split: the producers' backend")
    p.add_argument("--same-gpu", action="store_true", help="split: the producers and the trainer share GPU 0")
    p.add_argument("--producer-memory", type=float, default=0.4,
                   help="vllm producer: extract.gpu_memory_utilization (its share of the GPU's memory at start)")
    p.add_argument("--producer-kv-gb", type=float, default=4.0, help="vllm producer: extract.kv_cache_gb")
    p.add_argument("--transport", choices=("dir", "mooncake"), default="dir",
                   help="split: the directory (--dir) or a Mooncake master the launcher starts on 127.0.0.1")
    p.add_argument("--store-dtype", choices=("auto", "fp8"), default="auto",
                   help="the store's dtype: auto (bf16 on a GPU, float32 on a CPU) or fp8 (the producer writes it)")
    p.add_argument("--master", default="", help=argparse.SUPPRESS)
    p.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--role", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    args_shape(a)
    a.loop_steps = a.steps  # bench/train.py's loop_config reads it
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.role == "producer":
        return role_producer(a)
    if a.role == "trainer":
        return role_trainer(a)
    if not a.tiny and a.device == "cpu":
        sys.exit("bench/online.py times 8B-shaped work on a GPU; on a CPU run it with --tiny")
    need = 1 if a.same_gpu else a.producers + a.trainers
    if a.same_gpu and (a.layout != "split" or a.trainers != 1):
        sys.exit("--same-gpu is a --layout split of one trainer process")
    if a.layout == "split" and a.device != "cpu" and torch.cuda.device_count() < need:
        sys.exit(f"--layout split with {a.producers} producer(s) and {a.trainers} trainer(s) needs {need} GPUs "
                 f"(this machine shows {torch.cuda.device_count()})")
    r = colocated(a) if a.layout == "colocated" else split(a)
    r["args"] = vars(a)
    if os.environ.get("OUT"):
        name = f"{r['layout']}_same_gpu_{a.producer}" if a.same_gpu else r["layout"]
        name += f"_{a.transport}_{layout_of(a).dtype}" if a.layout == "split" else ""
        Path(os.environ["OUT"], f"bench_online_{name}.json").write_text(json.dumps(r, indent=2, default=str))
    print(table(r, a))


if __name__ == "__main__":
    main()
