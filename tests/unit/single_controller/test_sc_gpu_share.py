"""Fractional GPUs: ranks sharing one GPU (resources.gpus_per_worker < 1), as scripts/gpu_check.sh runs them."""

from __future__ import annotations

import pytest

from rlhf_ops.config import load_config
from rlhf_ops.config.errors import ConfigError
from workers.single_controller.resource_pool import RayResourcePool


def test_half_a_gpu_per_rank_puts_two_ranks_on_one_gpu() -> None:
    pool = RayResourcePool([2], use_gpu=True, num_cpus_per_process=4, gpus_per_process=0.5)
    assert pool.bundle == {"CPU": 4, "GPU": 0.5}  # 2 bundles x 0.5 = the 1 GPU of the node
    assert RayResourcePool([2], use_gpu=False, gpus_per_process=0.5).bundle == {"CPU": 1.0}


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_gpu_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="gpus_per_process"):
        RayResourcePool([2], use_gpu=True, gpus_per_process=share)


def test_config_key_bounds() -> None:
    cfg = load_config("tiny-cpu", ["resources.device=cuda", "resources.gpus_per_worker=0.5"])
    assert cfg.resources.gpus_per_worker == 0.5
    with pytest.raises(ConfigError, match="resources.gpus_per_worker"):
        load_config("tiny-cpu", ["resources.gpus_per_worker=2"])
