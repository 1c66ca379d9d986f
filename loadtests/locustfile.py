"""Locust users for sbgate: single messages and batches to queues and topics, bodies from
100 B to 200 KB, unique MessageIds, every request's ids and outcome recorded.

Run by ``python -m loadtests load`` (which starts a stack for it), or by hand against any
gateway. Against ``make run``: start it, copy the ``LOADTEST_AUTHORIZATION=...`` line its
banner prints (a token for every entity, signed with the demo keys), and::

    export LOADTEST_AUTHORIZATION='SharedAccessSignature sr=...'   # the banner's line
    .venv/bin/locust -f loadtests/locustfile.py --headless -u 8 -r 8 -t 30s \\
        --host http://127.0.0.1:8080

The default entities are the ones ``make run`` declares, so nothing else needs setting.

Environment:

* ``LOADTEST_HOSTS`` — comma-separated gateway base URLs; users are spread over them
  (default: Locust's ``--host``).
* ``LOADTEST_ENTITIES`` — the entities to send to, in ``SBGATE_ENTITIES`` form
  (``queue:orders,topic:events``, the default: ``make run``'s). Each must be declared on the
  gateway, or its requests fail with 404.
* ``LOADTEST_ACKS_DIR`` — where each Locust process writes ``acks-<pid>.jsonl`` (the
  acknowledgement format of `loadtests.acks`; default ``out/load/acks``).
* ``LOADTEST_AUTHORIZATION`` — a ready ``Authorization`` header value, sent on every request:
  required when the gateway has authorization rules (``make run`` has: its banner prints
  one; ``gateway token --namespace`` mints one for any rules file).
* ``LOADTEST_RATE`` — requests per second for all users together (default: unpaced).
* ``LOADTEST_BATCH_RATIO`` — share of requests that are batches (default 0.2).
* ``LOADTEST_RUN_ID`` — a prefix that keeps MessageIds unique across runs.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from locust import FastHttpUser, constant, constant_throughput, events, task

# Locust puts this file's folder on sys.path, not the checkout: make `loadtests` importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtests.acks import AckWriter, classify
from loadtests.entities import MAKE_RUN_ENTITIES, targets

BATCH_CONTENT_TYPE = "application/vnd.microsoft.servicebus.json"
TARGETS = targets(os.environ.get("LOADTEST_ENTITIES") or MAKE_RUN_ENTITIES)
_HOSTS = [h.strip().rstrip("/") for h in os.environ.get("LOADTEST_HOSTS", "").split(",") if h]
_ACKS_DIR = os.environ.get("LOADTEST_ACKS_DIR", "out/load/acks")
_AUTH = os.environ.get("LOADTEST_AUTHORIZATION") or None
_RATE = float(os.environ.get("LOADTEST_RATE", "0") or 0)
_BATCH_RATIO = float(os.environ.get("LOADTEST_BATCH_RATIO", "0.2"))
_RUN_ID = os.environ.get("LOADTEST_RUN_ID") or uuid.uuid4().hex[:8]
_user_numbers = itertools.count()


class _Acks:
    """One ack file per Locust process (``--processes`` forks: the pid tells them apart)."""

    writer: AckWriter | None = None
    pid = 0

    @classmethod
    def get(cls) -> AckWriter:
        if cls.writer is None or cls.pid != os.getpid():
            cls.pid = os.getpid()
            cls.writer = AckWriter(os.path.join(_ACKS_DIR, f"acks-{cls.pid}.jsonl"))
        return cls.writer


def _flush(**_: Any) -> None:
    if _Acks.writer is not None:
        _Acks.writer.flush()


def _close(**_: Any) -> None:
    if _Acks.writer is not None:
        _Acks.writer.close()


events.test_stop.add_listener(_flush)  # type: ignore[no-untyped-call]
events.quitting.add_listener(_close)  # type: ignore[no-untyped-call]


def _body(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.03:
        n = rng.randint(16 * 1024, 200 * 1024)
    elif r < 0.23:
        n = rng.randint(1024, 16 * 1024)
    else:
        n = rng.randint(100, 1024)
    return "x" * n


class GatewayUser(FastHttpUser):
    """Sends one request at a time (a single message or a batch) to a gateway replica."""

    # Paced by LOADTEST_RATE (divided among users by the runner), else back to back.
    wait_time = constant(0)
    network_timeout = 15.0
    connection_timeout = 5.0

    def on_start(self) -> None:
        n = next(_user_numbers)
        self.number = n
        self.base = _HOSTS[n % len(_HOSTS)] if _HOSTS else (self.host or "").rstrip("/")
        self.rng = random.Random(f"{_RUN_ID}-{os.getpid()}-{n}")
        self.seq = itertools.count()
        self.prefix = f"{_RUN_ID}-{os.getpid()}-{n}"

    def _ids(self, k: int) -> list[str]:
        return [f"{self.prefix}-{next(self.seq)}" for _ in range(k)]

    def _headers(self) -> dict[str, str]:
        return {"Authorization": _AUTH} if _AUTH else {}

    @task
    def send(self) -> None:
        entity, path = TARGETS[self.rng.randrange(len(TARGETS))]
        headers = self._headers()
        if self.rng.random() < _BATCH_RATIO:
            ids = self._ids(self.rng.randint(2, 20))
            body = orjson.dumps(
                [
                    {
                        "Body": "b" * self.rng.randint(100, 2048),
                        "BrokerProperties": {"MessageId": mid},
                        "UserProperties": {"user": self.number},
                    }
                    for mid in ids
                ]
            ).decode()
            headers["Content-Type"] = BATCH_CONTENT_TYPE
            name = f"{entity} batch"
        else:
            ids = self._ids(1)
            body = _body(self.rng)
            headers["Content-Type"] = "application/octet-stream"
            headers["BrokerProperties"] = orjson.dumps({"MessageId": ids[0]}).decode()
            name = f"{entity} single"
        self._post(self.base + path, body, headers, ids, entity, name)

    def _post(
        self,
        url: str,
        body: str,
        headers: dict[str, str],
        ids: list[str],
        entity: str,
        name: str,
    ) -> None:
        start = time.perf_counter()
        with self.client.post(
            url, data=body, headers=headers, name=name, catch_response=True
        ) as resp:
            status: int | None = resp.status_code or None
            route = None
            code = None
            if status is not None:
                try:
                    payload = orjson.loads(resp.content or b"{}")
                except orjson.JSONDecodeError:
                    payload = {}
                if isinstance(payload, dict):
                    route = payload.get("route") if 200 <= status < 300 else None
                    code = payload.get("error")
            outcome = classify(status, code)
            if status is None and isinstance(resp.error, ConnectionRefusedError):
                outcome = "rejected"  # refused before anything was sent
            latency = (time.perf_counter() - start) * 1000 if status is not None else None
            _Acks.get().write(ids, entity, status, outcome, route, latency)
            if outcome == "acked":
                resp.success()
            else:
                resp.failure(f"{status} {code or resp.error}")


if _RATE > 0:
    # Each user's share of the total rate (the runner passes the user count).
    _users = max(1, int(os.environ.get("LOADTEST_USERS", "1")))
    GatewayUser.wait_time = constant_throughput(_RATE / _users)
