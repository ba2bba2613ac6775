"""`metrale unpack`: one slot of a pool image back as a PEFT LoRA adapter directory.

The slot's modules are written at the slot's rank `r` (rows and columns past a module's own rank
are the pool's zero padding, which adds nothing to a delta) with `lora_alpha` such that PEFT's
scaling is the slot's scale; the per-module scaling ratios `pack` folded into B stay in B, since
pool/1 does not record them separately. Every module's delta `scale * B @ A` is then exactly the
pool's. Expert LoRA is written in transformers-5 fused form (`target_parameters`), token
overlays as PEFT trainable tokens.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from metrale_cli.adapters.adapter import CONFIG_NAME, WEIGHTS_NAME
from metrale_cli.adapters.overlays import OVERLAY_PART
from metrale_cli.bf16 import non_finite
from metrale_cli.errors import NonFiniteWeights, UsageError
from metrale_cli.files.atomic import atomic_directory
from metrale_cli.files.pieces import PieceWriter
from metrale_cli.files.safetensors_header import adapter_header
from metrale_cli.image.check import check, digest_state
from metrale_cli.image.format import ImageTables, read_tables
from metrale_cli.layout.sharding import RankLayout

ADAPTER_PREFIX = "base_model.model."


@dataclass(frozen=True)
class UnpackResult:
    path: Path
    slot: int
    name: str
    rank: int
    lora_alpha: float
    modules: int
    overlay_tables: list[str]
    bytes: int
    digests: str  # check.digest_state: `checked`, or `none` for an image without digests

    def record(self) -> dict[str, Any]:
        return {"path": str(self.path), "slot": self.slot, "name": self.name, "r": self.rank,
                "lora_alpha": self.lora_alpha, "modules": self.modules,
                "overlays": self.overlay_tables, "bytes": self.bytes, "digests": self.digests}


def pick_slot(t: ImageTables, slot: int | None, name: str | None) -> int:
    """`--slot K` or `--name NAME` (exactly one) to a filled slot."""
    if (slot is None) == (name is None):
        raise UsageError("give exactly one of --slot and --name")
    if name is not None:
        # An empty name marks an empty slot: no adapter is named "" (it wrote an empty one).
        found = [k for k, s in enumerate(t.slots_doc) if name and s.get("name") == name]
        if not found:
            held = ", ".join(s["name"] for s in t.slots_doc if s.get("name")) or "none"
            raise UsageError(f"no slot of {t.path} holds {name!r} (it holds: {held})")
        return found[0]
    assert slot is not None
    if not 0 <= slot < t.max_loras:
        raise UsageError(f"--slot {slot} is outside [0, {t.max_loras})")
    if not t.slots_doc[slot].get("name"):
        raise UsageError(f"slot {slot} of {t.path} holds no adapter")
    return slot


def adapter_tensors(t: ImageTables, slot: int) -> tuple[dict[str, tuple[str, list[int], bytes]],
                                                         dict[str, Any]]:
    """The slot's tensors in PEFT's names (`name -> (dtype, shape, bytes)`) and its config."""
    rank, max_rank = int(t.ranks[slot]), t.layout.max_rank
    prefix = t.model.language_model
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    targets: list[str] = []
    pool = t.tensor("pool")
    fd = os.open(t.path, os.O_RDONLY)
    try:
        for i, e in enumerate(t.layout.entries):
            a_off, b_off = int(t.a_offsets[i, slot]), int(t.b_offsets[i, slot])
            if a_off < 0:
                continue
            path = f"{prefix}.layers.{e.layer}.{e.module.path_in(t.model, e.layer)}"
            targets.append(path)
            # A [max_rank, in] keeps its first `rank` rows; B [out, max_rank] its first columns.
            a = np.frombuffer(os.pread(fd, e.a_bytes, pool.begin + a_off), dtype="<u2")
            b = np.frombuffer(os.pread(fd, e.b_bytes, pool.begin + b_off), dtype="<u2")
            _refuse_non_finite(t, slot, f"layer {e.layer} {e.module.peft_name}", a, b)
            a = a.reshape(max_rank, e.in_dim)[:rank]
            b = b.reshape(e.out_dim, max_rank)[:, :rank]
            key = ADAPTER_PREFIX + path
            tensors[f"{key}.lora_A.weight"] = ("BF16", [rank, e.in_dim], a.tobytes())
            tensors[f"{key}.lora_B.weight"] = ("BF16", [e.out_dim, rank],
                                               np.ascontiguousarray(b).tobytes())
        token_indices: dict[str, list[int]] = {}
        for run in t.overlay_runs(slot):
            start, count = int(run["start"]), int(run["count"])
            rows = t.tensor("overlay_rows")
            hidden = rows.shape[1]
            assert t.overlay_tokens is not None
            table = str(run["table"])
            token_indices[table] = [int(x) for x in t.overlay_tokens[start:start + count]]
            data = os.pread(fd, count * hidden * 4, rows.begin + start * hidden * 4)
            if not np.isfinite(np.frombuffer(data, dtype="<f4")).all():
                raise NonFiniteWeights(f"{t.path}: slot {slot}: the {table} overlay rows hold "
                                       "NaN or infinity; pack never writes them, refusing to "
                                       "unpack it")
            where = f"{prefix}.embed_tokens" if table == "embed_tokens" else "lm_head"
            tensors[f"{ADAPTER_PREFIX}{where}.{OVERLAY_PART}"] = ("F32", [count, hidden], data)
        experts = _expert_tensors(t, slot, fd, prefix)
    finally:
        os.close(fd)
    scale = float(t.scales[slot])
    slot_doc = t.slots_doc[slot]
    alpha, rslora = config_alpha(slot_doc.get("alpha"), rank, scale)

    def alpha_at(r: int) -> float:
        """The alpha that gives rank `r` the slot's scale, in the config's form."""
        return scale * (math.sqrt(r) if rslora else r)

    tensors.update(experts.tensors)
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        # PEFT's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is the slot's scale, with
        # every module's own ratio already in its B.
        "lora_alpha": alpha, "use_rslora": rslora, "lora_dropout": 0.0, "bias": "none",
        "target_modules": targets,
        # Expert parameters at another rank keep the slot's scale through their own alpha.
        "rank_pattern": {p: r for p, r in experts.ranks.items() if r != rank},
        "alpha_pattern": {p: alpha_at(r) for p, r in experts.ranks.items() if r != rank},
        "base_model_name_or_path": t.model.source or None,
        "metrale": {"image": str(t.path), "slot": slot, "name": slot_doc.get("name"),
                    "packed_from": slot_doc.get("source"), "alpha": slot_doc.get("alpha")},
    }
    if experts.ranks:
        config["target_parameters"] = list(experts.ranks)
    if token_indices:
        config["trainable_token_indices"] = token_indices
    return tensors, config


def _refuse_non_finite(t: ImageTables, slot: int, entry: str, a: np.ndarray,
                       b: np.ndarray) -> None:
    """NonFiniteWeights naming the slot, layer and module where A or B (BF16 bits) holds NaN
    or infinity: pack refuses them, so such bytes are damage, not an adapter."""
    for part, bits in (("A", a), ("B", b)):
        bad = non_finite(bits)
        if bad:
            name = t.slots_doc[slot].get("name")
            raise NonFiniteWeights(f"{t.path}: slot {slot} ({name}): {entry} {part} holds "
                                   f"{bad:,} non-finite values (NaN or infinity); pack never "
                                   "writes them, refusing to unpack it")


def config_alpha(recorded: Any, rank: int, scale: float) -> tuple[float, bool]:
    """(lora_alpha, use_rslora) for a slot of `rank` and `scale`: the slot's recorded alpha in
    the form that gives exactly its scale (alpha / r, else rsLoRA's alpha / sqrt(r)), as the
    adapter was written; else (scale * r, False), which PEFT scales the same."""
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded > 0:
        for rslora, divisor in ((False, rank), (True, math.sqrt(rank))):
            if np.float32(recorded / divisor) == np.float32(scale):
                return float(recorded), rslora
    return scale * rank, False


@dataclass
class _Experts:
    tensors: dict[str, tuple[str, list[int], bytes]] = field(default_factory=dict)
    # target_parameters entry -> its rank, in the order PEFT nests the wrappers.
    ranks: dict[str, int] = field(default_factory=dict)


def _expert_tensors(t: ImageTables, slot: int, fd: int, prefix: str) -> _Experts:
    """The slot's expert pool in transformers-5 fused form, what PEFT's `target_parameters`
    saves: per MoE layer `mlp.experts` `lora_A [E*r, in]` and `lora_B [out, E*r]` (expert
    `e`'s B in columns `e, E + e, ...`), gate_up's rows `[gate; up]` (gpt_oss's
    interleaved); the router `mlp.gate` `A [r, H]`, `B [E, r]`. With both fused parameters
    PEFT nests the wrappers, the first target (gate_up) inner at `experts.base_layer`.
    Experts the slot does not adapt are zero. The block is the family's (`mlp`, granitemoe's
    `block_sparse_moe`)."""
    done = _Experts()
    block = t.model.family.fused_experts_block
    gate_up_param, down_param = f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"
    router_param = f"{block}.gate.weight"
    ex, offsets = t.expert_layout, t.expert_a_offsets
    if ex is None or offsets is None or not (offsets[:, slot] >= 0).any():
        return done
    assert t.expert_b_offsets is not None
    info = t.tensor("expert_pool")
    factors: dict[tuple[int, str, int], tuple[np.ndarray, np.ndarray]] = {}
    for i, e in enumerate(ex.entries):
        a_off, b_off = int(offsets[i, slot]), int(t.expert_b_offsets[i, slot])
        if a_off < 0:
            continue
        a = np.frombuffer(os.pread(fd, e.a_bytes, info.begin + a_off), dtype="<u2")
        b = np.frombuffer(os.pread(fd, e.b_bytes, info.begin + b_off), dtype="<u2")
        _refuse_non_finite(t, slot, t.entry_name("expert_pool", i), a, b)
        factors[(e.layer, e.proj.value, e.expert)] = (a.reshape(e.max_rank, e.in_dim),
                                                      b.reshape(e.out_dim, e.max_rank))
    model, r = t.model, ex.max_rank
    n_e, hidden, inter = model.num_experts, model.hidden_size, model.expert_intermediate_size
    projs = {p for _, p, _ in factors}
    # gate and up of one expert share A when they came from one fused gate_up (rank r);
    # otherwise gate_up is block-diagonal over [gate; up] at rank 2r, as PEFT's own rewrite.
    shared = all(np.array_equal(factors[(layer, "gate_proj", x)][0],
                                factors[(layer, "up_proj", x)][0])
                 for layer, p, x in factors if p == "gate_proj"
                 and (layer, "up_proj", x) in factors)
    gate_up_rank = r if shared else 2 * r
    if projs & {"gate_proj", "up_proj"}:
        done.ranks[gate_up_param] = gate_up_rank
    if "down_proj" in projs:
        done.ranks[down_param] = r
    if "router" in projs:
        done.ranks[router_param] = r
    # gate_up's output rows: [gate; up], or gate and up interleaved (gpt_oss), as PEFT has them.
    rows = ((slice(0, None, 2), slice(1, None, 2)) if model.family.experts_gate_up == "interleaved"
            else (slice(0, inter), slice(inter, None)))
    swapped = model.family.experts_peft_swapped
    for layer in model.moe_layers:
        base = f"{ADAPTER_PREFIX}{prefix}.layers.{layer}.{block}"
        nested = gate_up_param in done.ranks and down_param in done.ranks
        if gate_up_param in done.ranks:
            a_all = np.zeros((n_e, gate_up_rank, hidden), dtype="<u2")
            b_all = np.zeros((2 * inter, gate_up_rank, n_e), dtype="<u2")
            for x in range(n_e):
                for half, proj in enumerate(("gate_proj", "up_proj")):
                    if (layer, proj, x) not in factors:
                        continue
                    a, b = factors[(layer, proj, x)]
                    cols = slice(0, r) if shared else slice(half * r, (half + 1) * r)
                    a_all[x, cols] = a
                    b_all[rows[half], cols, x] = b
            _put_fused(done, f"{base}.experts{'.base_layer' if nested else ''}", a_all, b_all,
                       swapped)
        if down_param in done.ranks:
            a_all = np.zeros((n_e, r, inter), dtype="<u2")
            b_all = np.zeros((hidden, r, n_e), dtype="<u2")
            for x in range(n_e):
                if (layer, "down_proj", x) in factors:
                    a_all[x], b_all[:, :, x] = factors[(layer, "down_proj", x)]
            _put_fused(done, f"{base}.experts", a_all, b_all, swapped)
        if router_param in done.ranks:
            a, b = factors.get((layer, "router", -1), (np.zeros((r, hidden), dtype="<u2"),
                                                       np.zeros((n_e, r), dtype="<u2")))
            _put(done, f"{base}.gate", a, b)
    return done


def _put_fused(done: _Experts, key: str, a: np.ndarray, b: np.ndarray, swapped: bool) -> None:
    """Every expert's A `[E, r, in]` and B `[out, r, E]` as PEFT's `lora_A [E*r, in]`,
    `lora_B [out, r*E]`; where PEFT swaps in and out (llama4) its lora_A is the B side,
    `[E*r, out]`, and its lora_B the A side, `[in, r*E]`."""
    if swapped:
        a, b = b.transpose(2, 1, 0), a.transpose(2, 1, 0)
    n_e, r = a.shape[:2]
    _put(done, key, a.reshape(n_e * r, -1), b.reshape(b.shape[0], -1))


def _put(done: _Experts, key: str, a: np.ndarray, b: np.ndarray) -> None:
    done.tensors[f"{key}.lora_A.weight"] = ("BF16", list(a.shape),
                                            np.ascontiguousarray(a).tobytes())
    done.tensors[f"{key}.lora_B.weight"] = ("BF16", list(b.shape),
                                            np.ascontiguousarray(b).tobytes())


def _safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]]) -> list[bytes]:
    head = adapter_header((name, dtype, shape, len(data))
                          for name, (dtype, shape, data) in tensors.items())
    return [head, *(d for _, _, d in tensors.values())]


def unpack(image: str | Path, out_dir: str | Path, slot: int | None = None,
           name: str | None = None, force: bool = False) -> UnpackResult:
    """Write one slot of `image` as a PEFT adapter directory at `out_dir`, atomically
    (atomic.atomic_directory): built in a temporary directory beside it, then renamed into place
    without replacing what a concurrent writer put there, or swapped in with `force`."""
    t = read_tables(image)
    check(t, contents=True)  # a flipped bit anywhere in the pool is refused
    if isinstance(t.layout, RankLayout):
        # Its modules hold slices: under the full model's names they would be a wrong-shaped
        # adapter (a fully sharded A does not even have max_rank rows).
        spec = t.layout.shard
        raise UsageError(f"{t.path} is rank {spec.tp_rank} of a tensor-parallel deployment "
                         f"(tp {spec.tp_size}): its slots hold slices; unpack reads an "
                         "unsharded image (pack without --tp)")
    k = pick_slot(t, slot, name)
    if not str(out_dir).strip():
        raise UsageError("the adapter directory is empty")
    out = Path(out_dir)
    configs: list[dict[str, Any]] = []

    def fill(tmp: Path) -> None:
        tensors, config = adapter_tensors(t, k)
        configs.append(config)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        with (tmp / WEIGHTS_NAME).open("wb") as f:
            out = PieceWriter(f)  # large aligned writes: 2 MiB folios, which `pack` reads faster
            for chunk in _safetensors_bytes(tensors):
                out.write(chunk)
            out.finish()
            f.flush()
            os.fsync(f.fileno())

    atomic_directory(out, fill, force, owned=[CONFIG_NAME, WEIGHTS_NAME])
    config = configs[0]
    size = sum(p.stat().st_size for p in out.iterdir())
    return UnpackResult(out, k, str(t.slots_doc[k].get("name")), int(t.ranks[k]),
                        float(config["lora_alpha"]), len(config["target_modules"]),
                        list(config.get("trainable_token_indices", {})), size,
                        digest_state(t, checked=True))
