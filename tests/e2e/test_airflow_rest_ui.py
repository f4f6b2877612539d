"""``rlhf_ppo`` through a real Airflow deployment: the REST API, and the trigger form in headless Chromium.

Started once for the module: a fresh PostgreSQL database as Airflow's metadata DB and the four Airflow
components (api-server, scheduler, dag-processor, triggerer; LocalExecutor; simple auth manager with a
password) on 127.0.0.1 (``tests/support/airflow_services.py``), an MLflow server, a private Ray head with
token auth, and a local folder as the checkpoints' remote store (``file://``). The DAGs folder is a copy of
``dags/``, as a deployment syncs it.

* REST: the DAG is unpaused; a value that breaks the params' JSON Schema is refused with 400 and creates no
  run; a run with overrides (2 steps, 4 samples per prompt, lr 2e-3) succeeds, and the overrides reach the
  Ray job (MLflow params and metric history) and the checkpoint store.
* UI: Debian's Chromium, driven by Playwright, signs in, fills the trigger form (the number field turns
  ``rollout_n=0`` into the schema's minimum), triggers, and watches the run page until its badge says
  Success. Screenshots of the screens a user meets go to ``$RLHF_SCREENSHOT_DIR`` (``docs/images`` refreshes
  ``docs/ui.md``; a temporary folder by default, so a test run leaves the tree clean).

A run takes 1.5-3 min on 2 shared cores; the module 5-7 min.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import pytest

from rlhf_ops.pipeline.local_stack import start_ray_head
from tests.support.airflow_services import (
    AirflowServices,
    airflow_services,
    postgres_database,
    postgres_unavailable_reason,
)
from tests.support.chromium import VIEWPORT, around, chromium_page, png_size, settle
from tests.support.mlflow_server import mlflow_server

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "rlhf_ppo"
RUN_TIMEOUT_S = 480.0
# Fast settings: 2 steps with the preset's save_freq (50) give one checkpoint, at step 2.
REST_CONF: dict[str, Any] = {
    "total_training_steps": 2,
    "rollout_n": 4,
    "learning_rate": 0.002,
    "eval_max_prompts": 16,
    "eval_n_samples": 2,
    "overrides": ["trainer.test_freq=0", "trainer.val_before_train=false"],
}
UI_OVERRIDES = ["trainer.val_before_train=false", "trainer.test_freq=0"]
SCREENSHOTS = (
    "airflow_dags.png",
    "airflow_trigger_form.png",
    "airflow_trigger_form_training.png",
    "airflow_trigger_refused.png",
    "airflow_run_grid.png",
    "airflow_train_log.png",
    "airflow_train_links.png",
    "airflow_run_graph.png",
    "mlflow_run.png",
    "mlflow_run_metrics.png",
)


@dataclass(frozen=True)
class Stack:
    """The running services: Airflow (with a REST token), the MLflow tracking URI, the remote store folder."""

    airflow: AirflowServices
    token: str
    tracking_uri: str
    remote_root: Path


def _task_env(*, ray_dashboard: str, ray_token: str, tracking_uri: str, work_dir: Path) -> dict[str, str]:
    """Connections and settings for every Airflow component and task process."""
    return {
        "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
            {
                "conn_type": "ray",
                "host": "127.0.0.1",
                "port": int(ray_dashboard.rsplit(":", 1)[1]),
                "password": ray_token,
            }
        ),
        "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": tracking_uri}),
        "AIRFLOW_CONN_AWS_DEFAULT": json.dumps({"conn_type": "aws"}),  # the local-folder store needs no keys
        "RLHF_WORK_DIR": str(work_dir),
        "RLHF_MLFLOW_UI_URL": tracking_uri,
        # MLflow's telemetry thread unsets an env var while `requests` iterates os.environ: a KeyError that
        # fails a task's first try now and then. Telemetry cannot reach its server here anyway.
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """PostgreSQL DB, MLflow, Ray head and the four Airflow components, stopped by PID in reverse order."""
    if reason := postgres_unavailable_reason():
        pytest.fail(f"{reason} (Airflow's metadata DB for this test; PostgreSQL must listen on 127.0.0.1:5432)")
    root = tmp_path_factory.mktemp("airflow_e2e")
    dags = root / "dags"
    shutil.copytree(ROOT / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "ray").mkdir()
    saved = {k: os.environ.get(k) for k in ("PATH", "MLFLOW_DISABLE_TELEMETRY", "RLHF_WORK_DIR")}
    os.environ["RLHF_WORK_DIR"] = str(root / "work")  # the cluster's work folder: the heavy jobs resolve it there
    # The Ray job's entrypoint runs `python -m ...`: the head must find this virtualenv's interpreter first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    ray_token = secrets.token_hex(16)
    try:
        with contextlib.ExitStack() as services:
            tracking_uri = services.enter_context(mlflow_server(root=root / "mlflow"))
            head = start_ray_head(root / "ray", auth_token=ray_token, num_cpus=2)
            services.callback(head.stop)
            db = services.enter_context(postgres_database())
            env = _task_env(
                ray_dashboard=head.url,
                ray_token=ray_token,
                tracking_uri=tracking_uri,
                work_dir=root / "work",
            )
            af = services.enter_context(
                airflow_services(
                    root / "airflow", db_url=db.url, dags_folder=dags, plugins_folder=ROOT / "plugins", extra_env=env
                )
            )
            yield Stack(airflow=af, token=af.token(), tracking_uri=tracking_uri, remote_root=root / "remote")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def dag_ready(stack: Stack) -> None:
    """Wait until the dag-processor has stored ``rlhf_ppo``, then unpause it (new DAGs start paused)."""
    deadline = time.monotonic() + 120
    status, body = _api(stack, "GET", f"/api/v2/dags/{DAG_ID}")
    while status == 404 and time.monotonic() < deadline:
        time.sleep(2)
        status, body = _api(stack, "GET", f"/api/v2/dags/{DAG_ID}")
    _, errors = _api(stack, "GET", "/api/v2/importErrors")
    assert status == 200, f"{DAG_ID} not parsed: {body}; import errors: {errors}"
    assert body["is_paused"] is True and errors["total_entries"] == 0, errors
    status, body = _api(stack, "PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    assert (status, body["is_paused"]) == (200, False), body


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``$RLHF_SCREENSHOT_DIR`` (e.g. ``docs/images``) or a temporary folder."""
    configured = os.environ.get("RLHF_SCREENSHOT_DIR")
    folder = Path(configured) if configured else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    for name in (*SCREENSHOTS, "failure.png"):
        (folder / name).unlink(missing_ok=True)  # what the test finds afterwards is what this run took
    return folder


def _api(stack: Stack, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return stack.airflow.request(method, path, token=stack.token, body=body)


def _run_path(run_id: str) -> str:
    return f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}"


def _run_count(stack: Stack) -> int:
    status, body = _api(stack, "GET", f"/api/v2/dags/{DAG_ID}/dagRuns")
    assert status == 200, body
    return int(body["total_entries"])


def _task_states(stack: Stack, run_id: str) -> dict[str, str]:
    status, body = _api(stack, "GET", f"{_run_path(run_id)}/taskInstances?limit=100")
    assert status == 200, body
    return {f"{ti['task_id']}[{ti['map_index']}]": str(ti["state"]) for ti in body["task_instances"]}


def _xcom(stack: Stack, run_id: str, task_id: str, key: str = "return_value") -> Any:
    status, body = _api(stack, "GET", f"{_run_path(run_id)}/taskInstances/{task_id}/xcomEntries/{key}")
    assert status == 200, body
    return body["value"]


def _task_errors(af: AirflowServices, run_id: str) -> str:
    """The exceptions in this run's task logs (JSON lines under ``$AIRFLOW_HOME/logs``), for failure messages."""
    folder = af.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
    found = []
    for log in sorted(folder.rglob("attempt=*.log")):
        for value in re.findall(r'"exc_value":"((?:[^"\\]|\\.)*)"', log.read_text(errors="replace"))[:2]:
            found.append(f"{log.relative_to(folder)}: {value[:800]}")
    return "\n".join(found) or "(no exception in the task logs)"


def _wait_for_run(stack: Stack, run_id: str, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """Poll the run until it succeeds (returned) or fails (AssertionError with the task states and errors)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, run = _api(stack, "GET", _run_path(run_id))
        assert status == 200, run
        if run["state"] == "success":
            return dict(run)
        if run["state"] == "failed" or time.monotonic() > deadline:
            states = _task_states(stack, run_id)
            raise AssertionError(
                f"run {run_id} is {run['state']} after {run.get('duration')}s: {states}\n"
                f"{_task_errors(stack.airflow, run_id)}\n--- scheduler\n{stack.airflow.log_tail('scheduler', 30)}"
            )
        time.sleep(5)


def _mlflow_params_and_steps(stack: Stack, mlflow_run_id: str) -> tuple[dict[str, str], list[int]]:
    """The MLflow run's params and the steps at which ``actor/pg_loss`` was logged."""
    from mlflow import MlflowClient

    client = MlflowClient(stack.tracking_uri)
    params = dict(client.get_run(mlflow_run_id).data.params)
    return params, [m.step for m in client.get_metric_history(mlflow_run_id, "actor/pg_loss")]


@pytest.mark.parametrize(
    ("conf", "param"),
    [
        ({"rollout_n": 0}, "rollout_n"),  # minimum 1
        ({"total_training_steps": "two"}, "total_training_steps"),  # integer or null
        ({"preset": "tiny-gpu"}, "preset"),  # not a shipped preset
        ({"remote_store_url": "host/runs"}, "remote_store_url"),  # a URL with a scheme (any fsspec protocol)
    ],
)
def test_rest_api_refuses_a_param_that_breaks_the_schema(
    stack: Stack, dag_ready: None, conf: dict[str, Any], param: str
) -> None:
    before = _run_count(stack)
    status, body = _api(stack, "POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    assert status == 400, body
    assert body["detail"].startswith(f"Invalid input for param {param}:"), body
    assert _run_count(stack) == before  # refused before a run exists


# slow: the Chromium form test below runs the same pipeline to success through the UI (~105 s each)
@pytest.mark.slow
def test_rest_api_trigger_with_param_overrides_runs_to_success(stack: Stack, dag_ready: None) -> None:
    conf = {**REST_CONF, "remote_store_url": stack.remote_root.as_uri()}
    status, run = _api(stack, "POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    assert status == 200, run
    assert (run["state"], run["triggered_by"], run["conf"]) == ("queued", "rest_api", conf)
    run = _wait_for_run(stack, run["dag_run_id"])
    run_id = run["dag_run_id"]
    states = _task_states(stack, run_id)
    # promote_champion is skipped when an earlier run of this stack left a champion this one does not beat
    assert states.pop("fetch_champion[-1]") == "skipped", states  # warm_start: scratch (no job submitted)
    assert {s for t, s in states.items() if t != "promote_champion[-1]"} == {"success"}, states
    assert states["promote_champion[-1]"] in ("success", "skipped"), states
    assert "evaluate.evaluate_checkpoint[0]" in states and "evaluate.evaluate_checkpoint[1]" not in states
    assert _xcom(stack, run_id, "plan_evaluations") == [2]  # the only checkpoint: the last step's
    # the overrides reached the training job: resolved config logged as params, metrics at steps 1 and 2
    params, steps = _mlflow_params_and_steps(stack, _xcom(stack, run_id, "start_tracking", "mlflow_run_id"))
    assert params["trainer.total_training_steps"] == "2" and params["rollout.n"] == "4"
    assert params["actor.optim.lr"] == "0.002" and params["trainer.test_freq"] == "0"
    assert params["trainer.remote_store_url"] == stack.remote_root.as_uri()
    assert steps == [1, 2]
    # the checkpoint and its evaluation in the local-folder remote store
    remote = stack.remote_root / DAG_ID / _xcom(stack, run_id, "preflight", "layout")["run_key"]
    assert (remote / "latest").read_text().strip() == "global_step_2"
    assert (remote / "global_step_2" / "MANIFEST.json").is_file()
    assert json.loads((remote / "global_step_2" / "eval.json").read_text())["step"] == 2
    registered = _xcom(stack, run_id, "register_model")
    assert registered["registered_name"] == "rlhf_ppo-tiny-cpu" and registered["best_step"] == 2


def _sign_in_and_open_dag(page: Page, af: AirflowServices, shots: Path) -> None:
    """Sign in on the DAG list, then open ``rlhf_ppo`` from it."""
    from playwright.sync_api import expect

    page.goto(f"{af.base_url}/dags")
    page.get_by_label("Username").fill(af.username)
    page.get_by_label("Password").fill(af.password)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("link", name=DAG_ID, exact=True)).to_be_visible()
    settle(page)
    page.screenshot(path=shots / "airflow_dags.png")
    page.get_by_role("link", name=DAG_ID, exact=True).click()
    page.wait_for_url(re.compile(rf"/dags/{DAG_ID}$"))
    expect(page.get_by_test_id("trigger-dag-button")).to_have_count(1)  # the DAG page's (the list has one a row)


def _trigger_from_form(page: Page, stack: Stack, shots: Path) -> str:
    """Fill the form, see a bad store URL refused, fix it and trigger; returns the new run's id (from the URL)."""
    from playwright.sync_api import expect

    page.get_by_test_id("trigger-dag-button").click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_text(f"Trigger Dag - {DAG_ID}")).to_be_visible()
    page.screenshot(path=shots / "airflow_trigger_form.png")
    dialog.get_by_role("button", name="Training").click()
    rollout_n = dialog.locator("input[name=element_rollout_n]")
    rollout_n.fill("0")
    rollout_n.press("Tab")
    expect(rollout_n).to_have_value("1")  # clamped to the schema's minimum: 0 never reaches the API
    rollout_n.fill("4")
    rollout_n.press("Tab")
    dialog.locator("input[name=element_total_training_steps]").fill("2")
    overrides = dialog.locator("textarea[name=element_overrides]")
    overrides.fill("\n".join(UI_OVERRIDES))  # an array param: one item per line
    overrides.press("Tab")
    dialog.locator("input[name=element_save_freq]").evaluate("e => e.scrollIntoView({block: 'start'})")
    page.screenshot(path=shots / "airflow_trigger_form_training.png")
    _refused_store_url(page, stack, shots)
    dialog.get_by_role("button", name="Trigger").click()
    page.wait_for_url(re.compile(rf"/dags/{DAG_ID}/runs/[^/?]+$"))
    return unquote(page.url.rsplit("/runs/", 1)[1])


def _refused_store_url(page: Page, stack: Stack, shots: Path) -> None:
    """A store URL the schema's pattern refuses: the API answers 400, the form shows why; then a valid one."""
    from playwright.sync_api import expect

    dialog = page.get_by_role("dialog")
    before = _run_count(stack)
    dialog.get_by_role("button", name="Storage and cluster").click()
    store = dialog.locator("input[name=element_remote_store_url]")
    store.fill("host/runs")  # no scheme; the form does not check patterns as you type, the API does
    dialog.get_by_role("button", name="Trigger").click()
    error = dialog.get_by_text("Invalid input for param remote_store_url")
    expect(error).to_be_visible()
    error.scroll_into_view_if_needed()
    page.screenshot(path=shots / "airflow_trigger_refused.png")
    assert _run_count(stack) == before
    store.fill(stack.remote_root.as_uri())
    # The red note sits over the Trigger button and stays while the pointer rests on it: move away, let it go.
    page.mouse.move(VIEWPORT["width"] / 2, 10)
    expect(page.locator("[data-scope=toast][data-part=root]")).to_have_count(0, timeout=20_000)


def _screenshots_of_run(page: Page, stack: Stack, run_id: str, shots: Path) -> None:
    """The train task's log and extra links, the graph, and the MLflow run, as a user opens them."""
    from playwright.sync_api import expect

    run_url = f"{stack.airflow.base_url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}"
    page.goto(f"{run_url}/tasks/train")
    expect(page.get_by_text(re.compile(r"Ray job \S+ succeeded")).first).to_be_visible()
    settle(page)
    page.screenshot(path=shots / "airflow_train_log.png")
    page.goto(f"{run_url}/tasks/train/details")
    for link in ("MLflow run", "Ray job"):  # the plugin's extra links (the file:// checkpoint link is not shown)
        expect(page.get_by_role("link", name=link).or_(page.get_by_role("button", name=link)).first).to_be_visible()
    settle(page)
    page.screenshot(path=shots / "airflow_train_links.png")
    # The graph view is documentation (every task's state is asserted through the REST API); on a loaded
    # 2-core machine its first render can outlast the click timeout, so it gets a second try.
    for attempt in (1, 2):
        try:
            _graph_screenshot(page, run_url, shots)
            break
        except Exception as exc:  # noqa: BLE001
            print(f"graph screenshot, try {attempt}: {exc!r}")
    try:  # documentation only: the MLflow run's content is asserted through its API; its UI navigation is flaky
        _mlflow_screenshots(page, _xcom(stack, run_id, "start_tracking", "mlflow_run_url"), shots)
    except Exception as exc:  # noqa: BLE001
        print(f"MLflow screenshots skipped: {exc!r}")


def _graph_screenshot(page: Page, run_url: str, shots: Path) -> None:
    """The run's graph with the task groups expanded, cropped to the nodes."""
    from playwright.sync_api import expect

    page.goto(run_url)
    page.get_by_role("button", name="Show Graph (Press g)").click(timeout=60_000)
    page.get_by_role("button", name="Expand all task groups").click()
    page.get_by_role("button", name="Collapse Details Panel").click()
    page.locator("button.react-flow__controls-fitview").click()
    expect(page.get_by_text("evaluate_checkpoint [0]")).to_be_visible(timeout=60_000)
    page.wait_for_timeout(1000)  # the fit-view animation
    page.screenshot(path=shots / "airflow_run_graph.png", clip=around(page, ".react-flow__node", margin=24))


def _mlflow_screenshots(page: Page, mlflow_run_url: str, shots: Path) -> None:
    """The MLflow run page (overview and metric charts) in the UI's model-training mode."""
    from playwright.sync_api import expect

    page.goto(mlflow_run_url)
    page.get_by_text("Model training", exact=True).first.click()  # leaves the GenAI mode (it opens the runs list)
    page.goto(mlflow_run_url)
    assistant = page.get_by_role("button", name="Close")
    with contextlib.suppress(Exception):
        assistant.first.click(timeout=3_000)  # the assistant side panel, when it opens by itself
    expect(page.get_by_text("Registered models")).to_be_visible()
    page.screenshot(path=shots / "mlflow_run.png")
    page.get_by_text("Model metrics", exact=True).first.click()
    page.get_by_placeholder("Search metric charts").fill("reward")  # the RL signal: train, critic and eval
    expect(page.get_by_text(re.compile(r"\(eval/reward/mean\)")).first).to_be_visible()  # a chart's legend
    page.wait_for_timeout(1500)  # charts draw after their data arrives
    page.screenshot(path=shots / "mlflow_run_metrics.png")


# Slow: ~200 s on an AVX2-only host; its DAG run duplicates test_pipeline_dag's (the form's schema checks stay here).
@pytest.mark.slow
def test_trigger_form_in_chromium_runs_to_success(stack: Stack, dag_ready: None, screenshot_dir: Path) -> None:
    from playwright.sync_api import expect

    with chromium_page(screenshot_dir) as page:
        _sign_in_and_open_dag(page, stack.airflow, screenshot_dir)
        run_id = _trigger_from_form(page, stack, screenshot_dir)
        run = _wait_for_run(stack, run_id)  # via REST too, to fail fast with the task errors
        # the page refreshes itself while the run is active: the user sees it turn to Success
        expect(page.get_by_test_id("state-badge").first).to_have_text("Success", timeout=60_000)
        page.reload()  # without the "Dag Run Triggered" toast
        # After a reload the UI shows the untranslated key ("states.success") until its i18n bundle has
        # loaded: seconds on a loaded 2-core machine, so the default 5 s expect timeout is too short.
        expect(page.get_by_test_id("state-badge").first).to_have_text("Success", timeout=60_000)
        settle(page)
        page.screenshot(path=screenshot_dir / "airflow_run_grid.png")
        assert run["triggered_by"] == "ui"
        assert (run["conf"]["total_training_steps"], run["conf"]["rollout_n"]) == (2, 4)
        assert run["conf"]["overrides"] == UI_OVERRIDES and run["conf"]["preset"] == "tiny-cpu"  # a default
        assert run["conf"]["remote_store_url"] == stack.remote_root.as_uri()  # fixed after the refusal
        states = _task_states(stack, run_id)
        assert states.pop("fetch_champion[-1]") == "skipped", states  # warm_start: scratch (no job submitted)
        assert {s for t, s in states.items() if t != "promote_champion[-1]"} == {"success"}, states
        assert states["promote_champion[-1]"] in ("success", "skipped"), states  # a tie with the REST run's
        params, steps = _mlflow_params_and_steps(stack, _xcom(stack, run_id, "start_tracking", "mlflow_run_id"))
        assert (params["trainer.total_training_steps"], params["rollout.n"], steps) == ("2", "4", [1, 2])
        remote = stack.remote_root / DAG_ID / _xcom(stack, run_id, "preflight", "layout")["run_key"]
        assert (remote / "latest").read_text().strip() == "global_step_2"
        _screenshots_of_run(page, stack, run_id, screenshot_dir)
    optional = ("mlflow_", "airflow_run_graph")  # documentation-only screenshots (see _screenshots_of_run)
    taken = [name for name in SCREENSHOTS if not name.startswith(optional) or (screenshot_dir / name).exists()]
    sizes = {name: png_size(screenshot_dir / name) for name in taken}
    if "airflow_run_graph.png" in sizes:
        graph_w, graph_h = sizes.pop("airflow_run_graph.png")  # cropped to the graph
        assert 600 < graph_w <= 1280 and 100 < graph_h <= 800, (graph_w, graph_h)
    assert sizes == dict.fromkeys(sizes, (1280, 800)), sizes
