"""eagle3/online/mooncake.py against a real mooncake_master on 127.0.0.1 (the mooncake package, which
scripts/install.sh installs): two processes exchanging a 64 MiB message, upserts, missing keys, a full
segment, a master that is not there or dies, all in bounded time."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eagle3.online.mooncake import (
    MASTER_SETTING,
    MasterProcess,
    MooncakeClient,
    MooncakeError,
    MooncakeFull,
    check_master,
    code_name,
    local_address_for,
    split_address,
)

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _mooncake_missing() -> str:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"the mooncake package is not importable ({e}); scripts/install.sh installs it"
    return ""


needs_mooncake = pytest.mark.skipif(bool(_mooncake_missing()), reason=_mooncake_missing() or "-")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    if _mooncake_missing():
        pytest.skip(_mooncake_missing())
    with MasterProcess(tmp_path_factory.mktemp("mooncake") / "master.log") as m:
        yield m


@pytest.fixture(scope="module")
def trainer(master):
    """A client holding a segment (the trainer's side)."""
    with MooncakeClient.connect(master.address, segment_bytes=192 * MiB) as c:
        yield c


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("GLOG_minloglevel", "1")  # Mooncake's INFO lines
    return env


# the other process: reads what this one put in its segment, puts another message into it
_PEER = r"""
import json, sys
import numpy as np
from eagle3.online.mooncake import MooncakeClient
master, segment, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with MooncakeClient.connect(master, segment_bytes=0) as c:
    got = c.get("test/to-peer")
    expect = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    c.put("test/from-peer", np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8), segment=segment)
    print(json.dumps({"got": None if got is None else int(got.nbytes),
                      "equal": got is not None and bool(np.array_equal(got, expect))}))
"""


@needs_mooncake
def test_two_processes_exchange_64_mib(master, trainer):
    n = 64 * MiB
    trainer.put("test/to-peer", np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8), segment=trainer.segment)
    r = subprocess.run([sys.executable, "-c", _PEER, master.address, trainer.segment, str(n)], env=_child_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    peer = json.loads(r.stdout.strip().splitlines()[-1])
    assert peer == {"got": n, "equal": True}  # read over TCP from this process's segment
    got = trainer.get("test/from-peer")  # written over TCP into this process's segment, by a process now gone
    assert got is not None and got.nbytes == n
    assert np.array_equal(got, np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8))
    assert trainer.remove("test/to-peer") and trainer.remove("test/from-peer")
    assert trainer.exists(["test/to-peer", "test/from-peer"]) == [False, False]


@needs_mooncake
def test_json_round_trip_and_upserts_overwrite(trainer):
    trainer.put_json("test/plan", {"plan_id": "a", "order": [3, 1, 2]})
    assert trainer.get_json("test/plan") == {"plan_id": "a", "order": [3, 1, 2]}
    trainer.put_json("test/plan", {"plan_id": "b"})  # a plain Mooncake put would keep "a"
    assert trainer.get_json("test/plan") == {"plan_id": "b"}
    # the object was just read (a lease) and changes size both ways
    for data in (b"x" * 10, bytes(range(256)) * 40, b"yz"):
        trainer.put("test/bytes", data, segment=trainer.segment)
        assert trainer.get("test/bytes").tobytes() == data
    out = np.zeros(4096, np.uint8)
    view = trainer.get("test/bytes", out=out)
    assert view.tobytes() == b"yz" and view.base is out
    with pytest.raises(MooncakeError, match="out only 1 B"):
        trainer.get("test/bytes", out=np.zeros(1, np.uint8))
    trainer.put("test/array", np.arange(6, dtype=np.float32).reshape(2, 3))  # any C-contiguous array, as bytes
    assert np.array_equal(trainer.get("test/array").view(np.float32), np.arange(6, dtype=np.float32))
    with pytest.raises(ValueError, match="empty"):
        trainer.put("test/empty", b"")
    for k in ("test/plan", "test/bytes", "test/array"):
        assert trainer.remove(k)


@needs_mooncake
def test_missing_key_is_none_at_once(trainer):
    t0 = time.monotonic()
    assert trainer.get("test/never-written") is None
    assert trainer.get_json("test/never-written") is None
    assert trainer.exists(["test/never-written"]) == [False]
    assert trainer.exists([]) == []
    assert trainer.remove("test/never-written") is False
    assert time.monotonic() - t0 < 1.0
    assert trainer.healthy()


def test_check_master_on_a_closed_port_names_address_and_setting():
    port = _closed_port()
    t0 = time.monotonic()
    with pytest.raises(MooncakeError) as e:
        check_master(f"127.0.0.1:{port}", 1.0, MASTER_SETTING)
    assert time.monotonic() - t0 < 1.5
    assert f"127.0.0.1:{port}" in str(e.value) and MASTER_SETTING in str(e.value)
    with pytest.raises(MooncakeError, match="not a Mooncake master address"):
        split_address("no-port", MASTER_SETTING)
    assert split_address("[::1]:5") == ("::1", 5) and code_name(-704) == "OBJECT_NOT_FOUND"


@needs_mooncake
def test_connect_to_no_master_fails_fast():
    port = _closed_port()
    t0 = time.monotonic()
    with pytest.raises(MooncakeError, match=f"127.0.0.1:{port}"):  # not the store's 90 s of retries
        MooncakeClient.connect(f"127.0.0.1:{port}", segment_bytes=0, timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0


def test_local_address_for_the_master():
    assert local_address_for("127.0.0.1") == "127.0.0.1"
    assert local_address_for("localhost") == "127.0.0.1"
    try:  # a documentation address (TEST-NET-1): nothing is sent, only the route is looked up
        addr = local_address_for("192.0.2.1")
    except MooncakeError:
        pytest.skip("this host has no route beyond loopback")
    assert socket.inet_aton(addr) and not addr.startswith("127.")


@needs_mooncake
def test_full_segment_raises_mooncake_full(tmp_path):
    with MasterProcess(tmp_path / "master.log") as m, \
            MooncakeClient.connect(m.address, segment_bytes=16 * MiB) as c:
        msg = np.ones(2 * MiB, np.uint8)
        with pytest.raises(MooncakeFull) as e:
            for i in range(16):
                c.put(f"test/full/{i}", msg, segment=c.segment)
        full_at = int(e.value.key.rsplit("/", 1)[1])
        assert 4 <= full_at <= 8 and "NO_AVAILABLE_HANDLE" in str(e.value)
        assert c.exists([f"test/full/{i}" for i in range(full_at)]) == [True] * full_at  # pinned: nothing evicted
        assert c.remove("test/full/0")
        c.put(f"test/full/{full_at}", msg, segment=c.segment)  # room again
    with pytest.raises(MooncakeError, match="at least"):
        MooncakeClient.connect(m.address, segment_bytes=8 * MiB)


@needs_mooncake
def test_master_killed_while_connected_raises(tmp_path):
    m = MasterProcess(tmp_path / "master.log")
    # the one checked is a pure client: a client holding a segment spends about 7 s in close() trying to
    # unmount it from a dead master, so the segment's holder leaves before the master is killed
    holder = MooncakeClient.connect(m.address, segment_bytes=16 * MiB)
    c = MooncakeClient.connect(m.address, segment_bytes=0)
    try:
        c.put_json("test/k", {"v": 1})
        assert c.get_json("test/k") == {"v": 1}
        holder.close()
        os.kill(m.pid, signal.SIGKILL)
        m.proc.wait(5)
        # the first call fails at once, the next ones after one reconnect timeout each (about 4.3 s)
        for call in (lambda: c.get("test/k"), lambda: c.put("test/k2", b"x")):
            t0 = time.monotonic()
            with pytest.raises(MooncakeError, match="RPC_FAIL"):
                call()
            assert time.monotonic() - t0 < 10.0  # not a hang
    finally:
        c.close()
        m.stop()
    with pytest.raises(MooncakeError, match="closed"):  # the store itself would crash the process
        c.get("test/k")
    assert not c.healthy()


@needs_mooncake
def test_master_process_start_failure_shows_its_log(tmp_path):
    with pytest.raises(MooncakeError, match="no_such_flag"):
        MasterProcess(tmp_path / "bad.log", extra_args=["--no_such_flag=1"])
    with MasterProcess(tmp_path / "m.log") as m:
        check_master(m.address, 1.0)
    with pytest.raises(MooncakeError):
        check_master(m.address, 1.0)  # stopped
    with pytest.raises(MooncakeError, match="every interface"):
        MasterProcess(tmp_path / "any.log", host="0.0.0.0")
