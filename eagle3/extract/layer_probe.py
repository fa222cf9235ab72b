"""``extract.layer_ids=auto``: three aux layers chosen by a cheap linear probe, before extraction.

What it measures: how well a linear map of the target's states at position t (the aux ids'
convention, eagle3.extract.layers: id k = the input of decoder layer k, captured by the hf backend's
hooks exactly as extraction stores it) predicts the target's own next tokens, the draft's job. On
the first ``extract.layer_probe.samples`` training samples of the prepared data (at most
``max_tokens`` tokens), with the transformers backend:

- every candidate layer k in [0, L) is projected to 256 dimensions by a fixed random Gaussian matrix
  (seeded by k) and standardised;
- the labels at an answer position t (``loss_mask[t + 1] = 1``) are the target's top-1 tokens at
  t+1, t+2, t+3 (its final state through the final norm and lm_head, over the draft vocabulary of the
  prepare run), restricted to the fit part's most frequent classes;
- a ridge regression from the concatenated projected states of a layer set onto the one-hot labels
  is fitted on half the samples; a set's score is its top-1 accuracy at the three horizons weighted
  1, 0.8, 0.64 (normalised), averaged over positions;
- greedy forward selection adds, three times, the layer that most raises the score on a quarter of
  the samples (the selection part); the chosen set and the default (2, L//2, L-3) are then scored on
  the last quarter (the test part, unseen by the selection), and the chosen set replaces the default
  only when it beats it by at least ``min_z`` standard errors of the paired per-position difference
  (clustered by sample: positions of one sample are not independent).

The result is cached in ``${exp}/layer_probe/<key>.json`` (key: the target's identity, the prepare
run and its outputs, the probe's settings and dtype), written atomically under a file lock, so
parts of a scale-out and re-runs compute it once. The extract stage records it as
``ExtractFacts.layer_probe``; train and export read the ids from the store's layout as always.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from ..contracts import layer_probe_line
from ..errors import Eagle3Error

log = logging.getLogger("eagle3.extract")

PROJ_DIM = 256
"""Dimensions each candidate layer's state is projected to."""
HORIZON_WEIGHTS = (1.0, 0.8, 0.64)
"""Weights of the top-1 accuracy at t+1, t+2, t+3 (0.8^j)."""
RIDGE = 1e-2
"""Ridge penalty per fit row (the features are standardised)."""
MAX_CLASSES = 1024
"""Label classes kept: the fit part's most frequent top-1 tokens (other labels count as misses)."""
CHOOSE = 3
PROBE_VERSION = 1
PROBE_DIR = "layer_probe"


class LayerProbeError(Eagle3Error):
    pass


def probe_key(target, prep, probe_cfg, target_dtype: str) -> str:
    """What the probe's result depends on: the target's identity, the prepare run (config and outputs),
    the probe's settings, the dtype the target runs in and the method's version."""
    from dataclasses import asdict

    from ..hashing import hash_obj

    return hash_obj({"target": target.identity(), "prepare": prep.config_hash, "prepared": prep.outputs_digest,
                     "probe": asdict(probe_cfg), "dtype": target_dtype, "version": PROBE_VERSION})[:16]


def probe_path(exp_dir, key: str) -> Path:
    return Path(exp_dir) / PROBE_DIR / f"{key}.json"


def choose_layer_ids(exp_dir, target, prep, extract_cfg, target_dtype: str) -> dict:
    """The probe's record (``layer_ids``: the ids to extract), computed once per key: a cached one is
    read (``reused``: true) and said so."""
    from filelock import FileLock

    from ..atomic import atomic_write_json

    key = probe_key(target, prep, extract_cfg.layer_probe, target_dtype)
    path = probe_path(exp_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{key}.lock")):
        if path.is_file():
            result = json.loads(path.read_text())
            print(f"extract: layer probe reused from {path} (computed in {result['seconds']['total']:.1f} s): "
                  f"layer ids {result['layer_ids']}")
            return {**result, "reused": True}
        result = run_probe(target, prep, extract_cfg, target_dtype)
        result["key"] = key
        atomic_write_json(path, result)
    print(f"extract: {layer_probe_line(result)}")
    return {**result, "reused": False}


def _probe_samples(prep, probe_cfg) -> list:
    """(input_ids, loss_mask) of the first training samples, cut at ``max_tokens`` in all."""
    from . import prepared_samples

    train = prepared_samples(prep)["train"]
    ids, masks = train.get(0, min(probe_cfg.samples, len(train)))
    out, tokens = [], 0
    for x, m in zip(ids, masks):
        room = probe_cfg.max_tokens - tokens
        if room < 4:
            break
        out.append((list(x[:room]), list(m[:room])))
        tokens += len(out[-1][0])
    return out


def run_probe(target, prep, extract_cfg, target_dtype: str) -> dict:
    import dataclasses

    import torch

    from ..artifacts import VOCAB_FILE
    from ..data.vocab import load_vocab
    from ..store import StoreLayout
    from ..target_weights import read_target_head
    from .checks import head_argmax
    from .hf_backend import HFExtractor
    from .layers import default_layer_ids

    t0 = time.perf_counter()
    probe_cfg = extract_cfg.layer_probe
    L, H = target.num_hidden_layers, target.hidden_size
    default = list(default_layer_ids(L))
    if L <= CHOOSE:
        raise LayerProbeError(f"extract.layer_ids=auto: the target has {L} decoder layers, so the {CHOOSE} aux layers "
                              f"leave nothing to choose; set extract.layer_ids=[] (the default {default})")
    samples = _probe_samples(prep, probe_cfg)
    if len(samples) < 4:
        raise LayerProbeError(f"extract.layer_ids=auto: the probe needs at least 4 training samples (it fits, selects "
                              f"and tests on separate ones), the prepared data has {len(samples)}; give "
                              f"extract.layer_ids explicitly")
    layout = StoreLayout(layer_ids=tuple(range(L)), last_layer_id=L, hidden_size=H, dtype="float32",
                         target_hash=target.hash)
    try:
        ex = HFExtractor(target.path, layout, target_dtype, dataclasses.replace(extract_cfg, batch_size=1),
                         trust_remote_code=target.trust_remote_code)
    except Exception as e:
        raise LayerProbeError(f"extract.layer_ids=auto: the layer probe runs the target with the transformers backend, "
                              f"which cannot load {target.path} here ({type(e).__name__}: {e}); give "
                              f"extract.layer_ids explicitly (e.g. extract.layer_ids={default}, the default)") from e
    head = read_target_head(target.path, target.config, roles=("norm", "lm_head"))
    d2t, _ = load_vocab(prep.path(VOCAB_FILE))
    kept = torch.arange(len(d2t)) + d2t
    lm_head = head["lm_head"][kept].to(ex.device)
    eps = float(target.text_config.get("rms_norm_eps", 1e-6))
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(L, H, PROJ_DIM, generator=gen) / H ** 0.5
    parts = {0: "fit", 1: "fit", 2: "select", 3: "test"}
    feats = {"fit": [], "select": [], "test": []}
    labels = {"fit": [], "select": [], "test": []}
    groups = {"fit": [], "select": [], "test": []}
    tokens = 0
    try:
        for i, (ids, mask) in enumerate(samples):
            tokens += len(ids)
            aux, last = ex.states(ids)
            top = head_argmax(last, head["norm"], lm_head, eps)  # draft-vocabulary index of the target's top-1
            T = len(ids)
            m = np.asarray(mask, dtype=bool)
            ts = np.flatnonzero(m[1:T - 2]) if T >= 4 else np.array([], dtype=np.int64)  # t+1 an answer token, t+2 < T
            if not len(ts):
                continue
            part = parts[i % 4]
            ts = torch.from_numpy(ts)
            x = torch.einsum("tlh,lhp->tlp", aux[ts].float(), proj)
            feats[part].append(x)
            labels[part].append(torch.stack([top[ts + j] for j in range(len(HORIZON_WEIGHTS))], dim=1))
            groups[part].append(torch.full((len(ts),), i))
    finally:
        ex.close()
    forward_s = time.perf_counter() - t0
    if not all(feats.values()):
        raise LayerProbeError("extract.layer_ids=auto: the probe's samples hold too few answer positions (each of its "
                              "fit, select and test parts needs some); give extract.layer_ids explicitly")
    X = {p: torch.cat(v) for p, v in feats.items()}
    Y = {p: torch.cat(v) for p, v in labels.items()}
    G = {p: torch.cat(v) for p, v in groups.items()}
    mean, std = X["fit"].mean(0), X["fit"].std(0).clamp(min=1e-6)
    X = {p: (v - mean) / std for p, v in X.items()}
    # classes: the fit part's most frequent labels; others map to -1 (a miss for every layer set)
    counts = torch.bincount(Y["fit"].flatten(), minlength=len(kept))
    classes = torch.argsort(counts, descending=True, stable=True)[:MAX_CLASSES]
    classes = classes[counts[classes] > 0]
    to_class = torch.full((len(kept),), -1, dtype=torch.long)
    to_class[classes] = torch.arange(len(classes))
    Yc = {p: to_class[v] for p, v in Y.items()}
    C, n_fit = len(classes), len(Yc["fit"])
    J = len(HORIZON_WEIGHTS)
    w = torch.tensor(HORIZON_WEIGHTS) / sum(HORIZON_WEIGHTS)
    # X_k^T onehot(Y) per layer, each horizon's classes side by side: [L, P, J*C]
    rows = torch.arange(n_fit).repeat_interleave(J)
    cols = (Yc["fit"] + torch.arange(J) * C).flatten()
    ok = Yc["fit"].flatten() >= 0
    XtY = torch.zeros(L, PROJ_DIM, J * C)
    for k in range(L):
        XtY[k] = torch.zeros(J * C, PROJ_DIM).index_add_(0, cols[ok], X["fit"][rows[ok], k]).T
    prior = torch.zeros(J * C).index_add_(0, cols[ok], torch.ones(int(ok.sum()))) / n_fit
    gram: dict = {}

    def block(a, b):
        if (a, b) not in gram:
            gram[(a, b)] = X["fit"][:, a].T @ X["fit"][:, b]
            gram[(b, a)] = gram[(a, b)].T
        return gram[(a, b)]

    def position_scores(layer_set, part) -> torch.Tensor:
        S = list(layer_set)
        A = torch.cat([torch.cat([block(a, b) for b in S], dim=1) for a in S], dim=0)
        A += RIDGE * n_fit * torch.eye(len(S) * PROJ_DIM)
        W = torch.linalg.solve(A, torch.cat([XtY[k] for k in S], dim=0))
        pred = (X[part][:, S].flatten(1) @ W + prior).view(-1, J, C).argmax(-1)
        return ((pred == Yc[part]).float() * w).sum(-1)

    t_fit = time.perf_counter()
    chosen, greedy = [], []
    for _ in range(CHOOSE):
        best = max((float(position_scores(chosen + [k], "select").mean()), -k) for k in range(L) if k not in chosen)
        chosen.append(-best[1])
        greedy.append({"layer": -best[1], "select_score": round(best[0], 6)})
    chosen = sorted(chosen)
    s_chosen, s_default = position_scores(chosen, "test"), position_scores(default, "test")
    diff = (s_chosen - s_default).double()
    n = len(diff)
    d_mean = float(diff.mean())
    # standard error of the mean difference, clustered by sample
    sums = torch.zeros(int(G["test"].max()) + 1, dtype=torch.double).index_add_(0, G["test"], diff - d_mean)
    se = float(sums.pow(2).sum().sqrt()) / n
    z = d_mean / se if se > 0 else None  # None: no spread (the two sets agree, or differ alike, everywhere)
    use = chosen != default and (z >= probe_cfg.min_z if z is not None else d_mean > 0)
    return {"layer_ids": chosen if use else default, "chosen": chosen, "default": default, "kept_default": not use,
            "scores": {"chosen": round(float(s_chosen.mean()), 6), "default": round(float(s_default.mean()), 6)},
            "difference": round(d_mean, 6), "se": round(se, 6), "z": round(z, 3) if z is not None else None,
            "min_z": probe_cfg.min_z, "greedy": greedy, "samples": len(samples), "tokens": tokens,
            "positions": {p: len(v) for p, v in Yc.items()}, "classes": C, "projection_dim": PROJ_DIM,
            "horizon_weights": list(HORIZON_WEIGHTS), "ridge": RIDGE, "backend": "hf", "dtype": target_dtype,
            "device": str(ex.device), "candidates": L,
            "seconds": {"forward": round(forward_s, 3), "fit": round(time.perf_counter() - t_fit, 3),
                        "total": round(time.perf_counter() - t0, 3)}}
