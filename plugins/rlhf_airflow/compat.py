"""The Airflow names the provider uses whose home moved between Airflow 3.1 and 3.3, imported from where the
running release has them, so one provider release works across ``rlhf_airflow.versions.SUPPORTED_AIRFLOW``.

* Task SDK exceptions: ``airflow.sdk.exceptions`` (3.2+) or ``airflow.exceptions`` (3.1), the classes that
  release's own code raises and catches.
* ``yaml`` and ``conf``: ``airflow.sdk`` (3.2+) or PyYAML / ``airflow.configuration`` (3.1).
* ``amask_secret`` (3.2+) or the synchronous ``mask_secret`` run in a thread (3.1), and a connection's extras
  read without blocking the event loop (``aextra_dejson`` appeared in 3.2).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from airflow.sdk.log import mask_secret

if TYPE_CHECKING:
    from airflow.sdk import Connection

try:  # Airflow 3.2+
    from airflow.sdk.exceptions import (
        AirflowException,
        AirflowFailException,
        AirflowNotFoundException,
        AirflowSkipException,
    )
except ImportError:  # Airflow 3.1
    from airflow.exceptions import (  # type: ignore[no-redef,attr-defined,unused-ignore]
        AirflowException,
        AirflowFailException,
        AirflowNotFoundException,
        AirflowSkipException,
    )

try:  # Airflow 3.2+
    from airflow.sdk import conf, yaml
except ImportError:  # Airflow 3.1
    import yaml  # type: ignore[no-redef,unused-ignore]
    from airflow.configuration import conf  # type: ignore[no-redef,attr-defined,assignment,unused-ignore]

__all__ = [
    "AirflowException",
    "AirflowFailException",
    "AirflowNotFoundException",
    "AirflowSkipException",
    "aextra_dejson",
    "amask_secret",
    "conf",
    "mask_secret",
    "yaml",
]


async def amask_secret(secret: Any, name: str | None = None) -> None:
    """Register ``secret`` with the secrets masker without blocking the event loop (the triggerer's)."""
    try:  # Airflow 3.2+
        from airflow.sdk.log import amask_secret as native
    except ImportError:  # Airflow 3.1: the synchronous call, off the loop
        await asyncio.to_thread(mask_secret, secret, name)
    else:
        await native(secret, name)


async def aextra_dejson(conn: Connection) -> dict[str, Any]:
    """``conn``'s extras as a dict, read without blocking the event loop where the release can."""
    if hasattr(conn, "aextra_dejson"):  # Airflow 3.2+
        return dict(await conn.aextra_dejson())
    return dict(conn.extra_dejson)
