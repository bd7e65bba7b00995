"""opfuse inside PyTorch's distributed engines, on the CPU: two processes,
gloo on 127.0.0.1, a small pre-norm transformer trained with
DistributedDataParallel and with FSDP2 (fully_shard), eagerly and compiled
with torch.compile(backend="opfuse") in the same process group; losses,
gradients and parameters must agree, and opfuse must really have run
kernels. Each rank is tests/python/dist_worker.py run as a subprocess with a
hard time limit (see docs/distributed.md). The launcher and the checks take
a device and are reused with NCCL on GPUs by
tests/gpu/distributed/test_distributed_nccl.py."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import opfuse  # noqa: F401  (loads, and if need be rebuilds, opfuse before the workers start)

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 2
TIMEOUT_S = 240  # for both ranks and every mode together
MODES = ("ddp", "fsdp")

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own session: it and its children
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _launch_once(modes: str, tmp: Path, device: str, timeout_s: float):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("OPFUSE_DISABLE", None)  # the test is about opfuse running
    if device == "cuda":
        # NVLink multicast stays off in every rank (a rule of the GPU machines).
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    outs = [tmp / f"rank{r}.pt" for r in range(WORLD)]
    logs = [tmp / f"rank{r}.log" for r in range(WORLD)]
    for o in outs:
        o.unlink(missing_ok=True)
    procs = []
    t0 = time.monotonic()
    try:
        for r in range(WORLD):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), modes, str(r), str(WORLD), str(port), str(outs[r]), device],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs:
            p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        _kill(procs)
        tails = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()[-3000:]}" for r in range(WORLD))
        pytest.fail(f"workers did not finish in {timeout_s} s\n{tails}")
    finally:
        _kill(procs)
    wall = time.monotonic() - t0
    results = [torch.load(o, weights_only=False) if o.exists() else {"error": "no result file"} for o in outs]
    logs_text = {r: logs[r].read_text()[-4000:] for r in range(WORLD)}
    return results, logs_text, wall


def launch_modes(tmp: Path, device: str = "cpu", timeout_s: float = TIMEOUT_S):
    """Launches the ranks once for every mode (one import of torch and opfuse
    per rank); returns {mode: [result of rank 0, result of rank 1]}. The port
    is found by binding port 0 and released before rank 0 binds it, so
    another process may take it in between: that case is retried."""
    for attempt in range(3):
        results, logs_text, wall = _launch_once(",".join(MODES), tmp, device, timeout_s)
        setup_failed = [r for r in range(WORLD) if "error" in results[r]]
        if not setup_failed:
            break
        text = "\n".join(f"--- rank {r} ---\n{results[r]['error']}\n{logs_text[r]}" for r in setup_failed)
        if "address already in use" not in text.lower():
            pytest.fail(f"worker setup failed\n{text}")
    else:
        pytest.fail(f"worker setup failed\n{text}")
    print(f"\n{device} {','.join(MODES)}: {wall:.1f} s wall; imports {results[0]['import_s']:.1f} s, "
          f"process group {results[0]['init_s']:.1f} s")
    out = {}
    for mode in MODES:
        out[mode] = [dict(results[r][mode], rank=r, log=logs_text[r]) for r in range(WORLD)]
        for res in out[mode]:
            if "error" not in res:
                print(f"{mode} rank {res['rank']}: eager {res['eager_s']:.1f} s, opfuse {res['opfuse_s']:.1f} s, "
                      f"{res['stats']}, {res['aot_graphs']} graphs; opfuse vs eager {max_diffs(res)}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_modes(tmp_path_factory.mktemp("dist"))


def max_diffs(res):
    """Largest |opfuse - eager| of the losses, final gradients and parameters
    (printed with -s, to compare with the tolerances below)."""
    def worst(a, b):
        if isinstance(a, dict):
            return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)
        return (torch.tensor(a) - torch.tensor(b)).abs().max().item()

    return {what: f"{worst(o, e):.1e}" for what, o, e in zip(("loss", "grad", "param"), res["opfuse"], res["eager"])}


def ok(mode_results):
    """The results of one mode, or a failure with every rank's error."""
    failed = [res for res in mode_results if "error" in res]
    if failed:
        pytest.fail("\n".join(f"--- rank {res['rank']} ---\n{res['error']}\n{res['log']}" for res in failed))
    return mode_results


def close(actual, expected, rtol, atol, what):
    if isinstance(actual, dict):
        assert actual.keys() == expected.keys(), what
        for k in actual:
            torch.testing.assert_close(actual[k], expected[k], rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")
    else:
        torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}: {m}")


def check_training(results):
    """Per rank: opfuse's run equals eager's in the same process group; across
    ranks: the gradients were really reduced (equal on both ranks although
    each rank saw different data) and the replicas stayed equal."""
    for res in results:
        r = res["rank"]
        (e_loss, e_grad, e_par), (o_loss, o_grad, o_par) = res["eager"], res["opfuse"]
        assert len(o_loss) == res["steps"]
        # float32, 4 steps; opfuse's reductions sum in another order than
        # ATen's: measured differences are ~1e-7, tolerances are ~10-100x that
        # (a 5e-4 relative error injected into opfuse's kernel outputs fails them).
        close(o_loss, e_loss, 2e-5, 1e-6, f"rank {r} losses")
        close(o_grad, e_grad, 1e-4, 1e-6, f"rank {r} final gradients")
        close(o_par, e_par, 2e-5, 1e-6, f"rank {r} final parameters")
    r0, r1 = results[0], results[1]
    assert r0["eager"][0] != r1["eager"][0], "ranks saw the same data: the reduction is not tested"
    for run in ("eager", "opfuse"):
        close(r1[run][1], r0[run][1], 1e-6, 1e-8, f"{run}: rank 1 vs rank 0 gradients")
        close(r1[run][2], r0[run][2], 1e-6, 1e-8, f"{run}: rank 1 vs rank 0 parameters")


def check_opfuse_ran(res):
    """opfuse compiled graphs and ran its own kernels; the test cannot pass by
    running everything eagerly."""
    s = res["stats"]
    assert s["graphs_compiled"] > 1, s
    assert s["kernels_compiled"] > 0, s
    # every step runs opfuse kernels in the forward and in the backward
    assert s["kernel_launches"] >= 2 * res["steps"], s
    assert isinstance(s["fallback_ops"], int) and s["fallback_ops"] >= 0, s


def test_ddp_compiled_with_opfuse_matches_eager(runs):
    results = ok(runs["ddp"])
    check_training(results)
    for res in results:
        check_opfuse_ran(res)
        # Dynamo's DDPOptimizer split the graph at bucket boundaries (bucket_cap_mb=1
        # on ~1.6 MiB of parameters) and each piece went through opfuse.
        assert res["ddp_buckets"] and res["ddp_buckets"][0] >= 2, res["ddp_buckets"]
        assert res["aot_graphs"] == res["ddp_buckets"][0], (res["aot_graphs"], res["ddp_buckets"])


def test_fsdp2_compiled_with_opfuse_matches_eager(runs):
    results = ok(runs["fsdp"])
    check_training(results)
    for res in results:
        check_opfuse_ran(res)
        # Each block was compiled with fullgraph=True: one graph (the blocks share
        # it: parameters are graph inputs), no graph breaks.
        assert res["aot_graphs"] >= 1 and res["graph_breaks"] == 0, (res["aot_graphs"], res["graph_breaks"])
