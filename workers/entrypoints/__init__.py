"""The training's composition root: processes that wire the library (``rlhf_ops``) to the Ray worker groups.

``train`` is the Ray job driver (``python -m workers.entrypoints.train``; ``rlhf train`` runs it). Nothing
imports these modules; they import everything below them. The Airflow side's counterpart is
``rlhf_airflow.demo`` (``rlhf demo``). The layers are enforced by the import-linter contracts in
``pyproject.toml`` (see ``docs/decisions.md``).
"""
