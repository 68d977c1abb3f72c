"""N replicas of one engine behind one address: the data-parallel launch of an engine that has no
tensor parallelism of its own (the test engine, transformers serve, on a node of 8 GPUs; issue 19).

Run by path inside the server's sandbox (it imports nothing of the pipeline, only aiohttp), as
pipeline/serving/launch.py wraps a template with `data_parallel = true`:

    python replicas.py --replicas N --port P --ready /health --device cuda|cpu -- CHILD ARGV...

The child's argv holds `{port}`, filled per replica with a free loopback port. On a CUDA device replica i
sees one GPU, the i-th of the visible ones (CUDA_VISIBLE_DEVICES as this process got it, else 0..N-1);
fewer visible GPUs than replicas is a launch error, never two replicas on one GPU.

What it answers on --port:
- the readiness path: 200 once every replica answers 200 on it, 503 before;
- POST /flush_cache (and every --broadcast path): sent to every replica, 200 when all answer 200, else the
  first refusal's status and body (a flush must empty every replica's cache, not one);
- GET /_replicas: each replica's port, pid, GPU, requests served and in flight (a diagnostic);
- anything else: proxied to the replica with the fewest requests in flight (the lowest index on a tie),
  its status, headers and body streamed back chunk by chunk as they arrive (an SSE stream stays a stream).

A replica that exits ends this process with its exit code (the launch sees a dead server, as it would
see one engine die); SIGTERM or SIGINT stops every replica first. The sandbox kills whatever is left.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys

from aiohttp import ClientSession, ClientTimeout, web

HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
       "transfer-encoding", "upgrade", "host", "content-length"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_list(replicas: int, device: str, environ: dict[str, str]) -> list[str | None]:
    """The GPU each replica sees (None on the CPU): the visible ones in order, one each."""
    if device != "cuda":
        return [None] * replicas
    visible = [g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if "CUDA_VISIBLE_DEVICES" not in environ:
        visible = [str(i) for i in range(replicas)]
    if len(visible) < replicas:
        raise SystemExit(f"replicas.py: {replicas} replicas need {replicas} GPUs, and CUDA_VISIBLE_DEVICES shows "
                         f"{len(visible)} ({environ.get('CUDA_VISIBLE_DEVICES')!r}): one GPU a replica, never two on one")
    return visible[:replicas]


class Replica:
    def __init__(self, index: int, argv: list[str], gpu: str | None):
        self.index, self.gpu, self.port = index, gpu, free_port()
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        self.proc = subprocess.Popen(self.argv, env=env)
        self.served = self.in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def describe(self) -> dict:
        return {"index": self.index, "port": self.port, "pid": self.proc.pid, "gpu": self.gpu,
                "served": self.served, "in_flight": self.in_flight, "exit_code": self.proc.poll()}


class Router:
    def __init__(self, replicas: list[Replica], ready: str, broadcast: list[str]):
        self.replicas, self.ready, self.broadcast = replicas, ready, set(broadcast)
        self.session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        # no total timeout: a stream lasts as long as the reply; the replay bounds its own requests
        self.session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10), auto_decompress=False)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/_replicas":
            return web.json_response([r.describe() for r in self.replicas])
        if request.path == self.ready and request.method == "GET":
            return await self._ready()
        body = await request.read()
        if request.path in self.broadcast:
            return await self._broadcast(request, body)
        replica = min(self.replicas, key=lambda r: (r.in_flight, r.index))
        replica.in_flight += 1
        replica.served += 1
        try:
            return await self._proxy(request, body, replica)
        finally:
            replica.in_flight -= 1

    def _headers(self, request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP}

    async def _ready(self) -> web.Response:
        for r in self.replicas:
            try:
                async with self.session.get(r.url + self.ready, timeout=ClientTimeout(total=5)) as resp:
                    await resp.read()
                    if resp.status != 200:
                        return web.Response(status=503, text=f"replica {r.index}: {resp.status}")
            except Exception as exc:  # noqa: BLE001 - refused, reset, timed out: not up yet
                return web.Response(status=503, text=f"replica {r.index}: {type(exc).__name__}")
        return web.Response(status=200, text="ok")

    async def _broadcast(self, request: web.Request, body: bytes) -> web.Response:
        async def one(r: Replica):
            async with self.session.request(request.method, r.url + request.path_qs, data=body,
                                            headers=self._headers(request)) as resp:
                return resp.status, await resp.read(), resp.headers.get("Content-Type")

        answers = await asyncio.gather(*(one(r) for r in self.replicas), return_exceptions=True)
        for r, a in zip(self.replicas, answers):
            if isinstance(a, BaseException):
                return web.Response(status=502, text=f"replica {r.index}: {type(a).__name__}: {a}")
            if a[0] != 200:
                return web.Response(status=a[0], body=a[1], headers={"Content-Type": a[2]} if a[2] else None)
        status, data, kind = answers[0]
        return web.Response(status=status, body=data, headers={"Content-Type": kind} if kind else None)

    async def _proxy(self, request: web.Request, body: bytes, replica: Replica) -> web.StreamResponse:
        async with self.session.request(request.method, replica.url + request.path_qs, data=body,
                                        headers=self._headers(request)) as resp:
            out = web.StreamResponse(status=resp.status, reason=resp.reason,
                                     headers={k: v for k, v in resp.headers.items() if k.lower() not in HOP})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


async def serve(args: argparse.Namespace, child: list[str]) -> int:
    gpus = gpu_list(args.replicas, args.device, dict(os.environ))
    replicas = [Replica(i, child, gpus[i]) for i in range(args.replicas)]
    router = Router(replicas, args.ready, args.broadcast)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_route("*", "/{tail:.*}", router.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"replicas.py: {args.replicas} replicas on ports {[r.port for r in replicas]} (GPUs {gpus}) behind "
          f"{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        while not stop.is_set():
            dead = [r for r in replicas if r.proc.poll() is not None]
            if dead:
                code = dead[0].proc.returncode or 1
                print(f"replicas.py: replica {dead[0].index} (pid {dead[0].proc.pid}) exited with "
                      f"{dead[0].proc.returncode}; stopping the others", file=sys.stderr, flush=True)
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in replicas:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        await runner.cleanup()
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("replicas.py: the child's command follows `--` (it holds {port})")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="replicas.py", description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--ready", default="/health")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    ap.add_argument("--broadcast", action="append", default=["/flush_cache"],
                    help="a path sent to every replica (repeatable; /flush_cache always)")
    args = ap.parse_args(argv[:cut])
    child = argv[cut + 1:]
    if args.replicas < 1 or not child or not any("{port}" in a for a in child):
        raise SystemExit("replicas.py: --replicas >= 1 and a child command holding {port} after `--`")
    return asyncio.run(serve(args, child))


if __name__ == "__main__":
    sys.exit(main())
