"""Fixtures of the FSDP worker unit tests: a 1-rank gloo process group and fresh FSDP-wrapped tiny models."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rlhf_ops.config.schema import FSDPConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gloo_world1() -> Iterator[None]:
    """A world-size-1 gloo default group (reused if another fixture already started one)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def fsdp_model(gloo_world1: None, tiny_model_dir: str) -> Callable[..., nn.Module]:
    """Factory of fresh tiny models: ``fsdp_model(kind="causal_lm", wrap=True, attn="sdpa")``."""
    from workers.fsdp import apply_fsdp2, build_device_mesh, load_hf_model

    def make(*, kind: str = "causal_lm", wrap: bool = True, attn: str = "sdpa", seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)  # the value head is drawn from the global RNG
        model = load_hf_model(tiny_model_dir, kind=kind, attn_implementation=attn)  # type: ignore[arg-type]
        if wrap:
            apply_fsdp2(model, build_device_mesh(1), FSDPConfig())
        return model

    return make
