"""Plugins-folder entry of the RLHF plugin, for a source checkout that runs without the installed provider.

An installed ``airflow-provider-rlhf`` registers ``rlhf_airflow.plugin.RlhfPlugin`` through its provider info;
this module then defines no plugin, so Airflow never sees it twice.
"""

from __future__ import annotations

from rlhf_airflow.versions import PROVIDER_DISTRIBUTION, installed

if installed(PROVIDER_DISTRIBUTION) is None:
    from rlhf_airflow.plugin import RlhfPlugin

    __all__ = ["RlhfPlugin"]
