#!/usr/bin/env bash
# Build the wheel and rehearse the Dockerfile's install steps without a Docker engine
# (`make wheel`, part of `make test`):
#
# 1. the wheel, from the whole tree, into dist/ with the locked build backend and without
#    build isolation, as the image does: a broken build configuration fails here;
# 2. the gateway image's venv, in a throw-away venv: the locked runtime dependencies with hash
#    checking, then the project from a copy holding only what the gateway target copies
#    (pyproject.toml, README.md, LICENSE, sbamqp/, gateway/), --no-deps, and `pip check`;
# 3. in that venv, `gateway audit` (no pyspark, no pipeline: the gateway image) must exit 2
#    with a one-line hint, and `gateway --help` must work;
# 4. the audit image's lock must resolve with hash checking (pip --dry-run; the ~450 MB
#    pyspark wheel is not installed a second time).
#
# Needs PyPI (or pip's cache) for the locked packages. A few seconds to a minute.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
DIST=${DIST:-dist}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venv=$work/venv
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input -q)

"$PY" -m venv "$venv"
log=$work/pip.log
run() {
    if ! "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" | tail -20
        echo "build-check: FAILED: $*" >&2
        exit 1
    fi
}

echo "== locked build backend and gateway dependencies (--require-hashes)"
run "${pip[@]}" install --require-hashes --no-deps -r requirements/build.txt
run "${pip[@]}" install --require-hashes --no-deps -r requirements/gateway.txt

echo "== wheel"
# From a copy of the sources: setuptools builds in the source tree (build/, *.egg-info).
tree=$work/tree
mkdir -p "$tree" "$DIST"
cp -r pyproject.toml README.md LICENSE gateway sbamqp sblocal pipeline "$tree/"
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$DIST"/sbgate-*.whl
run "${pip[@]}" wheel --no-deps --no-build-isolation -w "$DIST" "$tree"
wheel=$(ls "$DIST"/sbgate-*.whl)
"$venv/bin/python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [
    want
    for want in ("gateway/cli.py", "pipeline/job.py", "sblocal/__main__.py", "sbamqp/engine.py")
    if want not in names
]
licenses = [n for n in names if n.endswith("/licenses/LICENSE")]
meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
text = zipfile.ZipFile(sys.argv[1]).read(meta).decode()
if missing or not licenses or "License-Expression: MIT" not in text:
    sys.exit(f"wheel {sys.argv[1]}: missing {missing}, LICENSE {licenses}, MIT expression")
print(f"wheel: {sys.argv[1]} ({len(names)} files, License-Expression: MIT)")
PY

echo "== the gateway image's install"
src=$work/src
mkdir -p "$src"
cp -r pyproject.toml README.md LICENSE sbamqp gateway "$src/"
run "${pip[@]}" install --no-deps --no-build-isolation "$src"
run "${pip[@]}" uninstall --yes setuptools
run "${pip[@]}" check
"$venv/bin/gateway" --help >/dev/null
set +e
"$venv/bin/gateway" audit --ledger l --delivered d --out o >"$work/out" 2>"$work/err"
code=$?
set -e
lines=$(wc -l <"$work/err")
if [[ $code -ne 2 || $lines -ne 1 ]] || ! grep -q "docker build --target audit" "$work/err"; then
    echo "FAIL gateway audit in the gateway image: exit $code, $lines line(s) on stderr:" >&2
    cat "$work/err" >&2
    exit 1
fi
echo "gateway audit without pyspark: exit 2, $(cat "$work/err")"

echo "== the audit image's lock resolves (--require-hashes, dry run)"
run "${pip[@]}" install --dry-run --require-hashes --no-deps -r requirements/audit.txt
echo "build-check: ok"
