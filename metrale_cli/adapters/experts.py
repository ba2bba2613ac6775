"""Routed-expert and router LoRA: the expert pool beside the slot pool.

Two on-disk formats name the same thing (docs/peft_format.md §2.5, §2.6):

- transformers-4 per-expert Linears: `mlp.experts.{e}.gate_proj|up_proj|down_proj` (Mixtral
  `block_sparse_moe.experts.{e}.w1|w3|w2`), each a plain `A [r, in]`, `B [out, r]`;
- transformers-5 fused `target_parameters`: `mlp.experts(.base_layer).lora_A [E*r, in]` and
  `lora_B [out, E*r]`, expert e's factors `A.reshape(E, r, in)[e]` and
  `B.reshape(out, r, E)[:, :, e]` (the expert index runs fastest along B's columns), with
  `gate_up_proj`'s rows `[gate; up]` (gpt_oss: gate and up interleaved, `B[0::2]`, `B[1::2]`;
  llama4: PEFT swaps in and out, so A holds the output side and B the input side).

Both, and the router (`mlp.gate` / `block_sparse_moe.gate`: `A [r, H]`, `B [E, r]`), are
normalised to `ExpertPair`s, one rank-r pair per (layer, projection, expert) that says where its
A and B sit in the file's tensors. `expert_pool.py` lays such pairs out in the expert pool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from metrale_cli.adapters.adapter import Adapter, AdapterKey
from metrale_cli.adapters.findings import Code, Collector, Severity
from metrale_cli.adapters.pair_checks import check_pair, rank_and_scale
from metrale_cli.files.safetensors_header import TensorInfo
from metrale_cli.model.config import ModelConfig
from metrale_cli.model.families import FAMILIES

ROUTER_EXPERT = -1


class ExpertProj(str, Enum):
    GATE_PROJ = "gate_proj"
    UP_PROJ = "up_proj"
    DOWN_PROJ = "down_proj"
    # The MoE router (`mlp.gate`): hidden to expert logits, one per layer.
    ROUTER = "router"

    def dims(self, model: ModelConfig) -> tuple[int, int]:
        """`(out_dim, in_dim)` of one expert's base projection (the router's: `(E, H)`)."""
        h, i = model.hidden_size, model.expert_intermediate_size
        if self is ExpertProj.ROUTER:
            return model.num_experts, h
        if self is ExpertProj.DOWN_PROJ:
            return h, i
        return i, h


_PROJ_ORDER = {p: n for n, p in enumerate(ExpertProj)}
# v4 leaf names of every family's spelling (Mixtral's w1/w3/w2 are gate/up/down), and the MoE
# blocks they sit in (model/families.py): a key is read the same whatever the base model.
_V4_LEAF = {leaf: ExpertProj(proj) for f in FAMILIES.values() for proj, leaf in f.expert_leaves}
EXPERT_LEAF_NAMES = tuple(_V4_LEAF)
_BLOCKS = "|".join(sorted({f.moe_block for f in FAMILIES.values()}))
EXPERT_KEY = re.compile(
    rf"^({_BLOCKS})\.experts\.(\d+)\.({'|'.join(map(re.escape, EXPERT_LEAF_NAMES))})$")
FUSED_EXPERTS_KEY = re.compile(rf"^({_BLOCKS})\.experts$")
ROUTER_KEY = re.compile(rf"^({_BLOCKS})\.gate$")


def is_expert_key(sub: str) -> bool:
    """A decoder-layer path that names routed experts or the router (either format)."""
    return bool(EXPERT_KEY.match(sub) or FUSED_EXPERTS_KEY.match(sub) or ROUTER_KEY.match(sub))


def entry_sort_key(layer: int, proj: ExpertProj, expert: int) -> tuple[int, int, int]:
    """Layer, then the router (expert -1), then expert-major gate/up/down."""
    return (layer, expert, _PROJ_ORDER[proj])


@dataclass(frozen=True)
class ExpertPair:
    """One rank-r pair of one (layer, projection, expert), and where it sits in the file.

    A is rows `[a_row, a_row + r)` of the file's A tensor (all columns). B is rows
    `b_row + k * b_row_step` (k < out_dim) and columns `b_col + j * b_col_step` (j < r) of the
    file's B: a per-expert v4 pair is the whole of both tensors (0, 0, 0, 1); a fused v5 pair
    has `a_row = e * r`, `b_col = e`, `b_col_step = E`, and gate/up take `b_row` 0 and I
    (stacked) or 0 and 1 with `b_row_step = 2` (interleaved, gpt_oss).

    `swapped` (llama4, whose experts PEFT wraps with in and out swapped): the file's B holds
    the pair's A side and its A the B side: the pair's A is the transpose of the file B's
    columns `b_col + j * b_col_step` (all rows), its B the transpose of the file A's rows
    `[a_row, a_row + r)`, columns `[b_row, b_row + out_dim)`.
    """

    layer: int
    proj: ExpertProj
    expert: int
    r: int
    alpha: float
    scaling: float
    out_dim: int
    in_dim: int
    a: TensorInfo
    b: TensorInfo
    a_row: int = 0
    b_row: int = 0
    b_col: int = 0
    b_col_step: int = 1
    b_row_step: int = 1
    swapped: bool = False
    # "v4" (per-expert Linears) or "v5" (fused target_parameters).
    source: str = "v4"

    @property
    def key(self) -> tuple[int, ExpertProj, int]:
        return (self.layer, self.proj, self.expert)

    @property
    def file_bytes(self) -> int:
        """The bytes of the file this pair's values occupy (for progress and throughput)."""
        a_item, b_item = self.a.nbytes // self.a.numel, self.b.nbytes // self.b.numel
        return self.r * self.in_dim * a_item + self.out_dim * self.r * b_item


def coverage(pairs: Iterable[ExpertPair]) -> list[dict[str, Any]]:
    """Per layer: how many experts each projection adapts, the ranks, and the router."""
    by_layer: dict[int, dict[str, Any]] = {}
    for p in pairs:
        row = by_layer.setdefault(p.layer, {"layer": p.layer, "router": False, "experts": {},
                                            "ranks": set(), "source": p.source})
        if p.proj is ExpertProj.ROUTER:
            row["router"] = True
        else:
            row["experts"].setdefault(p.proj.value, set()).add(p.expert)
        row["ranks"].add(p.r)
    out = []
    for layer in sorted(by_layer):
        row = by_layer[layer]
        projs = sorted(row["experts"].items(), key=lambda kv: _PROJ_ORDER[ExpertProj(kv[0])])
        out.append({
            "layer": layer,
            "router": row["router"],
            "experts": {k: len(v) for k, v in projs},
            "ranks": sorted(row["ranks"]),
            "source": row["source"],
        })
    return out


# -- the scan -----------------------------------------------------------------------------------


def scan(
    adapter: Adapter,
    model: ModelConfig,
    modules: dict[str, dict[str, AdapterKey]],
    out: Collector,
) -> list[ExpertPair]:
    """Normalise the expert and router modules of `adapter` (`module_key -> part -> key`, the
    inner ParamWrapper's parts suffixed `.inner`) into pairs, reporting what does not fit."""
    pairs: list[ExpertPair] = []
    for module_key, parts in modules.items():
        key = next(iter(parts.values()))
        layer, sub = key.layer, key.sub
        assert layer is not None  # callers pass decoder-layer keys only
        if not model.num_experts:
            out.at(Severity.ERROR, Code.MODULE_NOT_APPLICABLE,
                   f"{sub}{{where}}: the model has no routed experts", layer)
            continue
        if model.family.experts_unreadable:
            out.at(Severity.ERROR, Code.EXPERT_LORA,
                   f"{sub}{{where}}: {model.model_type}'s routed experts "
                   f"{model.family.experts_unreadable}; the expert pool does not read that "
                   "layout", layer)
            continue
        if layer >= model.num_hidden_layers or not model.is_moe_layer(layer):
            where = ("past the model's layers" if layer >= model.num_hidden_layers
                     else "a dense-MLP layer (no routed experts there)")
            out.at(Severity.ERROR, Code.MODULE_NOT_APPLICABLE, f"{sub}{{where}}: {where}", layer)
            continue
        v4 = EXPERT_KEY.match(sub)
        if v4:
            pairs.extend(_scan_linear(adapter, model, module_key, parts, layer,
                                      _V4_LEAF[v4.group(3)], int(v4.group(2)), out))
        elif ROUTER_KEY.match(sub):
            pairs.extend(_scan_linear(adapter, model, module_key, parts, layer,
                                      ExpertProj.ROUTER, ROUTER_EXPERT, out))
        else:
            pairs.extend(_scan_fused(adapter, model, module_key, parts, layer, out))
    _check_rsLoRA_rewrite(adapter, model, pairs, out)
    pairs.sort(key=lambda p: entry_sort_key(*p.key))
    return pairs


def _scan_linear(
    adapter: Adapter, model: ModelConfig, module_key: str, parts: dict[str, AdapterKey],
    layer: int, proj: ExpertProj, expert: int, out: Collector,
) -> list[ExpertPair]:
    """A per-expert v4 Linear or a router (v4 Linear or v5 `gate.weight` parameter): plain
    `A [r, in]`, `B [out, r]`."""
    what = (f"router {module_key.rsplit('.', 2)[-2]}.gate" if proj is ExpertProj.ROUTER
            else f"expert {expert} {proj.value}")
    if expert >= model.num_experts:
        out.at(Severity.ERROR, Code.EXPERT_OUT_OF_RANGE,
               f"expert {expert}{{where}}: the model has {model.num_experts} experts", layer)
        return []
    out_dim, in_dim = proj.dims(model)
    pair = check_pair(adapter, parts.get("lora_A.weight"), parts.get("lora_B.weight"), what,
                      layer, out, (out_dim, in_dim))
    if pair is None:
        return []
    a, b = pair
    r = a.shape[0]
    if proj is ExpertProj.ROUTER:
        # PEFT matches patterns against the parameter path when the router is a
        # target_parameters wrapper (`mlp.gate.weight`), else against the module path.
        param = f"{module_key}.weight"
        source = "v5" if adapter.config.targets_parameter(param) else "v4"
        pattern_key = param if source == "v5" else module_key
        explained = source == "v5" or adapter.config.is_targeted(module_key)
    else:
        source, pattern_key = "v4", module_key
        explained = adapter.config.is_targeted(module_key)
    if not explained:
        out.at(Severity.WARNING, Code.UNEXPLAINED_KEY,
               f"{proj.value if expert < 0 else 'expert ' + proj.value}{{where}}: has tensors, "
               "but neither target_modules nor target_parameters selects it", layer)
    alpha, scaling = rank_and_scale(adapter, pattern_key, what, r, layer, out)
    return [ExpertPair(layer, proj, expert, r, alpha, scaling, out_dim, in_dim, a, b,
                       source=source)]


def _scan_fused(
    adapter: Adapter, model: ModelConfig, module_key: str, parts: dict[str, AdapterKey],
    layer: int, out: Collector,
) -> list[ExpertPair]:
    """`mlp.experts` ParamWrappers: one (A, B) per wrapped parameter, the inner one (registered
    first) under `.base_layer.`. Which parameter a wrapper holds is read from the shapes,
    never from the nesting: A's in-dim is H for gate_up and I for down, B's out-dim 2I or H
    (the two cannot both coincide)."""
    h, i, n_exp = model.hidden_size, model.expert_intermediate_size, model.num_experts
    swapped = model.family.experts_peft_swapped
    found: dict[str, tuple[TensorInfo, TensorInfo]] = {}
    for suffix in ("", ".inner"):
        pair = check_pair(adapter, parts.get("lora_A.weight" + suffix),
                          parts.get("lora_B.weight" + suffix), "fused experts", layer, out)
        if pair is None:
            continue
        a, b = pair
        # (in, out) of the expert's weight as the tensors hold them.
        in_out = (b.shape[0], a.shape[1]) if swapped else (a.shape[1], b.shape[0])
        if in_out == (h, 2 * i):
            param = "gate_up_proj"
        elif in_out == (i, h):
            param = "down_proj"
        else:
            shapes = ((f"A [E*r, {2 * i}], B [{h}, E*r]", f"A [E*r, {h}], B [{i}, E*r]")
                      if swapped else
                      (f"A [E*r, {h}], B [{2 * i}, E*r]", f"A [E*r, {i}], B [{h}, E*r]"))
            out.at(Severity.ERROR, Code.SHAPE_MISMATCH,
                   f"fused experts{{where}}: A {list(a.shape)}, B {list(b.shape)} fit neither "
                   f"gate_up_proj ({shapes[0]}) nor down_proj ({shapes[1]})", layer)
            continue
        if a.shape[0] % n_exp:
            out.at(Severity.ERROR, Code.SHAPE_MISMATCH,
                   f"{param}{{where}}: A has {a.shape[0]} rows, not a multiple of the "
                   f"model's {n_exp} experts", layer)
            continue
        if param in found:
            out.at(Severity.ERROR, Code.EXPERT_AMBIGUOUS,
                   f"fused experts{{where}}: two wrappers both have {param}'s shapes", layer)
            continue
        found[param] = (a, b)
    pairs: list[ExpertPair] = []
    interleaved = model.family.experts_gate_up == "interleaved"
    for param, (a, b) in found.items():
        r = a.shape[0] // n_exp
        param_key = f"{module_key}.{param}"
        if not adapter.config.targets_parameter(param_key):
            out.at(Severity.WARNING, Code.UNEXPLAINED_KEY,
                   f"{param}{{where}}: has tensors, but target_parameters does not select it",
                   layer)
        alpha, scaling = rank_and_scale(adapter, param_key, param, r, layer, out)
        common = {"r": r, "alpha": alpha, "scaling": scaling,
                  "in_dim": b.shape[0] if swapped else a.shape[1], "a": a, "b": b,
                  "b_col_step": n_exp, "swapped": swapped, "source": "v5"}
        for e in range(n_exp):
            if param == "down_proj":
                pairs.append(ExpertPair(layer, ExpertProj.DOWN_PROJ, e, out_dim=h, a_row=e * r,
                                        b_row=0, b_col=e, **common))
            else:
                # gate_up's rows are [gate; up], or gate and up interleaved: one A, two row
                # sets of B.
                for proj, row in ((ExpertProj.GATE_PROJ, 0), (ExpertProj.UP_PROJ, 1)):
                    pairs.append(ExpertPair(layer, proj, e, out_dim=i, a_row=e * r,
                                            b_row=row if interleaved else row * i,
                                            b_row_step=2 if interleaved else 1, b_col=e,
                                            **common))
    return pairs


def _check_rsLoRA_rewrite(
    adapter: Adapter, model: ModelConfig, pairs: list[ExpertPair], out: Collector
) -> None:
    """PEFT >= 0.19 on transformers 5 loads a v4 per-expert adapter by fusing gate and up at rank
    2r and alpha 2*alpha: scaling-preserving for alpha/r, but sqrt(2) larger with rsLoRA."""
    if not adapter.config.use_rslora:
        return
    v4_gate_up = [p.layer for p in pairs
                  if p.source == "v4" and p.proj in (ExpertProj.GATE_PROJ, ExpertProj.UP_PROJ)]
    if v4_gate_up:
        out.add(Severity.WARNING, Code.RSLORA_REWRITE,
                "rsLoRA with per-expert gate/up pairs: PEFT >= 0.19 with transformers 5 loads "
                "them as a fused gate_up at rank 2r and alpha 2*alpha, which scales them "
                "sqrt(2) larger than training did; metrale serves the config's own scaling "
                "(alpha/sqrt(r))")
