"""Q4_K and Q6_K quantizers in numpy, for making K-quant GGUF files in the tests: gguf's Python package dequantizes
these types but cannot quantize to them, and llama.cpp's quantize takes minutes to build. Each writes llama.cpp's
block layout (ggml-common.h) with plain per-sub-block ranges, not llama.cpp's searched scales: a valid file of the
type, which is what serving it tests; tests/test_quantized_models.py checks the layouts against gguf's dequantizers."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x (rows, cols), cols a multiple of 256 -> uint8 (rows, cols / 256 * 144): per block d, dmin (float16), 12 bytes
    of 6-bit scales and mins for its 8 sub-blocks of 32, then 128 bytes of 4-bit quants (y = d sc q - dmin m)."""
    rows, cols = x.shape
    blocks = x.reshape(-1, 8, 32).astype(np.float32)  # (blocks, sub-blocks, values)
    low = np.minimum(blocks.min(axis=2), 0)
    scale = (blocks.max(axis=2) - low) / 15  # (blocks, 8)
    mins = -low
    d = _fp16(scale.max(axis=1) / 63)
    dmin = _fp16(mins.max(axis=1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step, offset = (df * sc)[:, :, None], (dminf * m)[:, :, None]
    q = np.clip(np.rint(np.divide(blocks + offset, step, out=np.zeros_like(blocks), where=step > 0)), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # (blocks, 64-value chunks, low/high nibble, 32)
    packed = np.empty((len(blocks), 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    quants = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, quants], axis=1)
    return out.reshape(rows, cols // QK_K * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x (rows, cols), cols a multiple of 256 -> uint8 (rows, cols / 256 * 210): per block 128 bytes of low 4 bits, 64
    of high 2 bits, 16 int8 scales (one per 16 values), d (float16); y = d sc (q - 32)."""
    rows, cols = x.shape
    blocks = x.reshape(-1, 16, 16).astype(np.float32)  # (blocks, sub-blocks, values)
    scale = np.abs(blocks).max(axis=2) / 31
    d = _fp16(scale.max(axis=1) / 127)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127).astype(np.int8)
    step = (df * sc)[:, :, None]
    q = np.clip(np.rint(np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # (blocks, halves of 128, groups of 32, l)
    ql = np.concatenate(
        [q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2
    )
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1
    )
    return out.reshape(rows, cols // QK_K * 210)
