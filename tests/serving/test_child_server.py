"""The test servers' harness (tests/serving/child_server.py): a server that writes more than a pipe holds keeps
serving, and what it wrote last can be read. Before the harness read the servers' output, a scripted server that
logged a traceback for every request blocked on its stderr after ~30 of them and a test hung for ten minutes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from scripted_server import Server


def _post(url: str) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()
    except TimeoutError:
        raise AssertionError("the server stopped answering (blocked writing its output?)") from None
    except urllib.error.URLError as exc:
        assert not isinstance(exc.reason, TimeoutError), "the server stopped answering (blocked writing its output?)"
    except OSError:
        pass  # the stream breaks where the handler raised
    except Exception as exc:  # http.client's IncompleteRead and the like
        assert "timed out" not in str(exc)


def test_a_server_that_logs_a_traceback_a_request_keeps_serving():
    with Server() as server:
        # every request's handler raises after its stream began (an unknown codec): aiohttp logs the traceback
        server.script(bad_chunk_every=1, bad_chunk="x", bad_chunk_encoding="no-such-codec")
        for _ in range(150):
            _post(server.url)
        assert server.log()["requests"], "the server stopped answering"
        tail = server.tail()
        assert tail.count("LookupError") > 5 and len(tail) <= 2 * 64 * 1024 + 8192
