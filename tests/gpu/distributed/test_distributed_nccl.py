"""The distributed tests of tests/python/test_distributed_cpu.py on two GPUs
with NCCL: two processes, rank r on cuda:r, the same small float32
transformer trained with DistributedDataParallel and with FSDP2
(fully_shard), eagerly and compiled with torch.compile(backend="opfuse") in
the same process group; losses, gradients and parameters must agree within
the CPU test's tolerances, and opfuse must have launched its own (CUDA)
kernels. The launcher, the worker (tests/python/dist_worker.py, with device
"cuda") and the checks are the CPU test's, so the two cannot drift apart.
Skipped without two CUDA devices and NCCL. Run by scripts/gpu-distributed-check
(see docs/distributed.md)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
import test_distributed_cpu as cpu_test  # noqa: E402  (launcher and checks; its tests are not collected here)

# Both modes in one launch, imports and NVRTC compiles included (cold cache):
# expected well under a minute on an H200 host; the bound is for a hang.
TIMEOUT_S = 240

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                       reason="needs 2 CUDA devices"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_nccl_available()),
                       reason="torch.distributed with NCCL is not available"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return cpu_test.launch_modes(tmp_path_factory.mktemp("nccl"), device="cuda", timeout_s=TIMEOUT_S)


def check_on_own_gpu(results):
    # opfuse runs a CUDA partition only on the current device and otherwise
    # falls back to eager; the launch counts (check_opfuse_ran) would catch
    # that, this says why.
    for res in results:
        assert res["device"] == f"cuda:{res['rank']}", res["device"]


def test_ddp_nccl_compiled_with_opfuse_matches_eager(runs):
    check_on_own_gpu(cpu_test.ok(runs["ddp"]))
    cpu_test.test_ddp_compiled_with_opfuse_matches_eager(runs)


def test_fsdp2_nccl_compiled_with_opfuse_matches_eager(runs):
    check_on_own_gpu(cpu_test.ok(runs["fsdp"]))
    cpu_test.test_fsdp2_compiled_with_opfuse_matches_eager(runs)
