"""``train.online.producer=external``, the producer's side (``python -m eagle3 stage=produce``):
serve the trainers' reading orders in the exchange (``train.online.transport``: the directory,
eagle3/online/exchange.py, or Mooncake, eagle3/online/mooncake_exchange.py) with the samples they
need next, within their window, until they say they finished."""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from ..errors import Eagle3Error
from ..store import StoreLayout, one_sample_shard
from .exchange import DirProducerLink, OnlineError, identity_diff

log = logging.getLogger("eagle3.online")

WAIT_LOG_S = 30.0  # while no trainer shows life, the producer says so this often (or twice per idle timeout)


def produce(exchange, splits: dict, layout: StoreLayout, extractor, identity: dict, *, poll_s: float = 0.05,
            idle_timeout_s: float = 0.0, progress: bool = True, part: int = 0, parts: int = 1) -> dict:
    """The producer loop: serve the trainer's plans in ``exchange`` (a producer link of
    eagle3/online/exchange.py or mooncake_exchange.py, or a directory: the directory protocol) until
    it says it finished.

    Several producers share a directory as ``parts`` (``stage=produce extract.num_shards=N
    extract.shard_index=p``): part p writes the samples i with i % N == p, each counting every
    sample of the window (so together they stay within it) and removing only its own.

    ``splits``: {"train": samples, "eval": samples} of the prepared dataset (``lengths``, ``get``);
    ``extractor``: a built backend (``Extractor.run(specs, dir, progress)``); ``identity``: what
    this producer computes (the trainer checks it). ``idle_timeout_s`` > 0: an OnlineError when no
    trainer has shown life for that long while there is nothing to write: no new plan, no read, no
    heartbeat (written while the trainer runs, evals and checkpoints included);
    0: wait forever. Returns counts (samples written, plans served)."""
    from tqdm.auto import tqdm

    from ..extract.backend import Progress

    link = DirProducerLink(exchange) if isinstance(exchange, (str, Path)) else exchange
    if not 0 <= part < parts:
        raise OnlineError(f"producer part {part} of {parts}: the part must be in [0, {parts})")
    beat = link.heartbeat(part, parts, {"identity": identity, "host": socket.gethostname(), "pid": os.getpid(),
                                        "part": part, "parts": parts}, max(1.0, 10 * poll_s))
    # counts, and where the loop's time went (seconds): computing samples, handing them to the link
    stats = {"written": 0, "plans": 0, "backend_s": 0.0, "publish_s": 0.0}
    bar = tqdm(desc="produce", unit="sample", disable=not progress)
    chans: dict = {}  # trainer channel (the top, or a rank of a multi-process trainer) -> its state
    try:
        # the last sign of a trainer (a new plan, a read, a heartbeat), on this host's clock: a
        # change of what the trainer wrote counts, not its timestamps (the hosts' clocks may differ)
        t_life = said = time.monotonic()
        every = min(WAIT_LOG_S, idle_timeout_s / 2) if idle_timeout_s else WAIT_LOG_S
        while True:
            work, waiting = [], False
            for cd in link.channels():
                plan = link.read(cd, "plan")
                if plan is None:
                    continue
                ch = chans.setdefault(cd, {"plan_id": None, "served": set(), "done": False, "sign": None})
                if plan["plan_id"] != ch["plan_id"]:
                    ch["plan_id"], ch["done"] = plan["plan_id"], False
                    stats["plans"] += 1
                    _check_plan(plan, identity, link, cd, splits)
                    log.info("online producer: plan %s in %s: %d samples, window %d bytes", ch["plan_id"][:8], cd,
                             len(plan["order"]), plan["window_bytes"])
                    _produce_eval(link, cd, plan, splits, extractor, stats, part, parts)
                consumed = link.read(cd, "consumed") or {}
                sign = (plan["plan_id"], consumed.get("position"), consumed.get("finished"),
                        (link.read(cd, "trainer") or {}).get("heartbeat"))
                if sign != ch["sign"]:
                    ch["sign"], t_life = sign, time.monotonic()
                if consumed.get("plan_id") != ch["plan_id"]:
                    waiting = True
                    continue
                if consumed.get("finished"):
                    # a plan finished before this producer saw it unfinished is an earlier run's: not an end
                    ch["done"] = ch["plan_id"] in ch["served"]
                    if ch["done"] and hasattr(beat, "record"):
                        beat.record.setdefault("finished", [])
                        if ch["plan_id"] not in beat.record["finished"]:
                            beat.record["finished"] = beat.record["finished"] + [ch["plan_id"]]
                            try:  # the trainer waits for this (a while) before it leaves
                                beat.beat()
                            except Eagle3Error as e:  # the next beat writes it again
                                log.warning("online producer: heartbeat not written: %s", e)
                    continue
                ch["served"].add(ch["plan_id"])
                waiting = True
                todo = link.window(cd, plan, int(consumed["position"]), splits["train"], layout, part, parts)
                if todo:
                    work.append((cd, plan, todo))
            served = [ch for ch in chans.values() if ch["served"]]
            if served and not waiting and all(ch["done"] for ch in served):
                log.info("online producer: every trainer finished (%s)", ", ".join(str(c) for c in chans))
                return stats
            if not work:
                now = time.monotonic()
                if idle_timeout_s and now - t_life > idle_timeout_s:
                    raise OnlineError(_idle_message(link, chans, now - t_life, idle_timeout_s))
                if now - t_life >= every and now - said >= every:
                    said = now
                    log.warning("online producer: no trainer has shown life in %s for %.0f s (%s)", link.where,
                                now - t_life, f"stops after train.online.idle_timeout_s={idle_timeout_s:g} s"
                                if idle_timeout_s else "train.online.idle_timeout_s=0: waits for one forever")
                time.sleep(poll_s)
                continue
            for cd, plan, todo in work:
                N = plan["num_samples"]
                specs = []
                for i in todo:
                    ids, mask = splits["train"].get(i, i + 1)
                    specs.append(one_sample_shard("train", i, N, ids[0], mask[0]))
                t0 = time.perf_counter()
                extractor.run(specs, link.staging(cd), Progress(sum(p.num_tokens for p in specs), "", False))
                t1 = time.perf_counter()
                link.publish(cd, plan, specs)
                stats["backend_s"] += t1 - t0
                stats["publish_s"] += time.perf_counter() - t1
                stats["written"] += len(specs)
                bar.update(len(specs))
    finally:
        bar.close()
        beat.close()
        link.close()


def _idle_message(link, chans: dict, idle: float, idle_timeout_s: float) -> str:
    again = (f"this producer stops (train.online.idle_timeout_s={idle_timeout_s:g}; 0 waits forever): start it "
             f"again with the trainer")
    if not chans:
        return f"no trainer wrote its plan to {link.where} within {idle:.0f} s; {again}"
    who = []
    for cd in chans:
        t = link.read(cd, "trainer") or {}
        c = link.read(cd, "consumed") or {}
        state = "finished" if c.get("finished") else f"at position {c.get('position')}"
        who.append(f"{cd}: plan {str(chans[cd]['plan_id'])[:8]} {state}"
                   + (f", trainer pid {t['pid']} on host {t.get('host')}" if t.get("pid") else ""))
    return (f"no trainer has shown life for {idle:.0f} s (no new plan, no sample read, no heartbeat): "
            f"{'; '.join(who)}. The trainer stopped or was killed; {again}")


def _check_plan(plan: dict, identity: dict, link, d, splits: dict) -> None:
    diff = identity_diff(identity, plan.get("identity", {}))
    if diff:
        raise OnlineError(f"the trainer's plan in {d} (pid {plan.get('pid')} on {plan.get('host')}) needs other "
                          f"hidden states than this producer computes: {diff} as (producer, trainer). Start the "
                          f"producer with the trainer's overrides")
    if plan["num_samples"] != len(splits["train"]):
        raise OnlineError(f"the trainer's plan in {d} is over {plan['num_samples']} training samples, this producer's "
                          f"prepared dataset has {len(splits['train'])}: they read different prepare runs")


def _produce_eval(link, chan, plan: dict, splits: dict, extractor, stats: dict, part: int = 0,
                  parts: int = 1) -> None:
    from ..extract.backend import Progress

    n = int(plan.get("eval", 0))
    if not n:
        return
    specs = []
    for i in link.eval_todo(chan, plan, part, parts):
        ids, mask = splits["eval"].get(i, i + 1)
        specs.append(one_sample_shard("eval", i, n, ids[0], mask[0]))
    if specs:
        extractor.run(specs, link.staging(chan), Progress(sum(p.num_tokens for p in specs), "", False))
        link.publish(chan, plan, specs)
        stats["written"] += len(specs)
