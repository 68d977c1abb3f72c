"""What the serving replayer itself costs: the output tokens/s it can absorb, and the latency it adds per chunk.

    python benchmarks/replayer_overhead.py [--concurrency 32] [--window 8] [--warmup 2] [--rate 20000]
                                           [--dataset datasets/serving/public-sample.json.gz] [--repeats 3]

Both against the scripted server (tests/serving/scripted_server.py), a separate process on this machine,
replaying the committed public sample (real histories, up to tens of thousands of tokens a request)
through pipeline/serving/replay.py exactly as a level is replayed, counted with the pinned tokenizer:

1. Absorb: the server streams every reply as fast as it can (no delay between tokens, one word = one
   token = one SSE chunk); the figure is the output tokens timestamped inside the window per second
   (T_c with one GPU). The CPU seconds each process used over the run are printed beside it: when the
   server is the one at a full core, the replayer can absorb at least that much.
2. Added latency: the server paces each of the c streams at rate / c tokens a second (the target load)
   and logs the perf_counter_ns of every chunk just before it writes it to the socket; the replayer
   timestamps each chunk with perf_counter_ns when it reads its line. Both are CLOCK_MONOTONIC on one
   machine, so client - server is the time a chunk spends in the kernel's loopback, the client's event
   loop and the HTTP/SSE parsing before the replayer's timestamp: what the replayer adds to every
   measured time. Percentiles over every chunk of the window.

Each measurement runs --repeats times (a fresh server each time); the table gives each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "serving"))

from pipeline.serving import metrics, replay  # noqa: E402
from pipeline.serving import tokenizer as pinned  # noqa: E402
from scripted_server import Server  # noqa: E402


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default), from /proc."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PINNED = False


def pin(server_pid: int) -> None:
    """With --pin: the server on the first CPU, this process (the client) on the last, each alone on its core."""
    if PINNED:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(server_pid, {cpus[0]})
        os.sched_setaffinity(0, {cpus[-1]})


def percentile(xs, p):
    return metrics.percentile(xs, p)


def one_run(dataset: Path, concurrency: int, window: float, warmup: float, token_s: float,
            log_sends: bool) -> dict:
    system, conversations, sha = replay.load_dataset(dataset)
    tok = pinned.load()
    with Server() as server:
        pin(server.proc.pid)
        server.script(token_s=token_s, record_bodies=False, log_sends=log_sends)
        server_cpu0, client_cpu0, wall0 = cpu_seconds(server.proc.pid), cpu_seconds(), time.perf_counter()
        doc = asyncio.run(replay.run(server.url, system, conversations, tok, engine="sglang",
                                     concurrency=concurrency, window_s=window, warmup_s=warmup, seed=1))
        wall = time.perf_counter() - wall0
        server_cpu, client_cpu = cpu_seconds(server.proc.pid) - server_cpu0, cpu_seconds() - client_cpu0
        log = server.log() if log_sends else None
    lv = metrics.level(doc, gpus=1)
    out = {"tokens_per_s": lv["T"], "turns": len(doc["turns"]), "valid": lv["valid"],
           "server_cpu_share": server_cpu / wall, "client_cpu_share": client_cpu / wall,
           "max_in_flight": None}
    if log is not None:
        out["max_in_flight"] = log["max_in_flight"]
        out.update(latencies(doc, log, conversations))
    return out


def latencies(doc: dict, log: dict, conversations: list[dict]) -> dict:
    """Client receive - server send per chunk, for the chunks inside the window (ms percentiles)."""
    facts = doc["facts"]
    origin, start, end = facts["origin_ns"], facts["window_start_ns"], facts["window_end_ns"]
    by_id = {c["id"]: c for c in conversations}
    # rebuild each record's request key: the system tag, the first user message, the message count
    sends_by_key = {}
    for req in log["requests"]:
        if "sends" in req:
            sends_by_key[req["key"]] = req["sends"]
    gaps = []
    unmatched = 0
    for rec in doc["turns"]:
        conv = by_id[rec["conversation"]]
        tag = facts["marker"] if rec["pass"] == 0 else f"{facts['marker']}/{rec['pass']}"
        n_messages = 1 + sum(len(t["messages"]) for t in conv["turns"][:rec["turn"] + 1]) + rec["turn"]
        key = json.dumps([tag, conv["turns"][0]["messages"][0]["content"][:200], n_messages])
        sends = sends_by_key.get(key)
        if sends is None:
            unmatched += 1
            continue
        for t, sent in zip(rec["chunk_ns"], sends):
            if start <= t < end:
                gaps.append((t + origin - sent) / 1e6)
    return {"chunks": len(gaps), "unmatched_turns": unmatched,
            "latency_p50_ms": percentile(gaps, 50), "latency_p99_ms": percentile(gaps, 99),
            "latency_max_ms": max(gaps) if gaps else None}


async def _floor_lane(port: int, lane: int, lengths: list[int], deadline: float, times: dict) -> None:
    # The least a Python client can do: one socket, a request written by hand, each read timestamped
    # and its content chunks counted by a byte search. No HTTP parser, no JSON, no SSE lines.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    perf = time.perf_counter_ns
    try:
        k = 0
        while time.perf_counter() < deadline:
            n = lengths[k % len(lengths)]
            body = json.dumps({"messages": [{"role": "system", "content": "floor"},
                                            {"role": "user", "content": f"lane {lane} turn {k}"}],
                               "max_tokens": n, "stream": True}).encode()
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            stamps = times[json.dumps(["floor", f"lane {lane} turn {k}", 2])] = []
            tail = b""
            while True:
                data = await reader.read(65536)
                t = perf()
                if not data:
                    return
                stamps.extend([t] * data.count(b'"content"'))
                tail = (tail + data)[-64:]
                if b"[DONE]" in tail and tail.endswith(b"0\r\n\r\n"):
                    break
            k += 1
    finally:
        writer.close()


def floor_run(concurrency: int, window: float, warmup: float, token_s: float, dataset: Path) -> dict:
    """The same load read by the floor client: what this machine adds to a chunk with no replayer at all."""
    _, conversations, _ = replay.load_dataset(dataset)
    lengths = [t["max_tokens"] for c in conversations for t in c["turns"]]
    with Server() as server:
        pin(server.proc.pid)
        server.script(token_s=token_s, record_bodies=False, log_sends=True)
        times: dict = {}
        t0 = time.perf_counter()

        async def main():
            deadline = t0 + warmup + window
            tasks = [asyncio.create_task(_floor_lane(server.port, i, lengths[i:] + lengths[:i], deadline, times))
                     for i in range(concurrency)]
            await asyncio.sleep(warmup + window)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        start_ns = time.perf_counter_ns() + int(warmup * 1e9)
        asyncio.run(main())
        log = server.log()
    gaps = []
    for req in log["requests"]:
        got = times.get(req.get("key"))
        if got:
            gaps.extend((t - sent) / 1e6 for t, sent in zip(got, req["sends"]) if t >= start_ns)
    return {"chunks": len(gaps), "latency_p50_ms": percentile(gaps, 50), "latency_p99_ms": percentile(gaps, 99),
            "latency_max_ms": max(gaps) if gaps else None, "tokens_per_s": len(gaps) / window}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=20000.0, help="the paced run's total tokens/s")
    parser.add_argument("--dataset", type=Path, default=ROOT / "datasets" / "serving" / "public-sample.json.gz")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=["absorb", "latency", "floor"], default=None)
    parser.add_argument("--pin", action="store_true", help="server and client each on a CPU of its own")
    args = parser.parse_args()
    global PINNED
    PINNED = args.pin
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "absorb"):
        for i in range(args.repeats):
            r = one_run(args.dataset, args.concurrency, args.window, args.warmup, 0.0, log_sends=False)
            print(f"absorb  run {i}: {r['tokens_per_s']:9.0f} tokens/s at c={args.concurrency} ({r['turns']} turns, "
                  f"valid={r['valid']}); CPU share over the run: replayer {r['client_cpu_share']:.2f}, "
                  f"server {r['server_cpu_share']:.2f}", flush=True)
    if args.only in (None, "latency"):
        token_s = args.concurrency / args.rate
        for i in range(args.repeats):
            r = one_run(args.dataset, args.concurrency, args.window, args.warmup, token_s, log_sends=True)
            print(f"latency run {i}: {r['tokens_per_s']:9.0f} tokens/s offered {args.rate:.0f} "
                  f"({token_s * 1e3:.2f} ms a token a stream); added latency per chunk over {r['chunks']} chunks: "
                  f"p50 {r['latency_p50_ms']:.3f} ms, p99 {r['latency_p99_ms']:.3f} ms, max {r['latency_max_ms']:.3f} ms; "
                  f"CPU share: replayer {r['client_cpu_share']:.2f}, server {r['server_cpu_share']:.2f}; "
                  f"unmatched turns {r['unmatched_turns']}", flush=True)
    if args.only in (None, "floor"):
        token_s = args.concurrency / args.rate
        for i in range(args.repeats):
            r = floor_run(args.concurrency, args.window, args.warmup, token_s, args.dataset)
            print(f"floor   run {i}: {r['tokens_per_s']:9.0f} tokens/s, the same load read by a bare socket client: "
                  f"p50 {r['latency_p50_ms']:.3f} ms, p99 {r['latency_p99_ms']:.3f} ms, max {r['latency_max_ms']:.3f} ms "
                  f"over {r['chunks']} chunks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
