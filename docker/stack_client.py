"""Talks to the Airflow REST API of the stack of ``scripts/stack.sh`` (standard library only).

::

    python3 docker/stack_client.py --state .rlhf/rlhf-stack dag-ready rlhf_ppo      # exit 0 once the DAG is parsed
    python3 docker/stack_client.py --state .rlhf/rlhf-stack run rlhf_ppo ['{"preset": ...}']

``run`` unpauses the DAG, triggers one run with the given conf (default: the tiny-cpu pipeline of
``DEFAULT_CONF``), waits for it to end and prints one JSON line: ``{"dag_run_id", "state", "tasks"}`` with
the state of every task instance (mapped ones as ``task_id[i]``). Exit status 0 only when the run succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# Tiny-cpu end to end in a few minutes: 4 steps, a checkpoint every 2 (both evaluated), checkpoints in moto S3.
DEFAULT_CONF: dict[str, Any] = {
    "preset": "tiny-cpu",
    "total_training_steps": 4,
    "save_freq": 2,
    "remote_store_url": "s3://rlhf-checkpoints/runs",
    "eval_n_samples": 2,
    "eval_max_prompts": 32,
    "overrides": ["trainer.test_freq=0", "trainer.val_before_train=false"],
}
FINAL_STATES = frozenset({"success", "failed"})


def read_env(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of one of the stack's env files."""
    pairs = (line.split("=", 1) for line in path.read_text(encoding="utf-8").splitlines() if "=" in line)
    return {key: value for key, value in pairs}


class Airflow:
    """Airflow REST API v2 client authenticated with the stack's admin user (JWT from ``/auth/token``)."""

    def __init__(self, state: Path) -> None:
        secrets, airflow = read_env(state / "secrets.env"), read_env(state / "airflow.env")
        self.base = f"http://127.0.0.1:{airflow['AIRFLOW__API__PORT']}"
        self._user, self._password = secrets["AIRFLOW_ADMIN_USERNAME"], secrets["AIRFLOW_ADMIN_PASSWORD"]
        self._token: str | None = None

    def _call(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> Any:
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read() or b"null")

    def token(self) -> str:
        """A JWT for the admin user (fetched once)."""
        if self._token is None:
            login = {"username": self._user, "password": self._password}
            answer = self._call("POST", "/auth/token", login, auth=False)
            self._token = str(answer["access_token"])
        return self._token

    def dag_ready(self, dag_id: str) -> bool:
        """Whether the dag-processor has parsed and stored ``dag_id``."""
        try:
            self._call("GET", f"/api/v2/dags/{dag_id}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise
        return True

    def run(self, dag_id: str, conf: dict[str, Any], *, timeout_s: float, poll_s: float = 10.0) -> dict[str, Any]:
        """Unpause, trigger and wait for one run; returns its id, final state and task states."""
        self._call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
        run = self._call("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf})
        run_id = str(run["dag_run_id"])
        print(f"stack: triggered {dag_id} run {run_id}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout_s
        state, seen = str(run["state"]), ""
        while state not in FINAL_STATES and time.monotonic() < deadline:
            time.sleep(poll_s)
            state = str(self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}")["state"])
            tasks = self.task_states(dag_id, run_id)
            line = ", ".join(f"{task}={st}" for task, st in sorted(tasks.items()) if st not in (None, "None"))
            if line != seen:
                print(f"stack: {state}: {line}", file=sys.stderr, flush=True)
                seen = line
        return {"dag_run_id": run_id, "state": state, "tasks": self.task_states(dag_id, run_id)}

    def failed_task_logs(self, dag_id: str, run_id: str, folder: Path) -> list[str]:
        """Save the log of every failed task's last try under ``folder``; returns one summary line per task.

        The stack's task logs live in a volume that ``down`` removes: this keeps what a failed run needs.
        """
        answer = self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for ti in answer["task_instances"]:
            if ti["state"] != "failed":
                continue
            key = ti["task_id"] if ti["map_index"] < 0 else f"{ti['task_id']}[{ti['map_index']}]"
            query = f"?full_content=true&map_index={ti['map_index']}"
            path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{ti['task_id']}/logs/{ti['try_number']}"
            try:
                entries = self._call("GET", path + query).get("content") or []
            except (urllib.error.URLError, OSError, ValueError) as exc:
                lines.append(f"{key}: its log could not be read ({exc})")
                continue
            text = "\n".join(json.dumps(e) if not isinstance(e, str) else e for e in entries)
            out = folder / f"{key}.try{ti['try_number']}.log"
            out.write_text(text + "\n")
            lines.append(f"{key} (try {ti['try_number']}): {_first_error(entries)} [log: {out}]")
        return lines

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        """``{task_id or task_id[map_index]: state}`` of one run."""
        answer = self._call("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances?limit=100")
        states: dict[str, str | None] = {}
        for ti in answer["task_instances"]:
            key = ti["task_id"] if ti["map_index"] < 0 else f"{ti['task_id']}[{ti['map_index']}]"
            states[key] = ti["state"]
        return states


def _first_error(entries: list[Any]) -> str:
    """The exception of a task log's "Task failed with exception" entry, on one line (at most 500 characters)."""
    for entry in entries:
        if isinstance(entry, dict) and entry.get("error_detail"):
            detail = entry["error_detail"][-1]
            text = f"{detail.get('exc_type')}: {detail.get('exc_value')}"
            return " ".join(text.split())[:500]
    return "no exception in the log (see the file)"


def main(argv: list[str] | None = None) -> int:
    """Command line: ``dag-ready DAG`` or ``run DAG [CONF_JSON]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", type=Path, default=Path(".rlhf/rlhf-stack"), help="the stack's state folder")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="how long `run` waits for the run")
    parser.add_argument("action", choices=["dag-ready", "run"])
    parser.add_argument("dag_id")
    parser.add_argument("conf", nargs="?", default="", help="JSON conf of the run (default: tiny-cpu, 4 steps)")
    args = parser.parse_args(argv)
    client = Airflow(args.state)
    if args.action == "dag-ready":
        return 0 if client.dag_ready(args.dag_id) else 1
    try:
        conf = json.loads(args.conf) if args.conf else DEFAULT_CONF
    except json.JSONDecodeError as exc:
        print(f'stack: the trigger conf is not JSON ({exc}): pass an object such as \'{{"preset": "tiny-cpu"}}\'')
        return 2
    result = client.run(args.dag_id, conf, timeout_s=args.timeout_s)
    print(json.dumps(result))
    if result["state"] != "success":
        failed = sorted(task for task, state in result["tasks"].items() if state not in ("success", "skipped"))
        print(
            f"stack: run {result['dag_run_id']} ended {result['state']}; tasks not successful: {failed}; "
            f"logs: Airflow UI {client.base}",
            file=sys.stderr,
        )
        folder = args.state / "logs" / "failed" / result["dag_run_id"].replace(":", "-")
        for line in client.failed_task_logs(args.dag_id, result["dag_run_id"], folder):
            print(f"stack: failed {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
