"""The train stage's loop on several GPUs: DDP and FSDP2 through `accelerate launch`.

Runs eagle3.train.loop.train (the loop `python -m eagle3 stage=train` runs) on an in-memory store
of random samples, launched as a user would launch it:

    one   python3 <worker>                                  (one process, GPU 0)
    ddp   accelerate launch --multi_gpu --num_processes N <worker>
    fsdp  accelerate launch --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy NO_WRAP
                            --fsdp_reshard_after_forward true --num_processes N <worker>

Two parts, each printed as a table:
  check  small shape, float32, no compile: every mode trains the same global batch (one process
         batch N, N processes batch 1) for --check-steps steps with a checkpoint half way; the
         losses, grad norms and final draft weights must equal the one-process run's. Then each
         distributed run's last checkpoint and draft are deleted and the run launched again: it
         resumes from the half-way checkpoint and must end with the same draft.
  speed  the bench shape (bench/train.py's, default Llama-3.1-8B-shaped), bf16, compiled:
         tokens/s of all GPUs together, per GPU, scaling against one GPU, peak memory per GPU.

    python3 bench/train_dist.py                     # both parts, 2 GPUs, ddp and fsdp
    python3 bench/train_dist.py --parts check --modes fsdp
    python3 bench/train_dist.py --cpu --parts check --modes ddp --gpus 2   # gloo smoke test, no GPU

A mode may carry options: ``ddp+muon`` trains with train.optimizer=muon (FastMuon, its Newton-Schulz
split over the processes, train.muon_shard), ``ddp+muon+noshard`` with every process computing all
of it (train.muon_shard=false); ``one+muon`` is the one-process Muon run the Muon rows scale against.

    python3 bench/train_dist.py --parts speed --modes ddp+muon,ddp+muon+noshard --gpus 8
    python3 bench/train_dist.py --cpu --parts check --modes ddp+muon --gpus 8   # 8 gloo processes

Raw numbers go to $OUT/bench_train_dist.json when OUT is set. Measurements: bench/results/train_h200_202611.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import train as bench  # noqa: E402  (bench/train.py: shapes, in-memory store, loop config)

from eagle3.launch import launch as where  # noqa: E402  (this process in the launch)

SMALL = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=688, vocab=4096, draft_vocab=1024,
             n_aux=3, ttt=3, seq=256, batch=1)


def worker(spec: dict) -> None:
    """One process of a run (started by the driver, directly or through accelerate launch)."""
    from eagle3.train.loop import train

    world = where().world_size
    if world != spec["world"]:
        raise RuntimeError(f"the launcher started a world of {world} processes, {spec['world']} expected")
    a = argparse.Namespace(**spec["shape"], loop_steps=spec["train"].get("max_steps", 30))
    dtype = getattr(torch, spec["dtype"])
    inputs = bench.loop_inputs(a, dtype)
    tcfg = bench.loop_config(a, spec["train"].pop("compile", "auto"), **spec["train"])
    t0 = time.time()
    train(tcfg, inputs, Path(spec["out"]), progress=False)
    if where().is_main:
        Path(spec["out"], "wall_s").write_text(f"{time.time() - t0:.1f}")


def launch(mode: str, n: int, spec: dict, cpu: bool, port: int, log: Path) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(dict(spec, world=n))]
    if mode != "one":
        acc = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
               "--main_process_port", str(port), "--dynamo_backend", "no", "--mixed_precision", "no"]
        if mode == "ddp":  # with ACCELERATE_USE_CPU (--cpu below): gloo processes
            acc += ["--multi_gpu"]  # (`accelerate launch --cpu` alone would start one process)
        elif mode == "fsdp":
            acc += ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "NO_WRAP",
                    "--fsdp_reshard_after_forward", "true", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"]
        cmd = acc + cmd[1:]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cpu:
        env.update(ACCELERATE_USE_CPU="1", CUDA_VISIBLE_DEVICES="")
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{mode} run failed (exit {r.returncode}); end of {log}:\n{tail}")


def parse_mode(mode: str) -> tuple[str, dict]:
    """'ddp+muon+noshard' -> ('ddp', the train overrides of its options)."""
    base, *opts = mode.split("+")
    if base not in ("one", "ddp", "fsdp") or not set(opts) <= {"muon", "noshard"} or ("noshard" in opts) > ("muon" in opts):
        raise SystemExit(f"bench/train_dist.py: unknown mode {mode!r}: one, ddp or fsdp, with +muon[+noshard]")
    over = {}
    if "muon" in opts:
        over = dict(optimizer="muon", muon_impl="fast", muon_shard="noshard" not in opts)
    return base, over


def records(out: Path) -> list:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "train/loss" in x]


def max_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def draft_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a / "draft.safetensors")), load_file(str(b / "draft.safetensors"))
    assert x.keys() == y.keys(), (sorted(x), sorted(y))
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x if x[k].is_floating_point())


def check(args, root: Path, log: Path) -> list:
    n, steps = args.gpus, args.check_steps
    shape = dict(SMALL)
    base = dict(max_steps=steps, save_every=steps // 2, keep_last=2, log_every=1, lr=1e-3, warmup_steps=1,
                mixed_precision="no", compile="false", num_workers=0)
    rows, port = [], 29611
    ref = root / "check-one"
    launch("one", 1, dict(shape=dict(shape, batch=n), train=dict(base, batch_size=n), dtype="float32",
                          out=str(ref)), args.cpu, port, log)
    ref_recs = records(ref)
    rows.append({"mode": "one", "processes": 1, "batch_per_process": n, "steps": len(ref_recs),
                 "loss_first_last": [ref_recs[0]["train/loss"], ref_recs[-1]["train/loss"]]})
    for mode in args.modes.split(","):
        kind, over = parse_mode(mode)
        if over:  # the one-process reference with the same optimizer
            ref = root / f"check-one-{mode}"
            port += 1
            launch("one", 1, dict(shape=dict(shape, batch=n), train=dict(base, batch_size=n, **over), dtype="float32",
                                  out=str(ref)), args.cpu, port, log)
            ref_recs = records(ref)
        else:
            ref, ref_recs = root / "check-one", records(root / "check-one")
        out = root / f"check-{mode}"
        spec = dict(shape=shape, train=dict(base, batch_size=1, **over), dtype="float32", out=str(out))
        port += 1
        launch(kind, n, spec, args.cpu, port, log)
        recs = records(out)
        row = {"mode": mode, "processes": n, "batch_per_process": 1, "steps": len(recs),
               "loss_rel_diff": max_rel([r["train/loss"] for r in recs], [r["train/loss"] for r in ref_recs]),
               "grad_norm_rel_diff": max_rel([r["grad_norm"] for r in recs], [r["grad_norm"] for r in ref_recs]),
               "draft_max_abs_diff": draft_diff(out, ref)}
        # resume: the last checkpoint and the draft gone, as after a crash between the two saves
        resumed = root / f"check-{mode}-resumed"
        shutil.copytree(out, resumed)
        last = sorted((resumed / "checkpoints").glob("step-*"))
        assert [p.name for p in last] == [f"step-{steps // 2:08d}", f"step-{steps:08d}"], last
        shutil.rmtree(last[-1])
        (resumed / "draft.safetensors").unlink()
        port += 1
        launch(kind, n, dict(spec, out=str(resumed)), args.cpu, port, log)
        rrecs = records(resumed)
        row["resumed_steps_logged"] = len(rrecs)
        row["resumed_loss_rel_diff"] = max_rel([r["train/loss"] for r in rrecs], [r["train/loss"] for r in recs])
        row["resumed_draft_max_abs_diff"] = draft_diff(resumed, out)
        row["ok"] = (row["steps"] == steps and row["loss_rel_diff"] < args.tol and row["grad_norm_rel_diff"] < args.tol
                     and row["draft_max_abs_diff"] < args.tol and row["resumed_steps_logged"] == steps
                     and row["resumed_loss_rel_diff"] < args.tol and row["resumed_draft_max_abs_diff"] < args.tol)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def speed(args, root: Path, log: Path) -> list:
    shape = {k: getattr(args, k) for k in SMALL}
    rows, port = [], 29711
    for mode in ([] if args.no_single else ["one"]) + args.modes.split(","):
        kind, over = parse_mode(mode)
        n = 1 if kind == "one" else args.gpus
        out = root / f"speed-{mode}"
        spec = dict(shape=shape, train=dict(max_steps=args.loop_steps, compile=args.compile, **over), dtype="bfloat16",
                    out=str(out))
        port += 1
        try:
            launch(kind, n, spec, args.cpu, port, log)
        except RuntimeError as e:  # report and go on: the table is the point of the call
            rows.append({"mode": mode, "processes": n, "error": str(e)[-600:]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        r = bench.loop_summary(mode, recs, n * args.batch * args.seq, float((out / "wall_s").read_text()))
        r.update(mode=mode, processes=n, tokens_per_s_per_gpu=r["tokens_per_s"] / n)
        rows.append(r)
        print(json.dumps(r), flush=True)
    for r in rows:  # against the one-process run with the same optimizer, where there is one
        muon = "muon" in r["mode"].split("+")
        one = next((x for x in rows if x["mode"] == ("one+muon" if muon else "one") and "error" not in x), None)
        if one and "error" not in r:
            r["scaling"] = r["tokens_per_s"] / (r["processes"] * one["tokens_per_s"])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_shape_args(p)
    p.add_argument("--gpus", type=int, default=2, help="processes of the distributed runs")
    p.add_argument("--modes", default="ddp,fsdp")
    p.add_argument("--parts", default="check,speed")
    p.add_argument("--check-steps", type=int, default=6)
    p.add_argument("--tol", type=float, default=1e-4, help="largest relative loss/grad-norm and absolute weight "
                                                          "difference the check accepts")
    p.add_argument("--loop-steps", type=int, default=30)
    p.add_argument("--compile", default="auto", help="train.compile of the speed runs")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU speed run (no scaling column)")
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (DDP only; a smoke test)")
    p.add_argument("--keep", default="", help="keep the runs' directories here (default: a temporary one)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        sys.exit(f"bench/train_dist.py: {args.gpus} GPUs asked for (--gpus), {torch.cuda.device_count()} visible")
    if args.cpu and "fsdp" in args.modes.split(","):
        sys.exit("bench/train_dist.py: FSDP runs on GPUs only (Accelerate turns it off on CPU); use --modes ddp")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="eagle3-train-dist-"))
    root.mkdir(parents=True, exist_ok=True)
    log = root / "launch.log"
    dev = "cpu (gloo)" if args.cpu else torch.cuda.get_device_name()
    out = {"device": dev, "gpus": args.gpus, "torch": torch.__version__, "args": vars(args)}
    try:
        if "check" in args.parts:
            out["check"] = check(args, root, log)
        if "speed" in args.parts:
            out["speed"] = speed(args, root, log)
    finally:
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "bench_train_dist.json").write_text(json.dumps(out, indent=2))
            if log.exists():
                shutil.copy(log, Path(os.environ["OUT"], "train_dist_launch.log"))
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{dev} x {args.gpus}, torch {torch.__version__}")
    if "check" in out:
        print(f"check: H {SMALL['hidden']}, vocab {SMALL['vocab']}->{SMALL['draft_vocab']}, TTT {SMALL['ttt']}, "
              f"{SMALL['seq']} tokens per row, float32, {args.check_steps} steps, global batch {args.gpus} rows; "
              "differences against one process")
        print(f"{'mode':<18}{'procs':>6}{'steps':>6}{'loss rel':>11}{'gnorm rel':>11}{'weights abs':>13}"
              f"{'resumed: loss rel':>19}{'weights abs':>13}{'ok':>5}")
        for r in out["check"][1:]:
            print(f"{r['mode']:<18}{r['processes']:>6}{r['steps']:>6}{r['loss_rel_diff']:>11.1e}"
                  f"{r['grad_norm_rel_diff']:>11.1e}{r['draft_max_abs_diff']:>13.1e}"
                  f"{r['resumed_loss_rel_diff']:>19.1e}{r['resumed_draft_max_abs_diff']:>13.1e}{str(r['ok']):>5}")
    if "speed" in out:
        print(f"speed: {bench.describe_shape(args)} tokens per GPU, bf16, compile={args.compile}; median over "
              "windows of 5 steps after the first")
        print(f"{'mode':<18}{'procs':>6}{'tokens/s':>11}{'per GPU':>10}{'step ms':>9}{'scaling':>9}{'MFU':>7}"
              f"{'peak GiB/GPU':>14}{'wall s':>8}")
        for r in out["speed"]:
            if "error" in r:
                print(f"{r['mode']:<18}{r['processes']:>6}  {r['error'][-200:]!r}")
                continue
            print(f"{r['mode']:<18}{r['processes']:>6}{r['tokens_per_s']:>11.0f}{r['tokens_per_s_per_gpu']:>10.0f}"
                  f"{r['step_ms']:>9.1f}{r.get('scaling', float('nan')):>9.2f}{100 * r['mfu']:>6.1f}%"
                  f"{r['peak_alloc_gib']:>14.2f}{r['wall_s']:>8.0f}")
    bad = [r["mode"] for r in out.get("check", [])[1:] if not r["ok"]]
    if bad:
        sys.exit(f"check failed for {bad}: see the table")


if __name__ == "__main__":
    main()
