"""The README's Quick start and failover demo, command for command, against `gateway serve`
started as `make run` starts it (the Makefile's own recipe, on a free port).

The commands come from the README itself, so it cannot drift:

* a ```` ```sh ```` block is run in bash, after the banner's ``export`` line (as the README
  tells the reader to paste it); the one that says ``make run`` starts the gateway instead;
* a ```` ```text ```` block right after it is that command's output (for ``make run``: the
  banner), matched line by line: a line ``...`` skips any lines, ``...`` inside a line matches
  anything;
* a ```` ```log ```` block is what the gateway's terminal shows (each line, in order, among
  the others);
* where the prose before a block says "within N s", the block is run again until its output
  matches, for at most N s: the documented bound, as a liveness deadline.

Every ``127.0.0.1:8080`` (the README's port) becomes the free port the gateway listens on.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import GatewayProcess, free_port
from tests.support.waiting import eventually

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parent.parent
README_PORT = "8080"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
_WITHIN = re.compile(r"within (\d+) s\b")


@dataclass
class Block:
    kind: str  # sh, text, log
    body: str
    prose: str  # the text between the previous block and this one


def quick_start(readme: str) -> str:
    start = readme.index("## Quick start\n")
    return readme[start : readme.index("\n## ", start + 1)]


def blocks(section: str) -> list[Block]:
    out: list[Block] = []
    last = 0
    for m in _FENCE.finditer(section):
        out.append(Block(m[1], m[2].rstrip("\n"), section[last : m.start()]))
        last = m.end()
    return out


def _pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in line.split("...")))


def matches(expected: str, actual: str, *, among_others: bool = False) -> bool:
    """`actual`'s lines as `expected` shows them (see the module docstring)."""
    lines = [a.rstrip("\r") for a in actual.splitlines()]
    i, gap = 0, among_others
    for e in expected.splitlines():
        if e == "...":
            gap = True
            continue
        pattern = _pattern(e)
        while i < len(lines) and not pattern.fullmatch(lines[i]):
            if not gap:
                return False
            i += 1
        if i == len(lines):
            return False
        i, gap = i + 1, among_others
    return gap or i == len(lines)


def test_the_matcher() -> None:
    assert matches("a\n...\nc...", "a\nb\ncd")
    assert not matches("a\nc", "a\nb\nc")
    assert not matches("a", "a\nb")
    assert matches("x\nz", "w\nx\ny\nz\n", among_others=True)


def make_run_command(banner_file: Path) -> list[str]:
    """The Makefile's `run` recipe: the words after `$(BIN)/gateway`, with the banner file
    `banner_file`."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run:[^\n]*\n\t([^\n]+)", makefile, re.M)
    assert recipe is not None, "the Makefile has no run target"
    words = shlex.split(recipe[1])
    assert words[0] == "$(BIN)/gateway", words
    return [str(banner_file) if w == ".run/banner.txt" else w for w in words[1:]]


class Gateway:
    """`make run`'s process (the launcher kit's `GatewayProcess`): what it printed (the
    banner) and its logs."""

    def __init__(self, process: GatewayProcess) -> None:
        self.process = process

    @property
    def out(self) -> str:
        return self.process.printed()

    @property
    def err(self) -> str:
        return self.process.output().decode(errors="replace")

    async def wait_for(self, what: str, text: str, within: float) -> None:
        def shown() -> bool:
            if not self.process.running:
                raise AssertionError(f"the gateway exited ({self.process.returncode})")
            return matches(text, getattr(self, what), among_others=what == "err")

        try:
            await eventually(shown, within=within, every=0.1)
        except AssertionError as exc:
            raise AssertionError(
                f"the gateway's {what} does not show, within {within} s ({exc}):\n{text}\n"
                f"--- stdout:\n{self.out}\n--- stderr:\n{self.err}"
            ) from None

    async def stop(self) -> float:
        """Ctrl-C; how long it took to exit (SIGKILL and a failure after 30 s)."""
        started = time.monotonic()
        self.process.signal(signal.SIGINT)
        if await self.process.wait(30) is None:
            self.process.kill()
            await self.process.wait(10)
            raise AssertionError(f"Ctrl-C did not stop the gateway within 30 s:\n{self.err}")
        return time.monotonic() - started


async def shell(script: str) -> tuple[int | None, str]:
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-euo",
        "pipefail",
        "-c",
        script,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,  # curl's progress meter (a terminal shows none)
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    return proc.returncode, out.decode() + ("" if proc.returncode == 0 else err.decode())


async def run_steps(gw: Gateway, steps: list[Block], first: int, export: str) -> int:
    """Run `steps[first:]` as the module docstring says (each ``sh`` block after `export`);
    how many ``sh`` blocks ran."""
    ran = 0
    for i, step in enumerate(steps[first:], start=first):
        if step.kind == "log":
            await gw.wait_for("err", step.body, within=10)
        if step.kind != "sh":
            continue
        expected = steps[i + 1].body if i + 1 < len(steps) and steps[i + 1].kind == "text" else None
        bound = _WITHIN.search(step.prose)
        printed = [""]

        async def as_shown(
            body: str = step.body, want: str | None = expected, out: list[str] = printed
        ) -> bool:
            code, out[0] = await shell(f"{export}\n{body}")
            return code == 0 and (want is None or matches(want, out[0]))

        # Run once; where the README states a bound, again until it matches within it.
        try:
            await eventually(as_shown, within=float(bound[1]) if bound else 0, every=0.5)
        except AssertionError:
            raise AssertionError(
                f"{step.body}\n--- printed:\n{printed[0]}\n--- the README shows:\n"
                f"{expected}\n--- gateway:\n{gw.err}"
            ) from None
        ran += 1
    return ran


async def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    port = str(free_port())
    section = quick_start((ROOT / "README.md").read_text()).replace(README_PORT, port)
    steps = blocks(section)
    assert [b.kind for b in steps].count("sh") >= 5, "the Quick start lost its commands"
    assert steps[0].kind == "sh" and steps[0].body.split("#")[0].strip() == "make run"
    command, *args = make_run_command(tmp_path / "banner.txt")
    process = GatewayProcess(
        "make-run",
        # The AMQP listener on a free port too (make run's 5672 may be taken on a CI host).
        {"PYTHONUNBUFFERED": "1", "SBGATE_AMQP_PLAIN_PORT": str(free_port())},
        port=int(port),
        log_dir=tmp_path,
        command=command,
        args=args,
    )
    process.spawn()  # ready when it prints the banner
    gw = Gateway(process)
    try:
        banner = steps[1]
        assert banner.kind == "text"
        await gw.wait_for("out", banner.body, within=60)  # a cold start imports the SDK
        assert (tmp_path / "banner.txt").read_text() == gw.out
        [export] = [line.strip() for line in gw.out.splitlines() if "export SEND=" in line]
        ran = 1 + await run_steps(gw, steps, 2, export)
        assert ran == [b.kind for b in steps].count("sh")
        # No noise: nothing at ERROR (the embedded broker's included) during the demo.
        assert not [line for line in gw.err.splitlines() if " ERROR " in line], gw.err
    finally:
        took = await gw.stop()
    stop = re.search(r"Ctrl-C stops it within (\d+) s", section)
    assert stop is not None, "the README no longer says how long Ctrl-C takes"
    assert took < float(stop[1]), f"Ctrl-C took {took:.1f} s"
    assert gw.process.returncode == 0, gw.err
    assert not (tmp_path / "banner.txt").exists(), "a stopped gateway's banner is stale"


def section(readme: str, heading: str) -> str:
    start = readme.index(f"## {heading}\n")
    return readme[start : readme.index("\n## ", start + 1)]


async def test_when_something_is_wrong_runs_as_written(tmp_path: Path) -> None:
    """The first incident (docs/troubleshooting.md, which the README sends to; issue #37),
    against `make run` with an entity the local
    broker lacks: the missing-entity line, parking and home, operator actions and client
    errors in the log, the docs' 405 and 413 answers, a second gateway on the same port."""
    port = str(free_port())
    text = section((ROOT / "docs" / "troubleshooting.md").read_text() + "\n## end\n", "Try it")
    steps = blocks(text.replace(README_PORT, port))
    assert steps[0].kind == "sh" and steps[0].body.endswith(" make run"), steps[0].body
    assignments = shlex.split(steps[0].body)[:-2]
    env = dict(a.split("=", 1) for a in assignments)
    assert env and all(k.startswith("SBGATE_") for k in env), env
    command, *args = make_run_command(tmp_path / "banner.txt")
    process = GatewayProcess(
        "make-run-wrong",
        {"PYTHONUNBUFFERED": "1", **env},
        port=int(port),
        log_dir=tmp_path,
        command=command,
        args=args,
    )
    process.spawn()
    gw = Gateway(process)
    try:
        await gw.wait_for("out", "sbgate listening on ...\n...", within=60)
        exports = [
            line.strip() for line in gw.out.splitlines() if line.strip().startswith("export ")
        ]
        assert len(exports) == 2, gw.out  # the README says: paste the two export lines
        ran = 1 + await run_steps(gw, steps, 1, "\n".join(exports))
        assert ran == [b.kind for b in steps].count("sh")
        assert not [line for line in gw.err.splitlines() if " ERROR " in line], gw.err
    finally:
        await gw.stop()
    assert gw.process.returncode == 0, gw.err
