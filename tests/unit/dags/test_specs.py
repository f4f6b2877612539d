"""YAML pipeline specs → DAG arguments, and bad specs skipped without hiding the good ones."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_spec_maps_data_keys_and_connections() -> None:
    from rlhf_pipeline.specs import spec_to_kwargs

    spec = {
        "schedule": "@daily",
        "preset": "tiny-cpu",
        "warm_start": "champion",
        "overrides": ["rollout.n=4"],
        "data": {"url": "s3://d/raw.jsonl", "field_map": {"prompt": "q"}},
        "params": {"keep_last": 3},
        "connections": {"s3": None, "ray": "ray_gpu"},
        "tags": ["nightly"],
    }
    kwargs = spec_to_kwargs(spec, source=Path("specs/my-run.yaml"))
    assert kwargs["dag_id"] == "rlhf_my_run"
    assert kwargs["param_defaults"] == {
        "keep_last": 3,
        "dataset_url": "s3://d/raw.jsonl",
        "field_map": {"prompt": "q"},
        "preset": "tiny-cpu",
        "overrides": ["rollout.n=4"],
        "warm_start": "champion",
    }
    assert (kwargs["s3_conn_id"], kwargs["ray_conn_id"]) == (None, "ray_gpu")
    assert kwargs["tags"] == ["scheduled", "nightly"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"preset": "tiny-cpu"}, "'schedule' is missing"),
        ({"schedule": None, "scheduel": "@daily"}, r"unknown key\(s\) \['scheduel'\]"),
        ({"schedule": None, "data": {"uri": "x"}}, r"unknown data key\(s\) \['uri'\]"),
        ({"schedule": None, "overrides": "rollout.n=4"}, "overrides must be a list"),
        ("just text", "must be a mapping"),
    ],
)
def test_bad_spec_names_the_problem(spec: object, message: str) -> None:
    from rlhf_pipeline.specs import SpecError, spec_to_kwargs

    with pytest.raises(SpecError, match=message):
        spec_to_kwargs(spec, source=Path("specs/x.yaml"))


def test_a_bad_spec_is_skipped_with_a_warning(tmp_path: Path) -> None:
    from rlhf_pipeline.specs import load_spec_dags

    (tmp_path / "good.yaml").write_text("schedule: '@weekly'\npreset: tiny-cpu\n")
    (tmp_path / "bad.yaml").write_text("schedule: '@weekly'\nparams: {not_a_param: 1}\n")
    with pytest.warns(UserWarning, match=r"skipping pipeline spec bad.yaml: unknown pipeline parameter"):
        dags = load_spec_dags(tmp_path)
    assert list(dags) == ["rlhf_good"]
