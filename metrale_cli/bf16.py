"""BF16 on the host with NumPy (which has no bfloat16 type): BF16 values travel as uint16 bits."""

from __future__ import annotations

import numpy as np

# safetensors dtype -> NumPy dtype of the raw little-endian elements.
RAW_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}
# The dtypes a LoRA tensor may have to be packed: exactly those this module converts.
LORA_DTYPES = tuple(RAW_DTYPES)
# A BF16 value is NaN or infinity when its exponent bits are all ones. As uint16 the negative
# ones are exactly the values from 0xFF80 up, as int16 the positive ones those from 0x7F80 up:
# two maxima, no temporary array.
_EXPONENT = np.uint16(0x7F80)
_NEGATIVE_NON_FINITE = np.uint16(0xFF80)
_POSITIVE_NON_FINITE = np.int16(0x7F80)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; the carry propagates into the
    # exponent exactly as IEEE rounding does (and overflows to infinity).
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bf16(raw: np.ndarray, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Raw elements of a safetensors dtype -> BF16 bits, multiplied by `scale` before the single
    rounding (a BF16 input with scale 1.0 is passed through bit for bit)."""
    if dtype == "BF16":
        if scale == 1.0:
            return raw.view(np.uint16)
        return f32_to_bf16(bf16_to_f32(raw) * np.float32(scale))
    values = raw.astype(np.float32)
    if scale != 1.0:
        # Multiply in float64 so the only rounding is the final one to BF16 (after float32).
        values = (raw.astype(np.float64) * scale).astype(np.float32)
    return f32_to_bf16(values)


def non_finite(bits: np.ndarray) -> int:
    """How many of the BF16 `bits` (contiguous uint16) are NaN or infinity; counted only when
    the two maxima say some are."""
    flat = bits.reshape(-1)
    if flat.size == 0 or (flat.max() < _NEGATIVE_NON_FINITE
                          and flat.view(np.int16).max() < _POSITIVE_NON_FINITE):
        return 0
    return int(np.count_nonzero((flat & _EXPONENT) == _EXPONENT))
