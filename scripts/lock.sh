#!/usr/bin/env bash
# The lock: uv.lock (every dependency of pyproject.toml, with hashes) and the requirement files
# exported from it that the Dockerfile installs with `pip install --require-hashes --no-deps`:
#
#   requirements/gateway.txt   the gateway image: runtime dependencies + the "fast" and "otel" extras
#   requirements/audit.txt     the audit image: runtime dependencies + the "spark" extra
#   requirements/build.txt     the build backend (the "build" dependency group: setuptools)
#
#   scripts/lock.sh            re-resolve after editing pyproject.toml (`make lock`; needs PyPI)
#   scripts/lock.sh --check    fail if the lock no longer matches pyproject.toml (`make test`)
#
# --check never re-resolves and never goes to the network: `uv lock --check --offline` validates
# uv.lock against pyproject.toml with the metadata stored in uv.lock itself, so it gives the same
# answer on a fresh clone with an empty cache, today or next year (a new release on PyPI does not
# make it fail; only a change to pyproject.toml does). The exports are then regenerated from
# uv.lock alone (--frozen) and compared with the committed files.
set -euo pipefail
cd "$(dirname "$0")/.."

UV=${UV:-.venv-tools/bin/uv}
export UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
if [[ ! -x $UV ]]; then
    echo "lock: $UV is missing; scripts/lint-packaging.sh installs it into .venv-tools" >&2
    exit 1
fi

HEADER="# Generated from uv.lock by scripts/lock.sh (make lock); do not edit.
# The Dockerfile installs it with: pip install --require-hashes --no-deps -r <this file>"
declare -A EXPORTS=(
    [gateway]="--no-dev --extra fast --extra otel"
    [audit]="--no-dev --extra spark"
    [build]="--only-group build"
)

export_one() {
    # shellcheck disable=SC2086  # the option list is split on purpose
    printf '%s\n' "$HEADER" && "$UV" export --quiet --frozen --no-header --no-emit-project \
        --format requirements-txt ${EXPORTS[$1]}
}

# The build group must name what build-system.requires names, or the image would build the
# wheel with another backend than the one pip's isolated builds (and `make wheel`) use.
check_build_group() {
    "${PY:-python3}" - <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
requires = sorted(p["build-system"]["requires"])
group = sorted(p["dependency-groups"]["build"])
if requires != group:
    sys.exit(f"pyproject.toml: [dependency-groups] build {group} != build-system.requires {requires}")
PY
}

if [[ ${1:-} == --check ]]; then
    check_build_group
    if ! "$UV" lock --check --offline --quiet 2>/dev/null; then
        echo "FAIL uv.lock does not match pyproject.toml: run 'make lock' and commit uv.lock and requirements/" >&2
        exit 1
    fi
    status=0
    for name in "${!EXPORTS[@]}"; do
        if ! diff -u "requirements/$name.txt" <(export_one "$name") >/dev/null; then
            echo "FAIL requirements/$name.txt is not what uv.lock exports: run 'make lock'" >&2
            status=1
        fi
    done
    [[ $status -eq 0 ]] && echo "lock: ok (uv.lock matches pyproject.toml; requirements/ match uv.lock)"
    exit $status
fi

check_build_group
"$UV" lock
for name in "${!EXPORTS[@]}"; do
    export_one "$name" >"requirements/$name.txt"
    echo "lock: wrote requirements/$name.txt ($(grep -c '==' "requirements/$name.txt") packages)"
done
