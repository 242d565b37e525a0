# syntax=docker/dockerfile:1
# One image for every acp-state process; the command picks the role (`api`, `worker`, ...).
#
#   docker build -t acp-state .                      the scripted test agent only (target `base`)
#   docker build --target qwen -t acp-state:qwen .   + Node.js 20 and Qwen Code 0.24.4, so a
#                                                     worker hosts a real agent (--agent-preset qwen)
#
# BASE_IMAGE: any Debian-like image with python3 (3.11+) and its venv module; the official
# Python image by default. scripts/compose-smoke builds from a local debootstrap of Debian
# instead (no image registry there). NODE_IMAGE: where the qwen target takes Node.js from.
ARG BASE_IMAGE=python:3.11-slim
ARG NODE_IMAGE=node:20-bookworm-slim

FROM ${BASE_IMAGE} AS base
WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements/test.lock requirements/
COPY acp_state ./acp_state
COPY api ./api
COPY worker ./worker
# In a venv of its own (a distribution's python3 refuses pip into the system, PEP 668), at
# the versions requirements/test.lock tested: its pins (not its test-only packages, and
# without the hashes, which pip takes only for a whole requirements file) constrain the install.
# With the `tracing` extra: OTEL_* variables turn traces on in a container (docs/tracing.md).
# Behind a TLS-intercepting proxy, hand the build its CA bundle as the secret `ca`
# (`--secret id=ca,src=/etc/ssl/certs/ca-certificates.crt`); nothing of it stays in the image.
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 -m venv /opt/acp-state \
 && grep -E '^[A-Za-z0-9].*==' requirements/test.lock | sed 's/ \\$//' > /tmp/constraints.txt \
 && /opt/acp-state/bin/pip install --no-cache-dir -c /tmp/constraints.txt '.[tracing]' \
 && rm -rf /tmp/constraints.txt /root/.cache
ENV PATH=/opt/acp-state/bin:$PATH
# Workspaces the agents work in are mounted here, and the agents' state (their history, what
# a resume or a drain's move loads) under /agent-state: see docs/deploy.md.
RUN mkdir -p /workspaces/demo /agent-state
# SIGTERM drains a worker (its sessions move to the others); give it the grace docs/deploy.md
# measures before the SIGKILL.
STOPSIGNAL SIGTERM
ENTRYPOINT ["acp-state"]

FROM ${NODE_IMAGE} AS node

# + Node.js and Qwen Code, installed at the version and integrity deploy/container/qwen's
# lockfile pins. Qwen's optional native parts (a pty, the clipboard, image resizing) are left
# out: an ACP child over stdio uses none of them. (`npm install` with the lock rather than
# `npm ci`: npm leaves the other platforms' builds of those optional parts out of a lock
# written on one platform, and `npm ci` then refuses the lock as out of sync.)
FROM base AS qwen
COPY --from=node /usr/local/bin/node /usr/local/bin/node
COPY --from=node /usr/local/lib/node_modules/npm /usr/local/lib/node_modules/npm
COPY deploy/container/qwen/package.json deploy/container/qwen/package-lock.json /opt/qwen/
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export NODE_EXTRA_CA_CERTS=/run/secrets/ca; fi \
 && ln -s ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm \
 && npm install --prefix /opt/qwen --omit=optional --no-audit --no-fund \
 && ln -s /opt/qwen/node_modules/.bin/qwen /usr/local/bin/qwen \
 && rm -rf /root/.npm \
 && qwen --version
