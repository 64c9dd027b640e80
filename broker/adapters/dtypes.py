"""Element types of adapter weights: the raw numpy arrays that hold each one's bits, and the
conversions between them (safetensors F32/F16/BF16 -> the broker's dtype; bf16 kept as uint16
bits, rounded to nearest even as torch does).

Pure array functions: no files, no arena, no manager state.
"""

from __future__ import annotations

import numpy as np

from memory_broker.broker.adapters.peft import FILE_DTYPES

# numpy arrays that hold each element type's bits (bf16 has no numpy type: kept as uint16).
RAW = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
FILE_RAW = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
FILE_SIZE = {"F32": 4, "F16": 2, "BF16": 2}
FILE_NAME = {v: k for k, v in FILE_DTYPES.items()}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even as torch does; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def to_f32(x: np.ndarray, file_dtype: str) -> np.ndarray:
    if file_dtype == "F32":
        return x
    if file_dtype == "F16":
        return x.astype(np.float32)
    return bf16_bits_to_f32(x)


def convert(x: np.ndarray, file_dtype: str, dtype: str) -> np.ndarray:
    """Raw file elements (``FILE_RAW`` arrays) -> raw elements of ``dtype`` (``RAW`` arrays)."""
    if FILE_DTYPES[file_dtype] == dtype:
        return x
    f32 = to_f32(x, file_dtype)
    if dtype == "float32":
        return f32
    if dtype == "float16":
        return f32.astype(np.float16)
    return f32_to_bf16_bits(f32)


def from_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    return f32_to_bf16_bits(x)
