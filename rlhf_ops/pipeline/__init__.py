"""Library functions behind the Airflow pipeline's tasks (``dags/``): one module per task role.

``layout`` (where a pipeline run keeps its files), ``params`` (the trigger form's values, validated, and the
config overrides they imply), ``data`` (prepare_data), ``preflight``, ``tracking`` (start/end of the MLflow
run), ``checkpoints`` (finding committed checkpoints and their eval reports), ``evaluate``, ``retention``
(final sync, keep-last-K + best) and ``register``. Every module imports without torch at module level, so
the DAG files and light tasks stay light.
"""
