"""The CLI as a real process: JSON line, human output, config files, durable restarts."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue

from sblocal.testing import BrokerProcess

from .conftest import receive_n, sb_client

# Broker subprocesses (a durable one is killed and restarted): ~10 s together.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


async def test_broker_process_json_line_and_sdk_round_trip() -> None:
    async with BrokerProcess() as broker:
        info = broker.info
        assert set(info) == {"control", "ca_cert", "amqp_tls", "namespaces"}
        assert set(info["namespaces"]) == {"primary", "secondary"}
        for ns in info["namespaces"].values():
            assert ns["connection_string"].endswith("UseDevelopmentEmulator=true;")
        assert broker.control_url.startswith("http://127.0.0.1:")
        assert (await broker.control.namespaces())["namespaces"].keys() == info["namespaces"].keys()
        async with sb_client(broker.connection_string("primary")) as client:
            async with client.get_topic_sender("events") as sender:
                await sender.send_messages(ServiceBusMessage("via process"))
            async with client.get_subscription_receiver("events", "audit") as receiver:
                [m] = await receive_n(receiver, 1)
                assert str(m) == "via process"
                await receiver.complete_message(m)
        assert (await broker.control.counters("primary"))["completes"] == 1
    assert broker.returncode is None  # reaped


def test_sync_context_manager_and_clean_sigterm_exit() -> None:
    with BrokerProcess() as proc:
        assert proc.pid is not None
        assert proc.amqp_port("secondary") > 0
    assert proc.pid is None  # reaped by __exit__
    started = BrokerProcess().start()
    assert started.stop() == 0  # SIGTERM: clean shutdown


def test_human_output_lists_connection_strings_and_control() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sblocal"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        text = b""
        deadline = time.monotonic() + 30
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"namespace secondary:" not in text or not text.endswith(b"\n"):
                assert time.monotonic() < deadline, text
                if sel.select(1):
                    chunk = os.read(proc.stdout.fileno(), 65536)
                    assert chunk, proc.stderr.read() if proc.stderr else b""
                    text += chunk
        out = text.decode()
        assert "control API: http://127.0.0.1:" in out
        assert "namespace primary:" in out
        assert out.count("UseDevelopmentEmulator=true;") == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_config_file_toml_and_invalid_config(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text(
        """
[[namespaces]]
name = "alpha"
management_port = false
keys = {}

[[namespaces.queues]]
path = "contoso/x-servicebus-transfer/0"
lock_duration = "PT1M"
max_delivery_count = 2147483647
default_message_time_to_live = "max"
dead_lettering_on_message_expiration = true
"""
    )
    with BrokerProcess(config=cfg) as proc:
        assert list(proc.info["namespaces"]) == ["alpha"]
        assert proc.management_connection_string("alpha") is None
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {"namespaces": [{"name": "x", "queues": [{"path": "q", "lock_duration": "soon"}]}]}
        )
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "sblocal", "--config", str(bad), "--json"],
        capture_output=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert b"lock_duration" in result.stderr
    assert result.stdout == b""


async def test_durable_mode_survives_a_crash(tmp_path: Path) -> None:
    data = tmp_path / "data"
    broker = await BrokerProcess(data_dir=data).astart()
    try:
        await broker.control.create_entity("secondary", "primary/x-servicebus-transfer/0")
        async with sb_client(broker.connection_string("primary")) as client:
            async with client.get_queue_sender("orders") as sender:
                await sender.send_messages(
                    [ServiceBusMessage(f"m{i}", message_id=f"m{i}") for i in range(3)]
                )
            async with client.get_queue_receiver("orders") as receiver:
                a, b, _ = await receive_n(receiver, 3)
                await receiver.complete_message(a)
                await receiver.dead_letter_message(b, reason="kept")
        async with sb_client(broker.connection_string("secondary")) as client:
            async with client.get_queue_sender("primary/x-servicebus-transfer/0") as sender:
                await sender.send_messages(ServiceBusMessage("backlog"))
    finally:
        broker.kill()  # SIGKILL: only what was committed before settling survives

    async with BrokerProcess(data_dir=data) as restarted:
        orders = await restarted.control.entity("primary", "orders")
        assert orders["active"] == 1 and orders["dead_letter"] == 1
        backlog = await restarted.control.entity("secondary", "primary/x-servicebus-transfer/0")
        assert backlog["active"] == 1
        async with sb_client(restarted.connection_string("primary")) as client:
            async with client.get_queue_receiver("orders") as receiver:
                [m] = await receive_n(receiver, 1)
                assert m.message_id == "m2"
                await receiver.complete_message(m)
            async with client.get_queue_sender("orders") as sender:
                await sender.send_messages(ServiceBusMessage("new"))
            async with client.get_queue_receiver(
                "orders", sub_queue=ServiceBusSubQueue.DEAD_LETTER
            ) as dlq:
                [d] = await receive_n(dlq, 1)
                assert d.dead_letter_reason == "kept"
                await dlq.complete_message(d)
            async with client.get_queue_receiver("orders") as receiver:
                [n] = await receive_n(receiver, 1)
                assert n.sequence_number > m.sequence_number  # numbering continues
                await receiver.complete_message(n)


def test_start_failure_reports_stderr(tmp_path: Path) -> None:
    proc = BrokerProcess(config=tmp_path / "missing.toml", startup_timeout=20)
    with pytest.raises(RuntimeError) as info:
        proc.start()
    assert "missing.toml" in str(info.value)
