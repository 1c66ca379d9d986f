"""The real Node.js Service Bus SDK (`@azure/service-bus`, pinned in
tests/compat/node/package-lock.json, installed by `make node-deps`), run by
tests/compat/node/run.mjs (or habits.mjs): one job a process, its JSON result. A run that outlives
`RUN_DEADLINE` is killed and fails the test: a protocol mismatch shows as a silent hang."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

NODE = shutil.which("node")
NODE_DIR = Path(__file__).resolve().parents[1] / "compat" / "node"
INSTALLED = (NODE_DIR / "node_modules" / "@azure" / "service-bus").is_dir()
RUN_DEADLINE = 60.0


async def run_job(
    job: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    script: str = "run.mjs",
    deadline: float = RUN_DEADLINE,
) -> dict[str, Any]:
    """Run `script` (run.mjs: ``{"connectionString", "entity", "steps"}``) with `job`; its
    result. A job that waits on purpose (an idle pause) passes a longer `deadline`."""
    assert NODE is not None, "node is not installed (`make sysdeps` installs it)"
    assert INSTALLED, "the Node SDK is not installed: run `make node-deps`"
    proc = await asyncio.create_subprocess_exec(
        NODE,
        str(NODE_DIR / script),
        cwd=NODE_DIR,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(deadline):
            out, err = await proc.communicate(json.dumps(job).encode())
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"the Node SDK did not finish in {deadline} s: {job}") from None
    lines = out.decode().strip().splitlines()
    assert lines, f"no result from node (exit {proc.returncode}): {err.decode()[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result
