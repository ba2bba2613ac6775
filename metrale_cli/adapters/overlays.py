"""Token overlays: rows of the served embedding and output tables that an adapter replaces.

What PEFT 0.21 does with `trainable_token_indices` (checked against `TrainableTokensLayer`):
the adapter keeps whole rows, initialised from the base rows, and its forward writes them over
the table with `index_copy` (they replace the rows, they are not added to them); row i of
`<table>.token_adapter.trainable_tokens_delta [n, hidden]` becomes token `indices[i]`'s row.
A list of indices targets the input embedding; a dict names tables (`{"embed_tokens": [...],
"lm_head": [...]}`) and an untied lm_head then saves its own tensor. With tied embeddings PEFT
ties the lm_head wrapper to the embedding's: the same rows are used for the output logits and
only the embedding's tensor is saved.

Embedding LoRA (`lora_embedding_A/B`) is not an overlay: it adds a rank-r term to every row of
the table, so it stays refused (see audit).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metrale_cli.adapters.adapter import Adapter, AdapterKey
from metrale_cli.adapters.findings import Code, Collector, Severity
from metrale_cli.bf16 import LORA_DTYPES
from metrale_cli.files.safetensors_header import TensorInfo
from metrale_cli.model.config import ModelConfig

TABLES = ("embed_tokens", "lm_head")
OVERLAY_PART = "token_adapter.trainable_tokens_delta"


@dataclass(frozen=True)
class Overlay:
    """One table's replaced rows: `rows [len(tokens), hidden]` replace `tokens`' rows."""

    table: str
    tokens: tuple[int, ...]
    rows: TensorInfo
    # The output head uses these rows too (tied embeddings).
    tied_lm_head: bool = False
    mode: str = "replace"

    def record(self) -> dict[str, Any]:
        return {"table": self.table, "mode": self.mode, "tokens": len(self.tokens),
                "tied_lm_head": self.tied_lm_head, "dtype": self.rows.dtype}


@dataclass
class OverlayRaw:
    """One slot's overlays as uploaded to the serving engine: per table, the token ids
    (int64 `[n]`) and their rows (float32 `[n, hidden]`, exactly the file's values)."""

    tables: list[str] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    tied_lm_head: list[bool] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(len(t) for t in self.tokens)

    def record(self) -> list[dict[str, Any]]:
        return [{"table": t, "mode": "replace", "tokens": len(ids), "tied_lm_head": tied}
                for t, ids, tied in zip(self.tables, self.tokens, self.tied_lm_head,
                                        strict=True)]


def _indices(raw: Any) -> dict[str, list[Any]] | None:
    if raw is None or raw == [] or raw == {}:
        return {}
    if isinstance(raw, list):
        return {"embed_tokens": raw}
    if isinstance(raw, dict) and all(isinstance(v, list) for v in raw.values()):
        return {str(k): v for k, v in raw.items()}
    return None


def scan(adapter: Adapter, model: ModelConfig, keys: Iterable[AdapterKey],
         out: Collector) -> list[Overlay]:
    """Pair each `trainable_tokens_delta` tensor with its indices from the config and audit
    them: a known table, every id inside the vocabulary and listed once, rows `hidden` wide."""
    keys = list(keys)
    indices = _indices(adapter.config.raw.get("trainable_token_indices"))
    if indices is None:
        out.add(Severity.ERROR, Code.OVERLAY_CONFIG,
                "trainable_token_indices must be a list of token ids or a dict of lists")
        return []
    overlays: list[Overlay] = []
    used: set[str] = set()
    for key in keys:
        table = key.module_key.rsplit(".", 1)[-1]
        if table not in TABLES:
            out.add(Severity.ERROR, Code.OVERLAY_TABLE,
                    f"trainable token rows for {key.sub}: not the input embedding or the "
                    "output head, which are the only tables overlays replace rows of")
            continue
        name = next((k for k in indices if key.module_key == k
                     or key.module_key.endswith("." + k)), None)
        if name is None:
            out.add(Severity.ERROR, Code.OVERLAY_INDICES_MISSING,
                    f"{table}: the file has trainable token rows but trainable_token_indices "
                    "names no token ids for it")
            continue
        used.add(name)
        ids = indices[name]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            out.add(Severity.ERROR, Code.OVERLAY_CONFIG,
                    f"{table}: trainable_token_indices must be integers")
            continue
        info = adapter.tensor(key)
        if info.dtype not in LORA_DTYPES:
            out.add(Severity.ERROR, Code.BAD_DTYPE, f"{table} overlay rows: dtype {info.dtype}; "
                    f"must be {'/'.join(LORA_DTYPES)}")
            continue
        if info.shape != (len(ids), model.hidden_size):
            out.add(Severity.ERROR, Code.OVERLAY_SHAPE,
                    f"{table} overlay rows {list(info.shape)}: the config lists {len(ids)} "
                    f"token ids and the model's hidden_size is {model.hidden_size}, so "
                    f"[{len(ids)}, {model.hidden_size}]")
            continue
        bad = [t for t in ids if t < 0 or (model.vocab_size and t >= model.vocab_size)]
        if bad:
            out.add(Severity.ERROR, Code.OVERLAY_TOKEN_RANGE,
                    f"{table} overlay: token ids {bad[:8]} outside the vocabulary "
                    f"[0, {model.vocab_size})")
            continue
        dupes = sorted({t for t in ids if ids.count(t) > 1})
        if dupes:
            out.add(Severity.ERROR, Code.OVERLAY_DUPLICATE_TOKENS,
                    f"{table} overlay: token ids {dupes[:8]} listed twice; which row PEFT's "
                    "index_copy keeps is undefined")
            continue
        tied = table == "embed_tokens" and model.tie_word_embeddings
        overlays.append(Overlay(table, tuple(ids), info, tied_lm_head=tied))
    for name, ids in indices.items():
        if name not in used and ids:
            tied_head = name.endswith("lm_head") and model.tie_word_embeddings
            out.add(Severity.WARNING if tied_head else Severity.ERROR, Code.OVERLAY_MISSING,
                    f"trainable_token_indices names {len(ids)} tokens of {name} but the file "
                    "holds no rows for it" + (" (the head is tied to the embedding)"
                                              if tied_head else ""))
    for o in overlays:
        out.add(Severity.INFO, Code.TOKEN_OVERLAY,
                f"{len(o.tokens)} token rows replace the {o.table} rows of those tokens"
                + (" (and, tied, the lm_head rows)" if o.tied_lm_head else "")
                + " (PEFT's trainable tokens: index_copy, not an addition)")
    return overlays
