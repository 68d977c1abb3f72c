"""A data-parallel launch (issue 19): `gpus` replicas of one engine behind one address
(pipeline/serving/replicas.py), for an engine with no tensor parallelism of its own. Real processes: the
scripted server as each replica, launched through the real sandbox; the router run by path as the
template runs it. What a node of 8 GPUs adds (each replica on its own GPU, NVML's view of them) is the
GPU machine's part; here a replica's GPU is what CUDA_VISIBLE_DEVICES tells it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import pin_with, scripted_template
from pipeline import sandbox
from pipeline.serving import launch
from pipeline.serving import pin as pin_stage
from test_launch import isolate  # noqa: F401 - the fixture: isolated (as root) and plain


@pytest.fixture(scope="module")
def limits():
    return launch.serving_limits()


def _template(tmp_path, text: str | None = None, **kw) -> pin_stage.LaunchTemplate:
    text = text or scripted_template(gpus=2, data_parallel=True, **kw)
    pin = pin_stage.load_pin(pin_with(tmp_path / "pin.toml", text))
    return pin_stage.launch_template(pin, "scripted")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("data_parallel = true", 'data_parallel = "yes"'), "data_parallel: true or false"),
    (lambda t: t.replace('"--port", "{port}", ', ""), "argv must name {port}"),
])
def test_a_data_parallel_template_is_read_strictly(tmp_path, edit, message):
    with pytest.raises(pin_stage.PinError, match=message):
        _template(tmp_path, edit(scripted_template(gpus=2, data_parallel=True)))


def test_the_router_is_put_in_front_and_each_replica_keeps_its_port_to_fill(tmp_path):
    template = _template(tmp_path)
    assert template.data_parallel and template.gpus == 2
    cmd = launch.render(template, tree=tmp_path, model=None, port=4321, delay_ms=5)
    cut = cmd.argv.index("--")
    assert cmd.argv[1] == launch.REPLICAS_FILE and launch.REPLICAS_FILE in cmd.readable
    router = cmd.argv[:cut]
    assert router[router.index("--replicas") + 1] == "2" and router[router.index("--port") + 1] == "4321"
    child = cmd.argv[cut + 1:]
    assert "{port}" in child and "4321" not in child  # replicas.py fills one free port a replica
    assert child[-2:] == ["--chunk-delay-ms", "5"]  # the delay knob slows every replica
    assert cmd.env["NCCL_NVLS_ENABLE"] == "0"  # multicast off reaches the router, so every replica


async def _chat(session, url: str, i: int, arrivals: list | None = None) -> list[str]:
    body = {"messages": [{"role": "system", "content": "marker"}, {"role": "user", "content": f"question {i}"}],
            "max_tokens": 5, "stream": True}
    words = []
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:  # the last chunk: usage, no choices
                    if choice["delta"].get("content"):
                        words.append(choice["delta"]["content"])
                        if arrivals is not None:
                            arrivals.append(time.monotonic())
    return words


def test_replicas_share_the_load_flush_together_and_leave_nothing(isolate, tmp_path, limits):  # noqa: F811
    template = _template(tmp_path, script={"token_s": 0.05}, tag="replicas-test")
    server = launch.Server(template, tree=tmp_path, model=None,
                           policy=sandbox.Policy(isolate=isolate, limits=limits.sandbox), limits=limits, label="baseline")

    arrivals = [[] for _ in range(6)]

    async def work():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            replies = await asyncio.gather(*(_chat(session, server.url, i, arrivals[i]) for i in range(6)))
            async with session.post(server.url + "/flush_cache") as resp:
                flushed = resp.status
            async with session.get(server.url + "/_replicas") as resp:
                replicas = await resp.json()
            logs = []
            for r in replicas:  # each replica's own log, on its own port (inside the sandbox's loopback)
                async with session.get(f"http://127.0.0.1:{r['port']}/_log") as resp:
                    logs.append(await resp.json())
            return replies, flushed, replicas, logs

    with server:
        server.wait_ready()
        replies, flushed, replicas, logs = server.call(work, timeout_s=30, what="the replicas' requests")
        assert len(server.box.processes()) >= 3  # the router and its two replicas, at least
    assert [len(words) for words in replies] == [5] * 6  # every stream whole
    # and streamed: a token 50 ms apart on the replica arrives so here, not all at the end
    assert all(a[-1] - a[0] > 0.12 for a in arrivals), [a[-1] - a[0] for a in arrivals]
    assert flushed == 200 and [len(log["flushes"]) for log in logs] == [1, 1]  # a flush reaches every replica
    served = [r["served"] for r in replicas]
    assert sum(served) == 7 and min(served) >= 3, served  # six concurrent chats and the warm-up, spread
    assert [len(log["requests"]) for log in logs] == served  # what the router counts is what each replica got
    assert len({r["port"] for r in replicas}) == 2 and all(r["exit_code"] is None for r in replicas)
    assert server.box.processes() == [] and not server.alive()


def test_a_replica_that_dies_takes_the_launch_down(tmp_path, limits):
    template = _template(tmp_path, script={"die_after": 1}, warmup=None)
    server = launch.Server(template, tree=tmp_path, model=None, policy=sandbox.Policy(limits=limits.sandbox),
                           limits=limits, label="candidate")

    async def two_chats():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            await _chat(session, server.url, 0)  # replica 0 (none in flight: the lowest index)
            await _chat(session, server.url, 1)  # replica 0 again: it dies at the start of its second
            await asyncio.sleep(60)

    with server:
        server.wait_ready()
        t0 = time.monotonic()
        with pytest.raises(launch.ServerDied, match="candidate server exited"):
            server.call(two_chats, timeout_s=30, what="a level")
        assert time.monotonic() - t0 < 25  # at the death, not at the call's 30 s
    assert server.box.processes() == []
    assert "replica 0" in server.log_tail() and "stopping the others" in server.log_tail()


CHILD = """
import os, sys
from aiohttp import web
async def health(request):
    return web.Response(text=os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
app = web.Application()
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def _router(port: int, replicas: int, visible: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.Popen([sys.executable, launch.REPLICAS_FILE, "--replicas", str(replicas), "--port", str(port),
                             "--device", "cuda", "--", sys.executable, "-c", CHILD, "{port}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_each_replica_sees_one_gpu_of_the_visible_ones():
    import urllib.request

    port = launch.free_port()
    proc = _router(port, 2, "3,5,6")
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_replicas", timeout=5) as resp:
            replicas = json.load(resp)
        seen = []
        for r in replicas:
            with urllib.request.urlopen(f"http://127.0.0.1:{r['port']}/health", timeout=5) as resp:
                seen.append(resp.read().decode())
        assert [r["gpu"] for r in replicas] == ["3", "5"] and seen == ["3", "5"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert proc.returncode == 0
    pids = [r["pid"] for r in replicas]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)  # SIGTERM stopped every replica first


def test_fewer_visible_gpus_than_replicas_is_refused():
    proc = _router(launch.free_port(), 3, "0,1")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode != 0 and "3 replicas need 3 GPUs" in out and "never two on one" in out


class _NodeReadings:
    """Stands in for NVML (no GPU here): what runner.Nvml().devices() returns, one reading per call, the
    last repeated: each GPU's index, uuid and compute processes (None where NVML cannot list them)."""

    def __init__(self, *readings):
        self.readings, self.calls, self.closed = list(readings), 0, False

    def devices(self):
        self.calls += 1
        return self.readings[min(self.calls, len(self.readings)) - 1]

    def close(self):
        self.closed = True


def _node(*procs_per_gpu):
    return [{"nvml_index": i, "uuid": f"GPU-{i}", "processes": p} for i, p in enumerate(procs_per_gpu)]


def test_a_stop_is_followed_until_every_gpu_is_clear():
    worker = [{"pid": 4242, "used_bytes": 1 << 30}]
    # a tensor-parallel worker's context freed a moment after the exit: clear on the third reading
    node = _NodeReadings(_node([], worker, []), _node([], worker, []), _node([], [], []))
    assert launch.gpu_leftovers(node, timeout_s=5, poll_s=0.01) == [] and node.calls == 3
    # one that outlives the stop is named, GPU and pid; our own process is not counted
    stuck = _NodeReadings(_node([{"pid": os.getpid(), "used_bytes": 0}], [], [], worker))
    t0 = time.monotonic()
    assert launch.gpu_leftovers(stuck, ignore={os.getpid()}, timeout_s=0.3, poll_s=0.05) == [
        {"gpu": 3, "uuid": "GPU-3", "pid": 4242, "used_bytes": 1 << 30}]
    assert time.monotonic() - t0 >= 0.3 and stuck.calls >= 2  # it polled until its timeout, then named it
    # a GPU whose processes cannot be listed is not called clean
    assert launch.gpu_leftovers(_NodeReadings(_node([], None)), timeout_s=0) == [
        {"gpu": 1, "uuid": "GPU-1", "pid": None, "used_bytes": None}]


def test_a_gpu_left_held_after_a_block_fails_the_evaluation_as_the_node_s(monkeypatch):
    from pipeline import runner
    from pipeline.serving import evaluate as ev

    monkeypatch.setattr(launch, "GPU_CLEAR_S", 0.2)
    node = _NodeReadings(_node([], [{"pid": 777, "used_bytes": None}]))
    monkeypatch.setattr(runner, "_reader", lambda: (node, None))
    environment = {}
    with pytest.raises(ev.HarnessFailure, match=r"block 2/4 \(candidate\): after the server stopped.*GPU 1: pid 777"):
        ev._gpus_clear("block 2/4 (candidate)", environment, None)
    assert node.closed and environment["gpus_clear_after_stop"][0]["left"][0]["pid"] == 777
    clear = _NodeReadings(_node([], []))
    monkeypatch.setattr(runner, "_reader", lambda: (clear, None))
    ev._gpus_clear("block 3/4 (baseline)", environment, None)
    assert environment["gpus_clear_after_stop"][1] == {"block": "block 3/4 (baseline)", "left": []}
    monkeypatch.setattr(runner, "_reader", lambda: (None, "pynvml: ImportError; nvidia-smi: not found"))
    with pytest.raises(ev.HarnessFailure, match="cannot be read after the stop"):
        ev._gpus_clear("block 4/4 (candidate)", environment, None)


@pytest.mark.heavy  # a whole serving evaluation of replicas
def test_an_evaluation_of_a_data_parallel_launch_is_per_gpu(scratch, tmp_path):
    """The whole serving evaluation (B C C B, levels, canaries, GSM8K) against two replicas behind one
    address: every level's T_c is its tokens in the window over window seconds times the template's 2 GPUs
    (the records keep each level's turns, so the division is checked against them), and every process of
    both launches, router and replicas, is gone afterwards."""
    import gzip

    from conftest import tiny_dataset
    from pipeline import result
    from pipeline.serving import metrics
    from test_serving_evaluate import ACT, ROOT, WINDOW, _tagged

    tag = f"replicas-evaluate-{os.getpid()}"
    pin = pin_with(tmp_path / "pin.toml", scripted_template({"token_s": 0.003}, tag=tag, gpus=2, data_parallel=True))
    s = scratch(ACT)
    s.append(ACT, "# tuned for the H200\n")
    patch = tmp_path / "patch.diff"
    patch.write_bytes(s.diff())
    out, records = tmp_path / "result.json", tmp_path / "records"
    done = subprocess.run([sys.executable, "-m", "pipeline", "serving", "evaluate", str(patch), "--launch", "scripted",
                           "--pin", str(pin), "--dataset", str(tiny_dataset(tmp_path / "tiny.json")), "--json", str(out),
                           "--records", str(records), *WINDOW], cwd=ROOT, capture_output=True, text=True, timeout=300,
)
    assert _tagged(tag) == [], "a process of the data-parallel launch outlived the evaluation"
    assert done.returncode == 0, done.stderr[-3000:]
    doc = result.read(out)
    assert doc["status"] == "passed" and doc["serving"]["engine"]["gpus"] == 2
    assert "on 2 GPU" in done.stdout  # the printed summary names the GPUs T_c divides by
    checked = 0
    for level in doc["serving"]["levels"]:
        for side in ("baseline", "candidate"):
            for run in level[side]["runs"]:
                path = records / f"block{run['block'] + 1}-{side}-c{level['concurrency']}-run{run['run'] + 1}.json.gz"
                recorded = json.loads(gzip.decompress(path.read_bytes()))
                assert run["T"] == pytest.approx(metrics.level(recorded, gpus=1)["T"] / 2, rel=1e-9)
                checked += 1
    assert checked == 2 * 2 * 2  # two levels, two blocks a side, one run each
