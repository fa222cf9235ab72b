"""``train.online.transport=mooncake``: the exchange between producers and the trainer through a Mooncake
Store (eagle3/online/mooncake.py), with no filesystem shared between their hosts.

The protocol is the directory protocol's (eagle3/online/exchange.py) with objects for files. Every key
starts with the run's namespace ``<ns>`` (``train.online.mooncake.namespace``, default derived from the
train run's config hash):

``<ns>/rank-<r>/plan``       rank r's reading order, identity, window, cache, its segment's name
``<ns>/rank-<r>/consumed``   its position, ``finished``, the held-out samples it holds
``<ns>/rank-<r>/trainer``    its heartbeat
``<ns>/parts``               how many producers share the samples (``extract.num_shards``)
``<ns>/producer-<p>-of-<N>`` each producer's identity, host, pid, heartbeat and the plans it saw finish
``<ns>/rank-<r>/<plan>/<split>/<i>``  sample i: a header, the one-sample shard's bytes (the store's
                             format: the store dtype's values, fp8 with its scales), a tag

Where the bytes live: each training process contributes a segment of its host's memory
(``mooncake.segment_bytes``) and the producers, pure clients, put its samples there (Mooncake's
preferred segment), so a sample crosses the network once, producer to trainer. The window bounds
what the producers have put and the trainer has not read; the trainer removes each sample as it
reads it. Cached samples (``train.online.cache_bytes``) and the held-out split are kept on the
trainer's own disk (``train.online.dir``, default ``online/`` in the run's directory): the held-out
samples are fetched as soon as they arrive, so they never hold room the window needs.

Trust: every object is sealed. Without a secret the seal is an xxh3-128 digest over the key and the
bytes (corruption and misdirected objects are refused); with ``EAGLE3_ONLINE_SECRET`` in the
environment of every process it is a keyed BLAKE3 MAC over the same, so only holders of the secret
can write an object the others accept (docs/reliability.md: what an attacker on the network can and
cannot do). A sample is also checked against what the trainer expects: its namespace, plan, split
and index, the producer's identity, the layout, the shard header the store would write for the
prepared sample, and then its tokens.

A trainer killed with -9 takes its segment (the samples in flight, its control objects) with it;
started again, it writes a new plan (new keys) and the producers follow. A producer killed with -9
loses nothing it finished; started again, it puts what the window still lacks. A master that stops
loses everything: processes that cannot reach it stop with an error naming it after
``train.online.timeout_s`` (the trainer saves a checkpoint first).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..store import StoreLayout, shard_header, shard_name, sidecar_path
from ..train.source import SourceStalled
from .exchange import Heartbeat, OnlineError, check_writable, layout_identity, shard_bytes, window_ids
from .mooncake import MASTER_ENV, MASTER_SETTING, MooncakeClient, MooncakeError, MooncakeFull

log = logging.getLogger("eagle3.online")

SECRET_ENV = "EAGLE3_ONLINE_SECRET"
MAGIC = b"EAGLE3S1"
_FIXED = len(MAGIC) + 8  # magic, header length (u32), tag length (u32)
_MAX_HEADER = 1 << 20
MESSAGE_EXTRA = 2048  # a message's bytes beyond its shard file and sidecar (shard_bytes): the fixed part, the header, the tag
WAIT_LOG_S = 30.0
_ST_TORCH = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn", "I64": "int64",
             "I32": "int32", "U8": "uint8"}
# errors that a master or peer that comes back may end: tried again until train.online.timeout_s. ILLEGAL_CLIENT
# and CLIENT_NOT_FOUND: the master expired this client (its pings missed --client_ttl on a loaded host); the client
# registers again at its next ping
_TRANSIENT = (-800, -900, -901, -200, -1010, -601, -103, -101)


class MasterUnreachable(MooncakeError, SourceStalled):
    """The master (or the segment holding the objects) has not answered for ``train.online.timeout_s``."""


# -- seals -----------------------------------------------------------------------------------------------------

def secret_from_env(env=None) -> Optional[bytes]:
    """The shared secret of ``EAGLE3_ONLINE_SECRET`` (None when unset); refused when shorter than 16 bytes."""
    raw = (os.environ if env is None else env).get(SECRET_ENV, "")
    if not raw:
        return None
    if len(raw.encode()) < 16:
        raise OnlineError(f"{SECRET_ENV} has {len(raw.encode())} bytes: a shared secret needs at least 16 (e.g. "
                          f"`python -c 'import secrets; print(secrets.token_hex(32))'`), the same in the environment "
                          f"of the trainer and of every producer")
    return raw.encode()


class Sealer:
    """Seals objects and opens them: a tag over the object's key and bytes, keyed BLAKE3 (a MAC) with the
    shared secret, else xxh3-128 (a digest). ``mode`` names which; objects sealed the other way are refused."""

    def __init__(self, secret: Optional[bytes]):
        if secret:
            import blake3

            self.key = blake3.blake3(secret, derive_key_context="eagle3 online exchange 2026-12 sealing key").digest()
            self.mode, self.tag_len = "blake3-keyed", 32
        else:
            self.key, self.mode, self.tag_len = None, "xxh3-128", 16

    def tag(self, key: str, *parts) -> bytes:
        k = key.encode()
        if self.key is not None:
            import blake3

            h = blake3.blake3(key=self.key, max_threads=blake3.blake3.AUTO)
        else:
            import xxhash

            h = xxhash.xxh3_128()
        h.update(len(k).to_bytes(4, "little"))
        h.update(k)
        for p in parts:
            h.update(p)
        return h.digest()

    def check_mode(self, key: str, theirs) -> None:
        if theirs != self.mode:
            have = f"{SECRET_ENV} is set here" if self.key is not None else f"{SECRET_ENV} is not set here"
            raise OnlineError(f"Mooncake object {key!r} is sealed with {theirs!r}, this process expects {self.mode!r} "
                              f"({have}): set the same {SECRET_ENV} in the environment of the trainer and of every "
                              f"producer, or in none")

    def seal_json(self, key: str, obj) -> bytes:
        body = json.dumps(obj, separators=(",", ":"), sort_keys=True)
        return json.dumps({"auth": self.mode, "body": body, "tag": self.tag(key, body.encode()).hex()},
                          separators=(",", ":")).encode()

    def open_json(self, key: str, raw: np.ndarray):
        try:
            env = json.loads(raw.tobytes())
            body, tag, auth = env["body"], bytes.fromhex(env["tag"]), env["auth"]
        except (ValueError, KeyError, TypeError) as e:
            raise OnlineError(f"Mooncake object {key!r} ({raw.nbytes} B) is not a sealed eagle3 object ({e}): "
                              f"something else writes this run's keys") from None
        self.check_mode(key, auth)
        import hmac

        if not hmac.compare_digest(tag, self.tag(key, body.encode())):
            raise OnlineError(self.refusal(key))
        return json.loads(body)

    def refusal(self, key: str) -> str:
        if self.key is not None:
            return (f"Mooncake object {key!r} does not carry a valid tag of this run's secret ({SECRET_ENV}): it was "
                    f"not written by a process holding the secret, or changed on the way. Refused")
        return (f"Mooncake object {key!r} does not match its digest: its bytes changed between the writer and this "
                f"process, or it was written under another key. Refused")


def digest_of(obj) -> str:
    """A short digest of a JSON-able object (a message carries its producer's identity and layout as these)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def message_bytes(split: str, i: int, num: int, length: int, layout: StoreLayout) -> int:
    """An upper bound of sample ``i``'s message in the store (what the window counts for it)."""
    return shard_bytes(split, i, num, length, layout) + MESSAGE_EXTRA


def pack_sample(key: str, header: dict, payload_path: Path, sealer: Sealer, out: Optional[np.ndarray] = None
                ) -> np.ndarray:
    """The message of one sample: magic, lengths, ``header`` (JSON), the shard file's bytes, the tag; one
    buffer (the file is read into it once): the first bytes of ``out`` when it is large enough (a buffer
    reused from one message to the next: no page faults), else a new one."""
    head = json.dumps(dict(header, auth=sealer.mode), separators=(",", ":"), sort_keys=True).encode()
    side = len(json.dumps(header.get("sidecar"), separators=(",", ":")))
    if len(head) - side + _FIXED + sealer.tag_len > MESSAGE_EXTRA:
        raise OnlineError(f"the header of {key} takes {len(head) - side} B besides the sidecar, more than the "
                          f"{MESSAGE_EXTRA} B the window counts for it (a host name that long?)")
    size = payload_path.stat().st_size
    total = _FIXED + len(head) + size + sealer.tag_len
    buf = out[:total] if out is not None and out.nbytes >= total else np.empty(total, dtype=np.uint8)
    buf[:len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)
    buf[len(MAGIC):_FIXED] = np.frombuffer(len(head).to_bytes(4, "little") + sealer.tag_len.to_bytes(4, "little"),
                                           dtype=np.uint8)
    buf[_FIXED:_FIXED + len(head)] = np.frombuffer(head, dtype=np.uint8)
    body = memoryview(buf)[_FIXED + len(head):_FIXED + len(head) + size]
    with open(payload_path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = f.readinto(body[got:])
            if not n:
                raise OnlineError(f"{payload_path} shrank while it was read ({got} of {size} B)")
            got += n
    end = len(buf) - sealer.tag_len
    buf[end:] = np.frombuffer(sealer.tag(key, memoryview(buf)[:end]), dtype=np.uint8)
    return buf


def unpack_sample(key: str, buf: np.ndarray, sealer: Sealer) -> tuple:
    """(header, payload) of a sample message read as ``key``, its tag checked first; an OnlineError naming
    the key for anything else (nothing of it is used before the tag is checked, but the lengths)."""
    n = buf.nbytes
    if n < _FIXED or buf[:len(MAGIC)].tobytes() != MAGIC:
        raise OnlineError(f"Mooncake object {key!r} ({n} B) is not an eagle3 sample message: something else writes "
                          f"this run's keys")
    hlen = int.from_bytes(buf[len(MAGIC):len(MAGIC) + 4].tobytes(), "little")
    tlen = int.from_bytes(buf[len(MAGIC) + 4:_FIXED].tobytes(), "little")
    if hlen > _MAX_HEADER or _FIXED + hlen + tlen > n:
        raise OnlineError(f"Mooncake object {key!r} ({n} B) has impossible lengths (header {hlen} B, tag {tlen} B): "
                          f"damaged or not an eagle3 message")
    try:
        header = json.loads(buf[_FIXED:_FIXED + hlen].tobytes())
    except ValueError as e:
        raise OnlineError(f"Mooncake object {key!r}: its header is not JSON ({e}): damaged") from None
    sealer.check_mode(key, header.get("auth"))
    if tlen != sealer.tag_len:
        raise OnlineError(sealer.refusal(key))
    import hmac

    end = n - tlen
    if not hmac.compare_digest(buf[end:].tobytes(), sealer.tag(key, memoryview(buf)[:end])):
        raise OnlineError(sealer.refusal(key))
    return header, buf[_FIXED + hlen:end]


def payload_item(payload: np.ndarray, spec, layout: StoreLayout, where: str) -> dict:
    """A one-sample shard's bytes (``payload``, those of its file) as a store item, viewing ``payload``'s
    memory (no copy): refused unless its header is byte for byte the one the store writes for ``spec``
    (the prepared sample's tokens and lengths) in ``layout`` and its size that of such a shard."""
    import torch

    from ..store import StoreError, shard_item

    blob, offs = shard_header(spec, layout)
    if payload.nbytes != offs["__end__"] or payload[:len(blob)].tobytes() != blob:
        theirs = {}
        try:
            hl = int.from_bytes(payload[:8].tobytes(), "little")
            theirs = json.loads(payload[8:8 + hl].tobytes()).get("__metadata__", {}) if hl < _MAX_HEADER else {}
        except ValueError:
            pass
        want = dict(layout.metadata(), split=spec.split, shard=str(spec.k), num_tokens=str(spec.num_tokens))
        diff = {k: (theirs.get(k), v) for k, v in want.items() if theirs.get(k) != v}
        raise OnlineError(f"{where}: the shard it carries ({payload.nbytes} B) is not the one this trainer expects for "
                          f"{spec.split} sample {spec.first} ({offs['__end__']} B; {diff or 'other tensors'} as "
                          f"(received, expected)): the producer runs another layout or prepare run; start it with "
                          f"the trainer's overrides")
    head = json.loads(blob[8:])
    tensors = {}
    for name, h in head.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        dtype = getattr(torch, _ST_TORCH[h["dtype"]])
        start = len(blob) + a
        t = torch.frombuffer(payload, dtype=torch.uint8, count=b - a, offset=start) if b > a else \
            torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(dtype).reshape(h["shape"])
    try:
        return shard_item(tensors.__getitem__, 0, int(tensors["input_ids"].shape[0]), int(tensors["sample_index"][0]),
                          layout.is_fp8, "raw", Path(where))
    except StoreError as e:
        raise OnlineError(str(e)) from None


# -- master address ---------------------------------------------------------------------------------------------

MASTER_FILE = "mooncake-master.json"


def configured_master(mcfg) -> tuple:
    """(address, where it came from) of the master from ``train.online.mooncake.master`` or the environment;
    ("", "") when neither gives one."""
    if mcfg.master:
        return mcfg.master, MASTER_SETTING
    if os.environ.get(MASTER_ENV):
        return os.environ[MASTER_ENV], f"env {MASTER_ENV}"
    return "", ""


def local_master(local_dir: Path, log_path: Path):
    """The master this host's trainer started for the run (recorded in ``local_dir``/mooncake-master.json), if it
    still answers, else a new one on 127.0.0.1 recorded there. Returns (address, MasterProcess or None)."""
    from .mooncake import MasterProcess, check_master

    rec_path = local_dir / MASTER_FILE
    rec = _read_json_file(rec_path)
    if rec and rec.get("address"):
        try:
            check_master(rec["address"], 1.0)
            log.info("online: the Mooncake master this run started earlier answers at %s (pid %s): using it",
                     rec["address"], rec.get("pid"))
            return rec["address"], None
        except MooncakeError:
            pass
    master = MasterProcess(log_path, extra_args=("--client_ttl=10",))
    from ..atomic import atomic_write_json

    atomic_write_json(rec_path, {"address": master.address, "pid": master.pid, "log": str(log_path)})
    log.info("online: started a Mooncake master at %s (pid %d, log %s) for this run; producers on this host find "
             "it in %s, others need train.online.mooncake.master=<this host's address>:%d and a master bound to it",
             master.address, master.pid, log_path, rec_path, master.rpc_port)
    return master.address, master


def start_master_at(address: str, setting: str, log_path: Path):
    """A master started at ``address`` (``host:port`` of this host) unless one answers there already (then None):
    ``train.online.mooncake.start_master``."""
    import socket

    from .mooncake import MasterProcess, check_master, split_address

    try:
        check_master(address, 1.0, setting)
        log.info("online: a Mooncake master answers at %s already (%s): using it", address, setting)
        return None
    except MooncakeError:
        pass
    host, port = split_address(address, setting)
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        raise OnlineError(f"{setting}={address!r}: cannot resolve {host!r} ({e}) to start a Mooncake master there "
                          f"(train.online.mooncake.start_master=true)") from None
    try:
        master = MasterProcess(log_path, host=ip, rpc_port=port, extra_args=("--client_ttl=10",))
    except MooncakeError as e:
        raise OnlineError(f"train.online.mooncake.start_master=true could not start a Mooncake master at {address} "
                          f"({ip}; from {setting}): {e}. The address must be one of this host's (the trainer's first "
                          f"process), its port free") from None
    log.info("online: started a Mooncake master at %s (pid %d, log %s); it stops with this trainer", address,
             master.pid, log_path)
    return master


def wait_for_local_master(local_dir: Path, timeout_s: float, poll_s: float) -> str:
    """The address a trainer on this host recorded (:func:`local_master`), waiting up to ``timeout_s`` for it."""
    from .mooncake import check_master

    rec_path = local_dir / MASTER_FILE
    t0 = said = time.monotonic()
    while True:
        rec = _read_json_file(rec_path)
        if rec and rec.get("address"):
            try:
                check_master(rec["address"], 1.0)
                return rec["address"]
            except MooncakeError:
                pass
        now = time.monotonic()
        if timeout_s and now - t0 > timeout_s:
            raise OnlineError(f"no Mooncake master address: {MASTER_SETTING} and env {MASTER_ENV} are unset, and no "
                              f"trainer on this host recorded a live master in {rec_path} within {timeout_s:g} s. Give "
                              f"the master's host:port in {MASTER_SETTING} (or {MASTER_ENV}), or start the trainer on "
                              f"this host first (it starts one)")
        if now - said >= WAIT_LOG_S:
            said = now
            log.warning("online producer: waiting for a trainer on this host to start the Mooncake master (%s); give "
                        "%s to use another", rec_path, MASTER_SETTING)
        time.sleep(max(poll_s, 0.1))


def _read_json_file(path: Path) -> Optional[dict]:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None


# -- the common part of both sides ---------------------------------------------------------------------------

class _Side:
    """A connected client and the sealed, retried calls both sides make."""

    def __init__(self, client: MooncakeClient, ns: str, sealer: Sealer, timeout_s: float, setting: str):
        self.client, self.ns, self.sealer = client, ns.rstrip("/"), sealer
        self.timeout_s, self.setting = float(timeout_s), setting
        self._failing_since: Optional[float] = None
        self._said = 0.0

    def _retry(self, what: str, fn, *args, **kw):
        """``fn(*args)``, tried again while the store fails in a way a master or peer coming back may end, for up
        to ``train.online.timeout_s`` since the first failure; then MasterUnreachable naming the master."""
        while True:
            try:
                out = fn(*args, **kw)
                self._failing_since = None
                return out
            except MooncakeFull:
                raise
            except MooncakeError as e:
                if e.code not in _TRANSIENT:
                    raise
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since = now
                failing = now - self._failing_since
                if failing > self.timeout_s:
                    raise MasterUnreachable(
                        f"the Mooncake master at {self.client.master} (from {self.setting}) has not served {what} for "
                        f"{failing:.0f} s (train.online.timeout_s={self.timeout_s:g}): {e}. A master that stopped "
                        f"lost every object: start it again (the same address), then the trainer (it resumes from its "
                        f"checkpoint) and the producers", key=e.key, code=e.code) from None
                if now - self._said >= WAIT_LOG_S:
                    self._said = now
                    log.warning("online: Mooncake %s failed for %.0f s (%s); trying again until "
                                "train.online.timeout_s=%g", what, failing, e, self.timeout_s)
                time.sleep(0.2)

    def _get_or_drop(self, key: str):
        """The object's bytes, or None; an object whose segment is gone (TRANSFER_FAIL: the process holding it
        died, and the master has not dropped it yet) is removed and reads as None: its writer puts it again."""
        try:
            return self.client.get(key)
        except MooncakeError as e:
            if e.code != -800:
                raise
            log.info("online: %s was in a segment that is gone (its holder died); removing it", key)
            try:
                self.client.remove(key)
            except MooncakeError:
                pass
            return None

    def get(self, key: str):
        return self._retry(f"the read of {key}", self._get_or_drop, key)

    def get_obj(self, key: str):
        raw = self.get(key)
        return None if raw is None else self.sealer.open_json(key, raw)

    def put_obj(self, key: str, obj, segment: Optional[str] = None) -> None:
        data = self.sealer.seal_json(key, obj)
        self._retry(f"the write of {key}", self._put_replacing, key, data, segment)

    def _put_replacing(self, key: str, data, segment):
        try:
            self.client.put(key, data, segment=segment)
        except MooncakeError as e:
            # TRANSFER_FAIL / INVALID_WRITE: the old object's segment is gone (its owner died); OBJECT_NOT_FOUND:
            # removed while it was replaced: drop it, put again
            if e.code not in (-800, -704, -700):
                raise
            self.client.remove(key)
            self.client.put(key, data, segment=segment)

    def remove(self, key: str) -> None:
        try:
            self._retry(f"the removal of {key}", self.client.remove, key)
        except MasterUnreachable:
            raise
        except MooncakeError as e:
            log.warning("online: Mooncake removal of %s failed: %s", key, e)

    def close(self) -> None:
        self.client.close()


def _key(ns: str, *parts) -> str:
    return "/".join([ns, *map(str, parts)])


def parts_key(ns: str) -> str:
    return _key(ns, "parts")


def producer_key(ns: str, part: int, parts: int) -> str:
    return _key(ns, f"producer-{part}-of-{parts}")


def sample_key(ns: str, rank: int, plan_id: str, split: str, i: int) -> str:
    return _key(ns, f"rank-{rank}", plan_id, split, i)


def default_segment_bytes(window_bytes: int) -> int:
    return int(2 * window_bytes + (64 << 20))


# -- the trainer's side ------------------------------------------------------------------------------------------

class MooncakeTrainerLink(_Side):
    """A training process's side: rank ``rank``'s plan, position and heartbeat as objects, the samples producers
    put into this process's segment, the cache and held-out samples on this host's disk in ``local_dir``.
    Connects at once (MooncakeError naming the master and its setting when none answers)."""

    transport = "mooncake"

    def __init__(self, master: str, ns: str, local_dir: Path, mcfg, layout: StoreLayout, identity: dict, *,
                 window_bytes: int, timeout_s: float, rank: int = 0, setting: str = MASTER_SETTING,
                 secret: Optional[bytes] = None, master_proc=None, poll_s: float = 0.05):
        segment = int(mcfg.segment_bytes) or default_segment_bytes(window_bytes)
        client = MooncakeClient.connect(master, segment_bytes=segment, local_hostname=mcfg.local_hostname,
                                        protocol=mcfg.protocol, rdma_devices=mcfg.rdma_devices,
                                        timeout_s=min(float(mcfg.connect_timeout_s), float(timeout_s)), setting=setting)
        super().__init__(client, ns, secret if isinstance(secret, Sealer) else Sealer(secret), timeout_s, setting)
        self.rank, self.dir = rank, Path(local_dir)
        check_writable(self.dir, "the online directory (train.online.dir: the trainer's cache and held-out samples)")
        self.master_proc, self.poll_s = master_proc, poll_s
        self.where = f"the Mooncake master {master} (namespace {self.ns}, rank {rank})"
        self.producers_where = f"{_key(self.ns, 'producer-<p>-of-<N>')} at {master}"
        self.plan: Optional[dict] = None
        self.layout, self.identity = layout, identity
        self.eval_have: set = set()
        self._eval_thread = None
        self._eval_error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # position writes: the loop's and the held-out fetcher's
        self._position = (None, 0, False)
        self.eval_store = None
        self._num_train = 0
        self.received_bytes = 0
        self.timings = {"get_s": 0.0, "open_s": 0.0}  # the reads' seconds: getting messages, checking them

    def _rk(self, name: str) -> str:
        return _key(self.ns, f"rank-{self.rank}", name)

    def attach(self, split: str, store=None) -> None:
        check_writable(self.dir / split, "the online directory (train.online.dir)")
        if split == "eval":
            self.eval_store = store
        elif store is not None:
            self._num_train = len(store)

    def plan_extra(self, cached: int) -> dict:
        have = sorted(i for i in range(cached) if self._local("train", i, self._num_train).exists()) \
            if cached else []
        self.eval_have = {i for i in range(len(self.eval_store) if self.eval_store is not None else 0)
                          if self._local("eval", i, len(self.eval_store)).exists()}
        return {"transport": "mooncake", "namespace": self.ns, "segment": self.client.segment, "have": have,
                "auth": self.sealer.mode}

    def write_plan(self, plan: dict) -> None:
        self._stop_eval()
        self.plan = plan
        self._num_train = int(plan["num_samples"])
        self.write_position(plan["plan_id"], 0, False)
        self.put_obj(self._rk("plan"), plan, segment=self.client.segment)
        if self.eval_store is not None and int(plan.get("eval", 0)) > len(self.eval_have):
            self._stop.clear()
            self._eval_thread = threading.Thread(target=self._fetch_eval, args=(plan["plan_id"],), daemon=True,
                                                 name="eagle3-online-eval-fetch")
            self._eval_thread.start()

    def write_position(self, plan_id: str, position: int, finished: bool) -> None:
        with self._lock:
            self._position = (plan_id, position, finished)
            self.put_obj(self._rk("consumed"), {"plan_id": plan_id, "position": position, "finished": finished,
                                               "eval_have": sorted(self.eval_have)}, segment=self.client.segment)

    def heartbeat(self, record: dict, every: float) -> Heartbeat:
        def write(rec):
            self.put_obj(self._rk("trainer"), rec, segment=self.client.segment)
            # a master that expired this client (pings missed on a loaded host) dropped its segment: the plan and
            # position are written again, so the producers find them (the samples lost are put again)
            if self.plan is not None and not self._retry("the lookup of the plan", self.client.exists,
                                                          [self._rk("plan")])[0]:
                log.warning("online: the plan in %s was gone (the master dropped this process's segment); "
                            "writing it again", self.where)
                self.put_obj(self._rk("plan"), self.plan, segment=self.client.segment)
                pid, pos, fin = self._position
                if pid is not None:
                    self.write_position(pid, pos, fin)

        return Heartbeat(write, record, every, where=self._rk("trainer"))

    def producers(self) -> list:
        parts = self.get_obj(parts_key(self.ns))
        if not parts:
            return []
        n = int(parts.get("parts", 1))
        out = []
        for p in range(n):
            k = producer_key(self.ns, p, n)
            rec = self.get_obj(k)
            if rec is not None:
                out.append((k, rec))
        return out

    def _local(self, split: str, i: int, num: int) -> Path:
        return self.dir / split / shard_name(i, num)

    def _sample_key(self, split: str, i: int) -> str:
        return sample_key(self.ns, self.rank, self.plan["plan_id"], split, i)

    def present(self, split: str, i: int, num: int) -> bool:
        if split == "eval" or (split == "train" and i < int(self.plan.get("cached", 0))):
            if self._local(split, i, num).exists():
                return True
            if split == "eval":
                if self._eval_error is not None:
                    raise OnlineError(f"fetching the held-out samples from {self.where} failed: "
                                      f"{self._eval_error}") from self._eval_error
                return False  # the fetcher brings it
        return bool(self._retry(f"the lookup of {split} sample {i}", self.client.exists, [self._sample_key(split, i)])[0])

    def _receive(self, split: str, spec, layout: StoreLayout) -> tuple:
        """(item, payload) of the sample's message, every check passed."""
        key = self._sample_key(split, spec.first)
        t0 = time.monotonic()
        while True:
            tg = time.perf_counter()
            buf = self.get(key)
            self.timings["get_s"] += time.perf_counter() - tg
            if buf is not None:
                break
            if time.monotonic() - t0 > self.timeout_s:
                raise OnlineError(f"{key} was there and then was not, for {self.timeout_s:g} s: something removes this "
                                  f"run's samples (another trainer with the same namespace?)")
            time.sleep(self.poll_s)
        t1 = time.perf_counter()
        header, payload = unpack_sample(key, buf, self.sealer)
        self.timings["open_s"] += time.perf_counter() - t1
        want = {"ns": self.ns, "plan_id": self.plan["plan_id"], "split": split, "index": spec.first,
                "num": spec.num, "layout_digest": digest_of(layout_identity(layout)),
                "identity_digest": digest_of(self.identity)}
        diff = {k: (header.get(k), v) for k, v in want.items() if header.get(k) != v}
        if diff:
            raise OnlineError(f"Mooncake object {key!r} (from producer pid {header.get('pid')} on {header.get('host')}) "
                              f"is not what this trainer reads there: {diff} as (received, expected). It was sent for "
                              f"another run, plan or sample, or by a producer of other settings (identity: target, "
                              f"layer ids, dtypes, backend; layout: the states' shape): refused. Start the producers "
                              f"with the trainer's overrides")
        self.received_bytes += buf.nbytes
        return payload_item(payload, spec, layout, key), payload, header

    def _keep(self, split: str, spec, payload: np.ndarray, header: dict) -> None:
        """The sample's shard into this host's directory (the cache, the held-out samples), atomically,
        its sidecar first (as the store's writer does)."""
        from ..atomic import atomic_write_json

        path = self._local(split, spec.first, spec.num)
        path.parent.mkdir(parents=True, exist_ok=True)
        if header.get("sidecar"):
            atomic_write_json(sidecar_path(path.parent, path.name), header["sidecar"], indent=None)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(memoryview(payload))
        os.replace(tmp, path)

    def read(self, split: str, spec, layout: StoreLayout, plan_id: str, cached: bool) -> dict:
        from ..store import read_shard_item

        local = self._local(split, spec.first, spec.num)
        if (split == "eval" or cached) and local.exists():
            return read_shard_item(local, layout)
        item, payload, header = self._receive(split, spec, layout)
        if split == "eval" or cached:
            self._keep(split, spec, payload, header)
            self.remove(self._sample_key(split, spec.first))
        return item

    def drop(self, split: str, i: int, num: int) -> None:
        self.remove(self._sample_key(split, i))

    def _fetch_eval(self, plan_id: str) -> None:
        """Every held-out sample of the plan into this host's directory as soon as it is there (it is read at
        every eval; in the store it would hold room the training samples need)."""
        from ..store import one_sample_shard

        n = len(self.eval_store)
        try:
            for i in range(n):
                while not self._stop.is_set() and i not in self.eval_have:
                    key = sample_key(self.ns, self.rank, plan_id, "eval", i)
                    if self._retry(f"the lookup of {key}", self.client.exists, [key])[0]:
                        spec = one_sample_shard("eval", i, n, *self.eval_store.tokens(i))
                        _, payload, header = self._receive("eval", spec, self.layout)
                        self._keep("eval", spec, payload, header)
                        self.remove(key)
                        with self._lock:
                            self.eval_have.add(i)
                        pid, pos, fin = self._position
                        if pid == plan_id:
                            self.write_position(pid, pos, fin)
                        break
                    self._stop.wait(self.poll_s)
                if self._stop.is_set():
                    return
        except Exception as e:  # raised by the next read of a held-out sample (present)
            log.error("online: fetching the held-out samples failed: %s", e)
            self._eval_error = e

    def _stop_eval(self) -> None:
        self._stop.set()
        if self._eval_thread is not None:
            self._eval_thread.join()
            self._eval_thread = None

    def finish(self, layout: StoreLayout, lengths, cached_all: bool) -> None:
        import shutil

        from .exchange import finalize_cache

        self._stop_eval()
        self._wait_producers_saw_finish()
        if self.eval_store is not None and self.plan is not None:
            for i in range(len(self.eval_store)):
                self.remove(sample_key(self.ns, self.rank, self.plan["plan_id"], "eval", i))
        shutil.rmtree(self.dir / "eval", ignore_errors=True)
        if cached_all:
            finalize_cache(self.dir, layout, lengths)

    def _wait_producers_saw_finish(self, timeout_s: float = 10.0) -> None:
        """The producers read the end from this process's segment: it stays until each live one says it saw it
        (or ``timeout_s``), so none waits for a trainer that is gone."""
        plan_id = self.plan["plan_id"] if self.plan else None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                recs = [r for _, r in self.producers() if time.time() - float(r.get("heartbeat", 0)) < 60]
            except MooncakeError:
                return
            if all(plan_id in r.get("finished", ()) for r in recs):
                return
            time.sleep(self.poll_s)
        log.warning("online: not every producer said it saw this trainer finish within %g s; stopping anyway", timeout_s)

    def close(self) -> None:
        self._stop_eval()
        super().close()
        if self.master_proc is not None:
            self.master_proc.stop()
            self.master_proc = None


# -- the producer's side -----------------------------------------------------------------------------------------

class MooncakeProducerLink(_Side):
    """A producer's side: the trainers' plans and positions as objects; what the backend writes into ``staging``
    (this host's disk) is sealed and put into the reading rank's segment, then removed here."""

    transport = "mooncake"

    def __init__(self, master: str, ns: str, staging: Path, mcfg, layout: StoreLayout, *, timeout_s: float,
                 setting: str = MASTER_SETTING, secret: Optional[bytes] = None, poll_s: float = 0.05):
        client = MooncakeClient.connect(master, segment_bytes=0, local_hostname=mcfg.local_hostname,
                                        protocol=mcfg.protocol, rdma_devices=mcfg.rdma_devices,
                                        timeout_s=min(float(mcfg.connect_timeout_s), float(timeout_s)), setting=setting)
        super().__init__(client, ns, secret if isinstance(secret, Sealer) else Sealer(secret), timeout_s, setting)
        self.staging_dir = Path(staging)
        check_writable(self.staging_dir, "the producer's staging directory (train.online.dir)")
        self.where = f"the Mooncake master {master} (namespace {self.ns})"
        self.poll_s = poll_s
        self.part, self.parts = 0, 1
        self.put_keys: dict = {}  # rank -> {plan_id: set of keys this producer put and the trainer may not have read}
        self.identity: dict = {}
        self.layout_digest = digest_of(layout_identity(layout))
        self._firsts: dict = {}
        self._beat = None
        self.sent_bytes = 0
        self.sent = 0
        # the sender's seconds: sealing messages, putting them (waits for room in the store included), of which
        # waiting for room
        self.timings = {"pack_s": 0.0, "put_s": 0.0, "room_wait_s": 0.0}
        # the sender: seals and puts the staged samples while the backend computes the next ones
        import queue

        self._queue: "queue.Queue" = queue.Queue(maxsize=1)
        self._pending: set = set()  # keys handed to the sender and not yet put (the window counts them as there)
        self._lock = threading.Lock()
        self._send_error: Optional[BaseException] = None
        self._buffer: Optional[np.ndarray] = None
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="eagle3-online-sender")
        self._sender.start()

    def heartbeat(self, part: int, parts: int, record: dict, every: float) -> Heartbeat:
        self.part, self.parts, self.identity = part, parts, record.get("identity", {})
        key = producer_key(self.ns, part, parts)

        def write(rec):
            theirs = self.get_obj(parts_key(self.ns))
            if theirs is not None and int(theirs.get("parts", parts)) != parts and \
                    time.time() - float(theirs.get("at", 0)) < 3 * every + 5:
                raise OnlineError(f"another producer of namespace {self.ns} runs with extract.num_shards="
                                  f"{theirs['parts']} (pid {theirs.get('pid')} on {theirs.get('host')}), this one with "
                                  f"{parts}: start every producer with the same extract.num_shards")
            try:
                self.put_obj(parts_key(self.ns), {"parts": parts, "at": time.time(), "pid": rec.get("pid"),
                                                  "host": rec.get("host")})
                self.put_obj(key, rec)
            except MooncakeFull:  # no segment mounted yet: no trainer has connected; written at a later beat
                log.debug("online producer: no trainer segment yet for %s", key)

        self._beat = _ProducerBeat(write, record, every, key)
        return self._beat

    def _check_sender(self) -> None:
        if self._send_error is not None:
            raise OnlineError(f"sending to {self.where} failed: {self._send_error}") from self._send_error

    def channels(self) -> list:
        if self._beat is not None and self._beat.error is not None:
            raise self._beat.error
        self._check_sender()
        plan0 = self.get_obj(_key(self.ns, "rank-0", "plan"))
        return list(range(int(plan0.get("world_size", 1)))) if plan0 else [0]

    def read(self, rank: int, name: str) -> Optional[dict]:
        return self.get_obj(_key(self.ns, f"rank-{rank}", name))

    def _forget_other_plans(self, rank: int, plan: dict) -> None:
        """Objects this producer put for an earlier plan of ``rank`` (a trainer that restarted): removed."""
        plans = self.put_keys.setdefault(rank, {})
        for pid in [p for p in plans if p != plan["plan_id"]]:
            for k in plans.pop(pid):
                self.remove(k)

    def eval_todo(self, rank: int, plan: dict, part: int, parts: int) -> list:
        self._check_plan(rank, plan)
        self._forget_other_plans(rank, plan)
        n = int(plan.get("eval", 0))
        consumed = self.read(rank, "consumed") or {}
        have = set(consumed.get("eval_have", ())) if consumed.get("plan_id") == plan["plan_id"] else set()
        mine = [i for i in range(n) if i % parts == part and i not in have]
        keys = [sample_key(self.ns, rank, plan["plan_id"], "eval", i) for i in mine]
        there = self._retry("the lookup of held-out samples", self.client.exists, keys) if keys else []
        with self._lock:
            return [i for i, k, t in zip(mine, keys, there) if not t and k not in self._pending]

    def _check_plan(self, rank: int, plan: dict) -> None:
        if plan.get("transport") != "mooncake" or plan.get("namespace") != self.ns:
            raise OnlineError(f"the plan of rank {rank} in namespace {self.ns} is not a Mooncake plan of this namespace "
                              f"({plan.get('transport')!r}, {plan.get('namespace')!r}): refused")

    def window(self, rank: int, plan: dict, position: int, samples, layout: StoreLayout, part: int,
               parts: int) -> list:
        """This part's samples of the window that are neither in the store nor with the trainer; removes what this
        producer put that the window no longer holds (a put after the trainer read it)."""
        self._forget_other_plans(rank, plan)
        N, cached, order = plan["num_samples"], int(plan["cached"]), plan["order"]
        have = set(plan.get("have", ()))
        first = self._first_positions(plan)

        def with_trainer(i):  # a cached sample the trainer holds on its disk: takes no room, needs no put
            return i < cached and (i in have or first[i] < position)

        ids = window_ids(order, position, int(plan["window_bytes"]),
                         lambda i: message_bytes("train", i, N, int(samples.lengths[i]), layout),
                         lambda i: not with_trainer(i))
        mine = [i for i in ids if i % parts == part and not with_trainer(i)]
        keys = [sample_key(self.ns, rank, plan["plan_id"], "train", i) for i in mine]
        there = self._retry("the lookup of the window's samples", self.client.exists, keys) if keys else []
        live = set(keys)
        with self._lock:
            put = self.put_keys.setdefault(rank, {}).setdefault(plan["plan_id"], set())
            stale = [k for k in put if k not in live and "/train/" in k]
            put.difference_update(stale)
            pending = set(self._pending)
        for k in stale:
            self.remove(k)
        return [i for i, k, t in zip(mine, keys, there) if not t and k not in pending]

    def _first_positions(self, plan: dict) -> dict:
        if self._firsts.get("plan_id") != plan["plan_id"]:
            first: dict = {}
            for p, i in enumerate(plan["order"]):
                first.setdefault(i, p)
            self._firsts = {"plan_id": plan["plan_id"], "first": first}
        return self._firsts["first"]

    def staging(self, rank: int) -> Path:
        """Where the backend writes rank ``rank``'s samples before they are sent: a directory a rank (the sender
        may still read one rank's copy of a sample while the backend writes another rank's)."""
        return self.staging_dir / f"rank-{rank}"

    def publish(self, rank: int, plan: dict, specs: list) -> None:
        """The staged shards handed to the sender thread, which seals each into a message and puts it into rank
        ``rank``'s segment (waiting while the store is full: the trainer frees room as it reads), then removes it
        from the staging directory; returns at once unless the sender still has an earlier batch (one waits)."""
        self._check_sender()
        keys = [sample_key(self.ns, rank, plan["plan_id"], spec.split, spec.first) for spec in specs]
        with self._lock:
            self._pending.update(keys)
        self._queue.put((rank, plan, specs, keys))

    def _send_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            rank, plan, specs, keys = job
            try:
                if self._send_error is None:
                    self._send(rank, plan, specs)
            except BaseException as e:  # raised by the producer loop's next call (channels, publish, close)
                log.error("online producer: sending failed: %s", e)
                self._send_error = e
            finally:
                with self._lock:
                    self._pending.difference_update(keys)
                self._queue.task_done()

    def _send(self, rank: int, plan: dict, specs: list) -> None:
        for spec in specs:
            path = self.staging(rank) / spec.split / spec.name
            side = sidecar_path(path.parent, path.name)
            key = sample_key(self.ns, rank, plan["plan_id"], spec.split, spec.first)
            header = {"ns": self.ns, "plan_id": plan["plan_id"], "split": spec.split, "index": spec.first,
                      "num": spec.num, "layout_digest": self.layout_digest,
                      "identity_digest": digest_of(self.identity), "part": self.part,
                      "parts": self.parts, "host": os.uname().nodename, "pid": os.getpid(),
                      "sidecar": _read_json_file(side)}
            t0 = time.perf_counter()
            msg = pack_sample(key, header, path, self.sealer, out=self._buffer)
            t1 = time.perf_counter()
            self.timings["pack_s"] += t1 - t0
            if self._buffer is None or msg.base is not self._buffer:  # a larger one than before: kept for the next
                self._buffer = msg if msg.base is None else msg.base
            sent = self._put_waiting(key, msg, plan, rank)
            self.timings["put_s"] += time.perf_counter() - t1
            path.unlink(missing_ok=True)
            side.unlink(missing_ok=True)
            if not sent:  # the trainer wrote a new plan meanwhile (it restarted): the rest is for nobody
                for rest in specs[specs.index(spec) + 1:]:
                    p = self.staging(rank) / rest.split / rest.name
                    p.unlink(missing_ok=True)
                    sidecar_path(p.parent, p.name).unlink(missing_ok=True)
                return
            with self._lock:
                self.put_keys.setdefault(rank, {}).setdefault(plan["plan_id"], set()).add(key)
            self.sent_bytes += msg.nbytes
            self.sent += 1

    def close(self) -> None:
        """Waits for the sender to put what it was handed (unless it failed), then disconnects."""
        if self._sender.is_alive():
            self._queue.put(None)
            self._sender.join()
        super().close()
        self._check_sender()

    def _plan_changed(self, rank: int, plan: dict) -> bool:
        try:
            now = self.read(rank, "plan")
        except MooncakeError:
            return False
        return now is None or now.get("plan_id") != plan["plan_id"]

    def _put_waiting(self, key: str, msg: np.ndarray, plan: dict, rank: int) -> bool:
        """Put ``msg`` into the segment of ``plan``'s rank, waiting while the store is full; False (nothing put)
        when the trainer's plan changed meanwhile (a trainer that restarted: its old segment is gone)."""
        t0 = said = time.monotonic()
        failing = None
        while True:
            try:
                self.client.put(key, msg, segment=plan.get("segment"))
                return True
            except MooncakeError as e:
                if self._plan_changed(rank, plan):
                    log.info("online producer: rank %d has a new plan; %s is not sent (%s)", rank, key, e)
                    return False
                if not isinstance(e, MooncakeFull):
                    if e.code not in _TRANSIENT and e.code != -704:  # -704: the key removed while it was put
                        raise
                    failing = failing or time.monotonic()
                    if time.monotonic() - failing > self.timeout_s:
                        raise MasterUnreachable(f"the Mooncake master at {self.client.master} (from {self.setting}) "
                                                f"has not taken {key} for {self.timeout_s:g} s: {e}", key=key,
                                                code=e.code) from None
                    time.sleep(0.2)
                    continue
                now = time.monotonic()
                if now - t0 > self.timeout_s:
                    raise OnlineError(f"the Mooncake store at {self.client.master} has had no room for {key} "
                                      f"({msg.nbytes} B) for {now - t0:.0f} s: the trainer of rank {rank} does not read "
                                      f"(stopped?) or its segment is too small for its window (raise "
                                      f"train.online.mooncake.segment_bytes, or lower train.online.window_bytes)") \
                        from None
                if now - said >= WAIT_LOG_S:
                    said = now
                    log.warning("online producer: the Mooncake store is full; waiting for the trainer of rank %d to "
                                "read (%.0f s)", rank, now - t0)
                time.sleep(self.poll_s)
                self.timings["room_wait_s"] += time.monotonic() - now


class _ProducerBeat(Heartbeat):
    """A producer's heartbeat whose write may refuse the producer (another ``extract.num_shards``): that
    error is kept and raised by :meth:`check` instead of only logged."""

    def __init__(self, write, record, every, where):
        self.error = None
        super().__init__(write, record, every, where=where)

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.beat()
            except OnlineError as e:
                if isinstance(e, MooncakeError):
                    log.warning("online: heartbeat %s not written: %s", self.where, e)
                else:
                    self.error = e
                    return
