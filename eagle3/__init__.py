"""eagle3: train EAGLE-3 speculative-decoding drafts and hand them to vLLM."""

from .train import inductor as _inductor  # noqa: F401 - records TORCHINDUCTOR_COMPILE_THREADS before vLLM sets it

__version__ = "0.1.0"


def open_hidden_states(experiment_dir, split: str = "train", fp8: str = "dequantize"):
    """The extract stage's hidden states of an experiment, as a sequence of per-sample dicts. An
    fp8 store's states come dequantised to float32 unless ``fp8="raw"`` (values + scales)."""
    from .store import open_hidden_states as _open

    return _open(experiment_dir, split=split, fp8=fp8)


__all__ = ["open_hidden_states", "__version__"]
