"""Tiny quantized targets, built offline from the tiny random targets of conftest: the two formats
the served checkpoints of the targets eagle3 is for come in.

- ``w4a16``: compressed-tensors, weight-only INT4, symmetric, group-quantized along the input
  dimension, ``pack-quantized`` (eight 4-bit values per int32: ``weight_packed``, ``weight_scale``,
  ``weight_shape``), as Kimi-K2's INT4 checkpoints are. Quantized with compressed-tensors' own
  functions (``calculate_qparams`` for each group's min/max scale, the ``pack-quantized``
  compressor for the packing) on the saved state dict, data-free: the scales of a weight-only
  scheme need no calibration data.
- ``fp8_block``: DeepSeek-V3's block FP8 (``quant_method: fp8``, e4m3 weights, one float32 scale
  per 128x128 block in ``weight_scale_inv``, ``activation_scheme: dynamic``). Written here, as
  DeepSeek's own conversion does: amax of each block / 448 (e4m3's largest value).

Every linear layer of the decoder layers is quantized except the ones ``ignore`` names (by default
the MoE router, which vLLM and transformers keep unquantized); the embedding, norms and lm_head stay
as they were, as in the real checkpoints (eagle3's train and export stages read exactly those).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

W4A16_GROUP_SIZE = 32
FP8_BLOCK = (128, 128)
FP8_E4M3_MAX = 448.0
ROUTER = r"re:.*mlp\.gate$"  # DeepSeek's router (e_score_correction_bias beside it): never quantized


def _quantizable(name: str, tensor, ignore) -> bool:
    if not name.endswith(".weight") or tensor.ndim != 2 or ".layers." not in name:
        return False
    module = name[: -len(".weight")]
    if module.rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm", "q_a_layernorm",
                                     "kv_a_layernorm", "norm"):
        return False
    for pattern in ignore:
        if pattern.startswith("re:") and re.fullmatch(pattern[3:], module) or pattern == module:
            return False
    return True


def _copy_non_weights(src: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "config.json" and not p.name.endswith(".index.json"):
            shutil.copy2(p, out / p.name)
    return json.loads((src / "config.json").read_text())


def _load(src: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for p in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    return tensors


def _save(out: Path, tensors: dict, conf: dict) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))
    return out


def w4a16_scheme(group_size: int = W4A16_GROUP_SIZE):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True,
                            dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=args)


def quantize_w4a16(src: Path, out: Path, group_size: int = W4A16_GROUP_SIZE, dtype: str = "bfloat16",
                   ignore=("lm_head", ROUTER)) -> Path:
    """``src`` (an HF checkpoint) as a compressed-tensors W4A16 checkpoint in ``out``; the unquantized
    tensors and the scales in ``dtype`` (the real checkpoints' bf16)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    src, out = Path(src), Path(out)
    conf = _copy_non_weights(src, out)
    scheme = w4a16_scheme(group_size)
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for name, w in _load(src).items():
        if not _quantizable(name, w, ignore):
            tensors[name] = w.to(torch_dtype) if w.is_floating_point() else w
            continue
        w = w.to(torch_dtype)
        if w.shape[1] % group_size:
            raise ValueError(f"{name}: input size {w.shape[1]} is not a multiple of the group size {group_size}")
        groups = w.float().unflatten(1, (w.shape[1] // group_size, group_size))
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        packed = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(torch_dtype), "weight_zero_point": zp}, scheme)
        module = name[: -len(".weight")]
        for k, v in packed.items():
            tensors[f"{module}.{k}"] = v
    qconf = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                               quantization_status=QuantizationStatus.COMPRESSED, ignore=list(ignore))
    conf["quantization_config"] = {**qconf.model_dump(exclude={"run_compressed"}), "quant_method": "compressed-tensors"}
    conf["torch_dtype"] = dtype
    conf.pop("dtype", None)
    return _save(out, tensors, conf)


def fp8_block_quantization_config() -> dict:
    """DeepSeek-V3's config.json ``quantization_config``."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK)}


def quantize_fp8_block(src: Path, out: Path, dtype: str = "bfloat16", ignore=("lm_head", ROUTER)) -> Path:
    """``src`` as a DeepSeek-V3-style block-FP8 checkpoint in ``out``: each quantized ``weight`` in
    float8_e4m3fn, its ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] in float32 (dequantized
    weight = fp8 value x scale of its block); the rest in ``dtype``."""
    import torch

    src, out = Path(src), Path(out)
    conf = _copy_non_weights(src, out)
    bn, bk = FP8_BLOCK
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for name, w in _load(src).items():
        if not _quantizable(name, w, ignore):
            tensors[name] = w.to(torch_dtype) if w.is_floating_point() else w
            continue
        n, k = w.shape
        pn, pk = -n % bn, -k % bk
        x = torch.nn.functional.pad(w.to(torch_dtype).float(), (0, pk, 0, pn))
        blocks = x.unflatten(0, ((n + pn) // bn, bn)).unflatten(2, ((k + pk) // bk, bk))  # [nb, bn, kb, bk]
        scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_E4M3_MAX  # [nb, kb]
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        tensors[name] = q.flatten(2).flatten(0, 1)[:n, :k].contiguous()
        tensors[name[: -len("weight")] + "weight_scale_inv"] = scale.float().contiguous()
    conf["quantization_config"] = fp8_block_quantization_config()
    conf["torch_dtype"] = dtype
    conf.pop("dtype", None)
    return _save(out, tensors, conf)


def dequantized_fp8_block(path: Path, name: str):
    """The float32 weight ``name`` of a block-FP8 checkpoint, dequantized (for tests of the format)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        q = f.get_tensor(name).float()
        s = f.get_tensor(name[: -len("weight")] + "weight_scale_inv")
    bn, bk = FP8_BLOCK
    return q * s.repeat_interleave(bn, 0)[: q.shape[0]].repeat_interleave(bk, 1)[:, : q.shape[1]]
