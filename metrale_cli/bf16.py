"""BF16 on the host with NumPy (which has no bfloat16 type): BF16 values travel as uint16 bits."""

from __future__ import annotations

import math

import numpy as np

from metrale_cli import native

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


class Scratch:
    """Buffers a conversion reuses chunk after chunk, each grown to the largest asked of it and
    let go with the object: NumPy's temporaries, fresh for every chunk, were fresh pages from
    the kernel each time (a pass of `bench pack --dtype f32` faulted 1 GiB in, two thirds of
    its CPU time)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def take(self, role: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A `shape` array of `dtype` over the buffer of `role` (one dtype a role), its
        contents left from the last use."""
        size = math.prod(shape)
        buffer = self.buffers.get(role)
        if buffer is None or buffer.size < size:
            buffer = self.buffers[role] = np.empty(size, dtype)
        return buffer[:size].reshape(shape)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(values.shape, np.uint16)
    _round_into(out, values, Scratch())
    return out


def _round_into(out: np.ndarray, values: np.ndarray, scratch: Scratch) -> None:
    """`out` (uint16, strided or not) = float32 `values` (its shape, any strides whose last
    is one element) as BF16 bits, round to nearest even, NaN a quiet NaN; every temporary
    in `scratch`."""
    bits = values.view(np.uint32)
    rounded = scratch.take("rounded", values.shape, np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; the carry propagates into the
    # exponent exactly as IEEE rounding does (and overflows to infinity).
    np.right_shift(bits, 16, out=rounded)
    np.bitwise_and(rounded, 1, out=rounded)
    np.add(rounded, 0x7FFF, out=rounded)
    np.add(rounded, bits, out=rounded)
    np.right_shift(rounded, 16, out=rounded)
    np.copyto(out, rounded, casting="unsafe")  # each value below 2**16 now
    # A NaN's rounding may carry into the sign or clear its mantissa: set its top bits quiet.
    # The maximum is NaN exactly when a value is: one pass, no mask, in the common case.
    if values.size and np.isnan(values.max()):
        nan = np.isnan(values)
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """BF16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bf16(raw: np.ndarray, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Raw elements of a safetensors dtype -> BF16 bits, multiplied by `scale` before the single
    rounding (a BF16 input with scale 1.0 is passed through bit for bit)."""
    if dtype == "BF16" and scale == 1.0:
        return raw.view(np.uint16)
    out = np.empty(raw.shape, np.uint16)
    to_bf16_into(out, raw, dtype, scale, Scratch())
    return out


def to_bf16_into(out: np.ndarray, raw: np.ndarray, dtype: str, scale: float,
                 scratch: Scratch) -> None:
    """`to_bf16(raw, dtype, scale)` written into `out` (uint16 of `raw`'s shape, strided or
    not: a slot's rows), every temporary in `scratch`'s buffers: a chunk is converted in
    buffers that earlier chunks faulted in, while they are in cache."""
    if dtype == "BF16" and scale == 1.0:
        np.copyto(out, raw.view(np.uint16))
        return
    if dtype == "F32" and scale == 1.0:
        _round_into(out, raw.view(np.float32), scratch)
        return
    values = scratch.take("values", raw.shape, np.float32)
    if dtype == "BF16":
        np.left_shift(raw.view(np.uint16), 16, out=values.view(np.uint32), dtype=np.uint32)
        np.multiply(values, np.float32(scale), out=values)  # exact BF16 times a float32 scale
    elif scale == 1.0:
        np.copyto(values, raw, casting="same_kind")  # F16 widened: exact
    else:
        # Multiply in float64 so the only rounding is the final one to BF16 (after float32).
        wide = scratch.take("wide", raw.shape, np.float64)
        np.multiply(raw, np.float64(scale), out=wide, dtype=np.float64)
        np.copyto(values, wide, casting="same_kind")
    _round_into(out, values, scratch)


def non_finite(bits: np.ndarray) -> int:
    """How many of the BF16 `bits` (contiguous uint16) are NaN or infinity; counted only when
    a pass says some are: the compiled one (`metrale_cli/_native.c`) where it is built, else
    NumPy's two maxima."""
    flat = bits.reshape(-1)
    if flat.size == 0:
        return 0
    if native.compiled is not None:
        if not native.compiled.any_non_finite(flat):
            return 0
    elif (flat.max() < _NEGATIVE_NON_FINITE
          and flat.view(np.int16).max() < _POSITIVE_NON_FINITE):
        return 0
    return int(np.count_nonzero((flat & _EXPONENT) == _EXPONENT))
