"""The RLHF platform's Airflow provider (``airflow-provider-rlhf``): the Ray job hook, the deferrable operator and
its trigger, the extra links, the pools and the pipeline's DAG factory (``rlhf_airflow.pipeline``).

Importing the package checks that it sits next to a supported Airflow and the library release it was built with
(``rlhf_airflow.versions``): a mismatch stops here with one line naming both versions and the fix.
"""

from __future__ import annotations

from rlhf_airflow.versions import check_installation

check_installation()
