# One image for every acp-state process; the command picks the role.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY acp_state ./acp_state
COPY api ./api
COPY worker ./worker
RUN pip install --no-cache-dir .
# Workspaces the agents work in are mounted here.
RUN mkdir -p /workspaces/demo
STOPSIGNAL SIGTERM
ENTRYPOINT ["acp-state"]
