# sbgate images. Two targets, both non-root with exec-form entry points:
#
#   docker build -t sbgate:0.1.0 .                             # target "gateway" (the default)
#   docker build --target audit -t sbgate-audit:0.1.0 .        # JRE 17 + pyspark: `gateway audit`
#
#   docker run --rm -p 8080:8080 -e SBGATE_PRIMARY_CONNECTION_STRING=... sbgate:0.1.0
#   docker run --rm -v "$PWD:/audit" sbgate-audit:0.1.0 --ledger ledger/ --delivered d.jsonl --out out/
#
# Dependencies come from the lock, with hash checking: requirements/*.txt are exported from
# uv.lock (scripts/lock.sh), so the same sources give the same packages on every build. The
# wheel is built with the locked build backend (requirements/build.txt), without build isolation
# (which would fetch an unpinned setuptools). The local broker (sblocal) and its dev
# certificates, the tests, benchmarks and load tests never enter the build context
# (.dockerignore is an allowlist); the Spark pipeline enters only the audit image.
#
# Every stage uses the same Python base, so the venv's interpreter path
# (/usr/local/bin/python3.11) exists in the runtime stages too.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
# Eclipse Temurin's JRE, copied into the Debian-based Python image (the pattern Adoptium
# documents for other base images): no apt repositories at build time.
ARG JRE_IMAGE=eclipse-temurin:17-jre-jammy


FROM ${PYTHON_IMAGE} AS venv

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

WORKDIR /src

# The build backend (setuptools), locked with hashes.
COPY requirements/build.txt requirements/
RUN pip install --require-hashes --no-deps --requirement requirements/build.txt


# The gateway's venv. Dependencies first, from the lock alone: this layer is rebuilt only when
# the lock changes, not on every source edit.
FROM venv AS build-gateway

COPY requirements/gateway.txt requirements/
RUN pip install --require-hashes --no-deps --requirement requirements/gateway.txt

# Then the source, only the gateway package; --no-deps: everything is already installed. The
# project also declares the local broker's console script, which cannot run here: drop it.
COPY pyproject.toml README.md LICENSE ./
COPY sbamqp/ ./sbamqp/
COPY gateway/ ./gateway/
RUN pip install --no-deps --no-build-isolation . \
    && pip uninstall --yes setuptools \
    && pip check \
    && rm -f /opt/venv/bin/sblocal


# The audit's venv: the gateway's runtime dependencies plus pyspark and matplotlib, and the
# pipeline package next to the gateway (whose CLI runs it: `gateway audit`).
FROM venv AS build-audit

COPY requirements/audit.txt requirements/
RUN pip install --require-hashes --no-deps --requirement requirements/audit.txt

COPY pyproject.toml README.md LICENSE ./
COPY sbamqp/ ./sbamqp/
COPY gateway/ ./gateway/
COPY pipeline/ ./pipeline/
RUN pip install --no-deps --no-build-isolation . \
    && pip uninstall --yes setuptools \
    && pip check \
    && rm -f /opt/venv/bin/sblocal


FROM ${JRE_IMAGE} AS jre


# What both images share: the base, the app user, the environment.
FROM ${PYTHON_IMAGE} AS runtime

# Keep in step with pyproject.toml's version (and the chart's appVersion).
ARG SBGATE_VERSION=0.1.0

LABEL org.opencontainers.image.version="${SBGATE_VERSION}" \
      org.opencontainers.image.licenses="MIT"

# A fixed numeric UID/GID, so Kubernetes can check runAsNonRoot without a passwd lookup.
RUN groupadd --system --gid 10001 sbgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin sbgate

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1


FROM runtime AS audit

LABEL org.opencontainers.image.title="sbgate-audit" \
      org.opencontainers.image.description="sbgate's Spark audit: proves that no acknowledged message was lost"

# matplotlib caches fonts in its config directory: /tmp, since the root filesystem is read-only.
ENV JAVA_HOME=/opt/java/openjdk \
    MPLCONFIGDIR=/tmp/matplotlib
ENV PATH=${JAVA_HOME}/bin:$PATH

# Owned by root and read-only to the app user, like the gateway's venv.
COPY --from=jre /opt/java/openjdk /opt/java/openjdk
COPY --from=build-audit /opt/venv /opt/venv

# Inputs and outputs are relative to /audit (mount a volume there); Spark's scratch space is
# /tmp (an emptyDir under Kubernetes' read-only root filesystem).
WORKDIR /audit
USER 10001:10001

# Exec form: `docker run sbgate-audit:0.1.0 --ledger … --delivered … --out …`. Without
# arguments it prints its usage.
ENTRYPOINT ["gateway", "audit"]
CMD ["--help"]


# Last, so that a plain `docker build .` builds the gateway image.
FROM runtime AS gateway

LABEL org.opencontainers.image.title="sbgate" \
      org.opencontainers.image.description="HTTP ingestion gateway for Azure Service Bus with paired-namespace failover"

# Owned by root and read-only to the app user: the container runs with a read-only root
# filesystem, and bytecode was compiled at install time.
COPY --from=build-gateway /opt/venv /opt/venv

ENV SBGATE_LISTEN_HOST=0.0.0.0 \
    SBGATE_LISTEN_PORT=8080

USER 10001:10001
EXPOSE 8080

# No curl in slim images: the interpreter does the probe. Kubernetes ignores HEALTHCHECK and
# uses the chart's probes (/healthz liveness, /readyz readiness) instead.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('SBGATE_LISTEN_PORT', '8080'), timeout=4)"]

# Exec form: the gateway is PID 1 and receives SIGTERM itself (graceful drain and shutdown).
# `gateway syphon` runs the syphon worker pool alone; `gateway token` mints a SAS token.
CMD ["gateway", "serve"]
