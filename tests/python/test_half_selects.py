"""Half-precision selects through the host compiler. GCC (12 to 14.3 at
least) with -march=native on a CPU with AVX512-FP16 turns a float16 select
stored as a masked `vmovsh` that the assembler rejects; the host compiler
keeps AVX512-FP16 off (kernels compute halves in float). Found by the IR
fuzzer (seed 3303, graph 170); on a CPU without AVX512-FP16 these pass
either way."""
import pytest
import torch

import opfuse
from conftest import launches


def where_le(x, y):
    return torch.where(x <= y, y, 0.0)


def where_mask_as_value(x, y):
    c = x <= y
    return torch.where(c, y, c.to(x.dtype)), torch.sigmoid(y) + 0.25


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn", [where_le, where_mask_as_value])
def test_half_select_compiles_and_matches(fn, dtype, device):
    x = torch.randn(8209, dtype=dtype, device=device)
    y = torch.randn(8209, dtype=dtype, device=device)
    out, n = launches(torch.compile(fn, backend="opfuse"), x, y)
    assert n == 1
    torch.testing.assert_close(out, fn(x, y))
