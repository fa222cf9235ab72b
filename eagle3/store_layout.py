"""What every shard of a hidden-state store holds (:class:`StoreLayout`), as one value: derived once
(eagle3.extract.layout.derive_store_layout), carried whole by the extract stage's facts
(``ExtractFacts.layout``), the store's metadata (store.json, read back with
:meth:`StoreLayout.from_json`), the backends and online training. Imports nothing beyond the
standard library, so the stages' contracts (eagle3.contracts) can hold it.
"""
from __future__ import annotations

from dataclasses import dataclass

FORMAT = "eagle3.hidden_states/1"
FORMAT_FP8 = "eagle3.hidden_states/2"  # float8 values + float32 scales (dtype "fp8")
FORMATS = (FORMAT, FORMAT_FP8)
_ST_DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2), "fp8": ("F8_E4M3", 1)}


@dataclass(frozen=True)
class StoreLayout:
    """What every shard of a store holds; identical for all shards and all processes."""

    layer_ids: tuple          # aux layer ids, ascending
    last_layer_id: int        # L (num_hidden_layers): the final pre-norm state
    hidden_size: int
    dtype: str                # float32 | bfloat16 | float16 | fp8 (float8 e4m3 + a float32 scale per row)
    target_hash: str = ""     # identity of the target (eagle3.target), "" when unknown

    def __post_init__(self):
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))  # JSON gives a list
        if self.dtype not in _ST_DTYPES:
            raise ValueError(f"store dtype {self.dtype!r} is not one of {sorted(_ST_DTYPES)}")
        if list(self.layer_ids) != sorted(set(self.layer_ids)):
            raise ValueError(f"layer ids must be distinct and ascending, got {self.layer_ids}")

    @property
    def itemsize(self) -> int:
        return _ST_DTYPES[self.dtype][1]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def format(self) -> str:
        return FORMAT_FP8 if self.is_fp8 else FORMAT

    @property
    def n_aux(self) -> int:
        return len(self.layer_ids)

    @property
    def hidden_bytes_per_token(self) -> int:
        """Values, and for fp8 the float32 scales (one per layer)."""
        return (self.n_aux + 1) * (self.hidden_size * self.itemsize + (4 if self.is_fp8 else 0))

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes per token: hidden states + input id (int32) + loss mask (uint8)."""
        return self.hidden_bytes_per_token + 5

    def metadata(self) -> dict:
        return {"format": self.format, "layer_ids": ",".join(map(str, self.layer_ids)),
                "last_layer_id": str(self.last_layer_id), "hidden_size": str(self.hidden_size),
                "dtype": self.dtype, "target_hash": self.target_hash}

    def to_json(self) -> dict:
        return {"layer_ids": list(self.layer_ids), "last_layer_id": self.last_layer_id,
                "hidden_size": self.hidden_size, "dtype": self.dtype, "target_hash": self.target_hash}

    @classmethod
    def from_json(cls, data: dict) -> "StoreLayout":
        """The layout :meth:`to_json` wrote, alone or inside a larger record (store.json holds it
        beside its splits); ``target_hash`` absent (a store written before it was recorded): ""."""
        return cls(layer_ids=data["layer_ids"], last_layer_id=int(data["last_layer_id"]),
                   hidden_size=int(data["hidden_size"]), dtype=data["dtype"], target_hash=data.get("target_hash") or "")
