"""The composition root: the processes that wire the library to ``workers/`` and Airflow.

``train`` (the Ray job driver, ``python -m rlhf_ops.entrypoints.train``), ``demo`` (``rlhf demo``: Airflow,
Ray and MLflow on this machine) and ``local_stack`` (the demo's and the tests' Ray head and MLflow server),
with ``rlhf_ops.cli`` beside them. Nothing imports these modules; they import everything. The layers are
enforced by the import-linter contracts in ``pyproject.toml`` (see ``docs/decisions.md``).
"""
