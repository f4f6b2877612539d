"""The @register contract, method resolution and the Worker base without Ray."""

from __future__ import annotations

import os

import pytest

from rlhf_ops.protocol import DataProto
from workers.single_controller.decorator import (
    DISPATCH_ATTR,
    Dispatch,
    DispatchSpec,
    get_dispatch_spec,
    register,
    registered_methods,
    resolve_method,
)
from workers.single_controller.dispatch import DPRankInfo
from workers.single_controller.worker import RankContext, Worker, get_free_port, resolve_backend

BASE_METHODS = ["dp_info", "get_free_port", "get_node_id", "get_node_ip", "get_pid", "init_process_group"]


class _Critic(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def save(self, path: str) -> None:
        pass

    def helper(self) -> int:  # not registered: the driver must not be able to call it
        return 1


class _Actor(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:  # same name as _Critic's
        return data


def test_register_records_spec_and_returns_the_same_function() -> None:
    def fn(self: object) -> None:
        pass

    decorated = register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)(fn)
    assert decorated is fn
    assert getattr(fn, DISPATCH_ATTR) == DispatchSpec(mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    assert get_dispatch_spec(fn) == DispatchSpec(mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    assert get_dispatch_spec(lambda: None) is None


def test_register_without_parentheses_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="with parentheses"):

        @register  # type: ignore[arg-type]
        def fn(self: object) -> None:
            pass


def test_registered_methods_include_inherited_and_skip_plain_ones() -> None:
    found = registered_methods(_Critic)
    assert sorted(found) == sorted([*BASE_METHODS, "compute_values", "save"])
    assert found["save"] == DispatchSpec(mode=Dispatch.ONE_TO_ALL, blocking=False)
    assert "helper" not in found


def test_resolve_by_name_and_by_reference() -> None:
    assert resolve_method(_Critic, "compute_values", role="critic") == (
        "compute_values",
        DispatchSpec(mode=Dispatch.DP_COMPUTE_PROTO),
    )
    assert resolve_method(_Critic, _Critic.save, role="critic")[0] == "save"
    # a base-class method the subclass inherits is the same call
    assert resolve_method(_Critic, Worker.dp_info, role="critic")[0] == "dp_info"


def test_unregistered_method_error_names_method_and_registered_ones() -> None:
    with pytest.raises(AttributeError, match=r"_Critic.helper is not decorated with @register.*\[critic\]") as info:
        resolve_method(_Critic, "helper", role="critic")
    assert "'compute_values'" in str(info.value) and "'save'" in str(info.value)
    with pytest.raises(AttributeError, match="_Critic.nope does not exist"):
        resolve_method(_Critic, "nope", role="critic")


def test_same_named_method_of_another_worker_class_is_rejected() -> None:
    with pytest.raises(AttributeError, match="nor a method it overrides"):
        resolve_method(_Critic, _Actor.compute_values, role="critic")


def test_rank_context_validates_and_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        RankContext(rank=2, world_size=2)
    for key, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29500")
    ctx = RankContext.from_env()
    assert ctx == RankContext(rank=1, world_size=4, local_rank=1, master_addr="10.0.0.1", master_port=29500)
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match=r"\['RANK'\] not set"):
        RankContext.from_env()


def test_worker_sets_env_and_reports_sequence_parallel_dp_info(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "unset")  # restored after the test, since Worker writes os.environ
    worker = Worker(RankContext(rank=3, world_size=4, local_rank=1, master_addr="127.0.0.1", master_port=1234))
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")] == [
        "3",
        "4",
        "1",
        "127.0.0.1",
        "1234",
    ]
    assert worker.dp_info() == DPRankInfo(dp_rank=3, dp_size=4, is_collect_rank=True)
    worker.set_sequence_parallel_size(2)  # ranks (2, 3) share dp chunk 1; rank 2 is collected
    assert worker.dp_info() == DPRankInfo(dp_rank=1, dp_size=2, is_collect_rank=False)


def test_resolve_backend() -> None:
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("auto", cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert resolve_backend("nccl", cuda_available=True) == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("nccl", cuda_available=False)
    with pytest.raises(ValueError, match="not one of"):
        resolve_backend("mpi", cuda_available=False)


def test_get_free_port_is_bindable() -> None:
    import socket

    port = get_free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
