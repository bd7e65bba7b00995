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
    for shape in ((37, 255), (5, 3001), (3, 40000)):
        rows(torch.randn(*shape, device="cuda"))
    torch.cuda.synchronize()
    print("sanitize cases ran")


if __name__ == "__main__":
    main()
