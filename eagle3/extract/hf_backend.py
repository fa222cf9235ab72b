"""extract.backend=hf: transformers, batched, CPU or GPU. The reference the vLLM backends are tested
against, and the fallback where vLLM is not available.

States are taken with hooks on the decoder layers, not ``output_hidden_states``: the input of layer
k is id k (vLLM's convention) and the output of the last layer is id L, the final state *before*
the final norm (transformers' last ``hidden_states`` entry is after it). This works for every
decoder-only family whose base model keeps its decoder layers in ``.layers`` (Llama, Qwen2/3,
Qwen3-MoE, DeepSeek-V3, ...). The lm_head is never run (we load the base model only).
"""
from __future__ import annotations

import logging

from ..store import ShardSpec, StoreLayout
from .writer import HostStager, ShardWriter, write_shards

log = logging.getLogger("eagle3.extract")


def host_to_device(t, device):
    """A host tensor on ``device`` without making the host wait for the device's queued work (a
    plain ``.to(cuda)`` of pageable memory synchronises the stream): pinned, then copied async."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def dequantizing_config(config: dict):
    """The transformers quantization config that loads a quantized checkpoint with its weights
    dequantized into floating point (compressed-tensors, block/tensor FP8), or None (not quantized,
    or a method transformers loads only its own way)."""
    from ..quantization import describe

    q = describe(config)
    if q is None:
        return None
    if q["method"] == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        return CompressedTensorsConfig(dequantize=True)
    if q["method"] == "fp8":
        from transformers import FineGrainedFP8Config

        return FineGrainedFP8Config(dequantize=True, weight_block_size=tuple(q.get("block_size") or (128, 128)))
    return None


def quantized_linear_names(target_path) -> set:
    """The modules of a quantized checkpoint whose weights carry a scale (``<name>.weight_scale`` or
    ``<name>.weight_scale_inv`` in its safetensors files): the linear layers its kernels run
    quantized, as the checkpoint names them."""
    from pathlib import Path

    from safetensors import safe_open

    names = set()
    for f in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                for end in (".weight_scale_inv", ".weight_scale"):
                    if k.endswith(end):
                        names.add(k[: -len(end)])
    return names


def fake_quantize_fp8_groups(x, group: int):
    """``x`` rounded as an FP8 W8A8 kernel rounds its input activations: each token's row in groups of
    ``group`` values (0: the whole row) scaled by amax / 448 into float8_e4m3fn and back, in x's dtype."""
    import torch

    shape, n = x.shape, x.shape[-1]
    g = group if group and n % group == 0 else n
    v = x.reshape(-1, n // g, g).float()
    scale = v.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return ((v / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype).reshape(shape)


def simulate_activation_quantization(model, target_path, q: dict) -> int:
    """Forward pre-hooks on ``model``'s linear layers that the checkpoint quantizes (see
    :func:`quantized_linear_names`), rounding their inputs to FP8 as the engine's W8A8 kernels do
    (block FP8: groups of the block's column size, 128; otherwise per token). For the noise of a
    check where transformers cannot run the checkpoint its own way: dequantized weights alone would
    leave out the activations' rounding, which the engine's states carry. Returns the hooked count."""
    import torch

    quantized = quantized_linear_names(target_path)
    group = int((q.get("block_size") or [0, 0])[-1]) if q.get("strategy") == "block" else 0
    # the model's module names may lack the checkpoint's leading prefixes (AutoModel: no "model.")
    known = {c.split(".", k)[-1] for c in quantized for k in range(c.count(".") + 1)}
    hooked = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name not in known:
            continue
        mod.register_forward_pre_hook(lambda m, args: (fake_quantize_fp8_groups(args[0], group), *args[1:]))
        hooked += 1
    return hooked


def load_base_model(target_path, dtype: str, *, trust_remote_code: bool, quantized: str = "dequantize"):
    """The base model of ``target_path`` in ``dtype``. A quantized checkpoint: ``dequantize`` loads
    its quantized weights dequantized into ``dtype`` (the exact weights the engine's kernels
    multiply with, up to the rounding of weight x scale); ``native`` lets transformers run it its
    own way on this device (FP8 on a GPU: its W8A8 block kernels, activations rounded to e4m3 as
    vLLM's are; on a CPU it dequantizes too); ``simulate``: dequantized weights, and the inputs of
    the quantized linear layers rounded to FP8 where the checkpoint quantizes activations to FP8
    (:func:`simulate_activation_quantization`; weight-only schemes: as ``dequantize``)."""
    import json
    from pathlib import Path

    import torch
    from transformers import AutoModel

    config = json.loads((Path(target_path) / "config.json").read_text())
    kwargs = {}
    deq = dequantizing_config(config)
    if deq is not None and quantized in ("dequantize", "simulate"):
        kwargs["quantization_config"] = deq
    model = AutoModel.from_pretrained(str(target_path), dtype=getattr(torch, dtype),
                                      trust_remote_code=trust_remote_code, **kwargs)
    if deq is not None and quantized in ("dequantize", "simulate"):
        # dequantized weights come out in the scales' dtype (or bf16 for FP8): the whole model in dtype
        model = model.to(getattr(torch, dtype))
    if deq is not None and quantized == "simulate":
        from ..quantization import describe

        q = describe(config)
        if str(q.get("activations") or "").startswith("fp8"):
            n = simulate_activation_quantization(model, target_path, q)
            log.info("extract: the inputs of %d quantized linear layers rounded to FP8 as the engine's kernels "
                     "round them (%s)", n, q["summary"])
    return model


class HFExtractor:
    name = "hf"

    def __init__(self, target_path, layout: StoreLayout, target_dtype: str, extract_cfg, model=None, *,
                 max_model_len: int = 0, work_dir=None, trust_remote_code: bool = False, quantized: str = "dequantize"):
        """Loads the base model of ``target_path`` (or wraps ``model``, a base model already built),
        running the checkpoint's own code only with ``trust_remote_code``; a quantized checkpoint
        as :func:`load_base_model` says (``quantized``). ``max_model_len`` and ``work_dir`` (the
        common constructor's) are not needed here."""
        import torch

        device = extract_cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.layout = layout
        self.batch_size = extract_cfg.batch_size
        if model is None:
            model = load_base_model(target_path, target_dtype, trust_remote_code=trust_remote_code, quantized=quantized)
        self.model = model.to(self.device)
        self.model.eval()
        layers = getattr(self.model, "layers", None)
        if layers is None:
            raise RuntimeError(f"{type(self.model).__name__} keeps no decoder layers in .layers; the hf backend "
                               f"cannot hook it")
        if len(layers) != layout.last_layer_id:
            raise RuntimeError(f"the model has {len(layers)} decoder layers but the store expects "
                               f"{layout.last_layer_id}")
        self._captured: dict = {}
        self._hooks = []
        for k in layout.layer_ids:
            self._hooks.append(layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
        self._hooks.append(layers[-1].register_forward_hook(self._post_hook(layout.last_layer_id)))
        self.stager = HostStager()
        self.last_stats = None
        log.info("extract: transformers %s on %s, %s, batch %d", type(self.model).__name__, self.device,
                 target_dtype, self.batch_size)

    def _pre_hook(self, k):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post_hook(self, k):
        def hook(module, args, output):
            self._captured[k] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def _forward(self, samples: list) -> tuple:
        """Padded batch of (j, ids) -> packed [N, n_aux, H], [N, H] on the device (rows in sample
        order, the target's dtype: the stager converts or quantises them).
        Nothing here waits for the device: the rows are picked with an index built on the host
        (a boolean mask on the device would make the host wait for the forward to end)."""
        import numpy as np
        import torch

        lengths = [len(ids) for _, ids in samples]
        width = max(lengths)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        for b, (_, x) in enumerate(samples):
            ids[b, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        # Right padding: causal attention keeps real tokens independent of the padding. Without
        # padding no mask at all: transformers then takes SDPA's causal path directly, the one it
        # picks for an all-ones mask only after reading the mask back (a host wait per forward).
        mask = None
        if min(lengths) < width:
            mask = host_to_device((torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long(), self.device)
        self._captured.clear()
        with torch.inference_mode():
            self.model(input_ids=host_to_device(ids, self.device), attention_mask=mask, use_cache=False)
            if min(lengths) == width:
                def rows(x):
                    return x.reshape(-1, x.shape[-1])
            else:
                keep = torch.cat([torch.arange(b * width, b * width + n) for b, n in enumerate(lengths)])
                keep = host_to_device(keep, self.device)

                def rows(x):
                    return x.reshape(-1, x.shape[-1]).index_select(0, keep)

            aux = torch.stack([rows(self._captured[k]) for k in self.layout.layer_ids], dim=1)
            last = rows(self._captured[self.layout.last_layer_id])
        self._captured.clear()
        return aux, last

    def states(self, input_ids) -> tuple:
        """One sample alone, no padding: (aux [T, n_aux, H], last [T, H]) on the CPU in the dtype the
        target runs in (not converted to the store dtype). The parity check's reference
        (eagle3.extract.checks)."""
        import numpy as np

        aux, last = self._forward([(0, np.asarray(input_ids, dtype=np.int64))])
        return aux.cpu(), last.cpu()

    def _produce(self, spec: ShardSpec, progress):
        import torch

        key = (spec.split, spec.k)
        # Longest first, fixed order: batches (hence bits) depend only on the shard's samples.
        order = sorted((j for j in range(spec.num_samples) if spec.lengths[j]), key=lambda j: (-int(spec.lengths[j]), j))
        for a in range(0, len(order), self.batch_size):
            batch = [(j, spec.input_ids[j]) for j in order[a:a + self.batch_size]]
            aux, last = self._forward(batch)
            segments, row = [], 0
            for j, x in batch:
                segments.append((key, j, 0, row, row + len(x)))
                row += len(x)
            with torch.inference_mode():
                # the store dtype, or fp8 values + scales, on the device (fp8: half the bytes to copy)
                captured = self.stager.capture(segments, aux, last, self.layout)
            yield captured
            progress.update(row)

    def run(self, specs: list[ShardSpec], store_dir, progress) -> list[dict]:
        writer = ShardWriter(store_dir, self.layout)
        wait0 = self.stager.wait_seconds
        done = write_shards(writer, specs, lambda spec: self._produce(spec, progress))
        self.last_stats = {"writer_cpu_s": writer.cpu_seconds, "stager_wait_s": self.stager.wait_seconds - wait0}
        return done

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.model = None
