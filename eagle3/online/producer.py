"""``train.online.producer=external``, the producer's side (``python -m eagle3 stage=produce``):
serve the trainers' reading orders in the exchange directory (eagle3/online/exchange.py) with the
shards they need next, within their window, until they say they finished."""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from ..store import StoreLayout, one_sample_shard, shard_name, sidecar_path
from .exchange import (
    CONSUMED_FILE,
    PLAN_FILE,
    TRAINER_FILE,
    Heartbeat,
    OnlineError,
    check_writable,
    producer_file,
    read_json,
    shard_bytes,
)

log = logging.getLogger("eagle3.online")

WAIT_LOG_S = 30.0  # while no trainer shows life, the producer says so this often (or twice per idle timeout)


def produce(exchange_dir, splits: dict, layout: StoreLayout, extractor, identity: dict, *, poll_s: float = 0.05,
            idle_timeout_s: float = 0.0, progress: bool = True, part: int = 0, parts: int = 1) -> dict:
    """The producer loop: serve the trainer's plans in ``exchange_dir`` until it says it finished.

    Several producers share a directory as ``parts`` (``stage=produce extract.num_shards=N
    extract.shard_index=p``): part p writes the samples i with i % N == p, each counting every
    sample of the window (so together they stay within it) and removing only its own.

    ``splits``: {"train": samples, "eval": samples} of the prepared dataset (``lengths``, ``get``);
    ``extractor``: a built backend (``Extractor.run(specs, dir, progress)``); ``identity``: what
    this producer computes (the trainer checks it). ``idle_timeout_s`` > 0: an OnlineError when no
    trainer has shown life for that long while there is nothing to write: no new plan, no read, no
    heartbeat (``trainer.json``, written while the trainer runs, evals and checkpoints included);
    0: wait forever. Returns counts (samples written, plans served)."""
    from tqdm.auto import tqdm

    from ..extract.backend import Progress

    d = Path(exchange_dir)
    check_writable(d, "the online exchange directory")
    if not 0 <= part < parts:
        raise OnlineError(f"producer part {part} of {parts}: the part must be in [0, {parts})")
    beat = Heartbeat(d / producer_file(part, parts), {"identity": identity, "host": socket.gethostname(),
                                                        "pid": os.getpid(), "part": part, "parts": parts},
                      max(1.0, 10 * poll_s))
    stats = {"written": 0, "plans": 0}
    bar = tqdm(desc="produce", unit="sample", disable=not progress)
    chans: dict = {}  # trainer directory (the top, or rank-<r>/ of a multi-process trainer) -> its state
    try:
        # the last sign of a trainer (a new plan, a read, a heartbeat), on this host's clock: a
        # change of what the trainer wrote counts, not its timestamps (the hosts' clocks may differ)
        t_life = said = time.monotonic()
        every = min(WAIT_LOG_S, idle_timeout_s / 2) if idle_timeout_s else WAIT_LOG_S
        while True:
            work, waiting = [], False
            for cd in [d] + sorted(p for p in d.glob("rank-*") if p.is_dir()):
                plan = read_json(cd / PLAN_FILE)
                if plan is None:
                    continue
                ch = chans.setdefault(cd, {"plan_id": None, "served": set(), "done": False, "sign": None})
                if plan["plan_id"] != ch["plan_id"]:
                    ch["plan_id"], ch["done"] = plan["plan_id"], False
                    stats["plans"] += 1
                    _check_plan(plan, identity, cd, splits)
                    log.info("online producer: plan %s in %s: %d samples, window %d bytes", ch["plan_id"][:8], cd,
                             len(plan["order"]), plan["window_bytes"])
                    _produce_eval(cd, plan, splits, layout, extractor, stats, part, parts)
                consumed = read_json(cd / CONSUMED_FILE) or {}
                sign = (plan["plan_id"], consumed.get("position"), consumed.get("finished"),
                        (read_json(cd / TRAINER_FILE) or {}).get("heartbeat"))
                if sign != ch["sign"]:
                    ch["sign"], t_life = sign, time.monotonic()
                if consumed.get("plan_id") != ch["plan_id"]:
                    waiting = True
                    continue
                if consumed.get("finished"):
                    # a plan finished before this producer saw it unfinished is an earlier run's: not an end
                    ch["done"] = ch["plan_id"] in ch["served"]
                    continue
                ch["served"].add(ch["plan_id"])
                waiting = True
                todo = _window(cd, plan, int(consumed["position"]), splits["train"], layout, part, parts)
                if todo:
                    work.append((cd, plan["num_samples"], todo))
            served = [ch for ch in chans.values() if ch["served"]]
            if served and not waiting and all(ch["done"] for ch in served):
                log.info("online producer: every trainer finished (%s)", ", ".join(str(c) for c in chans))
                return stats
            if not work:
                now = time.monotonic()
                if idle_timeout_s and now - t_life > idle_timeout_s:
                    raise OnlineError(_idle_message(d, chans, now - t_life, idle_timeout_s))
                if now - t_life >= every and now - said >= every:
                    said = now
                    log.warning("online producer: no trainer has shown life in %s for %.0f s (%s)", d, now - t_life,
                                f"stops after train.online.idle_timeout_s={idle_timeout_s:g} s" if idle_timeout_s
                                else "train.online.idle_timeout_s=0: waits for one forever")
                time.sleep(poll_s)
                continue
            for cd, N, todo in work:
                specs = []
                for i in todo:
                    ids, mask = splits["train"].get(i, i + 1)
                    specs.append(one_sample_shard("train", i, N, ids[0], mask[0]))
                extractor.run(specs, cd, Progress(sum(p.num_tokens for p in specs), "", False))
                stats["written"] += len(specs)
                bar.update(len(specs))
    finally:
        bar.close()
        beat.close()


def _idle_message(d: Path, chans: dict, idle: float, idle_timeout_s: float) -> str:
    again = (f"this producer stops (train.online.idle_timeout_s={idle_timeout_s:g}; 0 waits forever): start it "
             f"again with the trainer")
    if not chans:
        return f"no trainer wrote {d / PLAN_FILE} within {idle:.0f} s; {again}"
    who = []
    for cd in chans:
        t = read_json(cd / TRAINER_FILE) or {}
        c = read_json(cd / CONSUMED_FILE) or {}
        state = "finished" if c.get("finished") else f"at position {c.get('position')}"
        who.append(f"{cd}: plan {str(chans[cd]['plan_id'])[:8]} {state}"
                   + (f", trainer pid {t['pid']} on host {t.get('host')}" if t.get("pid") else ""))
    return (f"no trainer has shown life for {idle:.0f} s (no new plan, no sample read, no heartbeat in "
            f"{TRAINER_FILE}): {'; '.join(who)}. The trainer stopped or was killed; {again}")


def _check_plan(plan: dict, identity: dict, d: Path, splits: dict) -> None:
    theirs = plan.get("identity", {})
    diff = {k: (v, theirs.get(k)) for k, v in identity.items() if theirs.get(k) != v}
    if diff:
        raise OnlineError(f"the trainer's plan in {d} (pid {plan.get('pid')} on {plan.get('host')}) needs other "
                          f"hidden states than this producer computes: {diff} as (producer, trainer). Start the "
                          f"producer with the trainer's overrides")
    if plan["num_samples"] != len(splits["train"]):
        raise OnlineError(f"the trainer's plan in {d} is over {plan['num_samples']} training samples, this producer's "
                          f"prepared dataset has {len(splits['train'])}: they read different prepare runs")


def _produce_eval(d: Path, plan: dict, splits: dict, layout: StoreLayout, extractor, stats: dict, part: int = 0,
                  parts: int = 1) -> None:
    from ..extract.backend import Progress

    n = int(plan.get("eval", 0))
    if not n:
        return
    todo = [i for i in range(n) if i % parts == part and not (d / "eval" / shard_name(i, n)).exists()]
    specs = []
    for i in todo:
        ids, mask = splits["eval"].get(i, i + 1)
        specs.append(one_sample_shard("eval", i, n, ids[0], mask[0]))
    if specs:
        extractor.run(specs, d, Progress(sum(p.num_tokens for p in specs), "", False))
        stats["written"] += len(specs)


def _window(d: Path, plan: dict, position: int, samples, layout: StoreLayout, part: int = 0, parts: int = 1) -> list:
    """The samples of this part to write now: those at positions ``position ..`` not on disk, as
    long as the bytes not yet read (on disk or about to be, of every part) stay within the window;
    removes this part's shards that no position in the window needs (read already, or left by an
    earlier plan) and that are not cached."""
    order, N, cached = plan["order"], plan["num_samples"], int(plan["cached"])
    window, used, todo, seen = int(plan["window_bytes"]), 0, [], set()
    for p in range(position, len(order)):
        i = order[p]
        if i in seen:
            continue
        present = (d / "train" / shard_name(i, N)).exists()
        if i >= cached:
            b = shard_bytes("train", i, N, int(samples.lengths[i]), layout)
            if used + b > window:
                break
            used += b
        seen.add(i)
        if not present and i % parts == part:
            todo.append(i)
    # what is on disk and not needed within the window: gone (a cached sample stays)
    for f in (d / "train").glob("shard-*.safetensors"):
        i = int(f.name.split("-")[1])
        if i >= cached and i not in seen and i % parts == part:
            f.unlink(missing_ok=True)
            sidecar_path(f.parent, f.name).unlink(missing_ok=True)
    return todo
