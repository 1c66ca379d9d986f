"""The server side of the HTTP benchmarks, in its own process: the gateway or a bare handler.

Both modes are served as `gateway serve` serves (an `AppRunner` without an access log, a
listen backlog of 2048, uvloop when installed), on 127.0.0.1 and a port the kernel picks.
The gateway gets the CLI's runner and site (`HardenedAppRunner`: per-connection head/body
deadlines and the overload caps; `ShedSite`: it stops listening while it cannot keep up);
the bare handler aiohttp's plain `web.AppRunner` and `TCPSite` — that difference is part of
what P1 measures.

    python -m bench.gateway_server --mode bare
    SBGATE_...=... python -m bench.gateway_server --mode gateway --sink null|sdk

``--mode gateway`` reads its settings from the ``SBGATE_*`` environment like the CLI, builds
the app with `gateway.app.create_app`, and with ``--sink null`` plugs in the null sink
(`NullNamespaceClient`, every send settled at once) and a provisioner stub that reports every
backlog queue as usable. ``--mode bare`` answers every POST with 201 and a small JSON body,
after reading the request body — what any aiohttp service does at the least.

Prints ``READY {"port": N}`` once listening; stops on SIGTERM/SIGINT. With
``BENCH_MEMDUMP=<prefix>`` it writes the live objects' counts by type, and with
``BENCH_TRACEMALLOC=1`` also a `tracemalloc` snapshot, on every SIGUSR1 (the memory
benchmarks' ``--memdump`` and ``--tracemalloc``; see `bench.memwatch.compare_dumps`). With
``BENCH_GCLOG=<path>`` it appends a line to `path` for every collection of the cyclic
collector: when it ended, its generation, how long it held the loop, what it collected.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from bench.harness import emit, pin_self_from_env

if TYPE_CHECKING:
    from gateway.config import Settings

# About the size of the gateway's own answer ({"messageIds": [...], "entity", "route"}).
_BARE_ANSWER = orjson.dumps(
    {"messageIds": ["5b0f3c1e9a7d4e2f8c6b1a0d9e8f7a6b"], "entity": "orders", "route": "primary"}
)


async def _bare_post(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(status=201, body=_BARE_ANSWER, content_type="application/json")


def bare_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/{kind:queues|topics}/{name:.+}/messages", _bare_post)
    return app


def gateway_app(sink: str) -> tuple[web.Application, Settings]:
    from gateway.app import create_app
    from gateway.config import NamespaceSettings, load_settings
    from gateway.logs import setup_logging

    settings = load_settings(os.environ)
    setup_logging(settings.log_format, settings.log_level)
    if sink == "sdk":
        return create_app(settings), settings

    from bench.null_sink import NullNamespaceClient

    async def provision(ns: NamespaceSettings, paths: list[str]) -> list[str]:
        return list(paths)  # the null sink has every backlog queue

    def make(ns: NamespaceSettings) -> NullNamespaceClient:
        return NullNamespaceClient(ns.name)

    return create_app(settings, client_factory=make, provisioner=provision), settings


def gateway_runner(app: web.Application, settings: Settings) -> web.AppRunner:
    """The runner `gateway serve` uses (its hardened connection handler, when it has one)."""
    kwargs: dict[str, Any] = {"handle_signals": False, "access_log": None, "shutdown_timeout": 5.0}
    try:
        from gateway.app import edge_runner
    except ImportError:
        try:
            from gateway.web.runner import HardenedAppRunner
        except ImportError:
            return web.AppRunner(app, **kwargs)
        return HardenedAppRunner(app, settings=settings, **kwargs)
    return edge_runner(app, settings, **kwargs)


def _rss() -> int:
    from tests.support.processes import rss_bytes  # only for a dump: not in the serving path

    return rss_bytes(os.getpid()) or 0


def _mallinfo() -> dict[str, int]:
    """glibc's heap accounts (`mallinfo2`): `arena` bytes from brk, `hblkhd` from mmap,
    `uordblks` in use, `fordblks` free but kept; empty off glibc."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            ).split()
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {
        f"malloc_{name}": getattr(info, name)
        for name in ("arena", "hblkhd", "uordblks", "fordblks")
    }


def _memory_accounts() -> dict[str, int]:
    """Where the process's memory is: RSS, glibc's heap, Python's blocks, threads."""
    import sys
    import threading

    return {
        "rss": _rss(),
        **_mallinfo(),
        "python_blocks": sys.getallocatedblocks(),
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
    }


def _trimmed() -> dict[str, int]:
    """RSS after a full collection and glibc's `malloc_trim(0)` (free heap pages given back):
    how much of the RSS was memory kept free rather than held."""
    import ctypes
    import gc

    gc.collect()
    collected = _rss()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return {"rss_after_gc": collected}
    return {"rss_after_gc": collected, "rss_after_trim": _rss()}


def _snapshots(loop: asyncio.AbstractEventLoop) -> None:
    """``BENCH_MEMDUMP=<prefix>``: on each SIGUSR1, write the live objects' counts by type
    (``<prefix>.<n>.types.json``) and, with ``BENCH_TRACEMALLOC=1`` (allocations traced from
    the start, 25 frames), a `tracemalloc` snapshot (``<prefix>.<n>.snap``)."""
    prefix = os.environ.get("BENCH_MEMDUMP")
    if not prefix:
        return
    import gc
    import tracemalloc
    from collections import Counter

    if os.environ.get("BENCH_TRACEMALLOC"):
        tracemalloc.start(25)
    taken = 0

    def dump() -> None:
        nonlocal taken
        taken += 1
        memory = _memory_accounts()
        if tracemalloc.is_tracing():
            # Read before the snapshot, whose own making would be the peak.
            memory["traced"], memory["traced_peak"] = tracemalloc.get_traced_memory()
            tracemalloc.take_snapshot().dump(f"{prefix}.{taken}.snap")
            tracemalloc.reset_peak()  # the next dump's peak: the highest since this one
        before = Counter(type(o).__qualname__ for o in gc.get_objects())
        collected = gc.collect()  # what only the cycle collector frees
        objects = gc.get_objects()
        types = Counter(type(o).__qualname__ for o in objects)
        garbage = {t: n - types.get(t, 0) for t, n in before.most_common(30)}
        lanes = {  # the dispatchers' lanes: what waits where
            str(lane.dest): {
                "pending": len(lane.pending),
                "workers": len(lane.workers),
                **Counter(w.state.value for w in lane.workers),  # sending 2, idle 1, ...
            }
            for o in objects
            if type(o).__name__ == "Dispatcher"
            for lane in getattr(o, "_lanes", {}).values()
        }
        with open(f"{prefix}.{taken}.types.json", "wb") as fh:
            fh.write(
                orjson.dumps(
                    {
                        **dict(types.most_common(200)),
                        "_lanes": lanes,
                        "_cycles": {"collected": collected, **garbage},
                        "_memory": {**memory, **_trimmed()},
                    }
                )
            )

    loop.add_signal_handler(signal.SIGUSR1, dump)


def gc_log() -> Callable[[str, dict[str, int]], None] | None:
    """``BENCH_GCLOG=<path>``: every collection of the cyclic collector, one line each (the
    monotonic time it ended, its generation, milliseconds, objects collected), appended to
    `path` as the process runs (line-buffered): the loop's stalls that are the collector's.
    Returns the callback it added to `gc.callbacks` (None without the variable)."""
    path = os.environ.get("BENCH_GCLOG")
    if not path:
        return None
    import gc
    import time

    out = open(path, "a", buffering=1)  # open for the process's life
    started: list[float] = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            started[0] = now
        else:
            out.write(
                f"{time.monotonic():.4f}\t{info['generation']}\t"
                f"{(now - started[0]) * 1000:.2f}\t{info['collected']}\n"
            )

    gc.callbacks.append(timed)
    return timed


async def serve(mode: str, sink: str) -> None:
    _snapshots(asyncio.get_running_loop())
    gc_log()
    from gateway.web.listener import ShedSite
    from gateway.web.overload import LISTEN_BACKLOG

    if mode == "bare":
        runner = web.AppRunner(bare_app(), handle_signals=False, access_log=None)
    else:
        app, settings = gateway_app(sink)
        runner = gateway_runner(app, settings)
    await runner.setup()
    try:
        site = (
            web.TCPSite(runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG)
            if mode == "bare"
            else ShedSite(runner, "127.0.0.1", 0)
        )
        await site.start()
        if mode != "bare":
            from gateway.cli import tune_gc

            tune_gc()  # as `gateway serve` does once started
        port = runner.addresses[0][1]
        ready: dict[str, int] = {"port": port, "pid": os.getpid()}
        probes = None
        if mode != "bare":
            # The probe port, as `gateway serve` has it with probe_port set: /metrics on a
            # listener overload never closes, so a bench reads it while the listen port is
            # paused (a scrape there is refused then).
            from gateway.web.probes import probe_app
            from gateway.web.runner import ProbeRunner

            probes = ProbeRunner(
                probe_app(app), settings=settings, handle_signals=False, access_log=None
            )
            await probes.setup()
            await web.TCPSite(probes, "127.0.0.1", 0).start()
            ready["probe_port"] = probes.addresses[0][1]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        emit("READY " + orjson.dumps(ready).decode())
        await stop.wait()
        if probes is not None:
            await probes.cleanup()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    pin_self_from_env()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("bare", "gateway"), required=True)
    parser.add_argument("--sink", choices=("null", "sdk"), default="null")
    args = parser.parse_args(argv)
    try:
        if os.environ.get("BENCH_LOOP") == "asyncio":  # asyncio's own loop, to compare
            raise ImportError("BENCH_LOOP=asyncio")
        import uvloop
    except ImportError:
        asyncio.run(serve(args.mode, args.sink))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args.mode, args.sink))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
