"""``model.use_liger`` in the model builder: refused on CPU (worker side too), and the kernels it asks liger for.

liger-kernel is CUDA-only and not installed here; ``scripts/gpu_check.sh`` runs it for real on a GPU. The stub
below stands in for the third-party package only, to check which kernels the builder switches on.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest
import torch

from workers.fsdp import load_hf_model
from workers.utils.liger import LIGER_KERNELS, apply_liger


def test_liger_on_cpu_names_the_key_and_the_fix(tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    with pytest.raises(ValueError, match="model.use_liger=true.*Triton CUDA.*set model.use_liger=false"):
        apply_liger(model, device="cpu")


def test_missing_package_and_unsupported_model_type(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # what an environment without the package gives
    with pytest.raises(ValueError, match="needs the liger-kernel package"):
        apply_liger(model, device="cuda")
    calls: list[dict[str, Any]] = []
    _stub_liger(monkeypatch, supported={"qwen2": None}, calls=calls)
    with pytest.raises(ValueError, match="no kernels for model_type='llama'.*'qwen2'"):
        apply_liger(model, device=torch.device("cuda"))
    assert calls == []


def test_builder_asks_for_norm_swiglu_rope_and_no_loss_patch(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    calls: list[dict[str, Any]] = []
    _stub_liger(monkeypatch, supported={"llama": None}, calls=calls)
    apply_liger(model, device="cuda")
    assert calls == [{"model": model, **LIGER_KERNELS}]
    assert LIGER_KERNELS == {
        "rope": True,
        "rms_norm": True,
        "swiglu": True,
        "cross_entropy": False,
        "fused_linear_cross_entropy": False,
    }


def _stub_liger(monkeypatch: pytest.MonkeyPatch, *, supported: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    root, api, patch = ModuleType("liger_kernel"), ModuleType("liger_kernel.transformers"), ModuleType("m")
    api._apply_liger_kernel_to_instance = lambda **kwargs: calls.append(kwargs)  # type: ignore[attr-defined]
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = supported  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", root)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", api)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
