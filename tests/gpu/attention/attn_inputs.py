"""Seeded inputs shared by the GPU attention tests (needs torch with CUDA).

Every case draws its tensors from a generator seeded by a hash of the case's
parameters, so a failing case reproduces alone (pytest -k) with the same data.
"""

from __future__ import annotations

import zlib

import torch

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
# (Sq, Sk) of the forward and backward grids: ragged ends of both, one query
# row, more queries than keys (causal rows that see nothing), a long square.
SEQ_PAIRS = [(113, 203), (128, 217), (1023, 1024), (1, 239), (512, 256), (2048, 2048)]


def case_seed(*key) -> int:
    """A stable seed for one test case (crc32 of its parameters)."""
    return zlib.crc32(repr(key).encode()) % 2**31


def cuda_generator(seed: int):
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape, dtype, seed):
    """Standard normal float32 values on the GPU, rounded to dtype."""
    return torch.randn(*shape, generator=cuda_generator(seed), device="cuda", dtype=torch.float32).to(dtype)
