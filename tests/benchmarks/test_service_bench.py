"""benchmarks/service.py's own parts: the one-connection-per-request client reads a
status (or none), and each request is counted once in a load point's row."""

from __future__ import annotations

import asyncio
from types import ModuleType

import pytest

from tests.benchmarks._scripts import load_script


@pytest.fixture(scope="module")
def service() -> ModuleType:
    return load_script("service", "service_bench_under_test")


def test_the_client_reads_the_status_on_a_connection_of_its_own(service: ModuleType) -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> tuple[int, int]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            first = await service.post(port, "/embed", b'{"text": "hi"}', 5.0)
            second = await service.post(port, "/healthz", None, 5.0)
        return first, second

    assert asyncio.run(main()) == (503, 503)
    assert len(seen) == 2  # two connections, one per request
    assert seen[0].startswith(b"POST /embed HTTP/1.1") and b"Content-Length: 14" in seen[0]
    assert seen[1].startswith(b"GET /healthz HTTP/1.1")


def test_the_client_closes_its_connection_once_the_answer_is_read(service: ModuleType) -> None:
    closed: list[bool] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        closed.append(await reader.read() == b"")  # the client's end of file, not ours
        writer.close()

    async def main() -> int:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            status = await service.post(port, "/healthz", None, 5.0)
            await asyncio.sleep(0.05)
        return status

    assert asyncio.run(main()) == 200 and closed == [True]


def test_no_listener_is_no_answer(service: ModuleType) -> None:
    port = service.free_port()  # nothing listens there
    assert asyncio.run(service.post(port, "/healthz", None, 2.0)) == 0


def test_a_row_counts_each_request_once_and_judges_the_served_by_the_target(
    service: ModuleType,
) -> None:
    outcomes = [service.Outcome(200, 0.1)] * 90 + [service.Outcome(200, 0.6)] * 5
    outcomes += [service.Outcome(503, 0.01)] * 4 + [service.Outcome(0, 30.0)]
    row = service.summarize(2.0, outcomes, capacity=10.0, seconds=5.0, target_s=0.5, idle_ok=20)
    assert row.offered == 100 and row.statuses == {200: 95, 503: 4, 0: 1}
    assert row.goodput == pytest.approx(90 / 5.0 / 10.0)  # the 5 late ones do not count
    assert row.served_p99_ms == pytest.approx(600.0)
    assert row.refused_p99_ms == pytest.approx(10.0)


def test_a_503_is_told_apart_by_who_answered_it(service: ModuleType) -> None:
    refused = b'{"detail": "predicted 612.0 ms to answer this request", "error": "Overloaded"}'
    dropped = b'{"detail": "dropped before it ran: waited 450.1 ms", "error": "Overloaded"}'
    assert service.refusal_of(503, refused) == "refused"
    assert service.refusal_of(503, dropped) == "dropped"
    assert service.refusal_of(503, b"Service Unavailable") == "edge"  # uvicorn's own
    assert service.refusal_of(503, b'{"detail": "full", "error": "QueueFull"}') == "edge"
    assert service.refusal_of(200, b'{"embedding": []}') == ""


def test_a_row_gives_the_dropped_and_the_edge_their_own_tail(service: ModuleType) -> None:
    outcomes = [service.Outcome(503, 0.005, "refused")] * 98
    outcomes += [service.Outcome(503, 0.450, "dropped")] * 2
    edge = [0.002] * 98 + [0.040] * 2
    row = service.summarize(4.0, outcomes, 10.0, 5.0, 0.5, 20, edge)
    assert row.refusals == {"refused": 98, "dropped": 2}
    assert row.dropped_p99_ms == pytest.approx(450.0)
    assert row.edge_p99_ms == pytest.approx(40.0)


def test_the_texts_are_seeded_and_of_varied_length(service: ModuleType) -> None:
    texts = service.texts(50, seed=3)
    assert texts == service.texts(50, seed=3)
    lengths = {len(t.split()) for t in texts}
    assert min(lengths) >= 5 and max(lengths) <= 60 and len(lengths) > 10
