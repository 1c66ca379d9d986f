"""The harness's own pieces, without the stack: the fault proxy over real sockets, the
checker's classification, the ack format."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtests.acks import Ack, AckWriter, classify, read_acks
from loadtests.checker import check
from loadtests.client import RequestRecord
from loadtests.proxy import FaultProxy
from loadtests.scenarios.framework import five_xx


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()


async def _roundtrip(port: int, payload: bytes, within: float = 2.0) -> bytes:
    async with asyncio.timeout(within):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(payload)
            await writer.drain()
            return await reader.readexactly(len(payload))
        finally:
            writer.close()


async def test_proxy_forwards_and_adds_latency(echo_port: int) -> None:
    async with FaultProxy(echo_port) as proxy:
        assert await _roundtrip(proxy.port, b"hello") == b"hello"
        proxy.set_latency(0.1)
        loop = asyncio.get_running_loop()
        t = loop.time()
        assert await _roundtrip(proxy.port, b"slow") == b"slow"
        assert loop.time() - t >= 0.2  # 0.1 s each way


async def test_proxy_stall_keeps_the_stream_and_heal_resumes_it(echo_port: int) -> None:
    async with FaultProxy(echo_port) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            proxy.stall()
            writer.write(b"held")
            await writer.drain()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await reader.readexactly(4)
            proxy.heal()
            async with asyncio.timeout(2):
                assert await reader.readexactly(4) == b"held"
        finally:
            writer.close()


async def test_proxy_blackhole_swallows_then_heal_resets(echo_port: int) -> None:
    async with FaultProxy(echo_port) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            proxy.blackhole()
            writer.write(b"lost")
            await writer.drain()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await reader.read(1)
            proxy.heal()
            async with asyncio.timeout(2):
                with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                    await reader.readexactly(1)
            # New connections work again.
            assert await _roundtrip(proxy.port, b"back") == b"back"
        finally:
            writer.close()


async def test_proxy_reset_aborts_open_and_new_connections(echo_port: int) -> None:
    async with FaultProxy(echo_port) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(proxy.port, b"ok") == b"ok"
        proxy.reset()
        async with asyncio.timeout(2):
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                writer.write(b"x")
                await writer.drain()
                await reader.readexactly(1)
        writer.close()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await _roundtrip(proxy.port, b"no")
        proxy.heal()
        assert await _roundtrip(proxy.port, b"yes") == b"yes"


def _ack(mid: str, outcome: str, status: int | None, entity: str = "orders") -> Ack:
    return Ack("2025-01-01T00:00:00+00:00", mid, entity, status, outcome, None, 1.0)  # type: ignore[arg-type]


def _got(mid: str, *, queue: str = "orders", source: str = "primary", reason: str | None = None,
         entity: str = "orders") -> dict[str, object]:  # fmt: skip
    return {"message_id": mid, "entity": entity, "source": source, "queue": queue,
            "dead_letter_reason": reason}  # fmt: skip


def test_checker_classifies_every_case() -> None:
    acks = [
        _ack("ok", "acked", 201),
        _ack("lost", "acked", 202),
        _ack("dup", "acked", 201),
        _ack("shadow", "acked", 202),
        _ack("retried", "indeterminate", None),
        _ack("retried", "acked", 201),
        _ack("maybe", "indeterminate", None),  # never acked, delivered: allowed
        _ack("maybe5xx", "failed", 503),  # never acked, delivered: allowed
        _ack("refused", "rejected", 400),  # refused, delivered: a violation
        _ack("expired", "acked", 202),
        _ack("waiting", "acked", 202),
        _ack("wrong", "acked", 201, entity="payments"),
        _ack("never", "rejected", 503),  # refused and not delivered: fine
    ]
    delivered = [
        _got("ok"),
        _got("dup"),
        _got("dup", queue="orders/$DeadLetterQueue", reason="MaxDeliveryCountExceeded"),
        _got("shadow"),
        _got("shadow", source="backlog", queue="primary/x-servicebus-transfer/0"),
        _got("retried"),
        _got("maybe"),
        _got("maybe5xx"),
        _got("refused"),
        _got(
            "expired",
            queue="primary/x-servicebus-transfer/1/$DeadLetterQueue",
            source="backlog",
            reason="TTLExpiredException",
        ),
        _got("waiting", queue="primary/x-servicebus-transfer/2", source="backlog"),
        _got("wrong"),
        _got("ghost"),
        _got("injected"),
    ]
    v = check(acks, delivered, injected=["injected"])
    assert v.acked == 8
    assert v.lost == 1 and v.examples["lost"] == ["lost"]
    assert v.duplicated == 1 and v.extra_copies == 1
    assert v.backlog_shadows == 1 and v.examples["backlog_shadow"] == ["shadow"]
    assert v.unexpected == 2
    assert v.unexpected_violations == 1
    assert v.expired == 1
    assert v.in_backlog == 1
    assert v.misrouted == 1
    assert v.phantoms == 1
    assert v.not_acked == 1
    assert v.status_5xx == 2 and v.status_4xx == 1 and v.indeterminate == 2


def test_five_xx_names_what_each_answer_was() -> None:
    # A "no 5xx" criterion that fails says which statuses and error codes it saw.
    def rec(status: int | None, error: str | None = None) -> RequestRecord:
        return RequestRecord(0.0, 0.1, status, "acked", None, 1, "u", error, 0)

    records = [
        rec(201),
        rec(503, "overloaded"),
        rec(500, "internal_error"),
        rec(503, "overloaded"),
        rec(None, "ClientOSError"),
        rec(404, "not_found"),
    ]
    assert five_xx(records) == (
        3,
        "3 answers >= 500 (503 overloaded x2, 500 internal_error x1)",
    )
    assert five_xx([rec(201), rec(None, "TimeoutError")]) == (0, "none")


def test_ack_format_round_trips(tmp_path: Path) -> None:
    w = AckWriter(tmp_path / "a.jsonl")
    w.write(["m-1", "m-2"], "events", 202, "acked", "backlog", 3.14159)
    w.write(["m-3"], "orders", None, "indeterminate", None, None)
    w.close()
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert list(first) == ["ts", "message_id", "entity", "status", "outcome", "route",
                           "latency_ms"]  # fmt: skip
    assert first["latency_ms"] == 3.142 and first["ts"].endswith("+00:00")
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write('{"ts": "torn')  # a killed writer's last line
    assert [a.message_id for a in read_acks([tmp_path])] == ["m-1", "m-2", "m-3"]
    assert classify(201) == "acked"
    assert classify(400) == "rejected"
    assert classify(503, "saturated") == "rejected"
    assert classify(503, "upstream_timeout") == "failed"
    assert classify(None) == "indeterminate"


def test_locust_targets_default_to_make_runs_entities() -> None:
    from loadtests.entities import MAKE_RUN_ENTITIES, targets

    assert targets(MAKE_RUN_ENTITIES) == (
        ("orders", "/queues/orders/messages"),
        ("events", "/topics/events/messages"),
    )
    assert targets(" queue:a/b , topic:t ") == (
        ("a/b", "/queues/a/b/messages"),
        ("t", "/topics/t/messages"),
    )
    with pytest.raises(ValueError, match="payments"):
        targets("payments")
