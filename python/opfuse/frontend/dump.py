"""OPFUSE_DUMP=dir: every compiled partition's IR before and after the
passes, its fusion plan, kernel IR, generated source and a runnable repro."""
from __future__ import annotations

import itertools
import os
import textwrap

_counter = itertools.count()

REPRO = '''\
"""Repro for {name}: compiles the IR below with opfuse and checks it
against the float64 oracle on random inputs. Run: python {file}"""
import opfuse.testing as T

IR = """{ir}"""

if __name__ == "__main__":
    T.check_ir_against_oracle(IR, sizes={sizes!r})
    print("ok")
'''


class Dump:
    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def write(self, name: str, text: str) -> None:
        with open(self.path(name), "w") as f:
            f.write(text)

    def new_name(self, phase: str) -> str:
        return f"g{next(_counter):03d}_{phase}"

    def partition(self, name, ir_text, compiled, sizes):
        self.write(f"{name}.before.ir", ir_text)
        self.write(f"{name}.after.ir", compiled.graph_text())
        self.write(f"{name}.plan.txt", compiled.plan_text())
        self.write(f"{name}.kernels.txt", "\n".join(k["ir"] for k in compiled.kernels()))
        self.write(f"{name}_repro.py", REPRO.format(name=name, file=f"{name}_repro.py", ir=ir_text, sizes=sizes))

    def kernel_source(self, name, variant, source):
        self.write(f"{name}.v{variant}.cpp", source)


def from_env():
    d = os.environ.get("OPFUSE_DUMP")
    return Dump(d) if d else None
