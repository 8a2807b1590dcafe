# The batchtune image: the operator, the builtin load generator and the twin (simulated vLLM) in one.
#   docker build -t ghcr.io/batchtune/batchtune:0.1.0 .
# Runs as a non-root user on a read-only root filesystem: every runtime write goes to /tmp
# (the chart mounts an emptyDir there).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
LABEL org.opencontainers.image.source="https://github.com/batchtune/batchtune" \
      org.opencontainers.image.description="batchtune: tunes vLLM batching against latency SLOs" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /install /usr/local
# Byte-compiled at build time and never at run time: site-packages stays read-only.
RUN python -m compileall -q /usr/local/lib/python3.11/site-packages/batchtune \
    && groupadd --gid 65532 batchtune \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin batchtune
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/.cache
USER 65532:65532
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["batchtune"]
CMD ["operator"]
