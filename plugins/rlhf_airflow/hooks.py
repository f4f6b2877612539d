"""Thin Airflow hook around Ray's Job Submission REST API, plus connection → job-env helpers.

The hook speaks to the Ray dashboard's job server (``http(s)://host:8265``) through
``ray.job_submission.JobSubmissionClient``. It never imports torch or anything heavy.

Connection (``conn_type="ray"``):
    host/port/schema: the Ray dashboard, e.g. host ``127.0.0.1``, port ``8265`` (schema ``https`` for TLS; ``http``
    by default). A host that already holds a scheme (``http://ray-head``) is used as is.
    password: optional Ray auth token (Ray >= 2.5x enables token auth by default); sent as
    ``Authorization: Bearer <token>`` unless ``extra.headers`` already has an ``Authorization`` header.
    extra: ``{"headers": {...}, "verify": true | false | "/path/ca.pem"}``.

Idempotent submission (:meth:`RayJobHook.submit`): the caller passes a deterministic ``submission_id``.
If a job with that id is PENDING/RUNNING the hook re-attaches (returns the id, submits nothing); if it
SUCCEEDED the id is returned as is (the watcher then completes at once). If it FAILED or was STOPPED the
hook walks ``<id>-retry1``, ``<id>-retry2``… and re-attaches to / returns the first live or successful one,
or submits the first free one with ``RLHF_RESUME_MODE=auto`` (and ``RLHF_RETRY_INDEX=<n>``) in the job's
env, so the entrypoint resumes from its newest complete checkpoint instead of starting over.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from airflow.sdk import BaseHook

from rlhf_airflow.compat import AirflowNotFoundException, aextra_dejson, amask_secret, mask_secret

if TYPE_CHECKING:
    from airflow.sdk import Connection
    from ray.job_submission import JobDetails, JobSubmissionClient

# Ray job states, as strings (ray.job_submission.JobStatus is a str Enum with these values).
ACTIVE_STATES = frozenset({"PENDING", "RUNNING"})
RESUME_ENV_VAR = "RLHF_RESUME_MODE"
RETRY_INDEX_ENV_VAR = "RLHF_RETRY_INDEX"
_MAX_RETRY_SUFFIX = 1000


def normalize_dashboard_address(address: str, *, field: str = "ray_address") -> str:
    """Return ``address`` as ``scheme://host[:port]`` without a trailing slash.

    Args:
        address: Ray dashboard / job server URL (``http://127.0.0.1:8265``) or a bare ``host:port``.
        field: Name of the argument, used in error messages.

    Raises:
        ValueError: ``address`` is empty or uses a non-HTTP scheme (``ray://`` is the Ray Client port, not the
            job server).
    """
    address = (address or "").strip()
    if not address:
        raise ValueError(f"{field} is empty; set it to the Ray dashboard URL, e.g. http://127.0.0.1:8265")
    if "://" not in address:
        address = f"http://{address}"
    scheme = urlsplit(address).scheme
    if scheme not in ("http", "https"):
        raise ValueError(
            f"{field}={address!r} uses scheme {scheme!r}; the job API lives on the dashboard, "
            "so give its http(s) URL, e.g. http://127.0.0.1:8265"
        )
    return address.rstrip("/")


def _address_from_connection(conn: Connection) -> str:
    if not conn.host:
        raise ValueError(
            f"Airflow connection {conn.conn_id!r} has no host; set host to the Ray dashboard (e.g. 127.0.0.1) "
            "and port to its port (8265)"
        )
    host = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
    if conn.port and urlsplit(host).port is None:
        host = f"{host.rstrip('/')}:{conn.port}"
    return normalize_dashboard_address(host, field=f"connection {conn.conn_id!r} host")


def _parse_headers(raw: Any, *, conn_id: str) -> dict[str, str]:
    if raw in (None, ""):
        return {}
    if isinstance(raw, str):
        raw = json.loads(raw)
    if not isinstance(raw, Mapping):
        raise ValueError(f"connection {conn_id!r} extra 'headers' must be a JSON object, got {type(raw).__name__}")
    return {str(k): str(v) for k, v in raw.items()}


def _parse_verify(raw: Any) -> bool | str:
    # Absent or left empty (Airflow 3.1 without FAB shows the field without its default): verify TLS.
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return True
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false", "1", "0"):
        return raw.strip().lower() in ("true", "1")
    return raw if isinstance(raw, str) else bool(raw)


class RayJobHook(BaseHook):
    """Submit, watch and stop Ray jobs through the dashboard's job server.

    Args:
        ray_conn_id: Airflow connection of type ``ray`` (see the module docstring).
        address: Optional override of the dashboard URL (e.g. a DAG param ``ray_address``). When given, the
            connection is still read for headers / verify / token if it exists, but need not exist.
    """

    conn_name_attr = "ray_conn_id"
    default_conn_name = "ray_default"
    conn_type = "ray"
    hook_name = "Ray Jobs"

    def __init__(self, ray_conn_id: str = default_conn_name, *, address: str | None = None) -> None:
        super().__init__()
        self.ray_conn_id = ray_conn_id
        self.address_override = address
        self._config: tuple[str, dict[str, str], bool | str] | None = None
        self._client: JobSubmissionClient | None = None

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """The connection form's extra fields, for Airflow 3.1 (3.2+ reads them from the provider info)."""
        from rlhf_airflow.connection_form import form_widgets

        return form_widgets()

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """Hidden fields, labels and placeholders of the form, for Airflow 3.1 (3.2+: the provider info)."""
        from rlhf_airflow.connection_form import field_behaviour

        return field_behaviour()

    def test_connection(self) -> tuple[bool, str]:
        """The connection form's *Test* button: the job server's version endpoint answers, with a supported Ray."""
        from rlhf_airflow.connection_form import probe_job_server

        try:
            address, headers, verify = self.client_config()
        except (ValueError, AirflowNotFoundException) as exc:
            return False, str(exc)
        return probe_job_server(address, headers, verify)

    def client_config(self) -> tuple[str, dict[str, str], bool | str]:
        """Resolve ``(dashboard_address, headers, verify)`` from the override and the connection (cached)."""
        if self._config is None:
            try:
                conn: Connection | None = self.get_connection(self.ray_conn_id)
            except AirflowNotFoundException:
                if not self.address_override:
                    raise
                conn = None
            if conn is not None and conn.password:
                mask_secret(conn.password)
            self._config = self._resolve(conn, conn.extra_dejson if conn is not None else {})
        return self._config

    async def aclient_config(self) -> tuple[str, dict[str, str], bool | str]:
        """``client_config`` for async callers (the triggerer): the connection is read without blocking the loop.

        The trigger calls this instead of carrying the headers in its kwargs, which Airflow stores in its metadata
        DB: the token then lives only in the connection (its secrets backend) and in the triggerer's memory.
        """
        if self._config is None:
            try:
                conn: Connection | None = await self.aget_connection(self.ray_conn_id)
            except AirflowNotFoundException:
                if not self.address_override:
                    raise
                conn = None
            if conn is not None and conn.password:
                await amask_secret(conn.password)  # the sync call would block the triggerer's loop on the supervisor
            self._config = self._resolve(conn, await aextra_dejson(conn) if conn is not None else {})
        return self._config

    def _resolve(self, conn: Connection | None, extra: Mapping[str, Any]) -> tuple[str, dict[str, str], bool | str]:
        headers: dict[str, str] = {}
        verify: bool | str = True
        if conn is not None:
            headers = _parse_headers(extra.get("headers"), conn_id=self.ray_conn_id)
            verify = _parse_verify(extra.get("verify"))
            if conn.password and not any(k.lower() == "authorization" for k in headers):
                headers["Authorization"] = f"Bearer {conn.password}"
        if self.address_override:
            address = normalize_dashboard_address(self.address_override)
        else:
            assert conn is not None  # the lookup re-raises when there is no override
            address = _address_from_connection(conn)
        return address, headers, verify

    @property
    def dashboard_address(self) -> str:
        """The job server / dashboard base URL, e.g. ``http://127.0.0.1:8265``."""
        return self.client_config()[0]

    def get_conn(self) -> JobSubmissionClient:
        """Return a cached ``JobSubmissionClient`` (its constructor checks the server version over HTTP)."""
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            address, headers, verify = self.client_config()
            self._client = JobSubmissionClient(address, headers=headers or None, verify=verify)
        return self._client

    def job_url(self, submission_id: str) -> str:
        """Dashboard page of one job."""
        from rlhf_airflow.links import ray_job_url

        return ray_job_url(self.dashboard_address, submission_id)

    def status(self, submission_id: str) -> str:
        """Ray job status as a string: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        return str(self.get_conn().get_job_status(submission_id))

    def info(self, submission_id: str) -> JobDetails:
        """Full ``JobDetails`` (status, message, start/end time, metadata…)."""
        return self.get_conn().get_job_info(submission_id)

    def logs(self, submission_id: str) -> str:
        """Whole driver log of the job so far."""
        return self.get_conn().get_job_logs(submission_id)

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the job (SIGTERM, then SIGKILL); True if it was still running."""
        return bool(self.get_conn().stop_job(submission_id))

    def find_status(self, submission_id: str) -> str | None:
        """Status of ``submission_id``, or None when the cluster has no such job."""
        try:
            return self.status(submission_id)
        except RuntimeError as err:  # the SDK raises RuntimeError("Request failed with status code 404: ...")
            if "404" in str(err) or "does not exist" in str(err):
                return None
            raise

    def submit(
        self,
        entrypoint: str,
        *,
        submission_id: str,
        runtime_env: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        resume: bool = False,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
        entrypoint_resources: Mapping[str, float] | None = None,
    ) -> str:
        """Submit ``entrypoint`` idempotently and return the submission id that now owns the work.

        See the module docstring for the re-attach / ``-retry<N>`` rules. ``env_vars`` are merged into
        ``runtime_env["env_vars"]`` (they win on conflicts); they may hold secrets, so they are never logged.

        Args:
            entrypoint: Shell command run by the job driver.
            submission_id: Deterministic id (stable across Airflow retries).
            runtime_env: Ray runtime env (working_dir, pip, env_vars…).
            env_vars: Extra environment variables for the driver (string values).
            metadata: Job metadata shown in the dashboard (no secrets).
            resume: A new job resumes (``RLHF_RESUME_MODE=auto``) even under the base id: the resubmission of a job
                that a restarted Ray head lost.
            entrypoint_num_cpus: CPUs reserved for the driver.
            entrypoint_num_gpus: GPUs reserved for the driver.
            entrypoint_resources: Custom resources reserved for the driver.

        Returns:
            ``submission_id`` or ``f"{submission_id}-retry{n}"``.
        """
        for attempt in range(_MAX_RETRY_SUFFIX):
            candidate = submission_id if attempt == 0 else f"{submission_id}-retry{attempt}"
            status = self.find_status(candidate)
            if status in ACTIVE_STATES or status == "SUCCEEDED":
                self.log.info("Ray job %s is %s: re-attaching instead of submitting", candidate, status)
                return candidate
            if status is not None:  # FAILED / STOPPED: try the next suffix
                self.log.info("Ray job %s ended %s; looking at the next retry id", candidate, status)
                continue
            env = dict(env_vars or {})
            if attempt > 0:
                env.update({RESUME_ENV_VAR: "auto", RETRY_INDEX_ENV_VAR: str(attempt)})
            elif resume:
                env[RESUME_ENV_VAR] = "auto"
            try:
                self._submit_new(
                    entrypoint,
                    submission_id=candidate,
                    runtime_env=merge_env_vars(runtime_env, env),
                    metadata=metadata,
                    entrypoint_num_cpus=entrypoint_num_cpus,
                    entrypoint_num_gpus=entrypoint_num_gpus,
                    entrypoint_resources=entrypoint_resources,
                )
            except RuntimeError as err:
                if "already exists" not in str(err):
                    raise
                # Another worker submitted the same id between our lookup and our POST: re-attach to it.
                self.log.info("Ray job %s was submitted concurrently; re-attaching", candidate)
            return candidate
        raise RuntimeError(f"Ray job {submission_id} has {_MAX_RETRY_SUFFIX} failed retries; giving up")

    def _submit_new(
        self,
        entrypoint: str,
        *,
        submission_id: str,
        runtime_env: dict[str, Any],
        metadata: Mapping[str, str] | None,
        entrypoint_num_cpus: float | None,
        entrypoint_num_gpus: float | None,
        entrypoint_resources: Mapping[str, float] | None,
    ) -> None:
        self.log.info("Submitting Ray job %s to %s: %s", submission_id, self.dashboard_address, entrypoint)
        self.get_conn().submit_job(
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env=runtime_env,
            metadata=dict(metadata or {}),
            entrypoint_num_cpus=entrypoint_num_cpus,
            entrypoint_num_gpus=entrypoint_num_gpus,
            entrypoint_resources=dict(entrypoint_resources) if entrypoint_resources else None,
        )


def merge_env_vars(runtime_env: Mapping[str, Any] | None, env_vars: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``runtime_env`` whose ``env_vars`` also hold ``env_vars`` (which win on conflicts).

    Raises:
        ValueError: a key is not a string, or a value is not a str/int/float/bool (Ray needs strings).
    """
    merged = dict(runtime_env or {})
    env: dict[str, str] = dict(merged.get("env_vars") or {})
    for key, value in env_vars.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"env_vars key {key!r} must be a non-empty string")
        if isinstance(value, bool):
            value = "true" if value else "false"
        if not isinstance(value, str | int | float):
            raise ValueError(f"env_vars[{key!r}] is a {type(value).__name__}; pass a string (JSON-encode it)")
        env[key] = str(value)
    if env:
        merged["env_vars"] = env
    return merged


FORWARD_EXTRA = "forward_credentials"  # an aws connection's extra: forward short-lived credentials to Ray jobs
DEFAULT_FORWARD_SECONDS = 3600


def _aws_hook(conn_id: str, client_type: str = "s3") -> Any:
    """The Amazon provider's hook for ``conn_id``: every way the ``aws`` connection can authenticate (keys,
    ``role_arn`` assume-role, web identity, profiles, the node's own role)."""
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    return AwsBaseHook(aws_conn_id=conn_id, client_type=client_type)


def _aws_settings(hook: Any) -> dict[str, str]:
    """The connection's non-secret settings as environment: S3 endpoint and region."""
    config = hook.conn_config
    env: dict[str, str] = {}
    if endpoint := config.get_service_endpoint_url("s3"):
        # botocore (>=1.31) and therefore s3fs read AWS_ENDPOINT_URL[_S3]; FSSPEC_S3_ENDPOINT_URL covers older s3fs.
        env.update({"AWS_ENDPOINT_URL": str(endpoint), "AWS_ENDPOINT_URL_S3": str(endpoint)})
        env["FSSPEC_S3_ENDPOINT_URL"] = str(endpoint)
    if region := config.region_name:
        env.update({"AWS_DEFAULT_REGION": str(region), "AWS_REGION": str(region)})
    return env


def _aws_worker_env(conn_id: str) -> dict[str, str]:
    """This Airflow worker's own S3 access for the task's duration: the hook's resolved credentials."""
    hook = _aws_hook(conn_id)
    env = _aws_settings(hook)
    # Not hook.get_credentials(): it fails on a connection that resolves to none (a run on a local store).
    session_creds = hook.get_session().get_credentials()
    creds = session_creds.get_frozen_credentials() if session_creds is not None else None
    if creds is not None and creds.access_key:
        env.update({"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key})
        if creds.token:
            env["AWS_SESSION_TOKEN"] = creds.token
    return env


def short_lived_aws_env(conn_id: str, *, duration_s: int = DEFAULT_FORWARD_SECONDS) -> dict[str, str]:
    """Temporary credentials for a Ray job, never the connection's long-lived keys.

    Credentials that already are temporary (an assumed role, web identity, SSO: they carry a session token) are
    forwarded with their expiry; long-lived keys are exchanged for an STS session token of ``duration_s``.
    """
    hook = _aws_hook(conn_id, client_type="sts")
    env = _aws_settings(hook)
    session_creds = hook.get_session().get_credentials()
    frozen = session_creds.get_frozen_credentials() if session_creds is not None else None
    if frozen is None or not frozen.access_key:
        raise ValueError(f"aws connection {conn_id!r} resolves to no credentials; nothing to forward")
    if frozen.token:
        key, secret, token = frozen.access_key, frozen.secret_key, frozen.token
        expiry = getattr(session_creds, "_expiry_time", None)
    else:
        issued = hook.get_conn().get_session_token(DurationSeconds=duration_s)["Credentials"]
        key, secret, token = issued["AccessKeyId"], issued["SecretAccessKey"], issued["SessionToken"]
        expiry = issued.get("Expiration")
    env.update({"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": token})
    if expiry is not None:
        env["AWS_CREDENTIAL_EXPIRATION"] = expiry.isoformat() if hasattr(expiry, "isoformat") else str(expiry)
    return env


def _mlflow_uri(conn: Connection) -> str:
    if not conn.host:
        raise ValueError(f"MLflow connection {conn.conn_id!r} has no host; set it to the tracking server URL")
    uri = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
    if conn.port and urlsplit(uri).port is None:
        uri = f"{uri.rstrip('/')}:{conn.port}"
    return uri.rstrip("/")


def _mlflow_worker_env(conn: Connection) -> dict[str, str]:
    env = {"MLFLOW_TRACKING_URI": _mlflow_uri(conn)}
    if conn.login:
        env["MLFLOW_TRACKING_USERNAME"] = conn.login
    if conn.password:
        env["MLFLOW_TRACKING_PASSWORD"] = conn.password
    if token := conn.extra_dejson.get("token"):
        env["MLFLOW_TRACKING_TOKEN"] = str(token)
    return env


_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def _mask(env: Mapping[str, str]) -> None:
    for name in _SECRET_ENV:
        if env.get(name):
            mask_secret(env[name], name)


def worker_env_from_connections(*, s3_conn_id: str | None = None, mlflow_conn_id: str | None = None) -> dict[str, str]:
    """This Airflow worker's own environment for the remote store and MLflow, for one task's duration.

    * ``s3_conn_id`` (type ``aws``): the Amazon provider's hook resolves the credentials (keys, ``role_arn``,
      web identity, a profile, or none: the worker's own identity) → ``AWS_ACCESS_KEY_ID`` /
      ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``; extra ``endpoint_url`` → ``AWS_ENDPOINT_URL[_S3]``,
      ``region_name`` → ``AWS_DEFAULT_REGION``.
    * ``mlflow_conn_id`` (type ``http``): host[:port] → ``MLFLOW_TRACKING_URI``, login/password →
      ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, extra ``token`` → ``MLFLOW_TRACKING_TOKEN``.

    Secret values are registered with Airflow's secrets masker. Never pass the result to a Ray job
    (:func:`job_env_from_connections` is what a job gets).
    """
    env: dict[str, str] = {}
    if s3_conn_id:
        env.update(_aws_worker_env(s3_conn_id))
    if mlflow_conn_id:
        env.update(_mlflow_worker_env(BaseHook.get_connection(mlflow_conn_id)))
    _mask(env)
    return env


def job_env_from_connections(
    *, s3_conn_id: str | None = None, mlflow_conn_id: str | None = None, forward_credentials: bool | None = None
) -> dict[str, str]:
    """What a Ray job's ``runtime_env`` gets from the connections: settings, and no secret by default.

    Ray keeps a job's ``runtime_env`` in its job info, which anyone who can read the dashboard or
    ``GET /api/jobs/`` sees, so a job runs with the cluster's own identity (the nodes' role, a mounted secret) and
    receives only the S3 endpoint and region and the MLflow URL (without user or password). With
    ``forward_credentials`` (the operator's argument; None: the ``aws`` connection's extra ``forward_credentials``)
    it also receives short-lived S3 credentials (:func:`short_lived_aws_env`), never the connection's long-lived
    keys. MLflow credentials are never forwarded.
    """
    env: dict[str, str] = {}
    if s3_conn_id:
        hook = _aws_hook(s3_conn_id)
        env.update(_aws_settings(hook))
        forward = forward_credentials
        if forward is None:
            forward = str(hook.conn_config.extra_dejson.get(FORWARD_EXTRA, "")).lower() in ("true", "1", "yes")
        if forward:
            env.update(short_lived_aws_env(s3_conn_id))
    if mlflow_conn_id:
        parts = urlsplit(_mlflow_uri(BaseHook.get_connection(mlflow_conn_id)))
        netloc = parts.hostname or ""  # a user:password@ in the host stays on this side
        netloc = f"{netloc}:{parts.port}" if parts.port else netloc
        env["MLFLOW_TRACKING_URI"] = parts._replace(netloc=netloc).geturl()
    _mask(env)
    return env
