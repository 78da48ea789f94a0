# The extproc image: the admission controller (`extproc serve`) and the simulated backend
# (`extproc sim backend`) from one package.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc ./extproc
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels extproc && rm -rf /wheels
COPY examples /etc/extproc/examples
COPY examples/policy.yaml /etc/extproc/policy.yaml
# Non-root, and nothing written at run time: runs with a read-only root filesystem.
USER 65532:65532
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
EXPOSE 50051 9090
ENTRYPOINT ["extproc"]
CMD ["serve", "--policy", "/etc/extproc/policy.yaml", "--grpc", "0.0.0.0:50051", "--http", "0.0.0.0:9090"]
