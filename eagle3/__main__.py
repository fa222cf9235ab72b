"""Command line: ``python -m eagle3 stage=prepare|extract|train|export|all|status|eval|produce|plan``.

Only Hydra, OmegaConf and the config schemas are imported on the ``--help`` / ``--cfg`` path;
torch, transformers and vLLM load inside the stage that needs them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from .config import register_configs

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
register_configs()


def _presets() -> set[str]:
    return {p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")}


def rewrite_overrides(overrides: list[str]) -> list[str]:
    """Map the public keys onto Hydra's overrides (documented for users in conf/config.yaml).

    - ``experiment=NAME``: a preset in conf/experiment/ is selected as a config group (the preset
      sets ``name``); any other NAME sets ``name`` directly, so users can name experiments freely.
    - ``target.path=DIR`` / ``target.gguf=FILE``: another target than the embedded default's, so
      its sizing (the default preset ``embedded_default``) is dropped unless a preset is selected.
    - ``data.path=FILE`` / ``data.sources=[...]`` select data=jsonl / data=mixture.
    - ``export.from=DIR``: ``from`` is a Python keyword and cannot be a dataclass field; the schema
      calls it ``from_``.
    """
    presets = _presets()
    keys = {a.partition("=")[0].lstrip("+~") for a in overrides}
    out, groups = [], []
    preset_chosen = False
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and key == "experiment":
            names = value.split(",")
            if all(n in presets for n in names):
                preset_chosen = True
            else:
                if any(n in presets for n in names):
                    raise SystemExit("eagle3: a sweep over experiment= cannot mix presets "
                                     f"({sorted(presets)}) and plain names")
                arg = f"name={value}"
        elif sep and key.lstrip("+") == "export.from":
            arg = f"{key[:len(key) - len(key.lstrip('+'))]}export.from_={value}"
        out.append(arg)
    if keys & {"target.path", "target.gguf"} and not preset_chosen and "~experiment" not in overrides:
        groups.append("~experiment")
    if keys & {"data.path", "data.sources"} and "data" not in keys:
        groups.append("data=jsonl" if "data.path" in keys else "data=mixture")
    # next to the last override: Hydra's parser takes the overrides as one run of positionals, so
    # a group appended after a flag (`... --cfg job`) would be refused as an unknown argument
    last = max((i for i, a in enumerate(out) if "=" in a and not a.startswith("-")), default=len(out) - 1)
    return out[:last + 1] + groups + out[last + 1:]


def compose_config(overrides: list[str] = ()):
    """The validated Config for ``overrides``, as the command line would compose it (for tests,
    notebooks and scripts)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        dcfg = compose("config", overrides=rewrite_overrides(list(overrides)))
    return OmegaConf.to_object(dcfg)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(dcfg: DictConfig):
    from .runner import run_from_hydra

    return run_from_hydra(dcfg)


def main() -> None:
    sys.argv = [sys.argv[0]] + rewrite_overrides(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
