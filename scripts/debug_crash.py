import sys, torch, opfuse
from opfuse import _C
import nanobind
print("nanobind", nanobind.__version__, "python", sys.version, flush=True)
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
def chain(x, b1, b2): return torch.relu(x + b1) * 0.5 + b2
x = torch.randn(64, 100, device=dev)
print("compiling on", dev, flush=True)
y = torch.compile(chain, backend="opfuse")(x, x, x)
print("ok", (y - chain(x, x, x)).abs().max().item(), flush=True)
