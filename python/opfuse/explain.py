"""opfuse.explain(fn, *inputs): what fused into which kernel, what fell back
to PyTorch and why, Dynamo's graph breaks with the user's source lines, and
the roofline estimate of each kernel."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KernelRecord:
    name: str
    ops: list
    bytes: float
    flops: float
    est_time_s: float
    kind: str
    partition: str


@dataclass
class GraphBreak:
    reason: str
    user_source: list  # "file:line in function" entries, innermost last


@dataclass
class ExplainReport:
    kernels: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)    # (op, reason)
    graph_breaks: list = field(default_factory=list)
    coverage: float = 0.0                            # fused ATen ops / all ATen ops
    attention: list = field(default_factory=list)   # (where, kind, fused, reason) per softmax / SDPA

    def __str__(self) -> str:
        lines = [f"opfuse: {len(self.kernels)} kernels, {len(self.fallbacks)} ops left to PyTorch, "
                 f"{len(self.graph_breaks)} graph breaks, coverage {self.coverage:.0%}"]
        if self.kernels:
            lines.append(f"{'kernel':40} {'kind':9} {'MB':>9} {'MFLOP':>9} {'est us':>8}  ops")
            for k in self.kernels:
                lines.append(f"{k.name[:40]:40} {k.kind:9} {k.bytes / 1e6:9.3f} {k.flops / 1e6:9.3f} "
                             f"{k.est_time_s * 1e6:8.1f}  {' '.join(k.ops)}")
        for where, kind, fused, reason in self.attention:
            lines.append(f"attention ({kind}) at {where}: {'fused: ' if fused else 'not fused: '}{reason}")
        for op, reason in self.fallbacks:
            lines.append(f"fallback {op}: {reason}")
        for b in self.graph_breaks:
            where = b.user_source[-1] if b.user_source else "?"
            lines.append(f"graph break at {where}: {b.reason}")
        return "\n".join(lines)


def explain(fn, *inputs, **kwargs) -> ExplainReport:
    import torch._dynamo as dynamo

    from .frontend import backend

    report = ExplainReport()
    dynamo.reset()
    ex = dynamo.explain(fn)(*inputs, **kwargs)
    for r in ex.break_reasons:
        stack = [f"{f.filename}:{f.lineno} in {f.name}" for f in (r.user_stack or [])]
        report.graph_breaks.append(GraphBreak(reason=str(r.reason), user_source=stack))
    dynamo.reset()
    rec = backend.Report()
    backend._active_reports.append(rec)
    try:
        torch.compile(fn, backend=backend.opfuse_backend)(*inputs, **kwargs)
    finally:
        backend._active_reports.remove(rec)
        dynamo.reset()
    report.kernels = [KernelRecord(k["name"], k["ops"], k["bytes"], k["flops"], k["seconds"], k["kind"], k["partition"])
                      for k in rec.kernels]
    report.fallbacks = list(rec.fallbacks)
    report.attention = [(c.node, c.kind, c.fused, c.reason) for c in rec.attention]
    total = rec.fused_nodes + len(rec.fallbacks)
    report.coverage = rec.fused_nodes / total if total else 1.0
    return report
