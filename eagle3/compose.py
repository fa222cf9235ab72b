"""Composing eagle3's config as the command line does, for the command line (eagle3/__main__.py),
tests, notebooks, scripts and eagle3.dashboard: the public keys mapped onto Hydra's overrides, then
Hydra's compose and the schema's validation. Only Hydra, OmegaConf and the config schemas load here."""
from __future__ import annotations

from .config import CONF_DIR, register_configs

register_configs()


def _presets() -> set[str]:
    return {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")}


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
    return _insert(out, groups)


def _insert(args: list[str], extra: list[str]) -> list[str]:
    """``extra`` next to the last override: Hydra's parser takes the overrides as one run of
    positionals, so an override appended after a flag (`... --cfg job`) would be refused as an
    unknown argument."""
    last = max((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), default=len(args) - 1)
    return args[:last + 1] + extra + args[last + 1:]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def compose_config(overrides: list[str] = ()):
    """The validated Config for ``overrides``, as the command line would compose it (for tests,
    notebooks and scripts)."""
    from .config import to_config
    from .preflight import check_override_keys

    overrides = rewrite_overrides(list(overrides))
    check_override_keys(overrides)
    return to_config(_compose(overrides))
