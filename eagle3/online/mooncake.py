"""A checked client for Mooncake Store: the layer the Mooncake transport of online training
(``train.online.transport=mooncake``, eagle3/online/mooncake_exchange.py: the protocol, sealed
messages) is built on, where producers (the target in vLLM) and the trainer exchange one-sample
messages through a Mooncake master and the memory that clients contribute to the store, with no
shared filesystem.

What it is: a thin layer over ``mooncake.store.MooncakeDistributedStore`` (package
``mooncake-transfer-engine-non-cuda``, or ``mooncake-transfer-engine-cuda13`` on the CUDA 13 GPU
install; the ``mooncake`` / ``mooncake-cuda13`` extras, installed by scripts/install.sh) that turns the
store's return codes into exceptions and avoids its traps:

- :class:`MasterProcess` starts a local ``mooncake_master`` (tests, benches, a one-host run);
  :func:`check_master` tells in a bounded time whether a master answers, because the store's
  ``setup()`` blocks about 90 s before it fails when no master listens.
- :class:`MooncakeClient` puts and gets messages (bytes-like or numpy buffers) and small JSON objects.
  Every write is an *upsert* (Mooncake's ``put`` of an existing key returns success and keeps the old
  value) and *hard-pinned* (unpinned objects are evicted silently when the store is full; a pinned
  write into a full store fails at once with :class:`MooncakeFull`). Reads use ``get_size`` +
  ``get_into`` (Mooncake's ``get`` returns ``b''`` for a missing key, a dead master and a short buffer
  alike); a missing key reads as ``None``. Removal is forced (every read grants the reader a lease that
  would refuse a plain remove for ``--default_kv_lease_ttl``).
- A closed client raises instead of calling into the store (which crashes the process).

What it deliberately does not do: the protocol (key names, plan, position, heartbeats, which segment
holds whose window: eagle3/online/mooncake_exchange.py), waiting or retrying (a full store raises MooncakeFull, the caller
decides to wait), message digests or signatures, and anything that survives the master: a master
that stops or restarts loses every object (it keeps its metadata in memory), the clients see
``RPC_FAIL`` (the first call at once, each later one after a reconnect timeout of about 4 s) and the
protocol has to re-produce what was lost.

Where the bytes live: in the memory of the clients that contribute a segment (``segment_bytes`` > 0),
never in the master. A put goes to ``segment`` (a client's :attr:`MooncakeClient.segment` name) when
that segment has room, else to any mounted segment (placement is best effort). A client's
:meth:`~MooncakeClient.close` drops the objects in its segment at once; a client that dies takes them
with it (reads fail with ``TRANSFER_FAIL``, and the master unmounts the segment after its
``--client_ttl``, 10 s). So the trainer, which reads, holds the segment, and producers are pure
clients: a producer that dies loses nothing it finished.

Security. Mooncake has no authentication at all: any process that reaches the master's RPC port can
put, read, overwrite and remove any object, its admin HTTP port (``--metrics_port``) lists every key and
removes all of them on request, and every client listens for data and handshakes on all interfaces
(0.0.0.0, whatever ``local_hostname`` says). Run it only on a network that only trusted hosts reach,
or behind a host firewall. The application signs its messages (a keyed hash over a header and the
payload) and checks them on read, which gives integrity and authenticity but not confidentiality.
:class:`MasterProcess` binds the master to one address (127.0.0.1 by default) and never starts its
HTTP metadata server (which listens on 0.0.0.0 whatever its flag says); clients use Mooncake's
``P2PHANDSHAKE`` instead.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from .exchange import OnlineError

MASTER_SETTING = "train.online.mooncake.master"
MASTER_ENV = "EAGLE3_MOONCAKE_MASTER"
_DEFAULT_SETTING = f"{MASTER_SETTING} (or env {MASTER_ENV})"

# the package eagle3 was run with (scripts/install.sh installs it; pyproject's mooncake extras)
INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU; `pip install -e .[mooncake]`) "
                "or mooncake-transfer-engine-cuda13==0.3.13.post1 (CUDA 13 GPU install; `.[mooncake-cuda13]`); "
                "it needs the system libraries libibverbs1 and libnuma1 (apt-get install libibverbs1 librdmacm1 "
                "libnuma1), which scripts/install.sh installs")

# Mooncake Store's ErrorCode (mooncake-store/include/types.h); every store call returns these, none raises
OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

MIN_SEGMENT_BYTES = 16 << 20  # a smaller segment fails setup() with INVALID_PARAMS

ERROR_NAMES = {
    0: "OK",
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1000: "ETCD_OPERATION_ERROR",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}

# what a code means for this client's calls, in the message of the error it raises
_HINTS = {
    -1: "the store failed inside (see the Mooncake log lines on stderr)",
    -200: "no room in the store: the segments are full of hard-pinned objects (remove the ones read) or no "
          "segment is mounted (the client holding it is gone, or the master restarted a moment ago)",
    -600: "invalid parameters: an empty key, a buffer smaller than the object, or a client whose setup failed",
    -703: "a put of this key is still in progress",
    -704: "no such object",
    -706: "the object is leased by a recent read (remove it with force)",
    -707: "the read took longer than the master's lease (--default_kv_lease_ttl)",
    -800: "the transfer failed: the client holding the object's segment is gone or unreachable (the master "
          "drops its objects after --client_ttl)",
    -801: "the store's checksum did not match",
    -900: "the master does not answer: it is down or restarted, and a master that stops loses every object",
    -901: "the master did not answer in time",
}


def code_name(code: int) -> str:
    return ERROR_NAMES.get(int(code), f"UNKNOWN({int(code)})")


class MooncakeError(OnlineError):
    """A Mooncake call failed; ``key`` and ``code`` (a Mooncake ErrorCode, None when not from the store)
    say which and why."""

    def __init__(self, message: str, *, key: Optional[str] = None, code: Optional[int] = None):
        super().__init__(message)
        self.key, self.code = key, code


class MooncakeFull(MooncakeError):
    """A put found no room (NO_AVAILABLE_HANDLE): the segments are full of hard-pinned objects. Nothing was
    written or evicted; the put can be tried again once the reader removed what it read."""


def _raise_for(op: str, key: Optional[str], code: int, where: str = ""):
    cls = MooncakeFull if code == NO_AVAILABLE_HANDLE else MooncakeError
    what = f"{op} of {key!r}" if key is not None else op
    hint = _HINTS.get(int(code), "")
    raise cls(f"Mooncake {what} failed{where}: {code_name(code)} ({int(code)})" + (f": {hint}" if hint else ""),
              key=key, code=int(code))


# -- addresses -----------------------------------------------------------------------------------------------

def split_address(address: str, setting: str = _DEFAULT_SETTING) -> tuple:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``; else a MooncakeError naming ``setting``."""
    host, sep, port = str(address).strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MooncakeError(f"{setting}={address!r} is not a Mooncake master address: give host:port, e.g. "
                            "10.0.0.5:50051 (the master's --rpc_address and --rpc_port)")
    return host, int(port)


def check_master(address: str, timeout_s: float = 5.0, setting: str = _DEFAULT_SETTING) -> None:
    """Whether a Mooncake master listens at ``address`` (``host:port``): a TCP connection to it within
    ``timeout_s``, else a MooncakeError naming the address, the setting it came from and what to do.
    (The store's own ``setup()`` retries for about 90 s before it fails.)"""
    host, port = split_address(address, setting)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e) or type(e).__name__)
        raise MooncakeError(
            f"no Mooncake master answers at {address} ({why}, waited up to {timeout_s:g} s; from {setting}): "
            f"start one there (mooncake_master --rpc_address=<host> --rpc_port={port}), or set {setting} to a "
            "running master's host:port, reachable from this host (a firewall may drop the port)") from e


def local_address_for(master_host: str) -> str:
    """This host's IPv4 address on the route to ``master_host``, which is the address a client advertises for
    its segment (``local_hostname``) unless told. ``connect()`` of a UDP socket sends nothing: it only makes
    the kernel choose the route, and so the source address, that ``getsockname()`` then reads; a master on
    loopback gives 127.0.0.1. Peers (producers, other ranks) must reach this address too: when they do not
    route to this host the way the master does (NAT, several networks), set ``local_hostname``."""
    try:
        infos = socket.getaddrinfo(master_host, 9, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except OSError as e:
        raise MooncakeError(f"cannot find this host's address on the route to the Mooncake master {master_host!r} "
                            f"({e.strerror or e}): pass local_hostname (an IPv4 address of this host that the "
                            "master and the other clients reach)") from e


def _free_port(host: str, taken: Sequence[int] = ()) -> int:
    for _ in range(16):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
    raise MooncakeError(f"found no free TCP port on {host}")


# -- the master ----------------------------------------------------------------------------------------------

def master_command() -> list:
    """The command that runs ``mooncake_master``: the binary inside the mooncake package this Python imports
    (so a launcher on PATH cannot pick another Python's), else ``mooncake_master`` on PATH."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "mooncake_master"
        if binary.is_file():
            if os.access(binary, os.X_OK):
                return [str(binary)]
            # the package's launcher makes the binary executable, then execs it (the pid stays)
            return [sys.executable, "-m", "mooncake.cli"]
    found = shutil.which("mooncake_master")
    if found:
        return [found]
    raise MooncakeError(f"mooncake_master not found (the mooncake package is not installed): {INSTALL_HINT}")


class MasterProcess:
    """A local ``mooncake_master``, bound to ``host`` (127.0.0.1 by default: only this host reaches it) on free
    ports unless given; ready when this returns (its RPC port accepts connections). ``address`` is what
    clients connect to. Stop it with :meth:`stop` or a ``with`` block; it is also stopped when this Python
    exits normally, not when it is killed or crashes (the master then keeps running: stop it by its
    :attr:`pid`, written first in the log). Its output goes to ``log_path`` (appended).

    Another ``host`` (one of this host's addresses) lets other hosts use it: they can then also read,
    overwrite and remove anything in it (no authentication; see the module's docstring). ``extra_args``
    are more master flags, e.g. ``--client_ttl=5`` or ``--default_kv_lease_ttl=2000``."""

    def __init__(self, log_path, *, host: str = "127.0.0.1", rpc_port: int = 0, metrics_port: int = 0,
                 extra_args: Sequence[str] = (), timeout_s: float = 10.0):
        if host in ("", "0.0.0.0", "::"):
            raise MooncakeError(f"MasterProcess host={host!r} would listen on every interface of an "
                                "unauthenticated service: give one address of this host (127.0.0.1 for this host only)")
        self.host = host
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc: Optional[subprocess.Popen] = None
        cmd = master_command()
        # ports picked here may be taken before the master binds them: then it exits, and a new pair is tried
        tries = 1 if rpc_port and metrics_port else 3
        for attempt in range(tries):
            self.rpc_port = rpc_port or _free_port(host)
            self.metrics_port = metrics_port or _free_port(host, taken=(self.rpc_port,))
            args = cmd + [f"--rpc_port={self.rpc_port}", f"--rpc_address={host}",
                          f"--metrics_host={host}", f"--metrics_port={self.metrics_port}",
                          "--enable_http_metadata_server=false", *extra_args]
            with open(self.log_path, "ab") as log:
                log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(args)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
                log.write(f"=== pid {self.proc.pid} (started by pid {os.getpid()})\n".encode())
            atexit.register(self.stop)
            try:
                self._wait_ready(timeout_s)
                return
            except MooncakeError:
                exited = self.proc.poll() is not None  # by itself (a port taken), not for want of time
                self.stop()
                if attempt + 1 == tries or not exited:
                    raise

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, nbytes: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise MooncakeError(f"mooncake_master exited with {code} at start ({self.address}); the end of its "
                                    f"log {self.log_path}:\n{self.log_tail()}")
            try:
                socket.create_connection((self.host, self.rpc_port), timeout=0.2).close()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise MooncakeError(f"mooncake_master does not accept connections at {self.address} after "
                                    f"{timeout_s:g} s; the end of its log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.01)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the master (SIGTERM, then SIGKILL after ``timeout_s``) and wait for it. Its objects are lost."""
        atexit.unregister(self.stop)
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "MasterProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MasterProcess({self.address}, pid={self.pid}, running={self.running()})"


# -- the client ----------------------------------------------------------------------------------------------

def _import_store():
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as e:
        raise MooncakeError(f"the Mooncake transport needs the mooncake package ({e}): {INSTALL_HINT}") from e
    return MooncakeDistributedStore, ReplicateConfig


def as_byte_array(data) -> np.ndarray:
    """``data`` (bytes, bytearray, memoryview, a C-contiguous numpy array of any dtype) as a flat uint8 array
    over the same memory (no copy)."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("a Mooncake message must be C-contiguous (np.ascontiguousarray)")
        return data.reshape(-1).view(np.uint8)
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("a Mooncake message must be C-contiguous")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


class MooncakeClient:
    """One connection to a Mooncake master (a Mooncake Store client): make one with :meth:`connect`.

    Every call checks the store's return code and raises :class:`MooncakeError` (with the key, the code's name
    and a hint) on failure; a missing key is not a failure (``get`` gives None, ``exists`` False, ``remove``
    False). Calls from several threads go to the store as they come (it has its own locks); :meth:`close`
    must come after the other threads' calls."""

    def __init__(self, store, replicate_config, *, master: str, segment: str, segment_bytes: int, protocol: str):
        self._store = store
        self._ReplicateConfig = replicate_config
        self.master = master
        self._segment = segment
        self.segment_bytes = int(segment_bytes)
        self.protocol = protocol

    @classmethod
    def connect(cls, master: str, *, segment_bytes: int, buffer_bytes: int = 0, local_hostname: str = "",
                protocol: str = "tcp", rdma_devices: str = "", timeout_s: float = 5.0,
                setting: str = _DEFAULT_SETTING) -> "MooncakeClient":
        """Connect to the master at ``master`` (``host:port``; ``setting`` is where it came from, for messages).

        ``segment_bytes``: memory this client contributes to the store (its segment; 0 = a pure client, which
        holds nothing: a producer; else at least 16 MiB). The store reserves it as virtual memory and touches
        it as objects arrive; leave headroom of about one object (a 16 MiB segment held 8 objects of 2 MiB,
        but a 64 MiB one only 3 or 4 of 16 MiB).
        ``buffer_bytes``: Mooncake's own staging buffer for its copying put/get of bytes, which this class
        does not use (its calls read and write the caller's buffers directly); 0 is fine.
        ``local_hostname``: the address this client advertises to the master and the other clients (default:
        :func:`local_address_for` the master's host). ``protocol``: ``"tcp"`` or ``"rdma"`` (then
        ``rdma_devices``, e.g. ``"mlx5_0,mlx5_1"``).

        The master must answer within ``timeout_s`` (:func:`check_master`), else a MooncakeError at once;
        then ``setup()`` runs in this thread (about 20 ms)."""
        if 0 < segment_bytes < MIN_SEGMENT_BYTES:
            raise MooncakeError(f"Mooncake segment_bytes={segment_bytes}: give 0 (a pure client) or at least "
                                f"{MIN_SEGMENT_BYTES} (16 MiB, the store's smallest segment)")
        if protocol not in ("tcp", "rdma"):
            raise MooncakeError(f"Mooncake protocol {protocol!r}: use 'tcp' or 'rdma'")
        store_cls, replicate_config = _import_store()
        check_master(master, timeout_s, setting)
        host, _ = split_address(master, setting)
        if not local_hostname:
            local_hostname = local_address_for(host)
        store = store_cls()
        rc = store.setup(local_hostname, "P2PHANDSHAKE", int(segment_bytes), int(buffer_bytes), protocol,
                         rdma_devices, master)
        if rc != 0:
            raise MooncakeError(
                f"Mooncake client setup failed ({code_name(rc)}) with the master at {master} (from {setting}), "
                f"local_hostname={local_hostname!r}, protocol={protocol!r}, rdma_devices={rdma_devices!r}, "
                f"segment_bytes={segment_bytes}: see the Mooncake log lines on stderr (a master that stopped, "
                "an RDMA device that does not exist, a segment larger than this host can reserve)", code=rc)
        return cls(store, replicate_config, master=master, segment=store.get_hostname(),
                   segment_bytes=segment_bytes, protocol=protocol)

    # -- helpers
    def _live(self):
        if self._store is None:
            raise MooncakeError(f"this Mooncake client (master {self.master}) is closed")
        return self._store

    @contextlib.contextmanager
    def _registered(self, store, buf: np.ndarray) -> Iterator[None]:
        """``buf`` registered with the transfer engine for the call: RDMA reads and writes registered memory
        only. On tcp registration changes nothing (measured: the same rate), so it is skipped."""
        if self.protocol == "tcp" or buf.nbytes == 0:
            yield
            return
        rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            _raise_for(f"register_buffer of {buf.nbytes} B", None, rc)
        try:
            yield
        finally:
            store.unregister_buffer(buf.ctypes.data)

    def _config(self, segment: Optional[str]):
        cfg = self._ReplicateConfig()
        cfg.with_hard_pin = True  # never evicted; a full store refuses the put instead (MooncakeFull)
        if segment:
            cfg.preferred_segment = segment
        return cfg

    # -- the API
    @property
    def segment(self) -> str:
        """This client's segment name (``host:port``), for others' ``put(..., segment=)``; meaningful only when
        this client contributes memory (``segment_bytes`` > 0)."""
        return self._segment

    def put(self, key: str, data, *, segment: Optional[str] = None) -> None:
        """Write ``data`` (bytes-like or a C-contiguous numpy array) as ``key``, replacing any object of that key
        (an upsert), hard-pinned, in ``segment`` when it has room (else in any segment with room; None: any).
        Read straight from ``data``'s memory (no copy here). MooncakeFull when no segment has room."""
        store = self._live()
        buf = as_byte_array(data)
        if buf.nbytes == 0:
            raise ValueError(f"Mooncake put of {key!r}: an empty message (the store keeps no empty objects)")
        with self._registered(store, buf):
            rc = store.upsert_from(key, buf.ctypes.data, buf.nbytes, self._config(segment))
        if rc != 0:
            _raise_for("put", key, rc, f" ({buf.nbytes} B, segment {segment or 'any'})")

    def get(self, key: str, *, out: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """The bytes of ``key`` as a uint8 array, or None when there is no such object (or its put is still in
        progress). The array is new and the caller's (the object is read straight into it: no copy after the
        read); with ``out`` (a C-contiguous array of at least the object's size, e.g. reused from one get to the
        next) it is read into ``out`` and the result is a view of ``out``'s first bytes. A read grants this
        client a lease on the object (see :meth:`remove`).

        Measured for a 64 MiB object in this client's segment (bench/results/mooncake_transfer_cpu_202612.md):
        11 ms into a reused ``out``, 18 ms into a new array (the kernel maps and zeroes it; now and then much
        more on first-touched memory), 28 ms into a reused buffer and then copied, hence no staging buffer."""
        store = self._live()
        for attempt in range(3):
            size = store.get_size(key)
            if size in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                return None
            if size < 0:
                _raise_for("get_size", key, size)
            if out is not None:
                dst = as_byte_array(out)
                if dst.nbytes < size:
                    raise MooncakeError(f"Mooncake get of {key!r}: the object has {size} B, out only {dst.nbytes} B",
                                        key=key, code=INVALID_PARAMS)
            else:
                dst = np.empty(size, dtype=np.uint8)
            with self._registered(store, dst):
                n = store.get_into(key, dst.ctypes.data, dst.nbytes)
            if n >= 0:
                return dst[:n]
            if n in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):  # removed or being replaced since get_size
                return None
            if n == INVALID_PARAMS and out is None and attempt < 2:  # replaced by a larger one since get_size
                continue
            _raise_for("get", key, n, f" ({size} B)")
        raise AssertionError("unreachable")

    def put_json(self, key: str, obj: Any, *, segment: Optional[str] = None) -> None:
        """Write a small JSON-able object (a control object: plan, position, heartbeat) as ``key`` (an upsert)."""
        self.put(key, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode(), segment=segment)

    def get_json(self, key: str) -> Any:
        """The object :meth:`put_json` wrote as ``key``, or None when there is none."""
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw.tobytes())
        except ValueError as e:
            raise MooncakeError(f"Mooncake object {key!r} ({raw.nbytes} B) is not JSON ({e}): written by something "
                                "other than put_json", key=key) from e

    def exists(self, keys: Sequence[str]) -> list:
        """For each key, whether its object is there (and complete). Grants a lease on the ones that are."""
        keys = list(keys)
        if not keys:
            return []
        codes = self._live().batch_is_exist(keys)
        for k, c in zip(keys, codes):
            if c < 0:
                _raise_for("exists", k, c, f" (of {len(keys)} keys)")
        return [c == 1 for c in codes]

    def remove(self, key: str) -> bool:
        """Remove ``key``'s object (forced: whatever leases reads granted on it); False when there was none."""
        rc = self._live().remove(key, True)
        if rc == OBJECT_NOT_FOUND:
            return False
        if rc != 0:
            _raise_for("remove", key, rc)
        return True

    def healthy(self) -> bool:
        """Whether the store says it is set up and its master answers (its ``health_check``; it notices a dead
        master only some seconds later, while calls fail with RPC_FAIL at once)."""
        return self._store is not None and self._store.health_check() == 0

    def close(self) -> None:
        """Disconnect (idempotent). The objects in this client's segment go with it, at once. It takes about 2 s
        for a client holding a segment (7 s when the master is gone), well under 1 s for a pure client."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def __enter__(self) -> "MooncakeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._store is None else "open"
        return (f"MooncakeClient(master={self.master}, segment={self._segment}, segment_bytes={self.segment_bytes}, "
                f"protocol={self.protocol}, {state})")
