"""`gateway` command line: serve, syphon, token, drain, audit."""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any, Literal

from aiohttp import web

from gateway.config import ConfigError, Settings, load_settings
from gateway.core.ports import Tracer
from gateway.servicebus.identity import CREDENTIAL_KINDS
from gateway.tracing import create_tracer

log = logging.getLogger("gateway")

# The cyclic collector's first threshold for a serving process (CPython's default: 700). With
# 64 requests in flight, their live objects alone keep the young generation above 700, so
# the default collects every ~70 requests and promotes what is in flight to the older
# generations, whose collections then walk the whole heap: ~8% of a request's CPU, measured
# in process (docs/performance.md). A request frees what it allocates, so at 10,000 the
# collector rarely runs; the garbage cycles it still finds wait for at most 10,000 more
# allocations (well under a megabyte).
GC_THRESHOLD0 = 10_000


def tune_gc() -> None:
    """Call once the app has started, in a serving process (never in a test process):
    move what start-up built (modules, settings, clients) out of the collector's sight
    (`gc.freeze`: a full collection then walks only what requests made), and collect the
    young generation less often (`GC_THRESHOLD0`)."""
    gc.collect()
    gc.freeze()
    _, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, threshold1, threshold2)


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed (measured here: +5-20% on the bare path)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _demo_tokens(settings: Settings, entity: str) -> tuple[str, str, str] | None:
    """Ready tokens when the rules file has the demo rules: send to `entity`, manage the
    namespace, and send to every entity (the namespace root; for the load test)."""
    if not settings.auth_rules_file:
        return None
    from gateway.auth import load_rules, mint_token, resource_uri

    rules = {r.name: r for r in load_rules(settings.auth_rules_file)}
    if "demo" not in rules or "demo-admin" not in rules:
        return None
    host = f"{settings.listen_host}:{settings.listen_port}"
    day = 24 * 3600
    send = mint_token(
        resource_uri(host, entity, scheme="http"), "demo", rules["demo"].primary_key, day
    )
    root = resource_uri(host, None, scheme="http")
    manage = mint_token(root, "demo-admin", rules["demo-admin"].primary_key, day)
    send_all = mint_token(root, "demo", rules["demo"].primary_key, day)
    return send, manage, send_all


def _amqp_connection_string(settings: Settings) -> str | None:
    """What an unmodified Service Bus SDK app sets to send through the plain AMQP listener:
    the demo rule's key when the rules have it (open mode takes any key)."""
    amqp = settings.amqp
    if not amqp.plain_port:
        return None
    key_name, key = "any", "YW55LWtleS1pbiBvcGVuIG1vZGU="  # open mode: any signature passes
    if settings.auth_rules_file:
        from gateway.auth import load_rules

        rules = {r.name: r for r in load_rules(settings.auth_rules_file)}
        if "demo" in rules:
            key_name, key = "demo", rules["demo"].primary_key.get()
    from gateway.web.hosts import is_loopback

    host = "localhost" if is_loopback(amqp.plain_host) else amqp.plain_host
    return (
        f"Endpoint=sb://{host}:{amqp.plain_port};SharedAccessKeyName={key_name};"
        f"SharedAccessKey={key};UseDevelopmentEmulator=true"
    )


def _banner(settings: Settings, info: dict[str, Any] | None, *, dev: bool = False) -> str:
    base = f"http://{settings.listen_host}:{settings.listen_port}"
    lines = [f"sbgate listening on {base}"]
    amqp = _amqp_connection_string(settings)
    if amqp is not None:
        lines.append(f"AMQP for Service Bus SDK senders (connection string): {amqp}")
        usual = int(DEV_PROFILE["SBGATE_AMQP_PLAIN_PORT"])
        chosen = "SBGATE_AMQP_PLAIN_PORT" in os.environ
        if dev and not chosen and settings.amqp.plain_port != usual:
            lines.append(
                f"  (port {usual} is in use by another process, an AMQP broker perhaps: this one "
                "was free; SBGATE_AMQP_PLAIN_PORT chooses)"
            )
    if dev:
        lines.append(
            "development profile (gateway serve --dev): a failed-over entity is pinged every "
            f"{settings.failover.ping_primary_interval:g} s (production default: 60 s), "
            f"drain delay {settings.shutdown.drain_delay:g} s, {_dev_access_lines()}"
        )
    if info is not None:
        lines.append("local broker (embedded default):")
        for name, ns in info["namespaces"].items():
            lines.append(f"  {name}: {ns['connection_string']}")
        lines.append(f"  control API: {info['control']}")
    entity = settings.entities[0] if settings.entities else None
    if entity is not None:
        kind = "queues" if entity.kind == "queue" else "topics"
        tokens = _demo_tokens(settings, entity.path)
        exports = []
        if tokens:
            exports += [f"SEND='{tokens[0]}'", f"ADMIN='{tokens[1]}'"]
        if info is not None:
            exports.append(f"CTRL={info['control']}")
            primary = info["namespaces"].get("primary")
            if primary is not None:  # for `gateway drain` (docs/pipeline.md: the audit)
                exports.append(f"PRIMARY='{primary['connection_string']}'")
        auth = '-H "Authorization: $SEND" ' if tokens else ""
        lines.append("try (paste the export line first, in the shell you run curl from):")
        if exports:
            lines.append("  export " + " ".join(exports))
        lines.append(
            f"  curl -i -X POST {base}/{kind}/{entity.path}/messages {auth}"
            "-H 'Content-Type: text/plain' "
            '-H \'BrokerProperties: {"MessageId": "hello-1", "Label": "demo"}\' '
            "-d 'hello, Service Bus'"
        )
        if tokens:
            lines.append(f'  curl -s {base}/admin/entities -H "Authorization: $ADMIN"')
        lines.append(
            "load test (every entity above; writes each acknowledgement to out/load/acks for "
            "the audit, LOADTEST_ACKS_DIR; see loadtests/locustfile.py):"
        )
        if tokens:
            lines.append(f"  export LOADTEST_AUTHORIZATION='{tokens[2]}'")
        spec = ",".join(f"{e.kind}:{e.path}" for e in settings.entities)
        lines.append(
            f"  LOADTEST_ENTITIES={spec} .venv/bin/locust -f loadtests/locustfile.py "
            f"--headless -u 8 -r 8 -t 30s --host {base}"
        )
    return "\n".join(lines)


def _dev_access_lines() -> str:
    """What the development profile's access lines show, and how to see more."""
    if "SBGATE_LOG_LEVEL" in os.environ:
        return f"log level {os.environ['SBGATE_LOG_LEVEL']} (SBGATE_LOG_LEVEL)"
    return (
        "access lines for failures and client errors only "
        "(every request: SBGATE_LOG_LEVEL=INFO make run)"
    )


def _listeners(settings: Settings) -> list[tuple[str, int, str]]:
    """Every address the gateway listens on, with the setting that moves it: HTTP, the probe
    port, and the AMQP edge's plain and TLS listeners (a port of 0 is chosen by the kernel)."""
    http = "SBGATE_LISTEN_PORT"
    out = [(settings.listen_host, settings.listen_port, http)]
    if settings.probe_port:
        out.append((settings.listen_host, settings.probe_port, "SBGATE_PROBE_PORT"))
    amqp = settings.amqp
    if amqp.plain_port:
        out.append((amqp.plain_host, amqp.plain_port, "SBGATE_AMQP_PLAIN_PORT"))
    if amqp.tls_cert_file and amqp.tls_key_file and amqp.port:
        out.append((amqp.host or settings.listen_host, amqp.port, "SBGATE_AMQP_PORT"))
    return out


def _cannot_listen(settings: Settings) -> str | None:
    """Why the gateway could not listen on its ports (another process holds one, the address
    is not this host's), as the one line to print; None when it can. A look before start-up
    does its work, so a second `make run` says so at once, not after a traceback."""
    for host, port, setting in _listeners(settings):
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
                probe.bind((host, port))
        except OSError as exc:
            return _listen_error(host, port, setting, exc)
    return None


def _listen_error(host: str, port: int, setting: str, exc: OSError) -> str:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        if setting == "SBGATE_LISTEN_PORT":
            hint = (
                f"another process listens there (a gateway already running?): stop it, or "
                f"choose another port: SBGATE_LISTEN_PORT={port + 1} (or --port {port + 1})"
            )
        else:
            hint = f"another process listens there: set {setting} to another port"
        return f"error: cannot listen on {where}: the address is in use; {hint}"
    reason = exc.strerror or str(exc)
    return f"error: cannot listen on {where}: {reason} (SBGATE_LISTEN_HOST, --host)"


def _remove_banner(path: str, banner: str) -> None:
    """At a clean stop: the banner file goes with the gateway that wrote it (its tokens and
    ports are stale now), unless another instance has written its own since."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() != banner + "\n":
                return
        os.remove(path)
    except OSError:
        pass  # already gone, or never written


def _write_banner(path: str, banner: str) -> None:
    """The banner in a file too (`make run`: .run/banner.txt), for when it scrolled away."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(banner + "\n")
    except OSError as exc:
        log.warning("cannot write the banner to %s: %s", path, exc)


async def _serve(
    settings: Settings,
    mode: Literal["serve", "syphon"] = "serve",
    tracer: Tracer | None = None,
    *,
    dev: bool = False,
    banner_file: str | None = None,
) -> int:
    from gateway.app import create_app, edge_runner
    from gateway.web.handlers import EDGE
    from gateway.web.listener import ShedSite
    from gateway.web.probes import serving_probes

    if (problem := _cannot_listen(settings)) is not None:
        print(problem, file=sys.stderr)  # before the broker starts and the clients connect
        return 2
    embedded = None
    if settings.embedded:
        from gateway.embedded import EmbeddedBroker

        embedded = await EmbeddedBroker.start()
        settings = embedded.apply(settings)
    try:
        app = create_app(settings, mode=mode, tracer=tracer)
        if dev:  # a developer's 401 or 404 is a failure worth a line (docs/configuration.md)
            app[EDGE].access_log.client_errors = _DEV_ACCESS_LEVEL
        runner = edge_runner(
            app,
            settings,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=settings.shutdown.shutdown_timeout,
        )
        try:
            await runner.setup()
        except ConfigError as exc:  # found at start-up: the credential's environment
            await runner.cleanup()
            print(f"configuration error: {exc}", file=sys.stderr)
            return 2
        site = ShedSite(runner, settings.listen_host, settings.listen_port)
        try:
            await site.start()
        except OSError as exc:  # taken since `_cannot_listen` looked: one line, no traceback
            await runner.cleanup()  # stops what started (the syphon) before the broker goes
            print(
                _listen_error(
                    settings.listen_host, settings.listen_port, "SBGATE_LISTEN_PORT", exc
                ),
                file=sys.stderr,
            )
            return 2
        app[EDGE].lifecycle.checks.append(site.not_listening_reason)
        # The probes' own port (when set): never closed by overload, closed after the drain.
        async with serving_probes(app, settings):
            log.info("gateway ready", extra={"listen": site.name})  # once the sockets listen
            tune_gc()  # what start-up built (the probes' app too) is never collected
            if mode == "serve":
                banner = _banner(settings, embedded.info if embedded else None, dev=dev)
                if banner_file:
                    _write_banner(banner_file, banner)
                print(banner, flush=True)
            else:
                print(f"sbgate syphon running; health on port {settings.listen_port}", flush=True)
            exit_code = await _until_stopped(app, settings, mode)
            if mode == "serve" and banner_file:
                _remove_banner(banner_file, banner)
        await runner.cleanup()
        log.info("stopped")
        return exit_code
    finally:
        if embedded is not None:
            await embedded.stop()


async def _until_stopped(
    app: web.Application, settings: Settings, mode: Literal["serve", "syphon"]
) -> int:
    """Serve until SIGTERM or SIGINT, then start the graceful shutdown: readiness fails at
    once, and the app keeps serving for ``drain_delay`` while endpoints drop the pod (a
    second signal cuts it short). The caller's ``runner.cleanup()`` then stops accepting,
    waits for in-flight requests (aiohttp's shutdown_timeout), and the cleanup contexts
    close senders and clients. Returns the exit code: 3 when `gateway syphon` stopped on a
    namespace fault (``syphon.exit_on_fault``), else 0."""
    from gateway.app import SYPHONS
    from gateway.web.handlers import EDGE

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    syphons = app[SYPHONS]
    exit_code = 0
    if mode == "syphon" and settings.syphon.exit_on_fault and syphons:
        # Kubernetes restarts the pod: the fresh process reconnects both namespaces.
        if await _first_fault([s.fault_seen for s in syphons], stop):
            log.error("namespace fault: exiting (syphon.exit_on_fault)")
            exit_code = 3
    else:
        await stop.wait()
    app[EDGE].lifecycle.draining = True
    log.info("draining", extra={"drain_delay": settings.shutdown.drain_delay})
    stop.clear()
    try:
        async with asyncio.timeout(settings.shutdown.drain_delay):
            await stop.wait()  # a second signal skips the rest of the delay
    except TimeoutError:
        pass
    return exit_code


async def _first_fault(faults: list[asyncio.Event], stop: asyncio.Event) -> bool:
    """Wait for `stop` or any of `faults`; True when a fault came first. Every waiter is
    cancelled and awaited before returning (`TaskSet.stop`: they only wait on events)."""
    from gateway.lifetimes import CANCEL_GRACE, TaskSet

    waiters = TaskSet("waiting for a signal or a fault")
    stopper = waiters.spawn(stop.wait(), name="stop")
    for f in faults:
        waiters.spawn(f.wait(), name="fault")
    try:
        done, _ = await asyncio.wait(list(waiters), return_when=asyncio.FIRST_COMPLETED)
    finally:
        await waiters.stop(CANCEL_GRACE)
    return stopper not in done


# `gateway serve --dev` (what `make run` runs): defaults for a person at a terminal, each
# applied only where the environment sets nothing. Production defaults are unchanged.
DEV_PROFILE = {
    "SBGATE_PING_PRIMARY_INTERVAL": "5",  # the failover demo fails back in seconds, not a minute
    "SBGATE_DRAIN_DELAY": "0",  # Ctrl-C stops at once (no load balancer to drain from)
    "SBGATE_LOG_FORMAT": "text",
    "SBGATE_AUTH_RULES_FILE": "dev/demo-rules.toml",  # public demo keys (when present)
    # The AMQP edge, plain on loopback: an unmodified SDK app sends with the banner's string.
    "SBGATE_AMQP_PLAIN_PORT": "5672",
}
# In the development profile only failed requests get an access line (WARNING: the broker's
# failures, and client errors, 4xx), unless SBGATE_LOG_LEVEL is set: the banner and the
# failover transitions are not buried under one line per request (a 15 s load test wrote 17k).
_DEV_ACCESS_LEVEL = logging.WARNING


def _dev_env(env: dict[str, str]) -> None:
    """Apply `DEV_PROFILE` to `env` where unset."""
    for name, value in DEV_PROFILE.items():
        if name == "SBGATE_AUTH_RULES_FILE" and (
            not os.path.exists(value) or "SBGATE_AUTH_RULES" in env
        ):
            continue
        if name == "SBGATE_AMQP_PLAIN_PORT" and name not in env:
            host = env.get("SBGATE_AMQP_PLAIN_HOST", "127.0.0.1")
            value = str(dev_amqp_port(host, int(value)))
        env.setdefault(name, value)


def dev_amqp_port(host: str, port: int) -> int:
    """The development profile's AMQP port: `port`, or a free one when another process holds
    it (5672 is also RabbitMQ's and other brokers' port: `make run` must not fail on a machine
    that runs one). Only the profile's own default moves; a port the user chose is bound as
    given and a busy one is an error. The banner prints the connection string with the port
    in use, and says why it is not the usual one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # asyncio's server sets SO_REUSEADDR too: a port in TIME_WAIT is free to it.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        return port
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            return port  # not ours to judge: the listener's own bind reports it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


# Command-line options that stand for settings: each one sets its environment variable, so
# the configuration loader validates it like any other source (the command line wins).
_OPTION_ENV = {
    "namespace": "SBGATE_PRIMARY_NAMESPACE",
    "secondary_namespace": "SBGATE_SECONDARY_NAMESPACE",
    "credential": "SBGATE_AZURE_CREDENTIAL",
    "client_id": "SBGATE_AZURE_CLIENT_ID",
}


def _load(args: argparse.Namespace) -> Settings:
    env = dict(os.environ)
    if getattr(args, "dev", False):
        _dev_env(env)
    for option, name in _OPTION_ENV.items():
        value = getattr(args, option, None)
        if value is not None:
            env[name] = value
    try:
        return load_settings(env, args.config)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(args: argparse.Namespace) -> int:
    return _start(args, "serve")


def cmd_syphon(args: argparse.Namespace) -> int:
    return _start(args, "syphon")


def _start(args: argparse.Namespace, mode: Literal["serve", "syphon"]) -> int:
    from gateway.logs import ACCESS_LOGGER, setup_logging
    from gateway.web.hosts import is_loopback

    settings = _load(args)
    try:
        from gateway.web.auth import build_authorizer

        build_authorizer(settings)
    except ValueError as exc:  # AuthConfigError names the file and the field
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    if settings.embedded and importlib.util.find_spec("sblocal") is None:
        print(
            "configuration error: no Service Bus namespace is configured (set "
            "SBGATE_PRIMARY_CONNECTION_STRING or SBGATE_PRIMARY_NAMESPACE, and SBGATE_ENTITIES); "
            "the embedded local broker is only part of a development install",
            file=sys.stderr,
        )
        return 2
    if (unreadable := _unreadable_file(settings)) is not None:
        print(f"configuration error: {unreadable}", file=sys.stderr)
        return 2
    if args.host:
        settings = _with(settings, listen_host=args.host)
    if args.port is not None:
        settings = _with(settings, listen_port=args.port)
    setup_logging(settings.log_format, settings.log_level)
    if args.dev and "SBGATE_LOG_LEVEL" not in os.environ:
        logging.getLogger(ACCESS_LOGGER).setLevel(_DEV_ACCESS_LEVEL)
    has_auth = bool(settings.auth_rules_file or settings.auth_rules)
    # The same rule as open mode's Host check: one `is_loopback`.
    if not is_loopback(settings.listen_host) and not has_auth and not settings.allow_open:
        print(
            f"refusing to listen on {settings.listen_host} without authorization rules: set "
            "SBGATE_AUTH_RULES_FILE (or SBGATE_AUTH_RULES), or SBGATE_ALLOW_OPEN=true to run open",
            file=sys.stderr,
        )
        return 2
    amqp = settings.amqp
    amqp_hosts = ([amqp.host or settings.listen_host] if amqp.tls_cert_file else []) + (
        [amqp.plain_host] if amqp.plain_port else []
    )
    open_amqp = [h for h in amqp_hosts if not is_loopback(h)]
    if mode == "serve" and open_amqp and not has_auth and not settings.allow_open:
        print(
            f"refusing to listen for AMQP on {open_amqp[0]} without authorization rules: set "
            "SBGATE_AUTH_RULES_FILE (or SBGATE_AUTH_RULES), or SBGATE_ALLOW_OPEN=true to run open",
            file=sys.stderr,
        )
        return 2
    try:
        tracer = create_tracer(settings.tracing)  # tracing on without OpenTelemetry: one line
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(_serve(settings, mode, tracer, dev=args.dev, banner_file=args.banner_file))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers (start-up): no traceback
        print("interrupted during start-up", file=sys.stderr)
        return 130


def _unreadable_file(settings: Settings) -> str | None:
    """The first configured certificate file that cannot be read, named with its setting:
    found here in one line, not later as one failed connection after another."""
    files = [("SBGATE_REDIS_CA_FILE (redis_ca_file)", settings.redis_ca_file)]
    for pair in settings.pairs:
        for role, ns in (("primary", pair.primary), ("secondary", pair.secondary)):
            if ns is not None:
                setting = f"[pairs.{pair.name}.{role}] admin_ca_cert"
                files.append((f"SBGATE_{role.upper()}_ADMIN_CA_CERT ({setting})", ns.admin_ca_cert))
    for name, path in files:
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            return f"{name}: cannot read {path}: {exc.strerror or exc}"
    return None


def _with(settings: Settings, **changes: Any) -> Settings:
    from dataclasses import replace

    return replace(settings, **changes)


def _delegate(command: str, rest: list[str]) -> int:
    """Subcommands implemented in their own packages get the rest of the command line as is
    (argparse would swallow their options)."""
    if command == "token":
        from gateway.auth.cli import main as token_main

        return int(token_main(rest))
    if command == "drain":
        from gateway.audit.drain import main as drain_main

        return int(drain_main(rest))
    missing = _audit_missing()
    if missing:
        # The gateway image has neither: one line that says what to do, never a traceback.
        print(
            f"error: gateway audit needs {missing}, which this installation lacks: run it from "
            "the audit image (docker build --target audit) or pip install 'sbgate[spark]' "
            "(and Java 17+)",
            file=sys.stderr,
        )
        return 2
    from pipeline.cli import main as audit_main

    return int(audit_main(rest))


def _audit_missing() -> str | None:
    """The first module `gateway audit` needs that cannot be imported here, if any."""
    for module in ("pipeline", "pyspark"):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
            return module
    return None


# What `gateway serve --help` and `gateway syphon --help` say first: what runs.
_DESCRIPTIONS = {
    "serve": "Run the HTTP ingestion gateway: POST /{entity}/messages in the Service Bus REST "
    "format, sent to the primary namespace, failed over to backlog queues in the secondary "
    "one; the syphon too unless SBGATE_ENABLE_SYPHON=false. With no namespace configured, "
    "starts the local broker pair (a development install). Settings: SBGATE_* variables or "
    "--config (docs/configuration.md); options override them.",
    "syphon": "Run only the syphon: move the messages of the backlog queues home to the "
    "primary namespace (a deployment apart from the gateway's). Serves /healthz, /readyz "
    "and /metrics on the listen port; exits 3 on a namespace fault when "
    "SBGATE_EXIT_ON_FAULT=true. Settings as for gateway serve.",
}

DELEGATED = {
    "token": "mint a SAS token for the gateway",
    "drain": "receive everything from entities and write the delivered ids",
    "audit": "run the Spark audit pipeline locally",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from gateway.logs import quiet_sdk_loggers

    quiet_sdk_loggers()  # serve, syphon, token, drain, audit alike
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "run the HTTP gateway"),
        ("syphon", "run only the syphon worker pool (health and metrics on the listen port)"),
    ):
        p = sub.add_parser(name, help=help_text, description=_DESCRIPTIONS[name])
        p.add_argument("--config", help="TOML configuration file (or SBGATE_CONFIG)")
        p.add_argument("--host", help="listen address (overrides SBGATE_LISTEN_HOST)")
        p.add_argument("--port", type=int, help="listen port (overrides SBGATE_LISTEN_PORT)")
        p.add_argument(
            "--namespace",
            metavar="FQNS",
            help="primary namespace by name, with an Entra ID credential "
            "(overrides SBGATE_PRIMARY_NAMESPACE)",
        )
        p.add_argument(
            "--secondary-namespace",
            metavar="FQNS",
            help="secondary namespace by name (overrides SBGATE_SECONDARY_NAMESPACE)",
        )
        p.add_argument(
            "--credential",
            choices=CREDENTIAL_KINDS,
            help="workload | managed | default (overrides SBGATE_AZURE_CREDENTIAL)",
        )
        p.add_argument(
            "--client-id",
            help="a user-assigned identity's client id (overrides SBGATE_AZURE_CLIENT_ID)",
        )
        p.add_argument(
            "--dev",
            action="store_true",
            help="development profile (make run): pings every 5 s, no drain delay, text logs, "
            "access lines only for failures and client errors, the demo rules; the "
            "environment still wins",
        )
        p.add_argument(
            "--banner-file", metavar="FILE", help="also write the start-up banner to FILE"
        )
        p.set_defaults(func=cmd_serve if name == "serve" else cmd_syphon)
    for name, help_text in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
