"""What each image target may contain, and how it installs: checks hadolint cannot make.

Run by scripts/lint-packaging.sh (any Python 3.11+, standard library only):

    python scripts/dockerfile_check.py

- `.dockerignore` is an allowlist: it starts with `*` and re-includes exactly ALLOWED_CONTEXT.
- Each target (`gateway`, `audit`) copies from the build context only what it may: the
  stages it is built from (FROM, COPY --from) are followed, so a file copied in a build stage
  counts for the target that uses that stage. The gateway image never gets the pipeline.
- Every `pip install` installs either a locked requirements file with --require-hashes and
  --no-deps, or the project itself with --no-deps (its dependencies come from the lock).
- Each target runs as a numeric non-root user, with an exec-form (JSON) entry point.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALLOWED_CONTEXT = {
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "requirements/",
    "gateway/",
    "sbamqp/",
    "pipeline/",
}
_BUILD = {"pyproject.toml", "README.md", "LICENSE", "requirements/build.txt", "gateway/", "sbamqp/"}
TARGETS: dict[str, set[str]] = {
    "gateway": _BUILD | {"requirements/gateway.txt"},
    "audit": _BUILD | {"requirements/audit.txt", "pipeline/"},
}


@dataclass
class Stage:
    name: str
    base: str
    copies: list[tuple[str | None, list[str]]] = field(default_factory=list)  # (--from, srcs)
    runs: list[str] = field(default_factory=list)
    user: str | None = None
    entry: list[str] = field(default_factory=list)  # ENTRYPOINT / CMD arguments as written


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def parse(text: str) -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for word, rest in instructions(text):
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            if not m:
                raise ValueError(f"cannot read FROM {rest}")
            name = m.group(2) or f"stage{len(stages)}"
            current = stages[name] = Stage(name=name, base=m.group(1))
        elif current is None:
            continue
        elif word == "COPY":
            args = rest.split()
            source = None
            while args and args[0].startswith("--"):
                opt = args.pop(0)
                if opt.startswith("--from="):
                    source = opt.removeprefix("--from=")
            current.copies.append((source, args[:-1]))
        elif word == "RUN":
            current.runs.append(rest)
        elif word == "USER":
            current.user = rest
        elif word in ("ENTRYPOINT", "CMD"):
            current.entry.append(rest)
    return stages


def closure(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The target and every stage it is built from or copies from."""
    seen: list[str] = []
    todo = [target]
    while todo:
        name = todo.pop()
        if name in seen or name not in stages:
            continue
        seen.append(name)
        stage = stages[name]
        todo.append(stage.base)
        todo.extend(src for src, _ in stage.copies if src)
    return [stages[n] for n in seen]


def check_dockerfile(text: str) -> list[str]:
    stages = parse(text)
    errors: list[str] = []
    for target, allowed in TARGETS.items():
        if target not in stages:
            errors.append(f"Dockerfile: no stage named {target!r}")
            continue
        errors += _check_copies(stages, target, allowed)
        errors += _check_user_and_entry(stages, target)
    return errors + _check_installs(stages)


def _check_copies(stages: dict[str, Stage], target: str, allowed: set[str]) -> list[str]:
    """What the target's stages copy from the build context is allowed in its image."""
    return [
        f"target {target}: stage {stage.name} copies {p} into the image"
        for stage in closure(stages, target)
        for src, paths in stage.copies
        if src is None
        for p in paths
        if p not in allowed
    ]


def _check_user_and_entry(stages: dict[str, Stage], target: str) -> list[str]:
    """A numeric non-root USER and an exec-form entry point."""
    errors: list[str] = []
    # USER and the entry point are inherited through FROM only.
    lineage = []
    name: str | None = target
    while name in stages:
        lineage.append(stages[name])
        name = stages[name].base
    user = next((s.user for s in lineage if s.user), None)
    uid = (user or "").split(":")[0]
    if not uid.isdigit() or int(uid) == 0:
        errors.append(f"target {target}: runs as {user!r}, not a numeric non-root user")
    entry = next((s.entry for s in lineage if s.entry), [])
    if not entry:
        errors.append(f"target {target}: no ENTRYPOINT or CMD")
    for e in entry:
        try:
            ok = isinstance(json.loads(e), list)
        except ValueError:
            ok = False
        if not ok:
            errors.append(f"target {target}: {e!r} is not in exec (JSON) form")
    return errors


def _check_installs(stages: dict[str, Stage]) -> list[str]:
    """Every `pip install` installs from the lock (or the project itself, without deps)."""
    errors: list[str] = []
    for stage in stages.values():
        for run in stage.runs:
            for cmd in re.split(r"&&|;", run):
                words = cmd.split()
                if "pip" not in words[:1] or "install" not in words:
                    continue
                locked = "--require-hashes" in words and "--no-deps" in words
                project = "--no-deps" in words and words[-1] == "."
                if not (locked or project):
                    errors.append(
                        f"stage {stage.name}: {cmd.strip()!r} installs outside the lock "
                        "(use --require-hashes --no-deps -r requirements/..., or --no-deps .)"
                    )
    return errors


def check_dockerignore(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    rules = [line for line in lines if not line.startswith("#")]
    reincluded = {line[1:] for line in rules if line.startswith("!")}
    errors = []
    if not rules or rules[0] != "*":
        errors.append(".dockerignore must start with '*' (an allowlist)")
    if reincluded != ALLOWED_CONTEXT:
        errors.append(
            f".dockerignore re-includes {sorted(reincluded)}, expected {sorted(ALLOWED_CONTEXT)}"
        )
    return errors


def main() -> int:
    errors = check_dockerignore((ROOT / ".dockerignore").read_text(encoding="utf-8"))
    errors += check_dockerfile((ROOT / "Dockerfile").read_text(encoding="utf-8"))
    for e in errors:
        print(f"FAIL {e}")
    print(f"image contents: {'FAILED' if errors else 'ok'} (targets {', '.join(TARGETS)})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
