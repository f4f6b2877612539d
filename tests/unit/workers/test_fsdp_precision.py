"""Mixed precision through the real FSDP2 build path (workers.fsdp.build_fsdp_model) on a 1-rank gloo group.

The model is the real SmolLM2-135M-Instruct cut to 2 decoder blocks, stored bf16 on disk like the original
(tests.support.shrunk_model). Measured numbers are in the assertion comments.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rlhf_ops.config.precision import RolePrecision, resolve_precision
from rlhf_ops.config.schema import DType, FSDPConfig, OptimConfig
from tests.support.shrunk_model import shrunk_smollm2
from workers.actor.forward import response_log_probs
from workers.fsdp import build_device_mesh, build_fsdp_model, build_optimizer, clipped_optimizer_step

LR = 1e-6
PROMPT, RESPONSE = 12, 8


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shrunk_smollm2(str(tmp_path_factory.mktemp("smollm2-2l")), layers=2)


def _batch(model_dir: str) -> dict[str, Any]:
    """2 rows of real text (prompt 12 + response 8 tokens, no padding): input_ids / masks / positions (2, 20)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        "Question: Tom has 3 apples and buys 4 more. How many apples does he have now? Answer: 7 apples.",
        "The capital of France is Paris, and the capital of Italy is Rome. Both are old cities in Europe.",
    ]
    ids = torch.stack([torch.tensor(tok(t)["input_ids"][: PROMPT + RESPONSE]) for t in texts])  # (2, 20)
    assert ids.shape == (2, PROMPT + RESPONSE)
    mask = torch.ones_like(ids)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": torch.arange(ids.shape[1]).expand_as(ids),
        "response_length": RESPONSE,
    }


def _build(model_dir: str, precision: RolePrecision) -> nn.Module:
    return build_fsdp_model(
        model_dir,
        kind="causal_lm",
        mesh=build_device_mesh(1),
        cfg=FSDPConfig(),
        device="cpu",
        attn_implementation="sdpa",
        precision=precision,
    )


def _local(p: Tensor) -> Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def _one_step(model_dir: str, *, master_dtype: DType | None) -> tuple[Tensor, Tensor, nn.Module, Any]:
    """One AdamW step at lr 1e-6 on -mean(log p(response)); returns (q_proj before, after, model, optimizer)."""
    precision = resolve_precision("bfloat16", FSDPConfig(master_dtype=master_dtype), trained=True, device="cpu")
    model = _build(model_dir, precision)
    optimizer = build_optimizer(model, OptimConfig(lr=LR, weight_decay=0.0))
    weight = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    before = _local(weight)
    log_probs, _ = response_log_probs(model, **_batch(model_dir))  # (2, 8) fp32
    (-log_probs.mean()).backward()
    result = clipped_optimizer_step(model, optimizer, None, max_norm=1.0)
    assert not result.skipped and result.lr == LR
    return before, _local(weight), model, optimizer


def test_disk_weights_are_bf16(bf16_model_dir: str) -> None:
    from safetensors import safe_open

    with safe_open(str(Path(bf16_model_dir) / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert dtypes == {"BF16"}


def test_lr_1e6_step_changes_bf16_stored_weights_through_fp32_masters(gloo_world1: None, bf16_model_dir: str) -> None:
    before, after, model, optimizer = _one_step(bf16_model_dir, master_dtype=None)
    assert all(_local(p).dtype == torch.float32 for p in model.parameters())  # fp32 masters from bf16 on disk
    state = [t for s in optimizer.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert state and all(_local(t).dtype == torch.float32 for t in state)  # fp32 Adam moments
    delta = (after - before).abs()
    # AdamW's first step is lr * m_hat / (sqrt(v_hat) + eps) = lr * g / (|g| + 1e-8) = lr * sign(g) wherever
    # |g| >> 1e-8: every element moves by lr (measured: 100% moved, median |delta| 1.0e-6).
    moved = (delta > 0).float().mean().item()
    assert moved > 0.99, moved
    torch.testing.assert_close(delta.median(), torch.tensor(LR), rtol=0.02, atol=0.0)


def test_the_same_step_on_forced_bf16_masters_rounds_to_zero(gloo_world1: None, bf16_model_dir: str) -> None:
    before, after, _, _ = _one_step(bf16_model_dir, master_dtype="bfloat16")
    assert before.dtype == torch.bfloat16
    moved = after != before  # (H, H) bool
    # bf16 keeps 8 significant bits: above 2^-11 the spacing is >= 2^-18, half of it 1.9e-6 > lr, so the update
    # rounds away; only tiny weights (|w| <= 2^-11 = 4.9e-4, about 1% of q_proj) can move.
    assert moved.float().mean().item() < 0.05
    assert before[moved].float().abs().max().item() <= 2**-11


def test_bf16_autocast_losses_match_fp32_within_tolerance(gloo_world1: None, bf16_model_dir: str) -> None:
    batch = _batch(bf16_model_dir)
    results: dict[str, Tensor] = {}
    for compute in ("float32", "bfloat16"):
        precision = resolve_precision(compute, FSDPConfig(), trained=True, device="cpu")  # type: ignore[arg-type]
        assert precision.mechanism == ("autocast" if compute == "bfloat16" else "none")
        model = _build(bf16_model_dir, precision)
        with torch.no_grad():
            raw = model(input_ids=batch["input_ids"], use_cache=False).logits
            results[compute], _ = response_log_probs(model, **batch)
        assert raw.dtype == getattr(torch, compute)  # the matmuls ran in the compute dtype ...
        assert results[compute].dtype == torch.float32  # ... the log-softmax in fp32
        assert all(_local(p).dtype == torch.float32 for p in model.parameters())
    loss32, loss16 = -results["float32"].mean(), -results["bfloat16"].mean()
    token_diff = (results["bfloat16"] - results["float32"]).abs().max().item()
    print(f"NLL fp32 {loss32.item():.5f} bf16-autocast {loss16.item():.5f}; max token log-prob diff {token_diff:.2e}")
    # Tolerance: 2% relative on the loss, 0.25 nats per token (bf16 rounds each matmul input to 8 bits).
    # Measured: NLL 14.665 (fp32) vs 14.680 (bf16 autocast), 0.1% apart; max token diff 0.15 (2 cut-down blocks).
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=0.0)
    assert 0 < token_diff < 0.25


class _CastCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts fp32 -> bf16 copies of 2-D tensors (autocast's weight casts; activations are 3-D here)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.casts += int(args[0].dtype == torch.float32 and args[0].dim() == 2)
        return func(*args, **kwargs)


def _micro_batch_grads(model: nn.Module, batch: dict[str, Any], *, keep: bool) -> tuple[dict[str, Tensor], int]:
    """Gradients of 3 micro-batches' summed loss (each of the 2 rows, then both), and the weight casts made."""
    from workers.fsdp.precision import keep_autocast_casts

    model.zero_grad(set_to_none=True)
    rows = [slice(0, 1), slice(1, 2), slice(0, 2)]
    counter = _CastCounter()
    with counter, keep_autocast_casts(model) if keep else contextlib.nullcontext():
        for sl in rows:
            micro = {k: (v[sl] if isinstance(v, Tensor) else v) for k, v in batch.items()}
            log_probs, _ = response_log_probs(model, **micro)
            (-log_probs.mean()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, counter.casts


def test_autocast_casts_kept_over_micro_batches_cast_once_with_the_same_gradients(
    gloo_world1: None, bf16_model_dir: str
) -> None:
    precision = resolve_precision("bfloat16", FSDPConfig(), trained=True, device="cpu")
    model = build_fsdp_model(
        bf16_model_dir,
        kind="causal_lm",
        mesh=build_device_mesh(1),
        cfg=FSDPConfig(single_rank_plain=True),
        device="cpu",
        attn_implementation="sdpa",
        precision=precision,
    )
    batch = _batch(bf16_model_dir)
    per_forward, casts_each = _micro_batch_grads(model, batch, keep=False)
    kept, casts_kept = _micro_batch_grads(model, batch, keep=True)
    matrices = sum(p.dim() == 2 for p in model.parameters())  # 2 blocks x 7 linears + the tied embedding
    assert matrices == 15
    # Without the block every forward casts every matrix but the embedding's lookup again; with it, once.
    assert casts_each == 3 * matrices and casts_kept == matrices, (casts_each, casts_kept)
    assert kept.keys() == per_forward.keys() and len(kept) == sum(1 for _ in model.parameters())
    tied = "model.embed_tokens.weight"  # the LM head's weight too: its two gradients are summed in another order
    for name, grad in per_forward.items():
        if name != tied:
            assert torch.equal(kept[name], grad), name  # the same bf16 copies and gradients, widened exactly
    torch.testing.assert_close(kept[tied], per_forward[tied], rtol=1e-5, atol=1e-7)
    assert all(p.dtype == torch.float32 and isinstance(p, nn.Parameter) for p in model.parameters())  # restored
    assert torch.is_autocast_cache_enabled() and torch.autocast_increment_nesting() == 1  # nesting restored
    torch.autocast_decrement_nesting()


def test_flush_denormals_reaches_the_openmp_threads_started_after_it() -> None:
    """In a fresh process (the flags are per thread and would stay in this one): every element of a 2-thread
    multiply whose exact result is denormal (1e-40) comes out 0, so both OpenMP threads flush."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from workers.fsdp.precision import flush_denormals\n"
        "flushed = flush_denormals(torch.device('cpu'))\n"
        "torch.set_num_threads(2)\n"
        "y = torch.full((1 << 21,), 1e-30) * 1e-10\n"
        "print(flushed, int((y != 0).sum()), flush_denormals(torch.device('meta')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["True", "0", "False"], out.stdout + out.stderr
    unflushed = code.replace("flushed = flush_denormals(torch.device('cpu'))", "flushed = True")
    out = subprocess.run([sys.executable, "-c", unflushed], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split()[1] == str(1 << 21)  # without it: all 2M products are denormal, none zero
