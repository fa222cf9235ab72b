"""Peer baseline: speculators 0.9.0's own EAGLE-3 recipe, trained by its own trainer (in a python of
its own: --spec-python, --spec-path) on eagle3's samples, hidden states and vocabulary, exported and
served like eagle3's draft.

Subcommands: convert (an experiment's prepare + extract runs -> speculators' offline data), train,
export, all (the three for one seed), row (an arm's results.jsonl row after the offline evaluator),
table (prints a results.jsonl). The data layout, the budget, the CPU plumbing and resuming:
bench/peers/README.md. Results: bench/results/peer_speculators_cpu_202611.md, draft31_h200_202611.md.

    python3 bench/peers/peer_speculators.py all --workspace WS --data DATA --out RUNS --seed 0 --spec-python PY
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _exp_dir(args) -> Path:
    return Path(args.workspace) / args.experiment


def budget(experiment: str) -> dict:
    """The experiment's training budget from eagle3's composed config, in speculators' terms."""
    from eagle3.__main__ import compose_config

    t = compose_config([] if experiment == "default" else [f"experiment={experiment}"]).train
    if t.max_steps:
        raise SystemExit(f"experiment {experiment} sets train.max_steps={t.max_steps}; only epochs are mapped")
    # speculators packs one row of --total-seq-len tokens per optimizer step; eagle3 takes
    # batch_size rows of max_seq_len packed tokens, grad_accum times, per step
    return {"epochs": int(t.epochs), "ttt_steps": int(t.ttt_steps), "lr": float(t.lr),
            "total_seq_len": int(t.batch_size * t.max_seq_len * t.grad_accum)}


def _budget(args) -> dict:
    bud = budget(args.experiment)
    if args.epochs:  # smoke tests only
        bud["epochs"] = args.epochs
    return bud


# --------------------------------------------------------------------------------------- convert
def _convert_range(exp_dir: str, split: str, lo: int, hi: int, first: int, hs_dir: str) -> list:
    """Samples lo..hi-1 of ``split`` -> hs_<first + j - lo>.safetensors; their (ids, mask) arrays."""
    import torch
    from safetensors.torch import save_file

    import eagle3

    torch.set_num_threads(1)  # one process per core; threads only contend
    store = eagle3.open_hidden_states(exp_dir, split=split)  # fp8 comes dequantised
    out = []
    for j in range(lo, hi):
        item = store[j]
        aux, last, ids = item["aux_hidden_states"], item["last_hidden_state"], item["input_ids"].long()
        hs = torch.empty(aux.shape[0], aux.shape[1] + 1, aux.shape[2], dtype=torch.bfloat16)
        hs[:, :-1].copy_(aux)  # the cast rounds as .to(torch.bfloat16) does
        hs[:, -1].copy_(last)
        save_file({"hidden_states": hs, "token_ids": ids.contiguous()},
                  os.path.join(hs_dir, f"hs_{first + j - lo}.safetensors"))
        out.append((ids.numpy(), item["loss_mask"].to(torch.int64).numpy()))
    return out


def save_dataset(data: Path, rows: dict) -> None:
    """``rows`` (lists input_ids, loss_mask, seq_len) -> DATA's arrow files, format torch, at DATA's top
    (speculators reads them with load_from_disk(data_path), beside DATA/hidden_states)."""
    from datasets import Dataset

    out = Dataset.from_dict(rows)
    out.set_format(type="torch")
    out.save_to_disk(str(data / "dataset_tmp"))
    for p in (data / "dataset_tmp").iterdir():
        os.replace(p, data / p.name)
    (data / "dataset_tmp").rmdir()


def save_vocab(data: Path, d2t, t2d) -> None:
    """DATA/d2t.npy (int64 offsets) and DATA/t2d.npy (bool mask), checked against speculators' convention."""
    import numpy as np
    import torch

    d2t, t2d = d2t.long(), t2d.bool()
    tgt = torch.arange(d2t.numel()) + d2t
    assert int(t2d.sum()) == d2t.numel() and bool(t2d[tgt].all()) and bool((tgt[1:] > tgt[:-1]).all()), \
        "vocab mapping is not speculators' offset/mask convention"
    np.save(data / "d2t.npy", d2t.numpy())
    np.save(data / "t2d.npy", t2d.numpy())


def convert(args) -> dict:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from datasets import load_from_disk
    from safetensors.torch import load_file

    import eagle3
    from eagle3.manifest import Manifest

    exp = _exp_dir(args)
    man = Manifest(exp)
    prep, ext = man.current("prepare"), man.current("extract")
    data = Path(args.data)
    done = data / "convert.json"
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("prepare") == prep.config_hash and info.get("extract") == ext.config_hash:
            print(f"convert: {data} already holds prepare {prep.config_hash[:12]} / extract {ext.config_hash[:12]}")
            return info
    shutil.rmtree(data, ignore_errors=True)  # a stale or half-written conversion
    (data / "hidden_states").mkdir(parents=True)

    ds = load_from_disk(str(prep.out_dir / "dataset"))
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    checks = {}
    t0 = time.time()
    first = 0
    workers = max(1, args.workers)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for split in ("train", "eval"):
            store = eagle3.open_hidden_states(exp, split=split)
            n = len(store)
            assert n == len(ds[split]), (split, n, len(ds[split]))
            chunk = max(1, -(-n // (workers * 4)))
            futs = [pool.submit(_convert_range, str(exp), split, lo, min(n, lo + chunk), first + lo,
                                str(data / "hidden_states")) for lo in range(0, n, chunk)]
            got = [pair for f in futs for pair in f.result()]
            ref_ids, ref_mask = ds[split]["input_ids"], ds[split]["loss_mask"]
            mism_ids = sum(int(list(r) != ids.tolist()) for r, (ids, _) in zip(ref_ids, got))
            mism_mask = sum(int([int(m) for m in r] != mask.tolist()) for r, (_, mask) in zip(ref_mask, got))
            for ids, mask in got:
                rows["input_ids"].append(ids.tolist())
                rows["loss_mask"].append(mask.tolist())
                rows["seq_len"].append(len(ids))
            checks[split] = {"samples": n, "tokens": int(store.num_tokens),
                             "trainable_tokens": int(sum(int(m.sum()) for _, m in got)),
                             "ids_mismatch_vs_prepare": mism_ids, "mask_mismatch_vs_prepare": mism_mask,
                             "layer_ids": list(store.layer_ids), "last_layer_id": store.last_layer_id,
                             "store_dtype": store.dtype}
            first += n
            print(f"convert: {split} {n} samples, {store.num_tokens} tokens at {time.time() - t0:.1f} s", flush=True)
    assert all(c["ids_mismatch_vs_prepare"] == 0 and c["mask_mismatch_vs_prepare"] == 0 for c in checks.values()), checks
    save_dataset(data, rows)

    vocab = load_file(str(prep.out_dir / "vocab.safetensors"))
    d2t, t2d = vocab["d2t"].long(), vocab["t2d"].bool()
    save_vocab(data, d2t, t2d)
    n_train, n_eval = checks["train"]["samples"], checks["eval"]["samples"]
    info = {"prepare": prep.config_hash, "extract": ext.config_hash, "checks": checks,
            "num_train": n_train, "num_eval": n_eval,
            # int(N * ratio) == n_train: speculators' train part = eagle3's train split, val = eval split
            "train_data_ratio": (n_train + 0.5) / (n_train + n_eval),
            "draft_vocab_size": int(d2t.numel()), "vocab_size": int(t2d.numel()),
            "hidden_states": "bf16 [T, n_aux + 1, H]: aux layers ascending, then the final pre-norm state",
            "workers": workers, "seconds": round(time.time() - t0, 1)}
    assert int((n_train + n_eval) * info["train_data_ratio"]) == n_train
    done.write_text(json.dumps(info, indent=1) + "\n")
    print(f"convert: {first} samples -> {data} in {info['seconds']} s ({workers} workers); {json.dumps(checks)}")
    return info


# ----------------------------------------------------------------------------------------- train
LAUNCHER = r'''
import json, logging, os, sys, time
import torch
if os.environ.get("SPEC_DEVICE") == "cpu":
    torch.set_num_threads(int(os.environ.get("SPEC_THREADS", "2")))
    import speculators.train.trainer as T
    # CPU plumbing only: speculators 0.9.0's Trainer moves the model/batches with .to(local_rank)
    # (an int = cuda:0) and autocasts on "cuda" when no accelerator is found.
    T.get_local_rank = lambda: "cpu"
    _init = T.Trainer.__init__
    def _cpu_init(self, *a, **k):
        _init(self, *a, **k)
        self.device_type = "cpu"
    T.Trainer.__init__ = _cpu_init
    if not torch.accelerator.is_available():  # its step timer synchronises the accelerator
        torch.accelerator.synchronize = lambda *a, **k: None
    import speculators.train.checkpointer as K
    K.get_current_device = lambda: "cpu"  # a resume loads checkpoints onto "cuda:0" without an accelerator
import speculators.train.cli as C

class _Jsonl(logging.Handler):
    """speculators' metric records (dicts on logger speculators.metrics) as JSON lines."""
    def __init__(self, path):
        super().__init__()
        self.f = open(path, "a", buffering=1)
    def emit(self, record):
        if isinstance(record.msg, dict):
            rec = dict(record.msg, time=round(record.created, 3))
            if getattr(record, "hparams", False):
                rec = {"hparams": rec}
            self.f.write(json.dumps(rec, default=str) + "\n")

_setup = C.setup_metric_logger
def _setup_metric_logger(*a, **k):
    _setup(*a, **k)
    logging.getLogger("speculators.metrics").addHandler(_Jsonl(os.environ["SPEC_METRICS"]))
C.setup_metric_logger = _setup_metric_logger

if __name__ == "__main__":  # the dataloader's spawned workers re-import this file
    from speculators.train.config import TrainConfig
    cfg = TrainConfig.resolve(sys.argv[1:])
    print("RESOLVED", json.dumps(cfg.flatten(), default=str), flush=True)
    t0 = time.time()
    C.main(cfg)
    print(f"TRAIN_WALL_S {time.time() - t0:.1f}", flush=True)
'''

def _target_dir(args) -> Path:
    if args.target:
        return Path(args.target)
    found = [p for p in sorted((Path(args.workspace) / "targets").iterdir()) if (p / "config.json").is_file()]
    if len(found) != 1:
        raise SystemExit(f"{args.workspace}/targets holds {len(found)} converted targets; pass --target DIR")
    return found[0]


def _impl_args(args) -> list:
    """Device plumbing flags (attention, loss, dataloader workers); [] = speculators' defaults."""
    out = []
    cpu = args.device == "cpu"
    attn = args.attn or ("sdpa" if cpu else None)
    loss = args.loss or ("eager" if cpu else None)
    workers = args.num_workers if args.num_workers is not None else (1 if args.device == "cpu" else None)
    if attn:
        out += ["--draft-attn-impl", attn]
    if loss:
        out += ["--loss-implementation", loss]
    if workers is not None:
        out += ["--num-workers", str(workers)]
    return out


def train_argv(args, info: dict, bud: dict, impl: list) -> list:
    data = Path(args.data)
    save = Path(args.out) / args.name / "checkpoints"
    argv = [
        "--verifier-name-or-path", str(_target_dir(args)),
        "--data-path", str(data),
        "--speculator-type", "eagle3",
        # the same vocabulary mapping and aux layers as eagle3's runs
        "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
        "--draft-vocab-size", str(info["draft_vocab_size"]),
        "--target-layer-ids", *[str(x) for x in info["checks"]["train"]["layer_ids"]],
        # train = eagle3's train split, val = eagle3's eval split
        "--train-data-ratio", repr(info["train_data_ratio"]),
        # the experiment's budget
        "--epochs", str(bud["epochs"]), "--ttt-steps", str(bud["ttt_steps"]),
        "--lr", repr(bud["lr"]), "--total-seq-len", str(bud["total_seq_len"]),
        "--seed", str(args.seed),
        # no vLLM endpoint: every sample is cached
        "--on-missing", "raise",
        *impl,
        "--save-path", str(save), "--log-dir", str(save.parent / "logs"),
    ]
    if not args.resume:
        argv.append("--no-resume-from-checkpoint")
    return argv + args.extra


def _epoch_state(d: Path):
    try:
        return json.loads((d / "training_state.json").read_text())
    except (OSError, ValueError):
        return None


def _prune_incomplete(ckpts: Path) -> None:
    """Before a resume: drop what a stop may have left half-written. speculators writes an epoch's
    training_state.json last, so a numbered dir without a readable one is incomplete; its
    "interrupted" save (SIGTERM) is not resumable and dangling symlinks point at nothing."""
    if not ckpts.is_dir():
        return
    for d in ckpts.iterdir():
        if d.is_symlink() and not d.exists():
            d.unlink()
        elif d.is_dir() and not d.is_symlink() and (d.name == "interrupted" or (d.name.isdigit() and _epoch_state(d) is None)):
            print(f"train: removing incomplete checkpoint {d}", flush=True)
            shutil.rmtree(d)


def _last_epoch(ckpts: Path) -> int:
    nums = [int(d.name) for d in ckpts.iterdir() if d.name.isdigit() and not d.is_symlink()] if ckpts.is_dir() else []
    return max(nums, default=-1)


def _complete(ckpts: Path, epochs: int) -> bool:
    st = _epoch_state(ckpts / str(epochs - 1))
    return bool(st) and st.get("epoch") == epochs - 1 and st.get("local_step", 0) == 0


def _launch(args, run: Path, argv: list, launches: int) -> tuple:
    """One trainer process; (rc, stopped_for_deadline, wall seconds)."""
    launcher = run / "launch_speculators.py"
    launcher.write_text(LAUNCHER)
    env = dict(os.environ, SPEC_DEVICE=args.device, SPEC_THREADS=str(args.threads),
               SPEC_METRICS=str(run / "metrics.jsonl"), PYTHONPATH=args.spec_path,
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [args.spec_python, str(launcher), *argv]
    with open(run / "train_cmd.txt", "a") as f:
        f.write(f"# launch {launches} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n" + " ".join(cmd) + "\n")
    print("train:", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(run / "train.log", "a") as log:
        log.write(f"\n===== launch {launches} =====\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(run),
                                start_new_session=True)
        stopped = False
        try:
            proc.wait(timeout=None if args.deadline is None else max(1.0, args.deadline - args.grace - time.time()))
        except subprocess.TimeoutExpired:
            stopped = True
            print(f"train: deadline near, stopping {args.name} (SIGTERM)", flush=True)
            proc.send_signal(signal.SIGTERM)  # speculators' handler unwinds the step (and saves "interrupted")
            try:
                proc.wait(timeout=max(5, args.grace - 5))
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None or stopped:  # the trainer and its dataloader workers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode, stopped, time.time() - t0


def metric_records(run: Path) -> list:
    """The records of the run's metrics.jsonl (the launcher's copy of speculators' metric log), in
    order; a torn last line (a killed trainer) is skipped."""
    p = run / "metrics.jsonl"
    recs = []
    for line in p.read_text().splitlines() if p.exists() else ():
        try:
            recs.append(json.loads(line))
        except ValueError:
            continue
    return recs


def _read_metrics(run: Path) -> dict:
    """The last train step and the last validation record of metrics.jsonl."""
    last_step, last_val = None, None
    for r in metric_records(run):
        if "val" in r:
            last_val = r
        elif "global_step" in r:
            last_step = r
    return {"last_step": last_step, "last_val": last_val}


def train(args, info: dict) -> dict:
    bud = _budget(args)
    run = Path(args.out) / args.name
    ckpts = run / "checkpoints"
    result_path = run / "train_result.json"
    if args.resume and result_path.exists():
        res = json.loads(result_path.read_text())
        if res.get("complete") and _complete(ckpts, bud["epochs"]):
            print(f"train: {args.name} complete before ({res['checkpoint']})", flush=True)
            return res
    if not args.resume:  # a fresh run: nothing of an earlier one may count
        shutil.rmtree(ckpts, ignore_errors=True)
        for name in ("train.log", "metrics.jsonl", "train_cmd.txt", "impl.json", "train_result.json"):
            (run / name).unlink(missing_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    impl_path = run / "impl.json"
    state = json.loads(impl_path.read_text()) if (args.resume and impl_path.exists()) else {}
    launches, wall = state.get("launches", 0), state.get("wall_s", 0.0)
    if args.resume:
        _prune_incomplete(ckpts)
    # resume with what the checkpoints were trained with; nothing to resume: this call's options
    impl = state["impl"] if state and _last_epoch(ckpts) >= 0 else _impl_args(args)
    while True:
        if args.deadline is not None and args.deadline - time.time() < args.min_start_s:
            print(f"train: under {args.min_start_s} s left: not starting {args.name}", flush=True)
            raise SystemExit(124)
        if args.resume:
            _prune_incomplete(ckpts)
        launches += 1
        impl_path.write_text(json.dumps({"impl": impl, "launches": launches, "wall_s": wall}) + "\n")
        rc, stopped, dt = _launch(args, run, train_argv(args, info, bud, impl), launches)
        wall += dt
        impl_path.write_text(json.dumps({"impl": impl, "launches": launches, "wall_s": round(wall, 1)}) + "\n")
        if _complete(ckpts, bud["epochs"]) and (rc == 0 or stopped):
            break  # (stopped during the last validation pass: the final checkpoint is whole)
        if stopped:
            print(f"train: {args.name} stopped at epoch checkpoint {_last_epoch(ckpts)} after {dt:.0f} s; "
                  f"run again to resume", flush=True)
            raise SystemExit(124)
        tail = (run / "train.log").read_text()[-4000:]
        raise SystemExit(f"speculators training failed (rc {rc}); tail of {run / 'train.log'}:\n{tail}")
    final = ckpts / str(bud["epochs"] - 1)
    m = _read_metrics(run)
    res = {"name": args.name, "seed": args.seed, "complete": True, "device": args.device,
           "train_wall_s": round(wall, 1), "launches": launches, "impl": impl,
           "checkpoint": str(final), "global_step": (_epoch_state(final) or {}).get("global_step"),
           "budget": bud, "val": (m["last_val"] or {}).get("val"), "val_epoch": (m["last_val"] or {}).get("epoch"),
           "argv": train_argv(args, info, bud, impl)}
    result_path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"train: {args.name} done in {wall:.0f} s ({launches} launch(es), {res['global_step']} steps) -> {final}",
          flush=True)
    return res


# ---------------------------------------------------------------------------------------- export
def export(args, ckpt: str) -> dict:
    from eagle3.manifest import Manifest

    cmd = [sys.executable, "-m", "eagle3", "stage=export", f"workspace={args.workspace}", f"export.from={ckpt}"]
    if args.experiment != "default":
        cmd.append(f"experiment={args.experiment}")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = Path(args.out) / args.name
    run.mkdir(parents=True, exist_ok=True)
    print("export:", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(run / "export.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    if rc != 0:
        raise SystemExit(f"eagle3 export failed (rc {rc}); tail:\n{(run / 'export.log').read_text()[-4000:]}")
    man = Manifest(_exp_dir(args))
    rec = man.current("export")
    f = rec.facts
    res = {"name": args.name, "seed": args.seed, "export_run": rec.config_hash, "from": ckpt,
           "acceptance_by_k": f.acceptance_by_k, "acceptance_k3": f.acceptance_by_k.get("3"),
           "acceptance_per_position": f.acceptance_per_position, "num_prompts": f.num_prompts,
           "max_tokens": f.max_tokens, "lossless": f.lossless, "source": f.source,
           "export_wall_s": round(time.time() - t0, 1)}
    (run / "export_result.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"RESULT {args.name} seed {args.seed}: vLLM acceptance k=3 {res['acceptance_k3']} "
          f"(by k {f.acceptance_by_k}) on {f.num_prompts} prompts x {f.max_tokens} tokens; "
          f"export run {rec.config_hash[:12]}", flush=True)
    return res


# ------------------------------------------------------------------------------------- row, table
def served(exp_dir) -> dict:
    """The current export run's served figures (``export.verify`` in vLLM), for a results row: vLLM's
    acceptance at k = 1..5, the lossless check and its near-ties, prompt lookup, the offline evaluator
    at k beside it, the per-domain figures and how they were counted."""
    from eagle3.manifest import Manifest

    rec = Manifest(exp_dir).current("export")
    f = rec.facts
    if f.acceptance_by_k is None:
        raise SystemExit(f"the current export run {rec.config_hash[:12]} was not verified in vLLM (export.verify=false)")
    return {"export_run": rec.config_hash[:12], "served_by_k": f.acceptance_by_k,
            "served_tokens_per_step_by_k": f.tokens_per_step_by_k, "served_k": f.k,
            "served_per_position": f.acceptance_per_position, "lossless": f.lossless,
            "near_ties": getattr(f, "near_ties", None), "tie_margin": getattr(f, "tie_margin", None),
            "prompt_lookup_tokens_per_step": (f.ngram or {}).get("tokens_per_step"), "lookup_gain": f.lookup_gain,
            "offline_at_k": (f.offline or {}).get("acceptance_length"), "offline_vs_vllm": f.offline_vs_vllm,
            "hf_greedy_equals_vllm_greedy": f.hf_greedy_equals_vllm_greedy, "vllm_version": f.vllm_version,
            "by_domain": getattr(f, "by_domain", None), "domain_counting": getattr(f, "domain_counting", None)}


def row(args) -> dict:
    """The results.jsonl row of an arm whose checkpoint the offline evaluator just scored."""
    from eagle3.manifest import Manifest

    run = Path(args.out) / args.name
    tr = json.loads((run / "train_result.json").read_text())
    ev = Manifest(_exp_dir(args)).current("eval")
    src = ev.facts.source or {}
    if Path(str(src.get("path", ""))).resolve() != Path(tr["checkpoint"]).resolve():
        raise SystemExit(f"the current eval run {ev.config_hash[:12]} scored {src.get('path')}, not {tr['checkpoint']}")
    val = tr.get("val") or {}
    S = tr["budget"]["ttt_steps"]
    per = lambda key: [val.get(f"{key}_{j}_epoch") for j in range(S)]  # noqa: E731
    r = {"arm": args.arm, "train_run": f"speculators 0.9.0: {run}", "eval_run": ev.config_hash[:12],
         # speculators' own held-out metrics of the last epoch (its definitions: full_acc_j = steps
         # 0..j all right, cond_acc_j = step j right given 0..j-1 right), not eagle3's StepMetrics
         "train_eval": {"full_acc_per_step": per("full_acc"), "cond_acc_per_step": per("cond_acc"),
                        "loss_per_step": per("loss"), "loss": val.get("loss_epoch")},
         "steps": tr.get("global_step"), "train_wall_s": tr.get("train_wall_s"), "launches": tr.get("launches"),
         "impl": tr.get("impl"),
         "acceptance_by_k": ev.facts.acceptance_by_k, "acceptance_per_position": ev.facts.acceptance_per_position,
         "num_prompts": ev.facts.num_prompts, "max_tokens": ev.facts.max_tokens}
    if args.served:
        r.update(served(_exp_dir(args)))
    print(json.dumps(r))
    with open(args.results, "a") as f:
        f.write(json.dumps(r) + "\n")
    return r


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ks = sorted({k for r in rows for k in r["acceptance_by_k"]}, key=int)
    print("\n| arm | " + " | ".join(f"k={k}" for k in ks) + " | held-out acc per TTT step | steps |")
    print("| --- | " + " | ".join("---" for _ in ks) + " | --- | --- |")
    for r in rows:
        te = r.get("train_eval") or {}
        acc = te.get("acc_per_step") or []
        kind = ""
        if not acc and te.get("full_acc_per_step"):
            acc, kind = te["full_acc_per_step"], "full-chain: "
        cell = kind + " ".join(f"{a:.3f}" for a in acc if a is not None)
        print(f"| {r['arm']} | " + " | ".join(f"{r['acceptance_by_k'].get(k, float('nan')):.4f}" for k in ks)
              + f" | {cell} | {r.get('steps')} |")
    groups = {}
    for r in rows:
        groups.setdefault(r["arm"].split(":")[0], []).append(r)
    for g, rs in groups.items():
        k5 = [r["acceptance_by_k"]["5"] for r in rs if "5" in r["acceptance_by_k"]]
        print(f"{g}: mean over {len(rs)} seeds " + ", ".join(
            f"k={k} {sum(r['acceptance_by_k'][k] for r in rs) / len(rs):.4f}" for k in ks
            if all(k in r["acceptance_by_k"] for r in rs))
            + (f"; spread at k=5 {max(k5) - min(k5):.4f}" if len(k5) > 1 else ""))
    sv = [r for r in rows if r.get("served_by_k")]
    if sv:
        print("\nServed by vLLM (export.verify; the same prompts), beside the offline evaluator above:")
        print("| arm | " + " | ".join(f"vLLM k={k}" for k in ks) + " | offline at k (export) | relative difference | lossless "
              "(near-ties) | prompt lookup tokens/step | draft tokens/step | vLLM |")
        print("| --- | " + " | ".join("---" for _ in ks) + " | --- | --- | --- | --- | --- | --- |")
        for r in sv:
            nt = r.get("near_ties") or {}
            n_ties = sum(len(v) for v in nt.values())  # engine -> its near-tie divergences
            k = str(r.get("served_k"))
            print(f"| {r['arm']} | " + " | ".join(f"{r['served_by_k'].get(k_, float('nan')):.4f}" for k_ in ks)
                  + f" | {r.get('offline_at_k')} | {r.get('offline_vs_vllm')} | {r.get('lossless')} ({n_ties}) | "
                  f"{r.get('prompt_lookup_tokens_per_step')} | {(r.get('served_tokens_per_step_by_k') or {}).get(k)} | "
                  f"{r.get('vllm_version')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("convert", "train", "export", "all", "row", "table"))
    ap.add_argument("--workspace", default="/work/scratch/ws_spec",
                    help="an eagle3 workspace whose prepare and extract runs of --experiment are complete (a copy: "
                         "exports are recorded there)")
    ap.add_argument("--experiment", default="default",
                    help="experiment dir under the workspace; its budget comes from eagle3's config of that name "
                         "(default = the embedded default)")
    ap.add_argument("--data", default="/work/scratch/spec_data", help="where the converted speculators data go")
    ap.add_argument("--out", default="/work/scratch/spec_runs", help="one directory per speculators run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="run name (default: spec_default_s<seed>)")
    ap.add_argument("--target", default=None, help="the target's HF dir (default: the one under WORKSPACE/targets)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where speculators trains (auto: cuda when this python sees one)")
    ap.add_argument("--spec-python", default=None,
                    help="python that runs speculators (default: /work/scratch/specvenv/bin/python on cpu, this "
                         "python on cuda; bench/results/peer_speculators_cpu_202611.md: how the venv was made)")
    ap.add_argument("--spec-path", default="",
                    help="PYTHONPATH of the trainer (e.g. /tmp/specsite:/tmp/site on the GPU machine)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of a CPU run")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="convert: processes")
    ap.add_argument("--attn", default=None, help="--draft-attn-impl (default: sdpa on cpu, speculators' on cuda)")
    ap.add_argument("--loss", default=None, help="--loss-implementation (default: eager on cpu, speculators' on cuda)")
    ap.add_argument("--num-workers", type=int, default=None,
                    help="dataloader workers (default: 1 on cpu, speculators' 12 on cuda)")
    ap.add_argument("--resume", action="store_true",
                    help="resume the run's checkpoints (and skip a complete run) instead of starting fresh")
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds: stop the trainer before it (exit 124, resumable with --resume)")
    ap.add_argument("--grace", type=float, default=25.0, help="seconds before --deadline to stop the trainer")
    ap.add_argument("--min-start-s", type=float, default=60.0, help="do not launch with less time than this left")
    ap.add_argument("--epochs", type=int, default=None, help="override the budget's epochs (smoke tests only)")
    ap.add_argument("--ckpt", default=None, help="export: checkpoint dir (default: the run's final epoch)")
    ap.add_argument("--arm", default=None, help="row: the arm's name in results.jsonl (e.g. spec:0)")
    ap.add_argument("--results", default=None, help="row, table: the results.jsonl")
    ap.add_argument("--served", action="store_true", help="row: add the current export run's served figures")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = ap.parse_args(argv)
    args.extra = extra  # speculators flags after --, e.g. -- --optimizer adamw
    args.name = args.name or f"spec_default_s{args.seed}"
    if args.cmd == "table":
        return table(args.results)
    if args.cmd == "row":
        return row(args)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.spec_python is None:
        args.spec_python = "/work/scratch/specvenv/bin/python" if args.device == "cpu" else sys.executable
    if args.cmd in ("convert", "all", "train"):
        info = convert(args)
    if args.cmd in ("train", "all"):
        res = train(args, info)
    if args.cmd in ("export", "all"):
        ckpt = args.ckpt or (res["checkpoint"] if args.cmd == "all"
                             else str(Path(args.out) / args.name / "checkpoints" / str(_budget(args)["epochs"] - 1)))
        export(args, ckpt)


if __name__ == "__main__":
    main()
