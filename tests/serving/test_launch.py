"""Launching a server from a template (pipeline/serving/launch.py): the templates as data, a fresh tree with
the patch applied, the sandbox with its own loopback, readiness, failures that are said and never hang, and
a stop that leaves nothing. Real processes throughout: the scripted server (tests/serving/scripted_server.py)
and, for the delay knob, uvicorn serving a minimal ASGI app through launch.py's wrapper.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from conftest import CHILD_SERVER, SCRIPTED, pin_with, scripted_template
from pipeline import sandbox
from pipeline.serving import launch
from pipeline.serving import pin as pin_stage


def _isolation_or_skip(isolate: bool) -> None:
    if isolate:
        if os.geteuid() != 0:
            pytest.skip("isolation needs root (CI runs as root)")
        ok, why = sandbox.availability()
        assert ok, f"running as root, yet no isolation: {why}"


@pytest.fixture(params=[True, False], ids=["isolated", "plain"])
def isolate(request):
    _isolation_or_skip(request.param)
    return request.param


@pytest.fixture(scope="module")
def limits():
    return launch.serving_limits()


def _template(tmp_path, **kw) -> pin_stage.LaunchTemplate:
    pin = pin_stage.load_pin(pin_with(tmp_path / "pin.toml", scripted_template(**kw)))
    return pin_stage.launch_template(pin, "scripted")


async def _get(url: str) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            return resp.status, await resp.text()


def _reachable_from_here(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# ---- the templates ----

def test_the_launch_templates_are_data(sglang_pin):
    sglang = pin_stage.launch_template(sglang_pin, "sglang")
    assert sglang.argv == ("{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--tp", "{gpus}",
                           "--port", "{port}", "--context-length", "{context_length}", "--host", "127.0.0.1")
    assert sglang.gpus == 8 and sglang.engine == "sglang" and sglang.device == "cuda" and sglang.runs_patch
    assert sglang.env["PYTHONPATH"] == "{tree}/python" and sglang.env["NCCL_NVLS_ENABLE"] == "0"
    assert sglang.model_env == "PIPELINE_SERVING_MODEL" and sglang.tokenizer == "pinned"
    for name in ("transformers", "transformers-cpu", "transformers-x8"):
        tf = pin_stage.launch_template(sglang_pin, name)
        assert tf.argv[:4] == ("{python}", "-m", "transformers.cli.transformers", "serve") and "{port}" in tf.argv
        assert tf.engine == "transformers" and tf.warmup == "suppress_special" and not tf.runs_patch
        assert tf.ready == sglang.ready == "/health"
        assert tf.data_parallel == (name == "transformers-x8") and tf.gpus == (8 if tf.data_parallel else 1)
    assert not sglang.data_parallel  # SGLang spreads over its 8 GPUs itself (--tp {gpus})


def test_a_filled_template_is_the_command_the_node_runs(sglang_pin, tmp_path):
    sglang = pin_stage.launch_template(sglang_pin, "sglang")
    cmd = launch.render(sglang, tree=tmp_path / "tree", model="/models/m", port=30001,
                        environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SECRET": "x"})
    assert cmd.argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/m", "--tp", "8",
                        "--port", "30001", "--context-length", "131072", "--host", "127.0.0.1"]
    assert cmd.env["PYTHONPATH"] == f"{tmp_path}/tree/python" and cmd.env["HOME"] == sandbox.SCRATCH_TOKEN
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and "SECRET" not in cmd.env
    assert cmd.readable == ["/models/m", f"{tmp_path}/tree"] and cmd.device == "cuda"
    slowed = launch.render(sglang, tree=tmp_path / "tree", model="/models/m", port=30001, delay_ms=25, environ={})
    assert slowed.argv[:5] == [sys.executable, launch.LAUNCH_FILE, "--delay-ms", "25", "-m"]
    assert slowed.argv[5:] == cmd.argv[2:] and launch.LAUNCH_FILE in slowed.readable


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('ready = "/health"', 'ready = "/health"\npassthru = ["X"]'), "unknown key(s) passthru"),
    (lambda t: t.replace('gpus = 1\n', ''), "missing key(s) gpus"),
    (lambda t: t.replace('"--port", "{port}"', '"--port", "{prot}"'), "unknown placeholder {prot}"),
    (lambda t: t.replace('engine = "sglang"', 'engine = "vllm"'), "'vllm' is not one of"),
    (lambda t: t.replace('"--chunk-delay-ms", "{delay_ms}"', '"--chunk-delay-ms", "5"'), "must hold {delay_ms}"),
    (lambda t: t.replace('device = "cpu"', 'device = "tpu"'), "device"),
])
def test_a_template_is_read_strictly(tmp_path, edit, message):
    pin = pin_stage.load_pin(pin_with(tmp_path / "pin.toml", edit(scripted_template())))
    with pytest.raises(pin_stage.PinError) as got:
        pin_stage.launch_template(pin, "scripted")
    assert "[launch.scripted]" in str(got.value) and message in str(got.value)
    with pytest.raises(pin_stage.PinError, match="no launch template 'nope'"):
        pin_stage.launch_template(pin, "nope")


def test_serving_limits_are_read_strictly(tmp_path):
    assert launch.serving_limits().sandbox.shm_bytes >= 8 << 30  # NCCL between 8 GPUs needs GBs of /dev/shm
    text = (pin_stage.PIN_FILE.parents[1] / "competition.toml").read_text()
    bad = tmp_path / "competition.toml"
    bad.write_text(text.replace("level_extra = 300", "level_extr = 300"))
    with pytest.raises(sandbox.LimitsError, match=r"\[limits.serving\].*unknown key\(s\) level_extr.*missing key\(s\) level_extra"):
        launch.serving_limits(bad)


# ---- the tree ----

def test_a_fresh_tree_has_the_patch_and_the_cache_is_untouched(sglang_pin, sglang_tree, scratch, tmp_path):
    rel = "python/sglang/srt/layers/activation.py"
    s = scratch(rel)
    s.append(rel, "# tuned for the H200\n")
    before = hashlib.sha256((sglang_tree / rel).read_bytes()).hexdigest()
    tree = launch.fresh_tree(sglang_pin, tmp_path, s.diff())
    assert tree != sglang_tree and (tree / rel).read_text().endswith("# tuned for the H200\n")
    assert hashlib.sha256((sglang_tree / rel).read_bytes()).hexdigest() == before
    assert not (tree / pin_stage.MARKER).exists()  # a copy is never mistaken for a verified cache entry
    plain = launch.fresh_tree(sglang_pin, tmp_path / "b", None)
    assert (plain / rel).read_bytes() == (sglang_tree / rel).read_bytes()
    # readable by a uid of its own (the isolated server's): the cache's root folder is 0700
    assert launch.unreadable_by_others([str(tree), str(plain)]) == []
    with pytest.raises(launch.TreeError, match="did not apply"):  # a file the tree does not have
        launch.fresh_tree(sglang_pin, tmp_path / "c", s.diff().replace(b"activation.py", b"activation_x.py"))


# ---- a launch, its calls, its stop ----

def test_launch_and_stop_leave_nothing(isolate, tmp_path, limits, sglang_pin):
    tree = launch.fresh_tree(sglang_pin, tmp_path, None)
    template = _template(tmp_path, script={"spawn_detached": True})
    server = launch.Server(template, tree=tree, model=None, policy=sandbox.Policy(isolate=isolate, limits=limits.sandbox),
                           limits=limits, label="baseline")
    with server:
        launch_s = server.wait_ready()
        assert 0 < launch_s < 20 and server.warmup_s is not None
        status, text = server.call(lambda: _get(server.url + "/health"), timeout_s=10, what="a health check")
        assert (status, text) == (200, "ok")
        alive = server.box.processes()
        d = server.describe()
        if isolate:
            assert d["isolation"] == "namespaces" and d["network"] == "own loopback up"
            assert len(alive) >= 3  # the launcher, the init, the server, its detached grandchild
            # the server listens on the sandbox's own loopback: the host's 127.0.0.1 has nothing there
            assert not _reachable_from_here(server.command.port)
        else:
            assert d["isolation"] == "none" and _reachable_from_here(server.command.port)
    assert server.box.processes() == [] and not server.alive()
    if not isolate:
        assert server.killed >= 1  # the grandchild in a session of its own, outside the process group
    assert not _reachable_from_here(server.command.port)
    assert "PORT" in server.log_tail()


def test_a_server_that_exits_at_launch_is_reported_at_once(tmp_path, limits, sglang_pin, scratch):
    # the exit code comes from the patch: the server read the patched tree it was given
    s = scratch()
    s.write("python/sglang/srt/_scripted.json", '{"exit_at_start": 3}')
    tree = launch.fresh_tree(sglang_pin, tmp_path, s.diff())
    template = _template(tmp_path)
    server = launch.Server(template, tree=tree, model=None, policy=sandbox.Policy(limits=limits.sandbox),
                           limits=limits, label="candidate")
    t0 = time.monotonic()
    with server, pytest.raises(launch.ServerDied, match="candidate server exited with exit code 3 during the launch") as got:
        server.wait_ready()
    assert got.value.code == 3 and time.monotonic() - t0 < 60  # at once, not the launch timeout (1,800 s)
    assert "exiting before it listens" in server.log_tail()


@pytest.mark.parametrize("template_s, limit_s", [(1.5, 1800), (60, 1.5)], ids=["template", "limits.serving"])
def test_a_server_never_ready_times_out_and_is_stopped(tmp_path, limits, sglang_pin, template_s, limit_s):
    # the launch's wall clock is the template's ready_timeout_s or [limits.serving] launch, the shorter
    tree = tmp_path  # the scripted server reads nothing of it
    template = _template(tmp_path, script={"healthy": False}, ready_timeout_s=template_s)
    limits = dataclasses.replace(limits, launch_s=limit_s)
    server = launch.Server(template, tree=tree, model=None, policy=sandbox.Policy(limits=limits.sandbox),
                           limits=limits, label="candidate")
    t0 = time.monotonic()
    with server, pytest.raises(launch.PhaseTimeout, match=r"the launch .*GET /health.* took more than 1.5 s"):
        server.wait_ready()
    assert 1.4 < time.monotonic() - t0 < 60  # the shorter limit, not the other (60 s or 1,800 s)
    assert server.box.processes() == []


def test_client_calls_are_watched(tmp_path, limits, sglang_pin):
    tree = tmp_path  # the scripted server reads nothing of it
    template = _template(tmp_path, script={"hang_s": 60}, warmup=None)
    server = launch.Server(template, tree=tree, model=None, policy=sandbox.Policy(limits=limits.sandbox),
                           limits=limits, label="candidate")

    async def chat():
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/v1/chat/completions", json={"messages": [], "max_tokens": 2}) as r:
                return await r.read()

    with server:
        server.wait_ready()
        t0 = time.monotonic()
        with pytest.raises(launch.PhaseTimeout, match="a hung request took more than 1 s"):
            server.call(chat, timeout_s=1, what="a hung request")
        assert time.monotonic() - t0 < 25  # its 1 s, not a hang
        # the server itself dies while a call waits on it: the call ends at once, saying so
        pid = [p for p in server.box.processes() if "scripted_server" in Path(f"/proc/{p}/cmdline").read_text()]

        async def kill_then_wait():
            os.kill(pid[-1], 9)
            await asyncio.sleep(60)

        t0 = time.monotonic()
        with pytest.raises(launch.ServerDied, match="candidate server exited with signal SIGKILL during a level"):
            server.call(kill_then_wait, timeout_s=30, what="a level")
        assert time.monotonic() - t0 < 25  # at the death, not at the call's 30 s


def test_the_delay_knob_slows_every_chunk_of_a_uvicorn_app(tmp_path, limits, sglang_pin):
    # launch.py as the wrapper: `{python} launch.py --delay-ms N -m uvicorn ...` inside the sandbox
    table = "\n".join([
        "[launch.asgi]", 'engine = "openai"', 'version = "uvicorn"', "gpus = 1", 'device = "cpu"',
        'argv = ["{python}", "-m", "uvicorn", "--port", "{port}", "--host", "127.0.0.1", "scripted_server:asgi_app"]',
        'tokenizer = "pinned"', f'readable = ["{SCRIPTED}", "{CHILD_SERVER}"]', 'ready = "/health"', "ready_timeout_s = 30",
        'slowdown = "asgi"', f'env = {{ PYTHONPATH = "{SCRIPTED.parent}" }}', ""])
    template = pin_stage.launch_template(pin_stage.load_pin(pin_with(tmp_path / "pin.toml", table)), "asgi")

    async def gaps(url: str) -> list[float]:
        import aiohttp

        times = []
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/stream") as resp:
                async for _ in resp.content.iter_any():
                    times.append(time.monotonic())
        return [b - a for a, b in zip(times, times[1:])]

    seen = {}
    for delay in (0, 150):
        server = launch.Server(template, tree=tmp_path, model=None, policy=sandbox.Policy(limits=limits.sandbox),
                               limits=limits, delay_ms=delay, label=f"delay {delay}")
        with server:
            server.wait_ready()
            seen[delay] = server.call(lambda: gaps(server.url), timeout_s=20, what="a stream")
    assert len(seen[150]) >= 4 and min(seen[150]) > 0.12, seen
    assert sum(seen[0]) < 0.1 * sum(seen[150]), seen


def test_the_launched_environment_names_a_user_and_keeps_multicast_off(tmp_path, limits, sglang_pin):
    # In the sandbox the server's uid has no passwd entry: getpass.getuser() (torch inductor's cache path, which
    # transformers serve reaches on a GPU) raised KeyError there on the H200 until the environment named a user.
    # NVLink multicast stays off in every engine launched (docs/RUNBOOK.md, the device's KINDS.md).
    _isolation_or_skip(True)
    probe = ("import getpass, os, sys; print('probe', getpass.getuser(), os.environ['NCCL_NVLS_ENABLE'], "
             "os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'], os.environ['NVSHMEM_DISABLE_NVLS'], "
             "os.environ['TORCHINDUCTOR_CACHE_DIR'].startswith(os.environ['HOME']), flush=True); sys.exit(3)")
    table = scripted_template().replace(f"argv = ", "argv_was = ", 1)
    table = table.replace('[launch.scripted]\n', f'[launch.scripted]\nargv = {json.dumps(["{python}", "-c", probe])}\n', 1)
    template = pin_stage.launch_template(pin_stage.load_pin(pin_with(tmp_path / "pin.toml", table.replace("argv_was = ", "# "))),
                                         "scripted")
    server = launch.Server(template, tree=tmp_path, model=None, policy=sandbox.Policy(isolate=True, limits=limits.sandbox),
                           limits=limits, label="baseline")
    with server, pytest.raises(launch.ServerDied, match="exit code 3"):
        server.wait_ready()
    assert "probe muse-server 0 1 1 True" in server.log_tail()
