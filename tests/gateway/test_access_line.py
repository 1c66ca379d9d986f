"""A stored request's access line is serialised value by value (`gateway.ingest.log_outcome`,
`AccessLog.write_values`): the same bytes as the dict `AccessLog.write` serialises, for every
kind of outcome that takes that path."""

from __future__ import annotations

import io
import logging

import orjson
import pytest

from gateway.core.message import OutboundMessage
from gateway.errors import RequestError
from gateway.ingest import Outcome, log_outcome
from gateway.logs import ACCESS_LOGGER, AccessLog

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _info() -> object:
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(level)


def _line(outcome: Outcome, status: int, route: str, n: int, error: object = None) -> bytes:
    sink = io.StringIO()
    log = AccessLog("json", sink)  # no loop bound: each line is written at once
    messages = [OutboundMessage(body=b"x", message_id=f'id-{i}-"\\é') for i in range(n)]
    log_outcome(log, outcome, "orders/Sub", status, route, messages, 0.0123456, error)  # type: ignore[arg-type]
    return sink.getvalue().encode()


def _as_dict_path(outcome: Outcome, status: int, route: str, n: int) -> bytes:
    """The line as `AccessLog.write` writes the dict `log_outcome` builds for it."""
    sink = io.StringIO()
    log = AccessLog("json", sink)
    fields: dict[str, object] = {
        "request_id": outcome.request_id,
        "protocol": outcome.protocol,
        "entity": "orders/Sub",
        "status": status,
        "route": route,
        "message_ids": [f'id-{i}-"\\é' for i in range(n)][:20],
        "messages": n,
        "latency_ms": round(0.0123456 * 1000, 3),
    }
    if outcome.key_name is not None:
        fields["key_name"] = outcome.key_name
    log.write(logging.INFO, f"request {outcome.request_id} -> {status}", fields)
    return sink.getvalue().encode()


def _without_ts(line: bytes) -> list[tuple[str, object]]:
    items = list(orjson.loads(line).items())
    assert items[0][0] == "ts"
    return items[1:]


@pytest.mark.parametrize(
    ("outcome", "status", "route", "n"),
    [
        (Outcome("0e97458945e72c31b77e6e675b39bfa3"), 201, "primary", 1),
        (Outcome('client "id" \\ x', "amqp", key_name="sender"), 202, "backlog", 25),
        (Outcome("r", key_name="k\u00e9y"), 201, "primary", 100),
    ],
)
def test_the_serialised_line_is_the_dicts_line(outcome: Outcome, status: int, route: str, n: int):
    ours, theirs = _line(outcome, status, route, n), _as_dict_path(outcome, status, route, n)
    assert ours.endswith(b"\n") and ours.count(b"\n") == 1
    assert _without_ts(ours) == _without_ts(theirs)
    # Byte for byte once the timestamps are the same.
    ts = orjson.loads(ours)["ts"].encode()
    assert ours == theirs.replace(orjson.loads(theirs)["ts"].encode(), ts, 1)


def test_an_error_still_takes_the_dicts_path_with_its_code():
    line = orjson.loads(_line(Outcome("r"), 400, "none", 0, RequestError("bad body")))
    assert line["error"] == "bad_request" and line["error_message"] == "bad body"
