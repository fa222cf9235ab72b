"""Which attention/loss implementations of speculators 0.9.0's EAGLE-3 trainer work, and how fast, on this machine.

A self-contained probe for one short device call (no eagle3 workspace, no GGUF): the GPU run of
``bench/peer_speculators_gpu.sh`` found speculators' default launch (flex attention + the fused Triton
KL loss) failing under torch 2.11 (dynamo could not trace ``speculators/losses/fused.py`` from
``compute_metrics`` in the compiled step), and its sdpa + eager fallback at about 80 s an epoch of
smollm2_large. This probe times each implementation pair on synthetic data of the same shapes:

1. ``WORK/verifier``: a random SmolLM2-135M-shaped verifier, only what speculators' offline train path
   reads from ``--verifier-name-or-path``: config.json (LlamaConfig: hidden 576, 30 layers, 9 heads, 3
   kv heads, intermediate 1536, vocab 49152, tied embeddings; AutoConfig -> the draft decoder's shape,
   the verifier's layer count for ``--target-layer-ids``), model.safetensors with
   ``model.embed_tokens.weight`` (draft embedding, and lm_head since the embeddings are tied) and
   ``model.norm.weight`` (``load_model_layers``), and a tokenizer of the full vocabulary
   (``resolve_mask_token_id`` loads it with AutoProcessor: with len(tokenizer) == vocab it falls back
   to the pad id, as SmolLM2's does). ``--full-verifier``: a whole random LlamaForCausalLM instead
   (save_pretrained; same files, more weights).
2. ``WORK/data``: a synthetic offline dataset in exactly the layout ``peer_speculators.py convert``
   writes (its ``save_dataset``/``save_vocab``): columns input_ids/loss_mask/seq_len, format torch;
   ``hidden_states/hs_<i>.safetensors`` = {"hidden_states": bf16 [T, n_aux + 1, H], "token_ids": [T]};
   d2t.npy/t2d.npy of ``--draft-vocab`` random target ids. ``--samples`` samples of uniform random
   length in [``--min-len``, ``--max-len``]: random ids, loss mask on each sample's second half,
   hidden states ~ N(0, s^2) per layer with s from 1.2 (first aux layer) to 14 (last aux layer) and 22
   (the final state), about the median magnitudes of SmolLM2's real ones (without their outlier
   channels). ``--val-samples`` of them form speculators' val split (``--train-data-ratio``).
3. For each pair of ``--pairs`` (``ATTN+LOSS[:TIMEOUT_S]``; ``flex`` and ``fused`` = speculators'
   defaults, passed as ``peer_speculators.py`` passes them, i.e. not at all (on cpu by name, where
   peer_speculators' own defaults are sdpa/eager); other names verbatim as
   ``--draft-attn-impl``/``--loss-implementation``): speculators' trainer through
   ``peer_speculators.py``'s launcher (``_launch``: metrics.jsonl, the CPU patches on cpu, SIGTERM
   at the pair's timeout) with ``train_argv``'s flags: ``--epochs`` (1), ``--ttt 7``, ``--lr 5e-4``,
   ``--total-seq-len 8192``, speculators' 12 dataloader workers on cuda (``--num-workers``). Each pair
   gets its own, empty TorchInductor/Triton cache dirs (``--shared-cache``: the default ones), so its
   wall time includes its own compilation. Pairs start while ``--budget`` (seconds from this script's
   start) leaves at least ``--min-start-s``; a pair's timeout is cut to what is left.

Prints a table (pair, rc, wall s, steps, s/step over the steps after the first ``--skip-steps``,
first-step latency = start-up + compilation + first step, tokens/s, first error line) and writes
``OUT/results.json`` (after every pair: a cut-off call keeps what finished) with per-step times, the
argv and the tail of each failed pair's log in ``OUT/<pair>.log`` (at most 8 files come back from a
device call: results.json + one log per failed pair). The verifier, data and runs stay under
``--work`` (about 1 GB of hidden states at the default 400 samples): never under OUT.

Device (one H200; wheels installed first, as bench/peer_speculators_gpu.sh does)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wt/wheels/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specsite .wt/specwheels/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/peer_speculators_impl_gpu.py --out $OUT --budget 330 \\
        --pairs flex+eager:150,sdpa+eager:80,flex+fused:90 --spec-path /tmp/specsite:/tmp/site:$PWD

CPU smoke test (tiny: a 2-layer verifier, 20 samples, sdpa + eager, the CPU patches)::

    PYTHONPATH=/work/main python3 bench/peer_speculators_impl_gpu.py --device cpu --out /tmp/impl_out \\
        --work /tmp/impl_work --samples 20 --val-samples 2 --min-len 32 --max-len 96 --layers 2 \\
        --draft-vocab 1024 --total-seq-len 512 --ttt 2 --pairs sdpa+eager \\
        --spec-python /work/scratch/devsim/bin/python --spec-path /tmp/specsite311
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_speculators as P  # noqa: E402  (stdlib only at import)

# SmolLM2-135M's config (the converted target of experiment=smollm2_large), less its weights
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, hidden_act="silu",
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_parameters={"rope_theta": 100000.0,
               "rope_type": "default"}, bos_token_id=1, eos_token_id=2, pad_token_id=2, unk_token_id=0,
               initializer_range=0.02, attention_bias=False, mlp_bias=False)
DEFAULT_PAIRS = "flex+eager,sdpa+eager,flex+fused"
SPECULATORS_DEFAULT = {"flex": None, "fused": None}  # = not passed, as peer_speculators.py does on cuda


def layer_ids(n_layers: int) -> list:
    """speculators' default aux layers [2, n//2, n-3] (eagle3's for SmolLM2: 2 15 27); [0, 1, 2] for tiny verifiers."""
    ids = [2, n_layers // 2, n_layers - 3]
    return ids if len(set(ids)) == 3 and min(ids) >= 0 else [0, 1, 2]


# -------------------------------------------------------------------------------------- verifier
def build_verifier(d: Path, n_layers: int, full: bool, seed: int) -> dict:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    t0 = time.time()
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = LlamaConfig(**dict(SMOLLM2, num_hidden_layers=n_layers))
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    if full:
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(cfg).save_pretrained(str(d))
    else:
        cfg.save_pretrained(str(d))
        H, V = cfg.hidden_size, cfg.vocab_size
        save_file({"model.embed_tokens.weight": torch.randn(V, H) * cfg.initializer_range,
                   "model.norm.weight": torch.ones(H)}, str(d / "model.safetensors"))
    # a word-level tokenizer of the full vocabulary, SmolLM2's special ids (0 unk, 1 bos, 2 eos = pad)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), cfg.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", bos_token="<|im_start|>",
                            eos_token="<|im_end|>", pad_token="<|im_end|>").save_pretrained(str(d))
    files = sorted(p.name for p in d.iterdir())
    print(f"verifier: {d} ({n_layers} layers, {'full' if full else 'embed + norm only'}) {files} "
          f"in {time.time() - t0:.1f} s", flush=True)
    return {"dir": str(d), "layers": n_layers, "full": full, "files": files}


# ------------------------------------------------------------------------------------------ data
def build_data(data: Path, a, ids: list) -> dict:
    """The synthetic offline dataset; returns a convert.json-like info dict (what train_argv reads)."""
    import torch
    from safetensors.torch import save_file

    t0 = time.time()
    shutil.rmtree(data, ignore_errors=True)
    (data / "hidden_states").mkdir(parents=True)
    g = torch.Generator().manual_seed(a.seed)
    H, V, n_aux = SMOLLM2["hidden_size"], SMOLLM2["vocab_size"], len(ids)
    scales = torch.tensor([1.2 + (14.0 - 1.2) * j / max(1, n_aux - 1) for j in range(n_aux)] + [22.0])
    scales = scales.to(torch.bfloat16).view(1, -1, 1)
    lens = torch.randint(a.min_len, a.max_len + 1, (a.samples,), generator=g).tolist()
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, T in enumerate(lens):
        tok = torch.randint(0, V, (T,), generator=g, dtype=torch.int64)
        hs = torch.randn(T, n_aux + 1, H, generator=g, dtype=torch.bfloat16).mul_(scales)
        save_file({"hidden_states": hs, "token_ids": tok}, str(data / "hidden_states" / f"hs_{i}.safetensors"))
        mask = torch.zeros(T, dtype=torch.int64)
        mask[T // 2:] = 1
        rows["input_ids"].append(tok.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(T)
    P.save_dataset(data, rows)
    tgt = torch.randperm(V, generator=g)[:a.draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tgt] = True
    P.save_vocab(data, tgt - torch.arange(a.draft_vocab), t2d)
    n_eval = a.val_samples
    n_train = a.samples - n_eval
    info = {"synthetic": True, "num_train": n_train, "num_eval": n_eval,
            "train_data_ratio": (n_train + 0.5) / a.samples,
            "draft_vocab_size": a.draft_vocab, "vocab_size": V,
            "checks": {"train": {"samples": n_train, "tokens": sum(lens[:n_train]), "layer_ids": ids,
                                 "last_layer_id": a.layers},
                       "eval": {"samples": n_eval, "tokens": sum(lens[n_train:]), "layer_ids": ids,
                                "last_layer_id": a.layers}},
            "hidden_states": "bf16 [T, n_aux + 1, H]: aux layers ascending, then the final pre-norm state",
            "tokens": sum(lens), "seconds": round(time.time() - t0, 1)}
    assert int(a.samples * info["train_data_ratio"]) == n_train
    (data / "convert.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"data: {a.samples} samples ({n_train} train / {n_eval} val), {info['tokens']} tokens, aux layers {ids} "
          f"-> {data} in {info['seconds']} s", flush=True)
    return info


# ----------------------------------------------------------------------------------------- pairs
def parse_pairs(spec: str, default_timeout: float) -> list:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        pair, _, t = item.partition(":")
        attn, sep, loss = pair.partition("+")
        if not sep or not attn or not loss:
            raise SystemExit(f"--pairs: {item!r} is not ATTN+LOSS[:TIMEOUT_S]")
        out.append({"pair": pair, "attn": attn, "loss": loss, "timeout": float(t) if t else default_timeout})
    return out


_ERR = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?\w*(?:Error|Exception|Unsupported|Interrupt|Failed|OutOfResources)\b.*")


def error_lines(log_text: str) -> tuple:
    """(first, last) exception lines of a launch's log ("Foo.BarError: ..."), or its last line."""
    hits = [ln.strip() for ln in log_text.splitlines() if _ERR.match(ln) and "Warning" not in ln.split(":")[0]]
    if hits:
        return hits[0][:400], hits[-1][:400]
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    last = lines[-1][:400] if lines else ""
    return last, last


def step_stats(run: Path, t_start: float, skip: int) -> dict:
    recs = [r for r in P.metric_records(run) if "train" in r and "global_step" in r]
    out = {"steps": len(recs), "step_s": [round(r["profile"]["step_ms"] / 1000, 4) for r in recs],
           "tokens_per_s_step": [round(r["profile"].get("tokens_per_s", 0.0)) for r in recs]}
    if recs:
        out["first_step_at_s"] = round(recs[0]["time"] - t_start, 1)  # start-up + compilation + step 0
        later = recs[skip:] if len(recs) > skip else recs[-1:]
        out["s_per_step"] = round(sum(r["profile"]["step_ms"] for r in later) / 1000 / len(later), 4)
        out["tokens_per_s"] = round(sum(r["profile"].get("tokens_per_s", 0.0) for r in later) / len(later))
        out["steps_timed"] = len(later)
        out["median_s_per_step"] = round(sorted(r["profile"]["step_ms"] for r in later)[len(later) // 2] / 1000, 4)
        if len(later) > 1:  # wall clock between the metric records (the logging included)
            out["wall_s_per_step"] = round((later[-1]["time"] - later[0]["time"]) / (len(later) - 1), 4)
        out["last_train"] = {k: round(v, 4) for k, v in recs[-1]["train"].items() if isinstance(v, float)}
    m = P._read_metrics(run)
    if m["last_val"]:
        out["val"] = m["last_val"].get("val")
    return out


def run_pair(a, pr: dict, info: dict, timeout: float) -> dict:
    name = pr["pair"].replace("+", "_")
    run = Path(a.work) / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    attn = SPECULATORS_DEFAULT.get(pr["attn"], pr["attn"])
    loss = SPECULATORS_DEFAULT.get(pr["loss"], pr["loss"])
    if a.device == "cpu":  # peer_speculators' cpu defaults would turn flex/fused into sdpa/eager: name them
        attn, loss = attn or "simple_flex_attention", loss or "fused"
    args = argparse.Namespace(
        device=a.device, threads=a.threads, spec_python=a.spec_python, spec_path=a.spec_path,
        data=str(Path(a.work) / "data"), out=str(Path(a.work) / "runs"), name=name,
        target=str(Path(a.work) / "verifier"), seed=a.seed, resume=False, extra=a.extra,
        attn=attn, loss=loss, num_workers=a.num_workers, grace=10.0)
    bud = {"epochs": a.epochs, "ttt_steps": a.ttt, "lr": a.lr, "total_seq_len": a.total_seq_len}
    impl = P._impl_args(args)
    argv = P.train_argv(args, info, bud, impl)
    if not a.shared_cache:  # this pair compiles from scratch
        for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            os.environ[var] = str(run / "cache" / sub)
    t_start = time.time()
    args.deadline = t_start + timeout + args.grace  # _launch sends SIGTERM at deadline - grace
    print(f"== {pr['pair']}: {impl or 'speculators defaults'}, timeout {timeout:.0f} s", flush=True)
    rc, stopped, wall = P._launch(args, run, argv, 1)
    log = (run / "train.log").read_text(errors="replace")
    res = {"pair": pr["pair"], "impl": impl, "rc": rc, "stopped_at_timeout": stopped, "timeout_s": round(timeout),
           "wall_s": round(wall, 1), "complete": P._complete(run / "checkpoints", a.epochs),
           **step_stats(run, t_start, a.skip_steps)}
    m = re.search(r"TRAIN_WALL_S ([\d.]+)", log)
    res["train_wall_s"] = float(m.group(1)) if m else None  # C.main alone (no imports / config resolution)
    res["ok"] = rc == 0 and res["complete"]
    if not res["ok"]:
        res["error"], res["last_error"] = error_lines(log)
        if stopped:
            res["error"] = f"timeout: stopped (SIGTERM) at {timeout:.0f} s after {res['steps']} steps"
        (Path(a.out) / f"{name}.log").write_text(log[-a.log_tail:])
    res["argv"] = argv
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the draft's weights are of no use here
    return res


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def table(results: list) -> str:
    lines = ["| pair | rc | wall s | steps | s/step | first step at s | tok/s | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['pair']} | - | - | - | - | - | - | skipped: {r['skipped']} |")
            continue
        rc = f"{r['rc']}" + (" (timeout)" if r.get("stopped_at_timeout") else "")
        lines.append(f"| {r['pair']} | {rc} | {r['wall_s']:.0f} | {r['steps']} | {fmt(r.get('s_per_step'), '.3f')} | "
                     f"{fmt(r.get('first_step_at_s'), '.0f')} | {fmt(r.get('tokens_per_s'), '.0f')} | "
                     f"{(r.get('error') or '')[:160]} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results.json and the failed pairs' log tails (small files only)")
    ap.add_argument("--work", default="/tmp/spec_impl", help="verifier, data, runs (about 1 GB at the defaults)")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma-separated ATTN+LOSS[:TIMEOUT_S], run in this order")
    ap.add_argument("--timeout", type=float, default=120.0, help="a pair's timeout when it names none (s)")
    ap.add_argument("--budget", type=float, default=None, help="seconds from this script's start for everything")
    ap.add_argument("--min-start-s", type=float, default=40.0, help="start no pair with less time left")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--spec-python", default=None, help="python of the trainer (default: this one)")
    ap.add_argument("--spec-path", default=os.environ.get("PYTHONPATH", ""),
                    help="the trainer's PYTHONPATH (device: /tmp/specsite:/tmp/site; default: this PYTHONPATH)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of a cpu run")
    ap.add_argument("--num-workers", type=int, default=None, help="dataloader workers (default: 1 on cpu, "
                    "speculators' 12 on cuda)")
    ap.add_argument("--shared-cache", action="store_true", help="keep the default inductor/triton caches")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--val-samples", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=30, help="verifier layers (the aux layers follow)")
    ap.add_argument("--full-verifier", action="store_true", help="save a whole random LlamaForCausalLM")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--total-seq-len", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-steps", type=int, default=3, help="steps left out of s/step (compilation, warm-up)")
    ap.add_argument("--log-tail", type=int, default=200_000, help="bytes of a failed pair's log kept in OUT")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # speculators flags for every pair
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.extra = extra
    t0 = time.time()
    deadline = None if a.budget is None else t0 + a.budget
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.spec_python = a.spec_python or sys.executable
    if a.val_samples < 1 or a.val_samples >= a.samples:
        raise SystemExit("--val-samples must be in [1, --samples)")
    pairs = parse_pairs(a.pairs, a.timeout)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    work = Path(a.work)
    ids = layer_ids(a.layers)
    header = {"device": a.device, "samples": a.samples, "layers": a.layers, "aux_layer_ids": ids,
              "draft_vocab": a.draft_vocab, "epochs": a.epochs, "ttt": a.ttt, "lr": a.lr,
              "total_seq_len": a.total_seq_len, "pairs": [p["pair"] for p in pairs], "extra": extra}
    try:
        import torch

        header["torch"] = torch.__version__
        if a.device == "cuda":
            header["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        header["torch"] = repr(e)
    header["verifier"] = build_verifier(work / "verifier", a.layers, a.full_verifier, a.seed)
    info = build_data(work / "data", a, ids)
    header.update(tokens=info["tokens"], train_tokens=info["checks"]["train"]["tokens"],
                  setup_s=round(time.time() - t0, 1))
    results = []

    def save():
        (Path(a.out) / "results.json").write_text(json.dumps({**header, "results": results}, indent=1) + "\n")

    save()
    for pr in pairs:
        timeout = pr["timeout"]
        if deadline is not None:
            left = deadline - time.time()
            if left < a.min_start_s:
                print(f"== {pr['pair']}: skipped ({left:.0f} s left)", flush=True)
                results.append({"pair": pr["pair"], "skipped": f"{left:.0f} s left of the budget"})
                save()
                continue
            timeout = min(timeout, left - 5)
        r = run_pair(a, pr, info, timeout)
        results.append(r)
        save()
        print(f"== {r['pair']}: rc {r['rc']}{' (timeout)' if r['stopped_at_timeout'] else ''}, {r['wall_s']:.0f} s, "
              f"{r['steps']} steps, s/step {r.get('s_per_step')}, first step at {r.get('first_step_at_s')} s"
              + (f"; error: {r['error']}" if not r["ok"] else ""), flush=True)
    print("\n" + table(results), flush=True)
    print(f"\nsamples {a.samples} ({info['tokens']} tokens, {header['train_tokens']} train), TTT {a.ttt}, "
          f"total-seq-len {a.total_seq_len}, draft vocab {a.draft_vocab}; s/step = mean of speculators' step_ms "
          f"after the first {a.skip_steps} steps; total {time.time() - t0:.0f} s -> {Path(a.out) / 'results.json'}")


if __name__ == "__main__":
    main()
