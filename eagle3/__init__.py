"""eagle3: train EAGLE-3 speculative-decoding drafts and hand them to vLLM."""

import os as _os

from .train import inductor as _inductor  # noqa: F401 - records TORCHINDUCTOR_COMPILE_THREADS before vLLM sets it

__version__ = "0.1.0"


class _CheckoutStages:
    """``eagle3.stages`` in a checkout: the repository's top-level ``stages/`` (the project's layout),
    which a wheel carries as the package ``eagle3/stages/`` (pyproject.toml). Installed only where the
    package has no ``stages/`` of its own and the directory beside it is a checkout's."""

    def __init__(self, directory: str):
        self.directory = directory

    def find_spec(self, name, path=None, target=None):
        if name != "eagle3.stages":
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(name, _os.path.join(self.directory, "__init__.py"),
                                                      submodule_search_locations=[self.directory])


def _map_checkout_stages() -> None:
    import sys

    here = _os.path.dirname(_os.path.abspath(__file__))
    checkout = _os.path.join(_os.path.dirname(here), "stages")
    if _os.path.isdir(_os.path.join(here, "stages")) or not _os.path.isfile(_os.path.join(checkout, "__init__.py")):
        return
    if not any(isinstance(f, _CheckoutStages) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutStages(checkout))


_map_checkout_stages()


def open_hidden_states(experiment_dir, split: str = "train", fp8: str = "dequantize"):
    """The extract stage's hidden states of an experiment, as a sequence of per-sample dicts. An
    fp8 store's states come dequantised to float32 unless ``fp8="raw"`` (values + scales)."""
    from .store import open_hidden_states as _open

    return _open(experiment_dir, split=split, fp8=fp8)


__all__ = ["open_hidden_states", "__version__"]
