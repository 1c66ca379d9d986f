"""``python -m bench``: run every benchmark module in bench/ in turn (``*_bench.py``).

    .venv/bin/python -m bench                     # all of them
    .venv/bin/python -m bench --quick             # each in its short form
    .venv/bin/python -m bench gateway ledger      # a selection (with or without "_bench")
    .venv/bin/python -m bench gateway -- p1 p7    # arguments after "--" go to every module run
    .venv/bin/python -m bench --list

Each module runs as its own ``python -m bench.<name>`` process (their set-ups pin CPUs, start
brokers and servers; a fresh interpreter keeps them from disturbing one another), with a
deadline. ``--quick`` passes ``--quick`` on: every benchmark takes it and knows its own short
form (``python -m bench.<name> --help`` says what it is).

Benchmarks print ratios measured in one run; they assert nothing and are not part of
``make test``. The exit status is 1 when a module exits non-zero or overruns its deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent


def discover() -> list[str]:
    """Module names of bench/*_bench.py, in a stable order (the gateway's first)."""
    names = sorted(p.stem for p in BENCH_DIR.glob("*_bench.py"))
    return sorted(names, key=lambda n: (n != "gateway_bench", n))


def resolve(selected: list[str], available: list[str]) -> list[str]:
    out: list[str] = []
    for s in selected:
        name = s if s.endswith("_bench") else f"{s}_bench"
        if name not in available:
            raise SystemExit(f"no benchmark {s!r}; available: {', '.join(available)}")
        out.append(name)
    return out


def run_module(cmd: list[str], env: dict[str, str], deadline: float) -> str:
    """Run one module in its own process group, with a deadline.

    On the deadline (or Ctrl-C here) the module gets SIGINT, so its clean-up stops the
    servers and brokers it started; whatever is left of its group after 30 s is killed.
    """
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    outcome: str
    try:
        code = proc.wait(deadline)
        return "ok" if code == 0 else f"exit {code}"
    except subprocess.TimeoutExpired:
        outcome = f"over the {deadline:g} s deadline (stopped)"
    except KeyboardInterrupt:
        outcome = "interrupted"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group we created for this module
        proc.wait()
    return outcome


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="each benchmark in its short form")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument(
        "--deadline", type=float, default=900.0, help="seconds allowed per module (default 900)"
    )
    args = parser.parse_args(argv)
    available = discover()
    if args.list:
        for name in available:
            print(name.removesuffix("_bench"))
        return 0
    names = resolve(args.names, available) if args.names else available

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else "")
    outcomes: list[tuple[str, str, float]] = []
    for name in names:
        quick = ["--quick"] if args.quick else []
        cmd = [sys.executable, "-m", f"bench.{name}", *quick, *passthrough]
        print(f"\n######## {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        outcome = run_module(cmd, env, args.deadline)
        outcomes.append((name, outcome, time.monotonic() - started))
        if outcome == "interrupted":
            break

    print("\n######## bench summary")
    for name, outcome, seconds in outcomes:
        print(f"{name:16s} {outcome:12s} {seconds:6.0f} s")
    return 0 if all(o == "ok" for _, o, _ in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
