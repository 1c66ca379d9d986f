"""``python -m sblocal``: run the local Service Bus-compatible broker until SIGTERM/SIGINT.

    python -m sblocal [--config FILE] [--host 127.0.0.1] [--json] [--data-dir DIR] [--amqp-tls]

Without ``--json`` it prints each namespace's connection string, its management endpoint and
the control API address. With ``--json`` it prints exactly one JSON line on stdout once every
listener is bound (see `LocalBroker.info`), for programs such as `sblocal.testing`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from sblocal.collector import FrozenSurvivors
from sblocal.config import ConfigError, default_config, load_config
from sblocal.server import LocalBroker

_log = logging.getLogger("sblocal")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sblocal",
        description="Local Azure Service Bus-compatible broker (AMQP 1.0 + management API).",
    )
    parser.add_argument("--config", type=Path, help="TOML or JSON config (default: embedded)")
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--json", action="store_true", help="print one JSON line when ready")
    parser.add_argument("--data-dir", type=Path, help="durable mode: keep messages in DIR")
    parser.add_argument(
        "--amqp-tls",
        action="store_true",
        default=None,
        help="serve AMQPS with the development certificate instead of plain AMQP",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return parser.parse_args(argv)


def _human(broker: LocalBroker) -> str:
    info = broker.info
    lines = ["sblocal is running (Ctrl+C to stop)", f"control API: {info['control']}"]
    if info["ca_cert"]:
        lines.append(f"development TLS certificate: {info['ca_cert']}")
    lines.append(f"AMQP: {'AMQPS (TLS)' if info['amqp_tls'] else 'plain AMQP'}")
    for name, ns in info["namespaces"].items():
        lines.append(f"namespace {name}:")
        lines.append(f"  connection string: {ns['connection_string']}")
        if ns["management_port"] is not None:
            lines.append(f"  management endpoint: https://localhost:{ns['management_port']}")
            lines.append(f"  management connection string: {ns['management_connection_string']}")
        else:
            lines.append("  management endpoint: (none)")
    return "\n".join(lines)


async def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else default_config()
    config = config.with_overrides(host=args.host, data_dir=args.data_dir, amqp_tls=args.amqp_tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    broker = LocalBroker(config)
    await broker.start()
    # The collector kept off the stored messages: a process-wide setting, so here only.
    collector = FrozenSurvivors()
    collector.start()
    try:
        if args.json:
            sys.stdout.write(json.dumps(broker.info) + "\n")
        else:
            sys.stdout.write(_human(broker) + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        collector.uninstall()
        await broker.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(_serve(args))
    except ConfigError as exc:
        sys.stderr.write(f"sblocal: {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"sblocal: cannot listen: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
