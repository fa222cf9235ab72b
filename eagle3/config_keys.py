"""Keys a schema does not know: the closest valid name, and the refusal of a composed config that
holds one (wherever the key came from). Works on any schema dataclass given to it (the root is
``eagle3.config.Config``), so the schema module calls it without this module importing the schema.
The command line's own checks (its keys, config groups, a sweep's jobs) are eagle3/preflight.py's."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from functools import lru_cache


class UnknownKeyError(ValueError):
    """A key the schema does not know (the CLI prints it as an invalid config)."""


@lru_cache(maxsize=None)
def schema_fields(cls) -> dict:
    """{field name: its type} of a schema dataclass, with the annotations resolved."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _all_keys(cls, prefix: str = "") -> list[str]:
    out = []
    for name, t in schema_fields(cls).items():
        out.append(prefix + name)
        if dataclasses.is_dataclass(t):
            out += _all_keys(t, f"{prefix}{name}.")
    return out


def free_form(t) -> bool:
    """A dict-typed field: any key goes below it."""
    return t is dict or t is typing.Any or typing.get_origin(t) is dict


def closest_key(key: str, schema) -> str | None:
    """The valid key of ``schema`` most like ``key``: each unknown part replaced by its closest
    sibling (``trian.lr`` -> ``train.lr``), else a key anywhere in the schema whose last part is most
    like ``key``'s (``train.fc_norm`` -> ``train.model.fc_norm``, ``lr`` -> ``train.lr``); None when
    nothing is close."""
    parts, node, out = key.split("."), schema, []
    for part in parts:
        fields = schema_fields(node) if dataclasses.is_dataclass(node) else {}
        match = part if part in fields else next(iter(difflib.get_close_matches(part, list(fields), 1, 0.6)), None)
        if match is None:
            break
        out.append(match)
        node = fields[match]
    else:
        return ".".join(out) if out != parts else None
    by_last: dict[str, list[str]] = {}
    for k in _all_keys(schema):
        by_last.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    match = difflib.get_close_matches(parts[-1], list(by_last), 1, 0.75)
    if not match:
        return None
    # of the keys with that last part, the one sharing most of the path typed
    return max(by_last[match[0]], key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())


def unknown_key_message(key: str, schema, value: str | None = None) -> str:
    suggestion = closest_key(key, schema)
    fix = f"did you mean {suggestion}{'' if value is None else '=' + value}?" if suggestion else "no key is close."
    return (f"unknown key {key}: {fix} (`python -m eagle3 --help` lists every key, eagle3/config.py documents "
            f"them; a `+` adds none: the schema has no free-form section)")


def check_config_keys(dcfg) -> None:
    """Refuse a composed DictConfig holding a key that is no field of its schema section (the
    schema: the structured config's own type)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    root = OmegaConf.get_type(dcfg)

    def walk(node, prefix: str):
        cls = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(cls):
            return
        fields = schema_fields(cls)
        for k in node.keys():
            if k not in fields:
                if not (prefix == "" and k == "hydra"):
                    raise UnknownKeyError(unknown_key_message(f"{prefix}{k}", root))
                continue
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                walk(child, f"{prefix}{k}.")
            elif isinstance(child, ListConfig):
                for i, item in enumerate(child._iter_ex(resolve=False)):
                    if isinstance(item, DictConfig):
                        walk(item, f"{prefix}{k}[{i}].")

    walk(dcfg, "")
