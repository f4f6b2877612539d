"""Shared building blocks of the RLHF pipeline DAGs (not DAG files: ``.airflowignore`` skips this folder).

Airflow puts the DAGs folder on ``sys.path`` when it parses it, so DAG files import ``rlhf_pipeline.factory``.
Parse-time imports here are ``airflow.sdk``, ``pendulum`` and the ``rlhf_airflow`` plugin only.
"""
