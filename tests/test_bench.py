"""`python -m bench`: every benchmark takes ``--quick`` itself, and the runner only passes it on.

The benchmarks' figures are not tested here (they are printed, never asserted); what is, is
the contract between `bench/__main__.py` and the modules it runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as runner
from bench.harness import parse_args

ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--skip-spin", action="store_true")
    return parser


def test_quick_replaces_the_defaults() -> None:
    quick = {"messages": 500, "skip_spin": True}
    args = parse_args(_parser(), ["--quick"], quick)
    assert (args.quick, args.messages, args.skip_spin) == (True, 500, True)
    assert parse_args(_parser(), [], quick).messages == 20_000


def test_an_option_given_wins_over_quick() -> None:
    args = parse_args(_parser(), ["--quick", "--messages", "7"], {"messages": 500})
    assert args.messages == 7


def test_the_runner_passes_quick_on(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def run_module(cmd: list[str], env: dict[str, str], deadline: float) -> str:
        ran.append(cmd)
        return "ok"

    monkeypatch.setattr(runner, "run_module", run_module)
    assert runner.main(["--quick", "syphon", "ledger_bench", "--", "--json"]) == 0
    assert [cmd[1:] for cmd in ran] == [
        ["-m", "bench.syphon_bench", "--quick", "--json"],
        ["-m", "bench.ledger_bench", "--quick", "--json"],
    ]


@pytest.mark.integration
@pytest.mark.slow  # an interpreter per benchmark, each importing what it measures
def test_every_benchmark_takes_quick() -> None:
    names = runner.discover()
    assert "syphon_bench" in names and "failback_bench" in names
    for name in names:
        done = subprocess.run(
            [sys.executable, "-m", f"bench.{name}", "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        assert "--quick" in done.stdout, f"{name} has no --quick:\n{done.stdout}"


def test_the_gateway_servers_gc_log_writes_a_line_a_collection(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import gc

    from bench.gateway_server import gc_log

    monkeypatch.delenv("BENCH_GCLOG", raising=False)
    assert gc_log() is None
    path = tmp_path / "gc.log"
    monkeypatch.setenv("BENCH_GCLOG", str(path))
    callback = gc_log()
    assert callback is not None
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(callback)
    lines = [line.split("\t") for line in path.read_text().splitlines()]
    assert [generation for _, generation, _, _ in lines[-2:]] == ["0", "2"]
    assert all(float(ms) >= 0 and int(collected) >= 0 for _, _, ms, collected in lines)


async def test_step_0_tries_h2load_once_more_then_goes_on_without_the_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from bench import overload_bench
    from bench.harness import Cores
    from bench.native import H2Load

    outcomes: list[object] = [RuntimeError("h2load ran past 65 s (killed):\n"), "window"]

    async def run_h2load(load: H2Load, cpus: frozenset[int], watch: dict[str, int]) -> object:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(overload_bench, "run_h2load", run_h2load)
    lines: list[str] = []
    load = H2Load(["http://127.0.0.1:1/"], 1.0, connections=1)
    cores = Cores(frozenset(), frozenset())
    gateway = SimpleNamespace(pid=None)
    assert await overload_bench._h2load_retried(load, cores, gateway, lines.append) == "window"
    assert lines == ["  h2load failed (h2load ran past 65 s (killed):); once more"]
    outcomes[:] = [RuntimeError("h2load exited 1:"), RuntimeError("h2load exited 1:")]
    assert await overload_bench._h2load_retried(load, cores, gateway, lines.append) is None
    assert lines[-1] == "  h2load failed (h2load exited 1:); no figure"


def test_instructions_a_request_are_the_difference_between_three_runs_and_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`gateway_profile --instructions`: start-up and warm-up are in both counts and cancel
    out; the count is read from callgrind's output file (here written as callgrind would)."""
    from bench import gateway_profile

    fixed = {"bare": 5_000_000, "full": 9_000_000}  # start-up, imports, warm-up
    per = {"bare": 200, "full": 400}  # the instructions a request

    def fake_child(
        module: str, args: list[str], *, timeout: float, wrapper: tuple[str, ...]
    ) -> str:
        assert wrapper[:2] == ("valgrind", "--tool=callgrind")
        variant, requests, runs = args[1], int(args[3]), int(args[5])
        out = Path(wrapper[2].split("=", 1)[1])
        total = fixed[variant] + per[variant] * requests * runs
        out.write_text(f"# callgrind format\nevents: Ir\nsummary: {total}\ntotals: {total}\n")
        return ""

    monkeypatch.setattr(gateway_profile, "child_output", fake_child)
    assert gateway_profile.instructions_per_request(["bare", "full"], 1000) == {
        "bare": 200.0,
        "full": 400.0,
    }
