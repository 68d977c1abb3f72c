"""What sharing one MoE input set costs (pipeline/kernel/transport.py): 1.5 GB on the full model, the
largest thing the evaluator hands a worker. Per device: `share` (a new buffer of the parent's and one
copy into it), the worker's side of receiving it (mapping the descriptor: a memfd's mmap on the CPU, a
CUDA VMM import and map on a GPU) in another process, and the parent's bit-exact comparison of the
buffer with its pristine copy after the call (what replaced the digests the child used to report).

    python benchmarks/transport.py [--gb 1.5] [--repeats 5] [--device cpu|cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.kernel import transport  # noqa: E402

RECEIVER = textwrap.dedent("""
    import json, socket, sys, time
    sys.path.insert(0, sys.argv[2])
    import torch
    from pipeline.kernel.transport import Mappings
    sock = socket.socket(fileno=int(sys.argv[1]))
    device = torch.device(sys.argv[3])
    if device.type == "cuda":
        torch.empty(1, device=device)
    maps = Mappings(device)
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
        if not data:
            break
        req = json.loads(data)
        t0 = time.perf_counter()
        maps.receive(req["arenas"], fds)
        x = maps.unpack(req["bundle"])["w"]
        float(x[-1])  # touch it
        took = time.perf_counter() - t0
        maps.drop([a["id"] for a in req["arenas"]])
        sock.send(json.dumps({"map_s": took}).encode())
""")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    n = int(args.gb * (1 << 30))
    pristine = torch.randint(0, 255, (n,), dtype=torch.uint8, device=args.device)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(theirs.fileno()), str(ROOT), args.device],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    times: dict[str, list[float]] = {"share_s": [], "map_s": [], "compare_s": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        shared = transport.share({"w": pristine})
        times["share_s"].append(time.perf_counter() - t0)
        arenas = list(shared.arenas.values())
        transport.send(ours, json.dumps({"arenas": [a.spec() for a in arenas], "bundle": shared.spec()}).encode(),
                       [a.fd for a in arenas])
        times["map_s"].append(json.loads(ours.recv(1 << 16))["map_s"])
        t0 = time.perf_counter()
        same = transport.identical(shared.views["w"], pristine)
        times["compare_s"].append(time.perf_counter() - t0)
        assert same
        shared.close()
    ours.close()
    proc.wait(timeout=60)
    summary = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k.replace("_s", "_gb_per_s"): args.gb / v for k, v in summary.items()}
    out = {"device": args.device, "gb": args.gb, "repeats": args.repeats, "seconds": summary, "gb_per_s": gbs, "all": times}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
