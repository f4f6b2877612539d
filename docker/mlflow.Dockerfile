# syntax=docker/dockerfile:1
#
# MLflow tracking server of the compose stack: PostgreSQL backend store, artifacts proxied to S3 (MinIO).
# The server's release matches the client the platform pins (mlflow==3.17.2 in pyproject, mlflow-skinny==3.17.2
# in the images). psycopg2 for the postgresql+psycopg2:// store, boto3 for the s3:// artifact destination.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG MLFLOW_VERSION=3.17.2
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false

RUN pip install "mlflow==${MLFLOW_VERSION}" "psycopg2-binary==2.9.13" "boto3==1.43.117" \
    && useradd --create-home --uid 1000 mlflow

USER 1000
WORKDIR /home/mlflow
EXPOSE 5000
# The command (store URIs, allowed hosts, workers) comes from docker/compose.yaml.
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
