"""Small fused graphs for compute-sanitizer memcheck (scripts/gpu-check):
odd sizes, offsets, the vector and the scalar paths, every row schedule."""
import torch

import opfuse  # noqa: F401


def main():
    torch.manual_seed(0)
    chain = torch.compile(lambda x, b1, b2: torch.relu(x + b1) * 0.5 + b2, backend="opfuse")
    for n, off in ((1000, 0), (1003, 1), (4096, 0)):
        base = torch.randn(3, n + 4, device="cuda", dtype=torch.bfloat16)
        chain(base[0, off:off + n], base[1, off:off + n], base[2, off:off + n])
    rows = torch.compile(lambda x: (torch.softmax(x, -1), torch.nn.functional.layer_norm(x, (x.shape[-1],)),
                                    x.argmax(-1), x.var(-1)), backend="opfuse")
    # Lane groups (255, 256: a last block past the last row), a block per row
    # (3001), clusters of 3 and 8 blocks (40000 f32, 262144 bf16).
    for shape, dtype in (((37, 255), torch.float32), ((37, 256), torch.bfloat16), ((5, 3001), torch.float32),
                         ((3, 40000), torch.float32), ((2, 262144), torch.bfloat16)):
        rows(torch.randn(*shape, device="cuda", dtype=dtype))
    # The skinny GEMM (M <= 16) with bias, gelu and a residual, K not a multiple of 32.
    mlp = torch.compile(lambda x, w, b, r: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh") + r,
                        backend="opfuse")
    for m, k, n in ((3, 4104, 1001), (16, 4096, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        mlp(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
            torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    print("sanitize cases ran")


if __name__ == "__main__":
    main()
