"""MXFP4 checkpoint tensors (gpt-oss's released experts), dequantized exactly into fp32 on import.

The release holds each expert projection ``P`` (``gate_up_proj``, ``down_proj``) as two tensors:
``P_blocks`` (uint8, (E, R, G, 16)): per expert, R output rows of G blocks of 32 FP4 (e2m1) values,
two a byte, the low nibble first; and ``P_scales`` (uint8, (E, R, G)): each block's e8m0 exponent,
biased by 127. A value is ``FP4_VALUES[nibble] * 2 ** (scale - 127)``, and the dequantized tensor
is transposed to transformers' in-memory layout (E, G * 32, R), as ``transformers``'
``integrations/mxfp4.py`` (``convert_moe_packed_tensors``) does. Every FP4 value times a power of
two is exact in fp32, so the fp32 master holds exactly what transformers dequantizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatrain_jax.hf.safetensors_io import TensorInfo, read_exact

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


@dataclass(frozen=True)
class Mxfp4Tensor:
    """A checkpoint tensor stored as an MXFP4 ``_blocks``/``_scales`` pair; read like a ``TensorInfo``
    (``path``/``start``: the blocks', so readers open and order it by them)."""

    name: str
    blocks: TensorInfo
    scales: TensorInfo

    dtype = "MXFP4"

    @property
    def path(self) -> str:
        return self.blocks.path

    @property
    def start(self) -> int:
        return self.blocks.start

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        e, r, g, b = self.blocks.shape
        return (e, g * b * 2, r)

    @property
    def sources(self) -> tuple[str, str]:
        return self.blocks.name, self.scales.name

    def read(self, f, part: tuple[int, int] | None = None) -> np.ndarray:
        """The fp32 tensor (E, G*32, R), or its ``[..., k::n]`` part (``part`` = (k, n)), from ``f``
        (the blocks' open file); the scales are read from their own file."""
        blocks = _read_u8(f, self.blocks)
        with open(self.scales.path, "rb", buffering=0) as fs:
            scales = _read_u8(fs, self.scales)
        if part is not None:
            blocks, scales = blocks[:, part[0]::part[1]], scales[:, part[0]::part[1]]
        return dequantize(blocks, scales)


def _read_u8(f, info: TensorInfo) -> np.ndarray:
    out = np.empty(info.shape, np.uint8)
    f.seek(info.start)
    read_exact(f, memoryview(out.reshape(-1)))
    return out


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks (E, R, G, B) uint8 and scales (E, R, G) uint8 -> fp32 (E, G * B * 2, R), one expert at a
    time (the temporaries stay one expert's size)."""
    e, r, g, b = blocks.shape
    if scales.shape != (e, r, g):
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    out = np.empty((e, g * b * 2, r), np.float32)
    for i in range(e):
        vals = np.empty((r, g, b * 2), np.float32)
        vals[..., 0::2] = FP4_VALUES[blocks[i] & 0x0F]
        vals[..., 1::2] = FP4_VALUES[blocks[i] >> 4]
        vals = np.ldexp(vals, scales[i].astype(np.int32)[..., None] - 127)
        out[i] = vals.reshape(r, g * b * 2).T
    return out


def mxfp4_tensor(name: str, tensors: dict[str, TensorInfo]) -> Mxfp4Tensor | None:
    """The MXFP4 pair standing for tensor ``name`` (``name_blocks`` and ``name_scales``, uint8), or None."""
    blocks, scales = tensors.get(name + "_blocks"), tensors.get(name + "_scales")
    if blocks is None or scales is None or blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) != 4:
        return None
    return Mxfp4Tensor(name, blocks, scales)
