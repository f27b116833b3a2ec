# The cchatq image: every Python service of compose.yaml (workers, Flower, the replay server)
# runs it with its own `command`. The package is built into a wheel and installed (not
# editable), so the running image holds no source tree and no build tools; it runs as an
# unprivileged user.
#
#   docker build -t cchatq:local .     (or: docker compose build)

FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY --from=build /wheels /wheels
# with the otel extra: a compose fleet sends spans once .env sets OTEL_EXPORTER_OTLP_ENDPOINT
RUN pip install "$(echo /wheels/*.whl)[otel]" && rm -rf /wheels
# A home for the compiled-module cache (CCHATQ_MODULE_CACHE_DIR: ~/.cache/cchatq/modules),
# /app, the services' working directory, and /var/lib/flower, Flower's task history (a named
# volume starts as the image's folder, so it is the user's own too).
RUN useradd --create-home --uid 10001 --user-group cchatq \
    && install -d -o cchatq -g cchatq /app /var/lib/flower
USER cchatq
WORKDIR /app
CMD ["cchatq", "--help"]
