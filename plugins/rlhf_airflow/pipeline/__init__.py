"""The provider's DAG factory: the RLHF pipeline's tasks, its trigger form, specs and approval gate.

DAG files stay thin (``dags/rlhf_ppo.py``, ``dags/generated_pipelines.py``): they import
``rlhf_airflow.pipeline.factory`` or ``rlhf_airflow.pipeline.specs`` from the installed provider. Parse-time
imports here are ``airflow.sdk``, ``pendulum`` and the provider's own modules only: no torch.
"""
