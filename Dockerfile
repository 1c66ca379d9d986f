# sbgate: the HTTP gateway only. The local broker (sblocal) and its dev certificates, the tests,
# benchmarks, load tests and the Spark pipeline never enter the image: .dockerignore admits only
# pyproject.toml, README.md and gateway/, and the build installs nothing else.
#
#   docker build -t sbgate:0.1.0 .
#   docker run --rm -p 8080:8080 -e SBGATE_PRIMARY_CONNECTION_STRING=... sbgate:0.1.0
#
# Both stages use the same base, so the venv's interpreter path (/usr/local/bin/python3.11)
# exists in the runtime stage too.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

# Optional extras installed with the gateway; "fast" brings uvloop. Empty for none.
ARG SBGATE_EXTRAS=fast

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

WORKDIR /src

# Dependencies first, from pyproject.toml alone: this layer is rebuilt only when the
# dependency list changes, not on every source edit.
COPY pyproject.toml ./
RUN python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = sys.argv[1].replace(',', ' ').split(); reqs = p['dependencies'] + [r for e in extras for r in p['optional-dependencies'][e]]; print('\n'.join(reqs))" "$SBGATE_EXTRAS" > /tmp/requirements.txt \
    && pip install --requirement /tmp/requirements.txt

# Then the source: only the gateway package (setuptools' find would also pick up sblocal and
# pipeline if they were here; they are not). --no-deps: everything is already installed.
# The project also declares the local broker's console script, which cannot run here: drop it.
COPY README.md ./
COPY gateway/ ./gateway/
RUN pip install --no-deps . \
    && pip check \
    && rm -f /opt/venv/bin/sblocal


FROM ${PYTHON_IMAGE} AS runtime

# Keep in step with pyproject.toml's version (and the chart's appVersion).
ARG SBGATE_VERSION=0.1.0

LABEL org.opencontainers.image.title="sbgate" \
      org.opencontainers.image.description="HTTP ingestion gateway for Azure Service Bus with paired-namespace failover" \
      org.opencontainers.image.version="${SBGATE_VERSION}" \
      org.opencontainers.image.licenses="MIT"

# A fixed numeric UID/GID, so Kubernetes can check runAsNonRoot without a passwd lookup.
RUN groupadd --system --gid 10001 sbgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin sbgate

# Owned by root and read-only to the app user: the container runs with a read-only root
# filesystem, and bytecode was compiled at install time.
COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SBGATE_LISTEN_HOST=0.0.0.0 \
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
