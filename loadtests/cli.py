"""``python -m loadtests``: ``load`` (Locust against a stack started for it), ``chaos`` (the
scenario suite), ``check`` (re-check a finished run directory)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson

from loadtests.acks import read_acks
from loadtests.checker import check

log = logging.getLogger("loadtests")

ROOT = Path(__file__).resolve().parent.parent


def _seconds(text: str) -> float:
    """``30s``, ``2m``, ``1h30m`` or a number of seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    total = 0.0
    for value, unit in re.findall(r"(\d+(?:\.\d+)?)([hms])", text):
        total += float(value) * {"h": 3600, "m": 60, "s": 1}[unit]
    if total <= 0:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}")
    return total


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The SDK logs every link state change at INFO.
    logging.getLogger("azure").setLevel(logging.WARNING)
    logging.getLogger("uamqp").setLevel(logging.WARNING)


# -- chaos -----------------------------------------------------------------------------------


async def _chaos(args: argparse.Namespace) -> int:
    from loadtests import results
    from loadtests.scenarios import by_name, run_scenario

    out = Path(args.out)
    chosen = by_name(args.scenario)
    started = time.monotonic()
    done = []
    for scn in chosen:
        log.info("=== %s: %s", scn.name, scn.title)
        r = await run_scenario(scn, out, scale=args.scale, max_rate=args.max_rate)
        done.append(r)
        state = "PASS" if r.passed else "FAIL"
        log.info(
            "=== %s %s in %.0f s: acked %d lost %d dup %d",
            scn.name,
            state,
            r.duration_s,
            r.verdict.acked,
            r.verdict.lost,
            r.verdict.duplicated,
        )
        for c in r.criteria:
            if not c.ok:
                log.info("    [FAIL] %s: %s", c.name, c.detail)
    command = "python -m loadtests chaos" + " ".join(
        [""]
        + ([f"--scale {args.scale}"] if args.scale != 1.0 else [])
        + [f"--scenario {s}" for s in (args.scenario or [])]
    )
    doc = results.write(done, out, command)
    print()
    print(results.markdown(done, command))
    print(f"total runtime {time.monotonic() - started:.0f} s; results in {out}/results.md")
    return 0 if doc["passed"] else 1


# -- load ------------------------------------------------------------------------------------


async def _load(args: argparse.Namespace) -> int:
    from loadtests import results
    from loadtests.harness import drain_all
    from loadtests.scenarios import Criterion, ScenarioResult
    from loadtests.stack import ENTITIES as STACK_ENTITIES
    from loadtests.stack import Stack, StackOptions

    out = Path(args.out)
    run_dir = out / "stack"
    acks_dir = out / "acks"
    for d in (acks_dir,):
        if d.exists():
            for f in d.glob("*.jsonl"):
                f.unlink()
    started = time.monotonic()
    stack = Stack(StackOptions(replicas=args.replicas, syphon="off"), run_dir)
    await stack.start()
    try:
        env = dict(os.environ)
        env.update(
            {
                "LOADTEST_HOSTS": ",".join(stack.urls),
                "LOADTEST_ACKS_DIR": str(acks_dir),
                "LOADTEST_RATE": str(args.rate or 0),
                "LOADTEST_USERS": str(args.users),
                "LOADTEST_RUN_ID": uuid.uuid4().hex[:8],
                "LOADTEST_ENTITIES": STACK_ENTITIES,
                "PYTHONPATH": str(ROOT),
            }
        )
        if args.authorization:
            env["LOADTEST_AUTHORIZATION"] = args.authorization
        cmd = [
            sys.executable, "-m", "locust",
            "-f", str(ROOT / "loadtests" / "locustfile.py"),
            "--headless",
            "-u", str(args.users),
            "-r", str(args.spawn_rate or args.users),
            "-t", f"{int(args.time)}s",
            "--host", stack.urls[0],
            "--csv", str(out / "locust"),
            "--html", str(out / "locust.html"),
            "--only-summary",
            "--stop-timeout", "20",
        ]  # fmt: skip
        if args.processes:
            cmd += ["--processes", str(args.processes)]
        log.info("running %s", shlex.join(cmd))
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=str(ROOT))
        try:
            async with asyncio.timeout(args.time + 120):
                code = await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            code = -9
        log.info("locust exited %s", code)
        await stack.stop_gateways()
        assert stack.broker is not None
        delivered = await drain_all(stack.broker, run_dir)
        (out / "delivered.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in delivered))
    finally:
        await stack.stop()
    verdict = check(read_acks([acks_dir]), delivered)
    criteria = [
        Criterion("acknowledged messages", verdict.acked > 0, f"{verdict.acked}"),
        Criterion("no acknowledged message lost", verdict.lost == 0, ""),
        Criterion("no duplicate delivered", verdict.duplicated == 0, ""),
        Criterion("no delivery after a definite refusal", verdict.unexpected_violations == 0, ""),
    ]
    r = ScenarioResult(
        name=f"locust-{args.users}u-{args.replicas}r",
        title=f"Locust {args.users} users, {args.replicas} replicas, {int(args.time)} s",
        verdict=verdict,
        criteria=criteria,
        duration_s=time.monotonic() - started,
        requests=0,
    )
    command = (
        f"python -m loadtests load --users {args.users} --rate {args.rate or 0} "
        f"--time {int(args.time)}s --replicas {args.replicas}"
    )
    doc = results.write([r], out, command)
    print(results.markdown([r], command))
    print(f"Locust report: {out}/locust.html, CSV: {out}/locust_stats.csv")
    return 0 if doc["passed"] and code == 0 else 1


# -- check -----------------------------------------------------------------------------------


def _check(args: argparse.Namespace) -> int:
    run = Path(args.run_dir)
    delivered = [orjson.loads(line) for line in (run / "delivered.jsonl").read_bytes().splitlines()]
    v = check(read_acks([run / "acks"]), delivered)
    print(orjson.dumps(v.as_dict(), option=orjson.OPT_INDENT_2).decode())
    return 0 if v.lost == 0 and v.unexpected_violations == 0 else 1


async def _cancellable(work: Coroutine[Any, Any, int]) -> int:
    """Run `work`; SIGTERM or SIGINT cancels it, so every started stack is torn down (its
    processes stopped) by the `finally` blocks on the way out."""
    task = asyncio.create_task(work)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        log.warning("interrupted: stacks torn down")
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="Locust, headless and bounded, against a fresh stack")
    load.add_argument("--users", type=int, default=32)
    load.add_argument("--rate", type=float, default=0, help="requests/s in total (0: unpaced)")
    load.add_argument("--spawn-rate", type=float, default=0, help="users started per second")
    load.add_argument("--time", type=_seconds, default=30.0, help="run time (30s, 2m)")
    load.add_argument("--replicas", type=int, default=2)
    load.add_argument("--processes", type=int, default=0, help="Locust --processes (-1: cores)")
    load.add_argument(
        "--authorization",
        default=os.environ.get("LOADTEST_AUTHORIZATION"),
        help="an Authorization header value (gateway token)",
    )
    load.add_argument("--out", default="out/load")

    chaos = sub.add_parser("chaos", help="the chaos scenario suite")
    chaos.add_argument("--scenario", action="append", help="run only these (repeatable)")
    chaos.add_argument("--scale", type=float, default=1.0, help="duration factor (CI: 0.3)")
    chaos.add_argument("--max-rate", type=float, help="cap each client at N requests/s")
    chaos.add_argument("--out", default="out/chaos")
    chaos.add_argument("--list", action="store_true", help="list the scenarios and exit")

    chk = sub.add_parser("check", help="re-check a finished run (acks/ + delivered.jsonl)")
    chk.add_argument("run_dir")

    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if args.command == "chaos":
        if args.list:
            from loadtests.scenarios import SCENARIOS

            for s in SCENARIOS:
                print(f"{s.name:22} {s.title}")
            return 0
        return asyncio.run(_cancellable(_chaos(args)))
    if args.command == "load":
        return asyncio.run(_cancellable(_load(args)))
    return _check(args)
