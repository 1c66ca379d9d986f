"""The access line: the fields `logging` used to print, written by `AccessLog`'s buffer,
level-controlled, and never lost at shutdown (a real `gateway serve` and a real SIGTERM)."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import logging
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.logs import ACCESS_LOGGER, AccessLog, JsonFormatter
from sblocal.testing import BrokerProcess
from tests.support.processes import GatewayProcess, broker_env, free_port
from tests.support.waiting import eventually, next_tick

FIELDS = {
    "request_id": "r1",
    "entity": "orders",
    "status": 201,
    "route": "primary",
    "message_ids": ["m1"],
    "messages": 1,
    "latency_ms": 0.5,
}


@pytest.fixture
def access_level() -> Iterator[logging.Logger]:
    """The access logger, its level restored afterwards."""
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(level)


@pytest.mark.unit
def test_the_json_line_has_the_fields_the_logging_formatter_printed(access_level):
    stream = io.StringIO()
    AccessLog("json", stream).write(logging.INFO, "request r1 -> 201", dict(FIELDS))
    line = orjson.loads(stream.getvalue())
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, "", 0, "request r1 -> 201", (), None)
    record.__dict__.update(FIELDS)
    expected = orjson.loads(JsonFormatter().format(record))
    assert list(line) == list(expected)  # the same keys, in the same order
    assert {k: v for k, v in line.items() if k != "ts"} == {
        k: v for k, v in expected.items() if k != "ts"
    }
    ts = dt.datetime.fromisoformat(line["ts"])
    assert ts.tzinfo == dt.UTC and abs(ts - dt.datetime.now(dt.UTC)) < dt.timedelta(minutes=1)
    assert line["ts"][19] == "." and len(line["ts"]) == len(expected["ts"])  # milliseconds


@pytest.mark.unit
def test_extras_are_merged_after_the_fields_and_the_text_format_still_works(access_level):
    stream = io.StringIO()
    AccessLog("json", stream).write(
        logging.WARNING, "request r1 -> 503", dict(FIELDS), {"trace_id": "ab" * 16}
    )
    line = orjson.loads(stream.getvalue())
    assert line["level"] == "WARNING" and list(line)[-1] == "trace_id"
    text = io.StringIO()
    AccessLog("text", text).write(logging.INFO, "request r1 -> 201", dict(FIELDS))
    assert text.getvalue().endswith(" INFO    gateway.requests: request r1 -> 201\n")


@pytest.mark.unit
def test_the_level_is_the_access_loggers(access_level):
    log = AccessLog("json", io.StringIO())
    assert log.enabled(logging.INFO) and log.enabled(logging.WARNING)
    access_level.setLevel(logging.WARNING)
    assert not log.enabled(logging.INFO) and log.enabled(logging.WARNING)


class _Writes(io.StringIO):
    """A stream that counts its writes."""

    writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


@pytest.mark.unit
async def test_lines_are_buffered_for_a_moment_or_until_64_kib_or_close(access_level):
    stream = _Writes()
    log = AccessLog("json", stream, flush_delay=0.5)  # far longer than the turns below
    log.bind(asyncio.get_running_loop())
    for _ in range(3):
        log.write(logging.INFO, "request r1 -> 201", dict(FIELDS))
        await next_tick(3)  # lines of several loop turns
    assert stream.getvalue() == ""
    await eventually(lambda: stream.getvalue().count("\n") == 3, what="the buffered lines")
    assert stream.writes == 1  # one write for the three
    big = {**FIELDS, "message_ids": ["x" * 1000] * 20}
    for _ in range(4):  # > 64 KiB: written without waiting
        log.write(logging.INFO, "request r1 -> 201", dict(big))
    assert stream.getvalue().count("\n") == 7
    log.write(logging.INFO, "request last -> 201", dict(FIELDS))
    log.close()
    assert stream.getvalue().endswith('"latency_ms":0.5}\n')
    assert stream.getvalue().count("\n") == 8
    log.write(logging.INFO, "request after-close -> 201", dict(FIELDS))  # written at once
    assert "after-close" in stream.getvalue()


@pytest.mark.unit
def test_a_broken_stream_never_fails_the_request(access_level):
    stream = io.StringIO()
    stream.close()
    AccessLog("json", stream).write(logging.INFO, "request r1 -> 201", dict(FIELDS))


@pytest.mark.integration
async def test_the_last_line_before_sigterm_is_written(broker: BrokerProcess, tmp_path: Path):
    env = broker_env(
        broker, SBGATE_LOG_LEVEL="INFO", SBGATE_LOG_FORMAT="json", SBGATE_DRAIN_DELAY="0"
    )
    async with GatewayProcess("gateway", env, port=free_port(), log_dir=tmp_path) as gw:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            async with http.post(
                f"{gw.url}/queues/orders/messages",
                data=b"x",
                headers={"X-Request-Id": "the-last-one", "BrokerProperties": '{"MessageId":"m"}'},
            ) as r:
                assert r.status == 201
        gw.terminate()  # at once: the line may still be in the buffer
        assert await gw.wait(30) == 0
    err = gw.output()
    lines = [orjson.loads(x) for x in err.splitlines() if x.startswith(b"{")]
    access = [x for x in lines if x.get("request_id") == "the-last-one"]
    assert len(access) == 1, err.decode(errors="replace")[-2000:]
    assert access[0] | {"ts": "-", "latency_ms": 0} == {
        "ts": "-",
        "level": "INFO",
        "logger": "gateway.requests",
        "msg": "request the-last-one -> 201",
        "request_id": "the-last-one",
        "protocol": "http",
        "entity": "orders",
        "status": 201,
        "route": "primary",
        "message_ids": ["m"],
        "messages": 1,
        "latency_ms": 0,
    }


def test_a_value_orjson_refuses_still_makes_one_line_and_never_raises() -> None:
    """The line is written after the outcome is settled: raising would turn a stored
    message's 201 into a 500, and its client would send it again."""
    stream = io.StringIO()
    AccessLog("json", stream).write(
        logging.INFO, "request r1 -> 201", {**FIELDS, "message_ids": ["\udcff"], "n": 2**70}
    )
    line = orjson.loads(stream.getvalue())
    assert line["message_ids"] == "['\\udcff']" and line["n"] == str(2**70)
    assert line["request_id"] == FIELDS["request_id"]


@pytest.mark.unit
def test_ts_is_the_iso_time_to_the_millisecond_whatever_the_order_of_the_calls() -> None:
    """`ts` is formatted once a millisecond and its date once a second: neither cache may
    outlive its millisecond or second, backwards in time included (a clock stepped back)."""
    log = AccessLog("json", io.StringIO())
    base = dt.datetime(2026, 11, 30, 23, 59, 59, tzinfo=dt.UTC).timestamp()
    for offset in (0.0004, 0.0009, 0.0012, 0.9991, 1.0, 1.0005, 0.0004, 86_400.25, 0.5):
        now = base + offset
        expected = dt.datetime.fromtimestamp(now, dt.UTC).isoformat(timespec="milliseconds")
        assert log._iso(now) == expected, offset


@pytest.mark.unit
def test_a_send_requests_line_has_every_field_once_rounded_and_in_order(access_level):
    from gateway.core.message import OutboundMessage
    from gateway.errors import Saturated
    from gateway.ingest import Outcome, log_outcome

    stream = io.StringIO()
    log = AccessLog("json", stream)
    messages = [OutboundMessage(body=b"x", message_id=f"m{i}") for i in range(25)]
    outcome = Outcome("r1", "amqp", key_name="sender", fields={"link": "l1"})
    log_outcome(log, outcome, "orders", 201, "primary", messages[:1], 0.0069474, None)
    log_outcome(log, outcome, "orders", 503, "none", messages, 1.5, Saturated("no room"))
    one, many = (orjson.loads(x) for x in stream.getvalue().splitlines())
    assert list(one)[:4] == ["ts", "level", "logger", "msg"]
    assert one | {"ts": "-"} == {
        "ts": "-",
        "level": "INFO",
        "logger": "gateway.requests",
        "msg": "request r1 -> 201",
        "request_id": "r1",
        "protocol": "amqp",
        "entity": "orders",
        "status": 201,
        "route": "primary",
        "message_ids": ["m0"],
        "messages": 1,
        "latency_ms": 6.947,
        "link": "l1",
        "key_name": "sender",
    }
    assert many["level"] == "WARNING" and many["error"] == "saturated"
    assert many["message_ids"] == [f"m{i}" for i in range(20)] and many["messages"] == 25
    assert many["latency_ms"] == 1500.0
