"""A test server script run as a child process of a test (tests/serving/scripted_server.py, gsm8k_server.py).

The script prints `PORT <n>` once it listens on 127.0.0.1 (port 0 picks a free one); start() reads that
line, _call() posts or gets JSON on the server's control routes, stop() kills it and waits, so nothing is
left running; used as a context manager. Once it listens, two threads (the sandbox's OutputTail) read its
stdout and stderr to their ends and keep the last 64 KiB of each (`tail()`): a server that writes more than a
pipe holds (an exception logged for every request) would otherwise block on its next write, and the test
waiting on it would hang until CI's limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TAIL_BYTES = 64 * 1024


class ChildServer:
    script_path: str  # the server script (its module's __file__)
    name = "test server"

    def __init__(self, env: dict | None = None):
        self.proc = None
        self.port = None
        self.env = env

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ChildServer":
        self.proc = subprocess.Popen([sys.executable, self.script_path, "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=self.env)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"the {self.name} did not start: {line!r} {err[-2000:]}")
        self.port = int(line.split()[1])
        # The harness's own drain (in the test's process only: a server script imports this module in a sandbox,
        # where the pipeline package is not), each on a descriptor of its own, which it closes at the end.
        from pipeline.sandbox import OutputTail

        self._tails = [OutputTail(os.dup(s.fileno()), keep=TAIL_BYTES) for s in (self.proc.stdout, self.proc.stderr)]
        return self

    def tail(self) -> str:
        """The last of what the server wrote, stdout then stderr."""
        return "".join(t.text(TAIL_BYTES) for t in getattr(self, "_tails", ()))

    def _call(self, path: str, payload: dict | None = None) -> dict:
        import urllib.request

        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
