"""Drain entities with the real Service Bus SDK and write what they delivered
(docs/pipeline.md, "3. Delivered ids").

    gateway drain --connection-string "$CS" --entity orders --entity events/subscriptions/audit \\
        --out delivered.jsonl

Receives everything from each entity (queues, ``topic/subscriptions/sub`` paths, backlog
queues such as ``contoso/x-servicebus-transfer/0``, and by default each one's
``/$DeadLetterQueue``) until the entity has delivered nothing for ``idle_timeout`` seconds,
writing one JSON line per message::

    {"message_id": "m-1", "entity": "orders", "source": "backlog",
     "queue": "contoso/x-servicebus-transfer/3", "enqueued_time": "2025-01-31T12:00:00.123000Z",
     "dead_letter_reason": null, "delivery_count": 1, "sequence_number": 42,
     "session_id": null}

``entity`` is the entity the message was sent to: the topic for a subscription, and for a
message found in a backlog queue its ``x-ms-path`` application property. In peek-lock mode
(the default) a line is written before its message is completed, so a crash can repeat a line
but never lose a message; receive-and-delete is faster and loses what is in flight on a crash.
Messages are removed from the entities: drain only what you mean to audit. An entity that
requires sessions refuses a plain receiver: with ``sessions`` (``--sessions``) its messages are
received one session at a time, the next available one, until none is left.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import orjson
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    ServiceBusReceivedMessage,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import ServiceBusClient, ServiceBusReceiver
from azure.servicebus.exceptions import OperationTimeoutError, ServiceBusError

from gateway.core.backlog import PATH as X_MS_PATH
from gateway.core.backlog import is_backlog_path
from gateway.servicebus.identity import CREDENTIAL_KINDS, SharedCredential

if TYPE_CHECKING:
    from azure.core.credentials_async import AsyncTokenCredential

log = logging.getLogger(__name__)

Source = Literal["primary", "backlog", "dlq"]
ReceiveMode = Literal["peek_lock", "receive_and_delete"]

DLQ_SUFFIX: Final = "/$DeadLetterQueue"
_DLQ_RE: Final = re.compile(r"/\$deadletterqueue$", re.IGNORECASE)
_SUBSCRIPTION_RE: Final = re.compile(r"^(?P<topic>.+)/subscriptions/(?P<sub>[^/]+)$", re.IGNORECASE)


class DrainError(Exception):
    """Bad arguments to drain (an entity path it cannot receive from)."""


@dataclass(frozen=True, slots=True)
class DrainTarget:
    """One path to receive from."""

    queue: str  # the path as received from, e.g. "orders/$DeadLetterQueue"
    entity_path: str  # the entity without the DLQ suffix
    topic: str | None  # set for a subscription
    subscription: str | None
    dead_letter: bool
    backlog: bool  # a backlog queue (or its DLQ): messages carry x-ms-path

    @property
    def source(self) -> Source:
        if self.dead_letter:
            return "dlq"
        return "backlog" if self.backlog else "primary"

    @property
    def original_entity(self) -> str:
        """The entity a message found here was sent to (when it carries no x-ms-path)."""
        return self.topic if self.topic is not None else self.entity_path


def plan_targets(
    entities: Sequence[str], *, include_dlq: bool = True, backlog_prefix: str | None = None
) -> list[DrainTarget]:
    """The receive paths for ``entities`` (each one's DLQ added when ``include_dlq``)."""
    targets: dict[str, DrainTarget] = {}
    for raw in entities:
        path = raw.strip().strip("/")
        if not path:
            raise DrainError(f"empty entity path: {raw!r}")
        dead_letter = bool(_DLQ_RE.search(path))
        base = _DLQ_RE.sub("", path)
        sub = _SUBSCRIPTION_RE.match(base)
        backlog = is_backlog_path(base) or (
            backlog_prefix is not None and base.startswith(backlog_prefix.strip("/"))
        )
        for dlq in (dead_letter,) if dead_letter or not include_dlq else (False, True):
            target = DrainTarget(
                queue=base + DLQ_SUFFIX if dlq else base,
                entity_path=base,
                topic=sub.group("topic") if sub else None,
                subscription=sub.group("sub") if sub else None,
                dead_letter=dlq,
                backlog=backlog,
            )
            targets.setdefault(target.queue.lower(), target)
    return list(targets.values())


@dataclass(slots=True)
class DrainSummary:
    """What a drain did. ``errors`` maps a receive path to why it could not be drained."""

    out: Path
    received: dict[str, int] = field(default_factory=dict)  # per receive path
    without_message_id: int = 0
    backlog_without_path: int = 0  # backlog messages with no x-ms-path property
    errors: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.received.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "total": self.total,
            "received": self.received,
            "without_message_id": self.without_message_id,
            "backlog_without_path": self.backlog_without_path,
            "errors": self.errors,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _app_property(props: Mapping[Any, Any] | None, name: str) -> str | None:
    if not props:
        return None
    for key in (name, name.encode()):
        if key in props:
            return _text(props[key])
    return None


def _iso(value: dt.datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def delivered_record(
    msg: ServiceBusReceivedMessage, target: DrainTarget, summary: DrainSummary | None = None
) -> dict[str, Any]:
    """The delivered-id line (docs/pipeline.md, "3. Delivered ids") for one received message."""
    entity = target.original_entity
    if target.backlog:
        path = _app_property(msg.application_properties, X_MS_PATH)
        if path:
            entity = path
        elif summary is not None:
            summary.backlog_without_path += 1
    message_id = _text(msg.message_id)
    if message_id is None and summary is not None:
        summary.without_message_id += 1
    return {
        "message_id": message_id,
        "entity": entity,
        "source": target.source,
        "queue": target.queue,
        "enqueued_time": _iso(msg.enqueued_time_utc),
        "dead_letter_reason": _text(msg.dead_letter_reason),
        "delivery_count": msg.delivery_count,
        # Where it stands in its queue (the order a session receiver gets it in), and its
        # session: the audit checks a strict entity's per-session order with them.
        "sequence_number": msg.sequence_number,
        "session_id": _text(msg.session_id),
    }


class _Output:
    """The output file; each batch is appended from a worker thread (no blocking the loop)."""

    def __init__(self, path: Path, append: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("ab" if append else "wb")
        self._lock = asyncio.Lock()

    async def write(self, records: Sequence[dict[str, Any]]) -> None:
        data = b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records)
        async with self._lock:  # keep batches whole and in order
            await asyncio.to_thread(self._write_sync, data)

    def _write_sync(self, data: bytes) -> None:
        self._f.write(data)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _receiver(
    client: ServiceBusClient,
    target: DrainTarget,
    mode: ReceiveMode,
    prefetch: int,
    session_wait: float | None = None,
) -> ServiceBusReceiver:
    """A receiver of ``target``; with ``session_wait``, of its next available session, given up
    (``OperationTimeoutError``) when none is available within that many seconds."""
    kwargs: dict[str, Any] = {
        "receive_mode": ServiceBusReceiveMode.RECEIVE_AND_DELETE
        if mode == "receive_and_delete"
        else ServiceBusReceiveMode.PEEK_LOCK,
        "prefetch_count": prefetch,
        "keep_alive": 0,  # no keep-alive task: close() returns at once
    }
    if target.dead_letter:
        kwargs["sub_queue"] = ServiceBusSubQueue.DEAD_LETTER
    if session_wait is not None:
        kwargs.update(session_id=NEXT_AVAILABLE_SESSION, max_wait_time=session_wait)
    if target.topic is not None and target.subscription is not None:
        return client.get_subscription_receiver(target.topic, target.subscription, **kwargs)
    return client.get_queue_receiver(target.entity_path, **kwargs)


@dataclass(frozen=True, slots=True)
class _PathOptions:
    """How each receive path is drained (`drain`'s arguments)."""

    mode: ReceiveMode
    idle_timeout: float
    batch_size: int
    op_timeout: float
    max_messages: int | None
    sessions: bool = False  # the entities require sessions (their DLQs and backlogs do not)


def _client(
    connection_string: str | None,
    fully_qualified_namespace: str | None,
    credential: AsyncTokenCredential | None,
    client_kwargs: Mapping[str, Any] | None,
) -> ServiceBusClient:
    """The namespace's client: from a connection string, or a namespace and a credential."""
    if connection_string is not None:
        return ServiceBusClient.from_connection_string(
            connection_string, **dict(client_kwargs or {})
        )
    assert fully_qualified_namespace is not None and credential is not None
    return ServiceBusClient(fully_qualified_namespace, credential, **dict(client_kwargs or {}))


async def _drain_or_report(
    client: ServiceBusClient,
    target: DrainTarget,
    output: _Output,
    summary: DrainSummary,
    options: _PathOptions,
    sem: asyncio.Semaphore,
) -> None:
    """Drain one path under `sem`; a Service Bus, timeout or socket failure goes to
    ``summary.errors`` so that the other paths go on."""
    async with sem:
        try:
            if options.sessions and target.source == "primary":
                await _drain_sessions(client, target, output, summary, options)
            else:
                await _drain_one(client, target, output, summary, options)
        except asyncio.CancelledError:
            raise
        except (ServiceBusError, TimeoutError, OSError) as exc:
            summary.errors[target.queue] = f"{type(exc).__name__}: {exc}"
            log.warning("draining %s failed: %r", target.queue, exc)


async def _drain_sessions(
    client: ServiceBusClient,
    target: DrainTarget,
    output: _Output,
    summary: DrainSummary,
    options: _PathOptions,
) -> None:
    """Drain a session-required entity one session at a time: the next available session
    until none is left (none offered within ``idle_timeout``). A drained session's lock is
    released when its receiver closes, and an empty session is not offered again."""
    summary.received.setdefault(target.queue, 0)
    while options.max_messages is None or summary.received[target.queue] < options.max_messages:
        try:
            await _drain_one(client, target, output, summary, options, session=True)
        except OperationTimeoutError:
            return


async def _drain_one(
    client: ServiceBusClient,
    target: DrainTarget,
    output: _Output,
    summary: DrainSummary,
    options: _PathOptions,
    *,
    session: bool = False,
) -> None:
    """Drain one path (with ``session``: its next available session) until it is idle."""
    mode, idle_timeout, op_timeout = options.mode, options.idle_timeout, options.op_timeout
    batch_size, max_messages = options.batch_size, options.max_messages
    summary.received.setdefault(target.queue, 0)
    wait = idle_timeout if session else None
    receiver = _receiver(client, target, mode, prefetch=batch_size, session_wait=wait)
    try:
        # Waiting for a session to be offered takes up to idle_timeout on top of the call.
        async with asyncio.timeout(op_timeout + (wait or 0.0)):
            await receiver.__aenter__()
        while max_messages is None or summary.received[target.queue] < max_messages:
            want = batch_size
            if max_messages is not None:
                want = min(want, max_messages - summary.received[target.queue])
            # The SDK call can hang on a broken link: our own deadline on top of its wait.
            async with asyncio.timeout(idle_timeout + op_timeout):
                batch = await receiver.receive_messages(
                    max_message_count=want, max_wait_time=idle_timeout
                )
            if not batch:
                return  # idle for idle_timeout: drained
            await output.write([delivered_record(m, target, summary) for m in batch])
            if mode == "peek_lock":
                for msg in batch:
                    async with asyncio.timeout(op_timeout):
                        await receiver.complete_message(msg)
            summary.received[target.queue] += len(batch)
    finally:
        try:
            async with asyncio.timeout(op_timeout):
                await receiver.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # closing a broken receiver must not hide the real error
            log.debug("closing the receiver of %s failed: %r", target.queue, exc)


async def drain(
    connection_string: str | None,
    entities: list[str],
    out: Path,
    *,
    include_dlq: bool = True,
    idle_timeout: float = 2.0,
    backlog_prefix: str | None = None,
    receive_mode: ReceiveMode = "peek_lock",
    batch_size: int = 100,
    concurrency: int = 8,
    op_timeout: float = 30.0,
    max_messages: int | None = None,
    append: bool = False,
    sessions: bool = False,
    client_kwargs: Mapping[str, Any] | None = None,
    fully_qualified_namespace: str | None = None,
    credential: AsyncTokenCredential | None = None,
) -> DrainSummary:
    """Receive everything from ``entities`` and write delivered-id lines to ``out``.

    The namespace is ``connection_string``, or ``fully_qualified_namespace`` with an Entra ID
    ``credential`` (gateway.servicebus.identity; the caller owns and closes it).

    Each receive path (an entity, and its DLQ when ``include_dlq``) is drained until it has
    been idle for ``idle_timeout`` seconds (or ``max_messages`` were received from it), at
    most ``concurrency`` paths at a time. Every SDK call has a deadline of ``op_timeout``
    seconds (plus the idle wait for receives). A path that fails (entity not found, broken
    connection) is reported in ``summary.errors`` and the others go on; cancelling ``drain``
    cancels and awaits every receiver and closes the output file. With ``sessions`` the
    entities require sessions: each is drained one session at a time (`_drain_sessions`).
    """
    if idle_timeout <= 0 or batch_size < 1 or concurrency < 1 or op_timeout <= 0:
        raise DrainError("idle_timeout and op_timeout must be > 0, batch_size/concurrency >= 1")
    if connection_string is None and (fully_qualified_namespace is None or credential is None):
        raise DrainError("give a connection string, or a namespace and a credential")
    targets = plan_targets(entities, include_dlq=include_dlq, backlog_prefix=backlog_prefix)
    summary = DrainSummary(out=out)
    started = time.monotonic()
    output = _Output(out, append)
    sem = asyncio.Semaphore(concurrency)
    options = _PathOptions(
        receive_mode, idle_timeout, batch_size, op_timeout, max_messages, sessions
    )
    try:
        client = _client(connection_string, fully_qualified_namespace, credential, client_kwargs)
        async with client:
            async with asyncio.TaskGroup() as tg:
                for target in targets:
                    tg.create_task(
                        _drain_or_report(client, target, output, summary, options, sem),
                        name=f"drain:{target.queue}",
                    )
    finally:
        output.close()
        summary.elapsed_s = time.monotonic() - started
    log.info("drained %d messages from %d paths into %s", summary.total, len(targets), out)
    return summary


# -- command line ---------------------------------------------------------------------------------


def build_parser(prog: str = "gateway drain") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Receive everything from Service Bus entities and write the delivered ids "
        "as JSON lines (the audit pipeline's --delivered input). Removes the messages.",
    )
    cs = p.add_mutually_exclusive_group(required=True)
    cs.add_argument("--connection-string", help="namespace connection string")
    cs.add_argument(
        "--connection-string-env",
        metavar="VAR",
        help="read the connection string from this environment variable (keeps it out of ps)",
    )
    cs.add_argument(
        "--namespace",
        metavar="FQNS",
        help="fully qualified namespace (contoso.servicebus.windows.net), with --credential",
    )
    p.add_argument(
        "--credential",
        choices=CREDENTIAL_KINDS,
        default="default",
        help="Entra ID credential for --namespace, as the gateway's azure_credential setting: "
        "workload (AKS workload identity), managed (managed identity) or default "
        "(DefaultAzureCredential, for development; the default here)",
    )
    p.add_argument("--client-id", help="client id of a user-assigned managed identity")
    p.add_argument(
        "--entity",
        action="append",
        required=True,
        help="queue, topic/subscriptions/sub, backlog queue or .../$DeadLetterQueue; repeatable",
    )
    p.add_argument("--out", required=True, type=Path, help="output file (JSON lines)")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing")
    p.add_argument("--no-dlq", action="store_true", help="do not drain each entity's DLQ")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=2.0,
        help="seconds idle = drained (default: %(default)s)",
    )
    p.add_argument("--backlog-prefix", help="paths starting with this are backlog queues")
    p.add_argument(
        "--receive-and-delete",
        action="store_true",
        help="faster than peek-lock + complete, but a crash loses what is in flight",
    )
    p.add_argument(
        "--sessions",
        action="store_true",
        help="the entities require sessions: receive each one session at a time (the next "
        "available one) until none is left; their DLQs and backlog queues as usual",
    )
    p.add_argument(
        "--batch-size", type=int, default=100, help="messages per receive (default: %(default)s)"
    )
    p.add_argument(
        "--concurrency", type=int, default=8, help="paths drained at a time (default: %(default)s)"
    )
    p.add_argument("--max-messages", type=int, help="stop a path after this many messages")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: 0 all drained, 1 some path failed, 2 usage error. Prints a JSON summary."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code in (0, None) else 2
    conn = args.connection_string
    if args.connection_string_env:
        import os

        conn = os.environ.get(args.connection_string_env)
        if not conn:
            print(f"error: ${args.connection_string_env} is empty or unset", file=sys.stderr)
            return 2
    shared = None
    if args.namespace:
        shared = SharedCredential(args.credential, args.client_id)
    elif args.client_id or args.credential != "default":
        print("error: --credential and --client-id go with --namespace", file=sys.stderr)
        return 2

    async def run() -> DrainSummary:
        try:
            return await drain(
                conn,
                args.entity,
                args.out,
                include_dlq=not args.no_dlq,
                idle_timeout=args.idle_timeout,
                backlog_prefix=args.backlog_prefix,
                receive_mode="receive_and_delete" if args.receive_and_delete else "peek_lock",
                batch_size=args.batch_size,
                concurrency=args.concurrency,
                max_messages=args.max_messages,
                append=args.append,
                sessions=args.sessions,
                fully_qualified_namespace=args.namespace,
                credential=shared.get() if shared is not None else None,
            )
        finally:
            if shared is not None:
                await shared.aclose()

    try:
        summary = asyncio.run(run())
    except (DrainError, ValueError) as exc:  # ValueError: the credential is not configured
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(orjson.dumps(summary.as_dict()).decode())
    return 1 if summary.errors else 0


if __name__ == "__main__":
    sys.exit(main())
