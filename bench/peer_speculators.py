"""Peer baseline: speculators' own EAGLE-3 recipe on eagle3's data, hidden states and vocabulary.

Issue 18, part 0 (CPU half): on the embedded default's data and budget, eagle3's draft must reach a
higher vLLM acceptance length than speculators' default recipe on the same samples, hidden states
and vocabulary mapping. This script makes the comparison without letting speculators near eagle3's
environment: speculators runs from a scratch venv (``--spec-python``), eagle3 with this python.

Three subcommands (``all`` runs them in order for one seed):

``convert``  (this python, eagle3's reader) an experiment's current prepare + extract runs ->
             speculators 0.9.0's offline-training data directory (what its ``prepare_data`` plus
             offline hidden-state generation would have written):

               DATA/                      datasets.Dataset.save_to_disk, format torch, columns
                                          input_ids int64 [T], loss_mask int64 [T], seq_len int:
                                          the prepare run's train split (628 rows) then its eval
                                          split (26 rows), in store order
               DATA/hidden_states/hs_<i>.safetensors
                                          {"hidden_states": [T, 4, H] = aux layers (ascending
                                           vLLM ids) then the final pre-norm state,
                                           "token_ids": [T]} (hs_connectors' FileTransfer layout);
                                          stored bf16 = what speculators' collate casts them to
               DATA/d2t.npy, DATA/t2d.npy  the prepare run's vocabulary mapping (same offset /
                                          boolean-mask convention as speculators' own)
               DATA/convert.json          what was converted, with checks

             speculators splits train/val by ``--train-data-ratio``: it is set so that the train
             part is exactly eagle3's train split and the val part exactly eagle3's eval split.

``train``    (scratch-venv python) speculators' trainer, ``speculators.train.cli.main``, with its
             default recipe; only the budget knobs are set to the embedded default's
             (epochs 2, TTT 3, lr 1e-3, packed rows of 512 tokens) plus the data/vocab/layer
             paths and CPU plumbing. A small launcher patches three CUDA assumptions of
             speculators' Trainer for a CPU run (model/batch ``.to(0)`` -> cpu, autocast device
             "cuda" -> "cpu", torch.accelerator.synchronize -> no-op); nothing numerical.

``export``   (this python) ``python -m eagle3 stage=export workspace=WS export.from=CKPT`` on the
             final epoch's checkpoint: vLLM's acceptance on the prepare run's held-out prompts
             (export.eval_prompts / eval_max_tokens of the embedded default, k=1..5), read back
             from the manifest and printed.

Example (seed 0)::

    PYTHONPATH=/work/main python3 bench/peer_speculators.py all --workspace /work/scratch/ws_spec \
        --data /work/scratch/spec_data --out /work/scratch/spec_runs --seed 0 \
        --spec-python /work/scratch/specvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

EXPERIMENT = "default"

# The embedded default's budget (conf/experiment/embedded_default.yaml), where speculators exposes it.
BUDGET = {"epochs": 2, "ttt_steps": 3, "lr": 1e-3, "total_seq_len": 512}


def _exp_dir(workspace: str) -> Path:
    return Path(workspace) / EXPERIMENT


# --------------------------------------------------------------------------------------- convert
def convert(args) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset, load_from_disk
    from safetensors.torch import load_file, save_file

    import eagle3
    from eagle3.manifest import Manifest

    exp = _exp_dir(args.workspace)
    man = Manifest(exp)
    prep, ext = man.current("prepare"), man.current("extract")
    data = Path(args.data)
    done = data / "convert.json"
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("prepare") == prep.config_hash and info.get("extract") == ext.config_hash:
            print(f"convert: {data} already holds prepare {prep.config_hash[:12]} / extract {ext.config_hash[:12]}")
            return info
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)

    ds = load_from_disk(str(prep.out_dir / "dataset"))
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    checks = {}
    i = 0
    t0 = time.time()
    for split in ("train", "eval"):
        store = eagle3.open_hidden_states(exp, split=split)  # float32 store; fp8 would come dequantised
        assert len(store) == len(ds[split]), (split, len(store), len(ds[split]))
        mism_ids = mism_mask = 0
        for j in range(len(store)):
            item = store[j]
            ids, mask = item["input_ids"], item["loss_mask"]
            ref = ds[split][j]
            mism_ids += int(list(ref["input_ids"]) != ids.tolist())
            mism_mask += int([int(m) for m in ref["loss_mask"]] != mask.long().tolist())
            hs = torch.cat([item["aux_hidden_states"].float(), item["last_hidden_state"].float()[:, None, :]], dim=1)
            save_file({"hidden_states": hs.to(torch.bfloat16).contiguous(), "token_ids": ids.long().contiguous()},
                      str(data / "hidden_states" / f"hs_{i}.safetensors"))
            rows["input_ids"].append(ids.long().tolist())
            rows["loss_mask"].append(mask.long().tolist())
            rows["seq_len"].append(len(ids))
            i += 1
        checks[split] = {"samples": len(store), "tokens": int(store.num_tokens),
                         "trainable_tokens": int(sum(sum(m) for m in rows["loss_mask"][i - len(store):i])),
                         "ids_mismatch_vs_prepare": mism_ids, "mask_mismatch_vs_prepare": mism_mask,
                         "layer_ids": list(store.layer_ids), "last_layer_id": store.last_layer_id,
                         "store_dtype": store.dtype}
    out = Dataset.from_dict(rows)
    out.set_format(type="torch")
    out.save_to_disk(str(data / "dataset_tmp"))
    # speculators reads the dataset with load_from_disk(data_path): the arrow files sit at the top
    for p in (data / "dataset_tmp").iterdir():
        os.replace(p, data / p.name)
    (data / "dataset_tmp").rmdir()

    vocab = load_file(str(prep.out_dir / "vocab.safetensors"))
    d2t, t2d = vocab["d2t"].long(), vocab["t2d"].bool()
    tgt = torch.arange(d2t.numel()) + d2t
    assert int(t2d.sum()) == d2t.numel() and bool(t2d[tgt].all()) and bool((tgt[1:] > tgt[:-1]).all()), \
        "vocab mapping is not speculators' offset/mask convention"
    np.save(data / "d2t.npy", d2t.numpy())
    np.save(data / "t2d.npy", t2d.numpy())
    n_train, n_eval = checks["train"]["samples"], checks["eval"]["samples"]
    info = {"prepare": prep.config_hash, "extract": ext.config_hash, "checks": checks,
            "num_train": n_train, "num_eval": n_eval,
            # int(N * ratio) == n_train: speculators' train part = eagle3's train split, val = eval split
            "train_data_ratio": (n_train + 0.5) / (n_train + n_eval),
            "draft_vocab_size": int(d2t.numel()), "vocab_size": int(t2d.numel()),
            "hidden_states": "bf16 [T, n_aux + 1, H]: aux layers ascending, then the final pre-norm state",
            "seconds": round(time.time() - t0, 1)}
    assert int((n_train + n_eval) * info["train_data_ratio"]) == n_train
    done.write_text(json.dumps(info, indent=1) + "\n")
    print(f"convert: {i} samples -> {data} in {info['seconds']} s; {json.dumps(checks)}")
    return info


# ----------------------------------------------------------------------------------------- train
LAUNCHER = r'''
import os, sys, time, json
import torch
torch.set_num_threads(int(os.environ.get("SPEC_THREADS", "2")))
import speculators.train.trainer as T
# CPU plumbing only: speculators 0.9.0's Trainer moves the model/batches with .to(local_rank) (an int
# = cuda:0) and autocasts on "cuda" when no accelerator is found.
T.get_local_rank = lambda: "cpu"
_init = T.Trainer.__init__
def _cpu_init(self, *a, **k):
    _init(self, *a, **k)
    self.device_type = "cpu"
T.Trainer.__init__ = _cpu_init
if not torch.accelerator.is_available():  # its step timer synchronises the accelerator
    torch.accelerator.synchronize = lambda *a, **k: None
if __name__ == "__main__":  # the dataloader's spawned workers re-import this file
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig
    cfg = TrainConfig.resolve(sys.argv[1:])
    print("RESOLVED", json.dumps(cfg.flatten(), default=str), flush=True)
    t0 = time.time()
    main(cfg)
    print(f"TRAIN_WALL_S {time.time() - t0:.1f}", flush=True)
'''


def train_argv(args, info: dict) -> list:
    data = Path(args.data)
    save = Path(args.out) / args.name / "checkpoints"
    target = [p for p in sorted((Path(args.workspace) / "targets").iterdir()) if (p / "config.json").is_file()][0]
    argv = [
        "--verifier-name-or-path", str(target),
        "--data-path", str(data),
        "--speculator-type", "eagle3",
        # the same vocabulary mapping and aux layers as eagle3's runs
        "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
        "--draft-vocab-size", str(info["draft_vocab_size"]),
        "--target-layer-ids", *[str(x) for x in info["checks"]["train"]["layer_ids"]],
        # train = eagle3's train split, val = eagle3's eval split
        "--train-data-ratio", repr(info["train_data_ratio"]),
        # the embedded default's budget
        "--epochs", str(BUDGET["epochs"]), "--ttt-steps", str(BUDGET["ttt_steps"]),
        "--lr", repr(BUDGET["lr"]), "--total-seq-len", str(BUDGET["total_seq_len"]),
        "--seed", str(args.seed),
        # plumbing: no vLLM endpoint (every sample is cached), 2 cores
        "--on-missing", "raise", "--num-workers", "1", "--prefetch-factor", "4",
        # flex attention has no backward on CPU (torch 2.13); speculators' own alternative for such hardware
        "--draft-attn-impl", "sdpa",
        # its fused (Triton) losses need a GPU; eager computes the same kl_div
        "--loss-implementation", "eager",
        "--save-path", str(save), "--log-dir", str(save.parent / "logs"),
        "--no-resume-from-checkpoint",
    ]
    argv += args.extra
    return argv


def train(args, info: dict) -> dict:
    run = Path(args.out) / args.name
    run.mkdir(parents=True, exist_ok=True)
    argv = train_argv(args, info)
    launcher = run / "launch_speculators.py"
    launcher.write_text(LAUNCHER)
    env = dict(os.environ, SPEC_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH="", TOKENIZERS_PARALLELISM="false")
    cmd = [args.spec_python, str(launcher), *argv]
    (run / "train_cmd.txt").write_text(" ".join(cmd) + "\n")
    print("train:", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(run / "train.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(run))
    wall = time.time() - t0
    if rc != 0:
        tail = (run / "train.log").read_text()[-4000:]
        raise SystemExit(f"speculators training failed (rc {rc}); tail of {run / 'train.log'}:\n{tail}")
    ckpts = run / "checkpoints"
    final = ckpts / str(BUDGET["epochs"] - 1)
    steps = None
    for line in (run / "train.log").read_text().splitlines():
        if '"global_step"' in line:
            try:
                steps = json.loads(line[line.index("{"):]).get("global_step", steps)
            except Exception:
                pass
    res = {"name": args.name, "seed": args.seed, "train_wall_s": round(wall, 1), "checkpoint": str(final),
           "last_logged_global_step": steps, "argv": argv}
    (run / "train_result.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"train: {args.name} done in {wall:.0f} s -> {final}", flush=True)
    return res


# ---------------------------------------------------------------------------------------- export
def export(args, ckpt: str) -> dict:
    from eagle3.manifest import Manifest

    cmd = [sys.executable, "-m", "eagle3", "stage=export", f"workspace={args.workspace}", f"export.from={ckpt}"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    run = Path(args.out) / args.name
    run.mkdir(parents=True, exist_ok=True)
    print("export:", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(run / "export.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             cwd=str(Path(__file__).resolve().parents[1]))
    if rc != 0:
        raise SystemExit(f"eagle3 export failed (rc {rc}); tail:\n{(run / 'export.log').read_text()[-4000:]}")
    man = Manifest(_exp_dir(args.workspace))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("convert", "train", "export", "all"))
    ap.add_argument("--workspace", default="/work/scratch/ws_spec",
                    help="an eagle3 workspace whose embedded-default prepare and extract runs are complete (a copy: exports are recorded there)")
    ap.add_argument("--data", default="/work/scratch/spec_data", help="where the converted speculators data go")
    ap.add_argument("--out", default="/work/scratch/spec_runs", help="one directory per speculators run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="run name (default: spec_default_s<seed>)")
    ap.add_argument("--spec-python", default="/work/scratch/specvenv/bin/python",
                    help="python of a scratch venv with speculators 0.9.0 (bench/peer_speculators.md: how it was made)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt", default=None, help="export: checkpoint dir (default: the run's final epoch)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = ap.parse_args(argv)
    args.extra = extra  # speculators flags after --, e.g. -- --optimizer adamw
    args.name = args.name or f"spec_default_s{args.seed}"
    if args.cmd in ("convert", "all", "train"):
        info = convert(args)
    if args.cmd in ("train", "all"):
        res = train(args, info)
    if args.cmd in ("export", "all"):
        ckpt = args.ckpt or (res["checkpoint"] if args.cmd == "all"
                             else str(Path(args.out) / args.name / "checkpoints" / str(BUDGET["epochs"] - 1)))
        export(args, ckpt)


if __name__ == "__main__":
    main()
