"""Pure-logic tests of the broker's pieces: config, SAS, codec, fault table, store."""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid
from pathlib import Path

import pytest
from proton import Message, symbol

from sblocal import codec, sas
from sblocal.config import (
    DEV_KEY_NAME,
    DEV_KEY_VALUE,
    ConfigError,
    NamespaceConfig,
    QueueConfig,
    default_config,
    load_config,
    parse_duration,
)
from sblocal.entities import TIMESPAN_MAX, QueueProperties, TopicProperties
from sblocal.faults import FaultSpecError, FaultTable
from sblocal.persistence import Persistence
from sblocal.store import BrokerError, MessageState, Namespace

# -- config ----------------------------------------------------------------------------------


def test_default_config_is_the_embedded_pair() -> None:
    cfg = default_config()
    assert [ns.name for ns in cfg.namespaces] == ["primary", "secondary"]
    primary = cfg.namespace("primary")
    assert [q.path for q in primary.queues] == ["orders"]
    assert [(t.path, [s.name for s in t.subscriptions]) for t in primary.topics] == [
        ("events", ["audit"])
    ]
    assert primary.key_map == {DEV_KEY_NAME: DEV_KEY_VALUE}
    assert cfg.host == "127.0.0.1" and cfg.control_port == 0


def test_json_config_and_durations(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "control_port": 0,
                "namespaces": [
                    {
                        "name": "ns1",
                        "queues": [
                            {
                                "path": "/a/b/",
                                "lock_duration": 30,
                                "default_message_time_to_live": "P1DT2H",
                            }
                        ],
                        "topics": [
                            {"path": "t", "subscriptions": [{"name": "s", "max_delivery_count": 3}]}
                        ],
                    }
                ],
            }
        )
    )
    cfg = load_config(path)
    q = cfg.namespace("ns1").queues[0]
    assert q.path == "a/b"
    assert q.properties.lock_duration == dt.timedelta(seconds=30)
    assert q.properties.default_message_time_to_live == dt.timedelta(days=1, hours=2)
    assert cfg.namespace("ns1").topics[0].subscriptions[0].properties.max_delivery_count == 3
    assert parse_duration("max", "x") == TIMESPAN_MAX
    assert parse_duration("P10675199DT2H48M5.4775807S", "x") == TIMESPAN_MAX
    assert parse_duration("PT1M", "x") == dt.timedelta(minutes=1)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "namespaces"),
        ({"namespaces": [{"name": "a"}, {"name": "a"}]}, "duplicate"),
        ({"namespaces": [{"name": "bad name"}]}, "name"),
        ({"namespaces": [{"name": "a", "queues": [{"path": "q?"}]}]}, "path"),
        (
            {"namespaces": [{"name": "a", "queues": [{"path": "q", "max_delivery_count": "x"}]}]},
            "integer",
        ),
        ({"namespaces": [{"name": "a", "queues": [{"path": "q", "nope": 1}]}]}, "unknown property"),
        ({"namespaces": [{"name": "a", "amqp_port": 70000}]}, "amqp_port"),
        ({"namespaces": [{"name": "a"}], "extra": 1}, "unknown top-level"),
        ({"namespaces": [{"name": "a"}], "amqp_tls": "yes"}, "amqp_tls"),
    ],
)
def test_invalid_configs_say_where(tmp_path: Path, raw: dict[str, object], message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)


def test_amqp_tls_is_off_unless_the_config_turns_it_on(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"namespaces": [{"name": "a"}]}))
    assert load_config(path).amqp_tls is False
    path.write_text(json.dumps({"namespaces": [{"name": "a"}], "amqp_tls": True}))
    assert load_config(path).amqp_tls is True


# -- SAS -------------------------------------------------------------------------------------


def test_sas_sign_and_verify() -> None:
    keys = {"k": "secret"}
    expiry = int(time.time()) + 60
    token = sas.sign("sb://localhost:5672/orders", "k", "secret", expiry)
    assert sas.verify(token, keys) == "sb://localhost:5672/orders"
    with pytest.raises(sas.SasError, match="invalid signature"):
        sas.verify(token, {"k": "other"})
    with pytest.raises(sas.SasError, match="Unknown"):
        sas.verify(token, {"x": "secret"})
    with pytest.raises(sas.SasError, match="expired"):
        sas.verify(sas.sign("sb://x", "k", "secret", int(time.time()) - 1), keys)
    with pytest.raises(sas.SasError):
        sas.verify("Bearer abc", keys)


def test_sas_token_from_the_sdk_verifies() -> None:
    from azure.servicebus._base_handler import _generate_sas_token

    token = _generate_sas_token("sb://localhost:1234/orders", DEV_KEY_NAME, DEV_KEY_VALUE)
    assert sas.verify(token.token, {DEV_KEY_NAME: DEV_KEY_VALUE})


# -- codec -----------------------------------------------------------------------------------


def _encoded(**kwargs: object) -> bytes:
    return bytes(Message(**kwargs).encode())  # type: ignore[arg-type]


def test_parse_message_reads_broker_fields_and_keeps_the_tail() -> None:
    raw = _encoded(
        id="m1",
        body=b"hello",
        ttl=2.5,
        group_id="s1",
        content_type="text/plain",
        properties={"a": 1},
        annotations={symbol("x-opt-partition-key"): "p"},
    )
    parsed = codec.parse_message(raw)
    assert parsed.ttl_ms == 2500
    assert parsed.prop("message_id") == "m1" and parsed.prop("group_id") == "s1"
    assert parsed.annotations == {symbol("x-opt-partition-key"): "p"}
    assert parsed.has_body and parsed.app_properties_range is not None
    assert raw.endswith(parsed.tail)
    with pytest.raises(codec.CodecError):
        codec.parse_message(b"\x00\x53")


def test_split_batch_takes_each_data_section_of_the_envelope_as_a_message() -> None:
    inner = [_encoded(id=f"m{i}", body=f"b{i}".encode()) for i in range(3)]
    envelope = Message(id="m0")
    outer = bytes(envelope.encode())
    for m in inner:
        outer += codec.encode_value(codec.Described(codec.ulong(codec.DATA), m))
    assert codec.split_batch(outer) == inner
    with pytest.raises(codec.CodecError):
        codec.split_batch(_encoded(body="text value"))
    with pytest.raises(codec.CodecError):
        codec.split_batch(bytes(Message(id="empty").encode()))


# -- faults ----------------------------------------------------------------------------------


def test_fault_table_matching_and_counts() -> None:
    table = FaultTable()
    r1 = table.add(
        {"condition": "amqp:not-found", "entity": "Orders", "operation": "send", "count": 2}
    )
    table.add({"condition": "com.microsoft:server-busy", "operation": "receive"})
    assert table.take("other", "send") is None
    assert table.take("orders/$DeadLetterQueue", "send") is not None  # sub-paths covered
    rule = table.take("ORDERS", "send")
    assert rule is not None and rule.id == r1.id and rule.count == 0
    assert table.take("orders", "send") is None  # used up
    got = table.take("anything", "receive")
    assert got is not None and got.condition == "com.microsoft:server-busy"
    with pytest.raises(FaultSpecError):
        table.add({"condition": "amqp:not-found", "count": True})


# -- store -----------------------------------------------------------------------------------


def _ns(*queues: QueueConfig) -> Namespace:
    return Namespace(NamespaceConfig(name="t", keys=(), queues=queues))


def _send(ns: Namespace, path: str, **kwargs: object) -> list[int]:
    raw = _encoded(**kwargs)
    target = ns.send_target(path)
    assert target is not None
    return ns.enqueue(target, [codec.parse_message(raw)], [len(raw)]).sequence_numbers


def test_store_peek_lock_cycle_and_max_delivery() -> None:
    ns = _ns(QueueConfig("q", QueueProperties(max_delivery_count=2)))
    q = ns.receive_source("q")
    assert q is not None and q.dlq is not None
    _send(ns, "q", id="a", body=b"1")
    now = 1_000_000
    m = ns.take(q, lock=True, now=now)
    assert m is not None and m.lock_token is not None
    assert ns.take(q, lock=True, now=now) is None  # locked
    assert ns.abandon(q, m.lock_token, now=now)
    m = ns.take(q, lock=True, now=now)
    assert m is not None and m.delivery_count == 1
    assert m.lock_token is not None
    assert not ns.abandon(q, m.lock_token, now=now)  # second failure: dead-lettered
    [dead] = q.dlq.messages.values()
    assert dead.app_properties()["DeadLetterReason"] == "MaxDeliveryCountExceeded"
    with pytest.raises(BrokerError) as lost:
        ns.complete(q, uuid.uuid4())
    assert lost.value.condition == "com.microsoft:message-lock-lost"


def test_store_lock_expiry_scheduled_and_ttl() -> None:
    ns = _ns(
        QueueConfig(
            "q",
            QueueProperties(
                lock_duration=dt.timedelta(seconds=1),
                default_message_time_to_live=dt.timedelta(seconds=10),
                dead_lettering_on_message_expiration=True,
            ),
        )
    )
    q = ns.receive_source("q")
    assert q is not None and q.dlq is not None
    now = int(time.time() * 1000)
    _send(ns, "q", id="x", body=b"1")
    m = ns.take(q, lock=True, now=now)
    assert m is not None and m.ttl_ms == 10_000  # capped by the entity default
    assert ns.housekeeping(now + 1500) == [q]  # lock expired: requeued
    assert m.delivery_count == 1 and m.lock_token is None
    ns.housekeeping(now + 20_000)  # expired while available: dead-lettered
    assert q.messages == {} and len(q.dlq.messages) == 1
    [seq] = _send(
        ns,
        "q",
        id="s",
        body=b"2",
        annotations={codec.SCHEDULED_ENQUEUE_TIME: codec.ts(int(time.time() * 1000) + 60_000)},
    )
    assert q.messages[seq].state == MessageState.SCHEDULED
    assert ns.take(q, lock=False) is None
    ns.housekeeping(int(time.time() * 1000) + 61_000)
    assert q.messages[seq].state == MessageState.ACTIVE


def test_store_topic_sequence_dedup_and_persistence(tmp_path: Path) -> None:
    cfg = NamespaceConfig(name="t", keys=())
    db = tmp_path / "t.sqlite3"
    ns = Namespace(cfg, persistence=Persistence(db))
    ns.create_topic("top", TopicProperties(requires_duplicate_detection=True))
    from sblocal.entities import SubscriptionProperties

    ns.create_subscription("top", "a", SubscriptionProperties())
    ns.create_subscription("top", "b", SubscriptionProperties())
    assert _send(ns, "top", id="1", body=b"x") == [1]
    assert _send(ns, "top", id="1", body=b"x") == []  # duplicate dropped
    assert _send(ns, "top", id="2", body=b"y") == [2]
    a = ns.receive_source("top/Subscriptions/a")
    b = ns.receive_source("top/subscriptions/B")
    assert a is not None and b is not None
    assert sorted(a.messages) == sorted(b.messages) == [1, 2]
    ns.close()

    again = Namespace(cfg, persistence=Persistence(db))
    a2 = again.receive_source("top/Subscriptions/a")
    assert a2 is not None and sorted(a2.messages) == [1, 2]
    assert _send(again, "top", id="3", body=b"z") == [3]
    again.close()
