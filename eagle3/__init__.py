"""eagle3: train EAGLE-3 speculative-decoding drafts and hand them to vLLM."""

__version__ = "0.1.0"


def open_hidden_states(experiment_dir, split: str = "train"):
    """The extract stage's hidden states of an experiment, as a sequence of per-sample dicts."""
    from .store import open_hidden_states as _open

    return _open(experiment_dir, split=split)


__all__ = ["open_hidden_states", "__version__"]
