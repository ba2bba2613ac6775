"""Tensor- and expert-parallel shards of a pool: which slice of every LoRA weight a rank holds,
each rank's slot and expert layouts, the per-GPU capacity plan, and how a rank's slice is read
from an adapter file (docs/tensor-parallel.md).

N = `tp_size`, k = `tp_rank`, R = `max_rank`. A is `[R, in]`, B is `[out, R]`, as in a slot.

- Column-parallel (q_proj, k_proj, v_proj, gate_proj, up_proj): A whole; B output rows
  `[k*out/N, (k+1)*out/N)`. With fewer KV heads than N, k_proj/v_proj hold the one KV head
  `k // (N / num_kv_heads)`. A gated q_proj (`[query, gate]` per head) is sliced in whole heads.
  A fused projection (phi3's qkv_proj, phi3's and glm4's gate_up_proj: one LoRA pair over
  q|k|v or gate|up) splits each slice on its own by those rules, so a rank's B rows are one run
  per slice, concatenated in the slot's B as the engines concatenate them; A whole.
- Row-parallel (o_proj, down_proj, linear_attn.out_proj): A input columns `[k*in/N, ...)`; B
  whole. A rank's delta is a partial sum that the layer's all-reduce completes.
- Fully sharded (vLLM `fully_sharded_loras`): column layers also hold only A's rank rows
  `[k*R/N, (k+1)*R/N)`; row layers only B's output rows `[k*out/N, ...)`.
- Routers replicated; routed experts by the MoE TP degree N / M (gate/up B rows, down A
  columns), each of the M expert-parallel ranks holding a contiguous run of whole experts.

A rank's layout is `SlotLayout`'s construction over its shard shapes (layer, then module order,
A then B, aligned), and each entry records its `Slice` of the full weight. The unsharded layout,
its record and its fingerprint are untouched by any of this.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from metrale_cli.adapters.audit import AdapterReport
from metrale_cli.adapters.experts import ROUTER_EXPERT, ExpertPair, ExpertProj
from metrale_cli.arguments import checked_fields
from metrale_cli.errors import NotServable, UsageError
from metrale_cli.layout.expert_layout import EXPERT_LAYOUT_FORMAT, ExpertEntry, ExpertLayout
from metrale_cli.layout.plan import PoolPlan
from metrale_cli.layout.slot_layout import (
    LAYOUT_FORMAT,
    LayoutEntry,
    RowRuns,
    Slice,
    SlotLayout,
    fingerprint_of,
    place_pair,
)
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.families import ModuleSpec, Split
from metrale_cli.model.modules import LoraModule


@checked_fields("ShardSpec")
@dataclass(frozen=True)
class ShardSpec:
    """One rank of a TP deployment: `tp_size` ranks shard attention; the experts go to
    `ep_size` expert-parallel groups of `tp_size // ep_size` ranks each, which shard every
    expert among themselves (SGLang's `moe_tp = tp / ep`; `ep_size == tp_size` places every
    expert whole on one rank, as vLLM's expert parallelism does for base weights, though its
    fused-MoE LoRA layer refuses EP today)."""

    tp_size: int
    tp_rank: int = 0
    ep_size: int = 1
    fully_sharded: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise UsageError(f"--tp must be positive, got {self.tp_size}")
        if self.ep_size < 1:
            raise UsageError(f"--ep must be positive, got {self.ep_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise UsageError(f"rank {self.tp_rank} is out of range for --tp {self.tp_size}")
        if self.tp_size % self.ep_size:
            raise UsageError(f"--ep {self.ep_size} does not divide --tp {self.tp_size} (the "
                             "MoE TP degree is tp / ep)")
        if self.fully_sharded and self.ep_size > 1:
            raise UsageError("--ep with --fully-sharded is refused (vLLM refuses expert "
                             "parallelism with fully sharded LoRA)")

    @classmethod
    def from_options(cls, tp: int | None, ep: int | None,
                     fully_sharded: bool) -> ShardSpec | None:
        """Rank 0 of the deployment --tp/--ep/--fully-sharded name, or None without --tp."""
        if tp is None:
            if ep is not None or fully_sharded:
                raise UsageError("--ep and --fully-sharded need --tp")
            return None
        return cls(tp, 0, 1 if ep is None else ep, fully_sharded)

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    def all_ranks(self) -> list[ShardSpec]:
        """Every rank of this deployment, rank 0 first."""
        return [ShardSpec(self.tp_size, k, self.ep_size, self.fully_sharded)
                for k in range(self.tp_size)]

    def record(self) -> dict[str, Any]:
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank, "ep_size": self.ep_size,
                "ep_rank": self.ep_rank, "fully_sharded": self.fully_sharded}

    @classmethod
    def from_record(cls, doc: dict[str, Any]) -> ShardSpec:
        if not isinstance(doc["fully_sharded"], bool):
            raise ValueError(f"fully_sharded is {doc['fully_sharded']!r}, not true or false")
        spec = cls(int(doc["tp_size"]), int(doc["tp_rank"]), int(doc["ep_size"]),
                   doc["fully_sharded"])
        if spec.ep_rank != int(doc["ep_rank"]):
            raise ValueError(f"ep_rank {doc['ep_rank']} is not tp_rank // (tp_size / ep_size)")
        return spec


def _part(total: int, parts: int, part: int) -> tuple[int, int]:
    size = total // parts
    return part * size, (part + 1) * size


def _need(count: int, parts: int, what: str, flag: str) -> None:
    if count % parts:
        raise UsageError(f"{what} ({count}) does not split over {flag} {parts}")


def _named(model: ModelConfig, module: LoraModule, spec: ModuleSpec) -> str:
    """The module as a refusal names it: with its path where the family declares it at more
    than one (deepseek's gate_proj: the dense MLP's, the shared experts')."""
    paths = {m.path for m in model.family.modules if m.name == module.value}
    return f"{module.value} ({spec.path})" if len(paths) > 1 else module.value


def _slice_rows(model: ModelConfig, what: str, width: str | int, rows: int, n: int,
                k: int) -> tuple[int, int]:
    """The output rows `[lo, hi)` of one column-parallel slice `rows` wide (`width`, as the
    family names it) that rank k of n holds, within the slice: query heads (each with its gate
    on a gated model) or KV heads split whole, any other width by rows."""
    if width in ("q_width", "global_attn_width"):
        _need(model.num_attention_heads, n, f"{what} heads" + (
            " (each with its gate)" if model.attn_gated else ""), "--tp")
        return _part(rows, n, k)
    kv_heads = {"kv_width": (model.num_key_value_heads, model.head_dim),
                "global_kv_width": (model.global_kv_heads, model.global_head_width)}
    if width in kv_heads:
        kv, hd = kv_heads[width]
        if kv >= n:
            _need(kv, n, f"{what} KV heads", "--tp")
            return _part(rows, n, k)
        if n % kv:
            raise UsageError(f"{what}: {kv} KV heads neither split over --tp {n} nor divide "
                             "it (one KV head per rank needs tp a multiple of them)")
        # Fewer KV heads than ranks: each holds one whole head, as the base weight loader does.
        head = k // (n // kv)
        return head * hd, (head + 1) * hd
    _need(rows, n, f"{what} output rows", "--tp")
    return _part(rows, n, k)


def _column_rows(model: ModelConfig, module: LoraModule, layer: int, spec: ModuleSpec, n: int,
                 k: int) -> RowRuns:
    """B's output rows rank k of n holds: each slice of a fused projection split on its own
    (q, k, v by heads; gate, up by rows), as vLLM's QKVParallelLinearWithLoRA and
    ColumnParallelLinearWithLoRA (a merged base layer) and SGLang's slice_lora_b_weights cut
    one PEFT pair's B; runs that meet are one."""
    runs: list[tuple[int, int]] = []
    offset = 0
    for i, (width, rows) in enumerate(zip(spec.out, module.slices(model, layer), strict=True)):
        what = _named(model, module, spec) + (f" slice {i}" if spec.fused else "")
        lo, hi = _slice_rows(model, what, width, rows, n, k)
        if runs and runs[-1][1] == offset + lo:
            runs[-1] = (runs[-1][0], offset + hi)
        else:
            runs.append((offset + lo, offset + hi))
        offset += rows
    return tuple(runs)


def _row_cols(model: ModelConfig, module: LoraModule, layer: int, spec: ModuleSpec, n: int,
              k: int) -> tuple[int, int]:
    in_dim = module.dims(model, layer)[1]
    if spec.in_ in ("attn_width", "global_attn_width"):
        _need(model.num_attention_heads, n, "o_proj input heads", "--tp")
    elif spec.in_ == "linear_value_width":
        _need(model.linear_num_value_heads, n, "out_proj linear-attention value heads", "--tp")
    else:
        _need(in_dim, n, f"{_named(model, module, spec)} input columns", "--tp")
    return _part(in_dim, n, k)


def _rank_rows(max_rank: int, spec: ShardSpec) -> tuple[int, int] | None:
    if not spec.fully_sharded:
        return None
    _need(max_rank, spec.tp_size, "--fully-sharded: max rank", "--tp")
    return _part(max_rank, spec.tp_size, spec.tp_rank)


def module_slice(model: ModelConfig, module: LoraModule, layer: int, spec: ShardSpec,
                 max_rank: int) -> Slice:
    """The slice of `module`'s pair on `layer` that rank `spec.tp_rank` holds."""
    n, k = spec.tp_size, spec.tp_rank
    out_dim, in_dim = module.dims(model, layer)
    full = (out_dim, in_dim)
    declared = module.declared(model, layer)
    if declared.split is Split.REPLICATED:
        return Slice.whole(out_dim, in_dim)
    if declared.split is Split.COLUMN:
        return Slice(full, _column_rows(model, module, layer, declared, n, k), (0, in_dim),
                     _rank_rows(max_rank, spec))
    rows = (0, out_dim)
    if spec.fully_sharded:
        _need(out_dim, n, f"--fully-sharded: {_named(model, module, declared)} output rows",
              "--tp")
        rows = _part(out_dim, n, k)
    return Slice(full, (rows,), _row_cols(model, module, layer, declared, n, k))


def expert_slice(model: ModelConfig, proj: ExpertProj, spec: ShardSpec, max_rank: int) -> Slice:
    """The slice of one routed expert's (or the router's) pair a rank holds: the router whole;
    gate/up B rows and down A columns by the MoE TP degree."""
    out_dim, in_dim = proj.dims(model)
    full = (out_dim, in_dim)
    if proj is ExpertProj.ROUTER:
        return Slice.whole(out_dim, in_dim)
    m, j = spec.moe_tp_size, spec.moe_tp_rank
    inter = model.expert_intermediate_size
    _need(inter, m, "expert intermediate size", "MoE TP (tp / ep)")
    if proj is ExpertProj.DOWN_PROJ:
        rows = (0, out_dim)
        if spec.fully_sharded:
            _need(out_dim, spec.tp_size, "--fully-sharded: expert down_proj output rows", "--tp")
            rows = _part(out_dim, spec.tp_size, spec.tp_rank)
        return Slice(full, (rows,), _part(in_dim, m, j))
    return Slice(full, (_part(out_dim, m, j),), (0, in_dim), _rank_rows(max_rank, spec))


# The MoE blocks of vLLM's qwen3_moe.py and qwen3_next.py (which Qwen3.5-MoE reuses) raise
# "Tensor parallel size N is greater than the number of experts E".
_TP_BOUNDED_BY_EXPERTS = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")


def _model_need(model: ModelConfig, count: int, parts: int, what: str, flag: str,
                layer: str, who: str = "vLLM") -> None:
    if count % parts:
        verb = "does" if what.endswith("size") else "do"  # "query heads do", "a size does"
        raise UsageError(f"{model.source or model.model_type}: {what} ({count}) {verb} not "
                         f"split over {flag} {parts}; {who}'s {layer} would refuse to build")


def check_model_split(model: ModelConfig, spec: ShardSpec, who: str = "vLLM") -> None:
    """Refuse a deployment the base model cannot take, whatever the pool holds, as vLLM's
    parallel layers refuse to build: query heads over TP (QKVParallelLinear); KV heads over
    TP when there are at least TP of them, else TP a multiple of them (replicated heads);
    Gated-DeltaNet key and value heads over TP; the dense MLP's and the shared expert's
    intermediate size over TP (MergedColumnParallelLinear, RowParallelLinear); a routed
    expert's intermediate size over the MoE TP degree (FusedMoE); the experts over --ep, and
    --ep only on a model with routed experts. `who` names the engine in the refusal (SGLang's
    parallel layers, derived from vLLM's, split alike)."""
    n = spec.tp_size
    if model.attention_layers:
        _model_need(model, model.num_attention_heads, n, "query heads", "--tp",
                    "QKVParallelLinear", who)
        # gemma4's full-attention layers have KV heads of their own.
        for kv, what in ((model.num_key_value_heads, "KV heads"),
                         (model.num_global_key_value_heads, "full-attention KV heads")):
            if not kv:
                continue
            if kv >= n:
                _model_need(model, kv, n, what, "--tp", "QKVParallelLinear", who)
            elif n % kv:
                raise UsageError(f"{model.source or model.model_type}: {what} ({kv}) neither "
                                 f"split over --tp {n} nor divide it (replicated KV heads need "
                                 f"tp a multiple of them); {who}'s QKVParallelLinear would "
                                 "refuse to build")
    if model.linear_attention_layers:
        _model_need(model, model.linear_num_key_heads, n, "linear-attention key heads",
                    "--tp", "Gated-DeltaNet layer", who)
        _model_need(model, model.linear_num_value_heads, n, "linear-attention value heads",
                    "--tp", "Gated-DeltaNet layer", who)
    moe_layers = model.moe_layers
    # The dense layers' MLP width: llama4's is `intermediate_size_mlp` (its `intermediate_size`
    # is the experts' and the shared expert's).
    dense_width = model.intermediate_size_mlp or model.intermediate_size
    if len(moe_layers) < model.num_hidden_layers and dense_width:
        _model_need(model, dense_width, n, "MLP intermediate size", "--tp",
                    "MergedColumnParallelLinear", who)
    if spec.ep_size > 1 and not moe_layers:
        raise UsageError(f"--ep {spec.ep_size}: {model.source or model.model_type} has no "
                         "routed experts to split (expert parallelism needs an MoE model)")
    if not moe_layers:
        return
    if model.model_type in _TP_BOUNDED_BY_EXPERTS and n > model.num_experts:
        raise UsageError(f"{model.source or model.model_type}: --tp {n} is above the "
                         f"{model.num_experts} routed experts; {who}'s MoE block refuses it")
    _model_need(model, model.expert_intermediate_size, spec.moe_tp_size,
                "expert intermediate size", "MoE TP (tp / ep)", "FusedMoE", who)
    # The shared expert's width (deepseek's and glm4_moe's: their shared experts' sum).
    shared_width = model.shared_expert_intermediate_size or model.shared_experts_width
    if shared_width:
        _model_need(model, shared_width, n, "shared-expert intermediate size", "--tp",
                    "MergedColumnParallelLinear", who)
    _model_need(model, model.num_experts, spec.ep_size, "routed experts", "--ep",
                "expert map (metrale splits experts contiguously)", who)


def refuse_unshardable(reports: list[AdapterReport], spec: ShardSpec) -> None:
    """Refuse, as vLLM's fused-MoE LoRA layer does under `fully_sharded_loras`, an adapter
    whose routed-expert gate/up rank does not divide by TP: it slices each expert's A by rank
    and asserts `rank % tp_size == 0` (`FusedMoEWithLoRA._slice_w13_a`). Dense layers slice
    the padded A without that check, so their ranks are free."""
    if not spec.fully_sharded or spec.tp_size == 1:
        return
    for report in reports:
        bad = next((p for p in report.expert_pairs
                    if p.proj in (ExpertProj.GATE_PROJ, ExpertProj.UP_PROJ)
                    and p.r % spec.tp_size), None)
        if bad is not None:
            raise NotServable(f"{report.name}: routed-expert {bad.proj.value} rank {bad.r} "
                              f"(layer {bad.layer}, expert {bad.expert}) does not split over "
                              f"--tp {spec.tp_size} under --fully-sharded; vLLM's fused-MoE "
                              "LoRA refuses it (rank % tp must be 0)")


def owns_expert(model: ModelConfig, spec: ShardSpec, expert: int) -> bool:
    """Whether the rank's EP group holds `expert` (the router, expert -1, is everywhere)."""
    if expert == ROUTER_EXPERT or spec.ep_size == 1:
        return True
    _need(model.num_experts, spec.ep_size, "routed experts", "--ep")
    return expert // (model.num_experts // spec.ep_size) == spec.ep_rank


# -- per-rank layouts ---------------------------------------------------------------------------


class Sliced:
    """An entry over a shard: its `out_dim`/`in_dim` are the slice's, `slice` says where it
    sits in the full weight (recorded beside the entry's fields)."""

    slice: Slice

    @property
    def held(self) -> Slice:
        return self.slice

    def record(self) -> dict[str, Any]:
        return {**super().record(), "slice": self.slice.record()}  # type: ignore[misc]


@dataclass(frozen=True)
class ShardEntry(Sliced, LayoutEntry):
    slice: Slice


@dataclass(frozen=True)
class ShardExpertEntry(Sliced, ExpertEntry):
    slice: Slice


@dataclass(frozen=True)
class RankLayout(SlotLayout):
    """One rank's slot layout: the unsharded construction over the rank's shard shapes."""

    shard: ShardSpec = field(kw_only=True)

    @classmethod
    def of(cls, layout: SlotLayout, spec: ShardSpec) -> RankLayout:
        return cls(layout.model, layout.modules, layout.max_rank, layout.align, shard=spec)

    @cached_property
    def entries(self) -> tuple[ShardEntry, ...]:  # type: ignore[override]
        entries = []
        offset = 0
        # In layout order, so the first count that does not split is the one named; once per
        # family entry (a module whose widths differ by layer has one per group of layers).
        slices = {}
        for layer, module in self.applied():
            declared = module.declared(self.model, layer)
            if declared not in slices:
                slices[declared] = module_slice(self.model, module, layer, self.shard,
                                                self.max_rank)
            s = slices[declared]
            out_dim, in_dim = s.out_rows, s.cols[1] - s.cols[0]
            a_offset, b_offset, offset = place_pair(offset, out_dim, in_dim, self.max_rank,
                                                    self.align, s.a_rows(self.max_rank))
            entries.append(ShardEntry(layer, module, s, out_dim=out_dim, in_dim=in_dim,
                                      a_offset=a_offset, b_offset=b_offset,
                                      max_rank=self.max_rank))
        return tuple(entries)

    @cached_property
    def fingerprint(self) -> str:
        if all(e.slice.is_whole(self.max_rank) for e in self.entries):
            return super().fingerprint  # the unsharded bytes (--tp 1): the unsharded name
        canonical = {
            "format": LAYOUT_FORMAT, "dtype": "BF16", "align": self.align,
            "max_rank": self.max_rank, "slot_bytes": self.slot_bytes,
            "shard": self.shard.record(),
            "entries": [[e.layer, e.module.peft_name, e.out_dim, e.in_dim, e.a_offset,
                         e.b_offset, *e.slice.flat()] for e in self.entries],
        }
        return fingerprint_of(canonical)

    def record(self, max_loras: int | None = None) -> dict[str, Any]:
        return {**super().record(max_loras), "shard": self.shard.record()}


@dataclass(frozen=True)
class RankExpertLayout(ExpertLayout):
    """One rank's expert layout: its EP group's experts (and every router), each sliced by the
    MoE TP degree."""

    shard: ShardSpec = field(kw_only=True)

    @classmethod
    def of(cls, layout: ExpertLayout, spec: ShardSpec) -> RankExpertLayout:
        keys = tuple(k for k in layout.keys if owns_expert(layout.model, spec, k[2]))
        return cls(layout.model, keys, layout.max_rank, layout.align, shard=spec)

    def held_pairs(self, pairs: Iterable[ExpertPair]) -> list[ExpertPair]:
        """The pairs of the rank's expert-parallel group (and every router pair): the others
        live on other ranks."""
        return [p for p in pairs if owns_expert(self.model, self.shard, p.expert)]

    @cached_property
    def entries(self) -> tuple[ShardExpertEntry, ...]:  # type: ignore[override]
        entries = []
        offset = 0
        slices = {p: expert_slice(self.model, p, self.shard, self.max_rank)
                  for p in dict.fromkeys(k[1] for k in self.keys)}
        for layer, proj, expert in self.keys:
            s = slices[proj]
            out_dim, in_dim = s.out_rows, s.cols[1] - s.cols[0]
            a_offset, b_offset, offset = place_pair(offset, out_dim, in_dim, self.max_rank,
                                                    self.align, s.a_rows(self.max_rank))
            entries.append(ShardExpertEntry(layer, proj, expert, s, out_dim=out_dim,
                                            in_dim=in_dim, a_offset=a_offset,
                                            b_offset=b_offset, max_rank=self.max_rank))
        return tuple(entries)

    @cached_property
    def fingerprint(self) -> str:
        if all(e.slice.is_whole(self.max_rank) for e in self.entries):
            return super().fingerprint  # whole experts: an unsharded layout of these keys
        canonical = {
            "format": EXPERT_LAYOUT_FORMAT, "dtype": "BF16", "align": self.align,
            "max_rank": self.max_rank, "expert_slot_bytes": self.slot_bytes,
            "shard": self.shard.record(),
            "entries": [[e.layer, e.proj.value, e.expert, e.out_dim, e.in_dim, e.a_offset,
                         e.b_offset, *e.slice.flat()] for e in self.entries],
        }
        return fingerprint_of(canonical)

    def record(self, max_loras: int | None = None, entries: bool = True) -> dict[str, Any]:
        return {**super().record(max_loras, entries), "shard": self.shard.record()}


def rank_layouts(layout: SlotLayout, expert_layout: ExpertLayout | None,
                 spec: ShardSpec) -> tuple[RankLayout, RankExpertLayout | None]:
    """Rank `spec.tp_rank`'s slot layout and expert layout; UsageError names a count the
    deployment cannot split (the base model's, `check_model_split`, or the pool's)."""
    check_model_split(layout.model, spec)
    if spec.ep_size > 1 and expert_layout is None:
        raise UsageError(f"--ep {spec.ep_size} needs the expert pool (--experts): without it "
                         "no LoRA weight is split by expert")
    ranked = RankLayout.of(layout, spec)
    ranked.entries  # noqa: B018  (the rules run here, so a bad --tp fails before any work)
    ex = RankExpertLayout.of(expert_layout, spec) if expert_layout is not None else None
    if ex is not None:
        ex.entries  # noqa: B018
    return ranked, ex


def all_rank_layouts(layout: SlotLayout, expert_layout: ExpertLayout | None, spec: ShardSpec,
                     ) -> list[tuple[RankLayout, RankExpertLayout | None]]:
    """`rank_layouts` of every rank of `spec`'s deployment, rank 0 first. The base model's
    split is checked before any rank is made, so a --tp no model takes (10**20) is one
    UsageError, not a list of 10**20 ranks."""
    check_model_split(layout.model, spec)
    return [rank_layouts(layout, expert_layout, s) for s in spec.all_ranks()]


# -- the per-GPU plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedPlan:
    """A TP deployment's pool: every rank's plan at one `max_loras` (the ranks serve the same
    slots), so `--budget` is per GPU and the smallest fit wins. `plan` is the unsharded pool
    at the same `max_loras`, for comparison."""

    plan: PoolPlan
    ranks: tuple[PoolPlan, ...]
    spec: ShardSpec

    @classmethod
    def sized(cls, layout: SlotLayout, expert_layout: ExpertLayout | None, spec: ShardSpec,
              max_loras: int | None = None, budget_bytes: int | None = None) -> ShardedPlan:
        per_rank = all_rank_layouts(layout, expert_layout, spec)
        if budget_bytes is not None:
            if max_loras is not None:
                raise UsageError("give --max-loras or --budget, not both")
            max_loras = min(PoolPlan.sized(*r, budget_bytes=budget_bytes).max_loras or 0
                            for r in per_rank)
        ranks = tuple(PoolPlan(r[0], r[1], max_loras, budget_bytes) for r in per_rank)
        return cls(PoolPlan(layout, expert_layout, max_loras, budget_bytes), ranks, spec)

    def groups(self) -> list[list[int]]:
        """Ranks whose layouts place every byte alike (same shard shapes and offsets)."""
        found: dict[tuple[Any, ...], list[int]] = {}
        for k, p in enumerate(self.ranks):
            key: tuple[Any, ...] = tuple((e.out_dim, e.in_dim, e.a_offset, e.b_offset)
                                         for e in p.layout.entries)
            if p.expert_layout is not None:
                key += (p.expert_layout.slot_bytes, len(p.expert_layout.entries))
            found.setdefault(key, []).append(k)
        return list(found.values())

    def record(self) -> dict[str, Any]:
        n = self.plan.max_loras
        layouts = []
        for ranks in self.groups():
            p = self.ranks[ranks[0]]
            ex = p.expert_layout
            ex_fingerprints = [x.fingerprint for k in ranks
                               if (x := self.ranks[k].expert_layout) is not None]
            layouts.append({
                "ranks": ranks,
                "slot_bytes": p.layout.slot_bytes,
                "expert_slot_bytes": ex.slot_bytes if ex is not None else None,
                "bytes_per_slot": p.bytes_per_slot,
                "pool_bytes": p.layout.pool_bytes(n) if n is not None else None,
                "table_bytes": p.layout.table_bytes(n) if n is not None else None,
                "total_bytes": p.total_bytes,
                "fingerprints": [self.ranks[k].layout.fingerprint for k in ranks],
                "expert_fingerprints": ex_fingerprints if ex is not None else None,
            })
        return {**self.plan.record(), "tp_size": self.spec.tp_size,
                "ep_size": self.spec.ep_size, "fully_sharded": self.spec.fully_sharded,
                "rank_layouts": layouts}
