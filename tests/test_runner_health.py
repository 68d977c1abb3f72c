"""`runner health` on a node of several GPUs (the serving track's 8xH200): every GPU CUDA shows is checked,
the node must show `--gpus N` of them, and a GPU the driver lists but cannot read, or that CUDA does not
see, fails the node. No machine here has eight GPUs, so the GPU is what stands in: a torch whose `cuda`
answers for eight devices, NVML's answers as recorded data (and a pynvml whose fourth GPU is lost), and
the known kernel's answer. The gathering and the deciding are the real code; one GPU works as before."""

from __future__ import annotations

import contextlib
import types

import pytest

from pipeline import runner
from pipeline.__main__ import main

BOUNDS = runner.load_bounds()
UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(8)]


class FakeCuda:
    """torch.cuda as a node of H200s answers: CUDA device i is the driver's GPU `gpus[i]` (its uuid that
    one's, or none at all for an older torch); `count` for the first `count` of them."""

    def __init__(self, count: int, uuids: bool = True, gpus: tuple[int, ...] | None = None):
        self.gpus = gpus if gpus is not None else tuple(range(count))
        self.count, self.uuids = len(self.gpus), uuids

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_properties(self, i: int):
        if not self.uuids:
            raise AttributeError("'_CudaDeviceProperties' object has no attribute 'uuid'")
        return types.SimpleNamespace(uuid=UUIDS[self.gpus[i]][4:])  # torch prints it without NVML's "GPU-" prefix

    def get_device_name(self, i: int) -> str:
        return "NVIDIA H200"

    def device(self, i: int):
        return contextlib.nullcontext()

    def mem_get_info(self, i: int):
        return (140 << 30, 141 << 30)


class FakeReader:
    """NVML's answers for eight idle H200s, as data; `procs` {nvml index: [pid]} leaves processes on some."""

    source = "nvml"

    def __init__(self, n: int = 8, lost: tuple[int, ...] = (), procs: dict[int, list[int]] | None = None):
        self.n, self.lost, self.procs = n, lost, procs or {}
        self.closed = False

    def devices(self):
        out = []
        for i in range(self.n):
            if i in self.lost:
                out.append({"nvml_index": i, "uuid": None, "name": None, "memory_total": None, "memory_free": None,
                            "processes": None, "error": "NVMLError_GpuIsLost: GPU is lost"})
                continue
            out.append({"nvml_index": i, "uuid": UUIDS[i], "name": "NVIDIA H200", "memory_total": 143771 << 20,
                        "memory_free": 143220 << 20,
                        "processes": [{"pid": p, "used_bytes": 70 << 30} for p in self.procs.get(i, [])]})
        return out

    def under_load(self, entry):
        return {"sm_clock_mhz": 1980, "clock_reasons_mask": 0x4}

    def after(self, entry):
        return {"sm_clock_max_mhz": 1980, "temperature_c": 40 + entry["nvml_index"], "ecc_uncorrected": 0}

    def close(self):
        self.closed = True


@pytest.fixture
def kernel(monkeypatch):
    """The known kernel's right answer on every device (each call recorded), its clocks sampled under it."""
    calls = []

    def run(n, device, sample=None):
        calls.append(device)
        if sample is not None:
            sample()
        return {"n": n, "sum": BOUNDS["kernel_sum"], "sum_of_squares": BOUNDS["kernel_sum_of_squares"], "median_ms": 0.3}

    monkeypatch.setattr(runner, "run_known_kernel", run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return calls


def node(gpu: dict) -> dict:
    return {"device": "cuda", "host": {"sandbox_processes": [], "disk": [], "isolation": {
        "checked": False, "ok": None, "why": "not root"}}, "gpu": gpu}


def states(verdict: dict) -> dict[str, str]:
    return {name: state for state, name, _ in verdict["checks"]}


def test_every_gpu_of_an_eight_gpu_node_is_checked(kernel):
    reader = FakeReader()
    gpu = runner._gather_gpu(BOUNDS, set(), gpus=8, torch=types.SimpleNamespace(cuda=FakeCuda(8)), reader=reader)
    assert kernel == [f"cuda:{i}" for i in range(8)] and reader.closed
    assert [d["uuid"] for d in gpu["devices"]] == UUIDS, "each CUDA device matched to the driver's by its uuid"
    assert [d["temperature_c"] for d in gpu["devices"]] == [40 + i for i in range(8)]
    verdict = runner.decide(node(gpu), BOUNDS)
    assert verdict["healthy"], verdict["reasons"]
    got = states(verdict)
    assert got["gpu count"] == "ok"
    for i in range(8):
        assert {got[f"gpu {i} {what}"] for what in ("kernel", "memory", "processes", "clocks", "clock reasons",
                                                     "temperature", "ECC")} == {"ok"}


def test_a_leftover_on_one_gpu_of_eight_fails_that_gpu_only(kernel):
    gpu = runner._gather_gpu(BOUNDS, {111}, gpus=8, torch=types.SimpleNamespace(cuda=FakeCuda(8)),
                             reader=FakeReader(procs={5: [4321], 2: [111]}))
    verdict = runner.decide(node(gpu), BOUNDS)
    assert verdict["reasons"] == ["gpu 5 processes: 1 process(es) on the GPU: pid 4321 (70.0 GiB): kill them before "
                                  "the next evaluation"], "pid 111 is the checker's own"


def test_a_gpu_lost_to_the_driver_fails_the_node_and_the_others_are_still_checked(kernel):
    cuda = FakeCuda(0, gpus=(0, 1, 2, 4, 5, 6, 7))  # CUDA skips the GPU the driver lost
    gpu = runner._gather_gpu(BOUNDS, set(), gpus=8, torch=types.SimpleNamespace(cuda=cuda), reader=FakeReader(lost=(3,)))
    assert len(gpu["devices"]) == 7 and len(kernel) == 7
    verdict = runner.decide(node(gpu), BOUNDS)
    assert len(verdict["reasons"]) == 2, verdict["reasons"]
    assert verdict["reasons"][0].startswith("gpu count: 7 CUDA device(s) visible (0 (GPU-00000000-")
    assert "this runner needs 8" in verdict["reasons"][0]
    assert verdict["reasons"][1].startswith("gpu 3 (driver): the driver cannot read this GPU: NVMLError_GpuIsLost")


def test_a_gpu_cuda_does_not_see_fails_unless_cuda_visible_devices_hides_it(kernel, monkeypatch):
    torch = types.SimpleNamespace(cuda=FakeCuda(7))  # CUDA sees the first seven of the driver's eight
    verdict = runner.decide(node(runner._gather_gpu(BOUNDS, set(), torch=torch, reader=FakeReader())), BOUNDS)
    assert verdict["reasons"] == [f"gpu visibility: the driver lists GPU 7 ({UUIDS[7]}) but CUDA does not see it: a "
                                  "GPU that failed to initialise, or a driver and runtime that disagree; reset it or "
                                  "retire the node"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6")  # hidden on purpose: not this check's business
    verdict = runner.decide(node(runner._gather_gpu(BOUNDS, set(), torch=torch, reader=FakeReader())), BOUNDS)
    assert verdict["healthy"], verdict["reasons"]
    verdict = runner.decide(node(runner._gather_gpu(BOUNDS, set(), gpus=8, torch=torch, reader=FakeReader())), BOUNDS)
    assert [r.split(":")[0] for r in verdict["reasons"]] == ["gpu count"]


def test_one_gpu_works_as_before(kernel):
    """The kernel track's runner: one H200, no --gpus; a torch without uuids matches the one each way."""
    gpu = runner._gather_gpu(BOUNDS, set(), torch=types.SimpleNamespace(cuda=FakeCuda(1, uuids=False)),
                             reader=FakeReader(n=1))
    assert gpu["devices"][0]["uuid"] == UUIDS[0] and gpu["devices"][0]["memory_source"] == "nvml"
    verdict = runner.decide(node(gpu), BOUNDS)
    assert verdict["healthy"] and "gpu count" not in states(verdict) and "gpu visibility" not in states(verdict)
    # eight GPUs and a torch without uuids: no matching is possible, so the GPU's NVML readings are skipped, said
    gpu = runner._gather_gpu(BOUNDS, set(), gpus=8, torch=types.SimpleNamespace(cuda=FakeCuda(8, uuids=False)),
                             reader=FakeReader())
    verdict = runner.decide(node(gpu), BOUNDS)
    assert verdict["healthy"] and "gpu 7 processes: not read" in verdict["skipped"]


def test_nvml_reads_the_other_gpus_when_one_is_lost(monkeypatch):
    """pynvml raising for one GPU's handle (NVML_ERROR_GPU_IS_LOST) is that GPU's reading, not the end of all."""

    class GpuIsLost(Exception):
        pass

    def handle(i):
        if i == 3:
            raise GpuIsLost("GPU is lost")
        return i

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 8,
        nvmlDeviceGetHandleByIndex=handle, nvmlDeviceGetUUID=lambda h: UUIDS[h].encode(),
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=143771 << 20, free=143220 << 20),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [])
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    devices = runner.Nvml().devices()
    assert [d["uuid"] for d in devices] == UUIDS[:3] + [None] + UUIDS[4:]
    assert devices[3]["error"] == "GpuIsLost: GPU is lost" and devices[4]["memory_free"] == 143220 << 20


@pytest.mark.parametrize("argv,said", [(["--gpus", "0"], "at least one GPU"),
                                       (["--gpus", "8", "--device", "cpu"], "--gpus with --device cpu")])
def test_a_gpu_count_that_cannot_be_checked_is_a_usage_error(argv, said, capsys):
    assert main(["runner", "health", *argv]) == 2
    assert said in capsys.readouterr().err
