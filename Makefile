# sbgate — the two commands a newcomer needs: `make run` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev
# pytest's temporary directories live in the checkout, not in the shared /tmp/pytest-of-$USER:
# another checkout's test run (a second worktree) keeps only its last three sessions there
# and could remove a long run's directories under it.
export PYTEST_DEBUG_TEMPROOT ?= $(CURDIR)/.pytest-tmp
# Python's bytecode caches are kept (some environments set PYTHONDONTWRITEBYTECODE=1): without
# them every test run, and every broker or gateway process a test starts, compiles every
# module from source again, and pytest rewrites every test module's asserts again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test venv sysdeps node-deps lint typecheck pytest packaging broker bench fuzz load chaos \
	clean tools lock lock-check wheel pipeline-dist chart-readme bench-tools

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

venv: $(STAMP)

# Tests start real redis-server processes on free ports, the audit pipeline runs real
# Spark (pyspark 4 needs Java 17+), the chart's alerts are evaluated by Prometheus' promtool
# (Debian's prometheus package), its README's tables written by a Node.js tool (npm installs
# it), the Node.js SDK tier needs npm, and the benches' native load generators (h2load, wrk)
# have a test of their own: install what is missing.
sysdeps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	command -v h2load >/dev/null || missing="$$missing nghttp2-client"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v cc >/dev/null || missing="$$missing gcc"; \
	{ command -v java >/dev/null && java -version 2>&1 | grep -qE 'version "(1[7-9]|[2-9][0-9])'; } \
	  || missing="$$missing openjdk-17-jre-headless"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

## node-deps: the Node.js Service Bus SDK the compatibility tests drive (tests/compat/node:
## exactly what its package-lock.json pins, integrity-checked; no install scripts run)
NODE_DEPS := tests/compat/node/node_modules/.installed
$(NODE_DEPS): tests/compat/node/package-lock.json | sysdeps
	cd tests/compat/node && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $(NODE_DEPS)

node-deps: $(NODE_DEPS)

## run: the gateway on 127.0.0.1:8080 with its embedded default (local broker pair, no Redis),
## in the development profile (`gateway serve --dev`: pings every 5 s, no drain delay, text
## logs, the demo keys; any SBGATE_* variable you set wins). The banner also goes to
## .run/banner.txt.
run: $(STAMP)
	$(BIN)/gateway serve --dev --banner-file .run/banner.txt

## broker: the local Service Bus-compatible broker alone (two namespaces)
broker: $(STAMP)
	$(BIN)/python -m sblocal

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

## packaging: the lock, hadolint on both Dockerfile targets, and tests/packaging: Helm's own
## lint, renders of the chart for several value sets validated against Kubernetes' schemas, the
## alerts and the dashboard, the chart README's tables against values.yaml
packaging: $(STAMP) sysdeps
	scripts/lint-packaging.sh

## tools: the packaging tools (.venv-tools: hadolint, Helm's library, uv, kubernetes-validate;
## .tools: bitnami's readme-generator-for-helm, which needs Node.js 18+ and npm)
tools:
	scripts/lint-packaging.sh --install-only

## chart-render: print the chart's manifests for a values file, without a cluster
## (VALUES=my-values.yaml; without it the chart's defaults, which name what is missing), by Helm's own library
## (scripts/helm_render.py, the chart tests' renderer) for Kubernetes $(KUBE_VERSION)
KUBE_VERSION ?= 1.31.0
.PHONY: chart-render
chart-render: tools
	.venv-tools/bin/python scripts/helm_render.py template --kube-version $(KUBE_VERSION) $(if $(VALUES),--values $(VALUES))

## chart-readme: rewrite helm/sbgate/README.md's parameter tables from values.yaml's `## @param` lines
chart-readme: tools
	.tools/node_modules/.bin/readme-generator --values helm/sbgate/values.yaml --readme helm/sbgate/README.md

## lock: re-resolve uv.lock and requirements/*.txt after editing pyproject.toml's dependencies
lock: tools
	scripts/lock.sh

## lock-check: fail if uv.lock no longer matches pyproject.toml (offline; part of packaging)
lock-check: tools
	scripts/lock.sh --check

## wheel: build dist/sbgate-*.whl and rehearse the Dockerfile's locked installs in a throw-away venv
wheel:
	scripts/build-check.sh

## pipeline-dist: dist/sbgate-pipeline.zip, the audit's --py-files archive for spark-submit
pipeline-dist:
	$(PY) scripts/pipeline_dist.py

## pytest: every test but tests/packaging, which `make packaging` runs
pytest: $(STAMP) sysdeps node-deps $(BIN)/sbload
	mkdir -p $(PYTEST_DEBUG_TEMPROOT)
	$(BIN)/pytest -q --durations=15 --ignore=tests/packaging

## test-fast: unit tests and the fast integration tests, not the `slow` ones (gateway end to
## end, Spark, chaos, fuzzing, fault waits), in four pytest-xdist workers (the tests mostly
## wait on sockets and processes, so four share two cores well): about a minute, for the
## edit-test loop. `make test` runs all, in one process.
.PHONY: test-fast
test-fast: $(STAMP) sysdeps node-deps
	mkdir -p $(PYTEST_DEBUG_TEMPROOT)
	$(BIN)/pytest -q -m "not slow" -n 4 --dist worksteal

## test: everything CI runs, from a fresh clone
test: sysdeps $(STAMP) lint typecheck packaging wheel pipeline-dist pytest

## fuzz: the REST parser, then the AMQP decoders and engine (sbamqp), under atheris for 10 minutes
## each (make test runs each for 20 s)
fuzz: $(STAMP)
	mkdir -p .fuzz .fuzz-amqp
	$(BIN)/python fuzz/fuzz_rest.py -max_total_time=$${FUZZ_SECONDS:-600} -dict=fuzz/rest.dict -artifact_prefix=.fuzz/ .fuzz fuzz/corpus/rest
	$(BIN)/python fuzz/fuzz_amqp.py -max_total_time=$${FUZZ_SECONDS:-600} -dict=fuzz/amqp.dict -artifact_prefix=.fuzz-amqp/ .fuzz-amqp fuzz/corpus/amqp

## load: a bounded headless Locust run against a fresh local stack (LOAD_ARGS to change it)
load: $(STAMP) sysdeps
	$(BIN)/python -m loadtests load $${LOAD_ARGS:---users 32 --time 30s --replicas 2}

## chaos: every fault scenario against 2 replicas, with the checker (~13 min)
chaos: $(STAMP) sysdeps
	$(BIN)/python -m loadtests chaos

## bench-tools: the native load generators the HTTP benchmarks drive load with (h2load from
## Debian's nghttp2-client, and wrk), and valgrind for the instruction counts
## (`bench.gateway_profile --instructions`), with apt if missing: a Python generator on the CPU
## it shares with the broker was the bottleneck it was meant to measure.
bench-tools:
	@missing=""; \
	command -v h2load >/dev/null || missing="$$missing nghttp2-client"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v taskset >/dev/null || missing="$$missing util-linux"; \
	command -v cc >/dev/null || missing="$$missing gcc"; \
	command -v valgrind >/dev/null || missing="$$missing valgrind"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@$(MAKE) --no-print-directory $(BIN)/sbload

## sbload: the open-loop generator whose clients reconnect one by one (bench/sbload.c)
$(BIN)/sbload: bench/sbload.c
	mkdir -p $(BIN)
	cc -O2 -Wall -Wextra -Werror -o $@ bench/sbload.c

## bench: benchmarks that print ratios measured in one run
bench: $(STAMP) bench-tools node-deps
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) tests/compat/node/node_modules .pytest-tmp .pytest_cache .mypy_cache .ruff_cache *.egg-info .run out .fuzz .fuzz-amqp dist
