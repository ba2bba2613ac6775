"""The checks every LoRA (A, B) pair gets, wherever it sits: a pool module's pair in the slot
audit, and a per-expert, router or fused expert pair in the expert scan. Written once so the
two report one defect with one code and one wording."""

from __future__ import annotations

from metrale_cli.adapters.adapter import Adapter, AdapterKey
from metrale_cli.adapters.findings import Code, Collector, Severity
from metrale_cli.bf16 import LORA_DTYPES
from metrale_cli.files.safetensors_header import TensorInfo


def check_pair(
    adapter: Adapter, a_key: AdapterKey | None, b_key: AdapterKey | None, what: str,
    layer: int | None, out: Collector, dims: tuple[int, int] | None = None,
) -> tuple[TensorInfo, TensorInfo] | None:
    """A's and B's tensors when the pair can be laid out: both present (`missing_a`,
    `missing_b`), two-dimensional (`shape_mismatch`), one rank (`rank_ab_mismatch`: A's rows
    against B's columns), not rank 0, and where `dims` = (out, in) gives the module's dims in
    the model, A `[r, in]` and B `[out, r]` (`shape_mismatch`); else None. A dtype other than
    F32/BF16/F16 is an error (`bad_dtype`) and A and B of different dtypes a warning
    (`mixed_dtype`), neither a reason to stop: the report still shows the pair.

    `what` names the pair in the messages; `{where}` after it becomes its layers."""
    if a_key is None and b_key is None:
        return None
    if a_key is None or b_key is None:
        code, present, missing = ((Code.MISSING_B, "lora_A", "lora_B") if b_key is None
                                  else (Code.MISSING_A, "lora_B", "lora_A"))
        out.at(Severity.ERROR, code, f"{what}{{where}}: {present} without {missing}", layer)
        return None
    a, b = adapter.tensor(a_key), adapter.tensor(b_key)
    bad = [t for t in (a, b) if t.dtype not in LORA_DTYPES]
    for t in bad:
        out.at(Severity.ERROR, Code.BAD_DTYPE, f"{what}{{where}}: dtype {t.dtype}; LoRA "
               f"tensors must be {'/'.join(LORA_DTYPES)}", layer)
    if a.dtype != b.dtype and not bad:
        out.at(Severity.WARNING, Code.MIXED_DTYPE,
               f"{what}{{where}}: A is {a.dtype}, B is {b.dtype}", layer)
    if len(a.shape) != 2 or len(b.shape) != 2:
        out.at(Severity.ERROR, Code.SHAPE_MISMATCH,
               f"{what}{{where}}: A {list(a.shape)} and B {list(b.shape)} must be "
               "two-dimensional", layer)
        return None
    if a.shape[0] != b.shape[1]:
        out.at(Severity.ERROR, Code.RANK_AB_MISMATCH,
               f"{what}{{where}}: A {list(a.shape)} and B {list(b.shape)} disagree on the rank "
               f"(A's rows {a.shape[0]}, B's columns {b.shape[1]})", layer)
        return None
    if a.shape[0] == 0:
        out.at(Severity.ERROR, Code.SHAPE_MISMATCH, f"{what}{{where}}: rank 0", layer)
        return None
    if dims is not None and (a.shape[1] != dims[1] or b.shape[0] != dims[0]):
        out_dim, in_dim = dims
        out.at(Severity.ERROR, Code.SHAPE_MISMATCH,
               f"{what}{{where}}: A {list(a.shape)}, B {list(b.shape)}; the model needs "
               f"A [r, {in_dim}], B [{out_dim}, r]", layer)
        return None
    return a, b


def rank_and_scale(
    adapter: Adapter, pattern_key: str, what: str, r: int, layer: int, out: Collector,
) -> tuple[float, float]:
    """PEFT's alpha and scaling for the pair's rank `r` at `pattern_key`; a rank the config
    (`r` and `rank_pattern`) does not give is an error (`rank_config_mismatch`)."""
    cfg = adapter.config
    r_cfg, alpha = cfg.rank_for(pattern_key), cfg.alpha_for(pattern_key)
    if r != r_cfg:
        out.at(Severity.ERROR, Code.RANK_CONFIG_MISMATCH,
               f"{what}{{where}}: tensors have rank {r}, but the config (r and rank_pattern) "
               f"gives {r_cfg}; PEFT would refuse to load it", layer)
    return alpha, cfg.scaling(r, alpha)
