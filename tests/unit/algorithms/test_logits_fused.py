"""The fused chunked log-prob + entropy against the plain full-vocab log-softmax, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.algorithms import logprobs_and_entropy


def _plain(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    logp_all = torch.log_softmax(wide / temperature, dim=-1)  # (N..., V): the materialised path
    return logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 1024])  # 7 leaves a remainder of 40 % 7 = 5 rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_plain_log_softmax_within_1e_6(chunk_size: int, temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    # 40 positions over SmolLM2's 49152-token vocabulary, logits spread like a real LM head's (std 4).
    logits = (4 * torch.randn(4, 10, 49152, generator=gen)).requires_grad_(True)
    labels = torch.randint(0, 49152, (4, 10), generator=gen)
    w_lp, w_ent = torch.randn(4, 10, generator=gen), torch.randn(4, 10, generator=gen)  # upstream gradients

    lp, ent = logprobs_and_entropy(logits, labels, temperature=temperature, chunk_size=chunk_size)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    # The plain path in fp64 is the exact value; in fp32 it is itself ~1e-5 off on log-probs near -20.
    exact_logits = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _plain(exact_logits, labels, temperature)
    ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    plain32_lp, _ = _plain(logits.detach(), labels, temperature)

    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (4, 10)
    lp_err = (lp.double() - ref_lp).abs().max().item()
    assert lp_err <= 1e-6 * ref_lp.abs().max().item()  # relative to |log p| <= ~25: 1-2 fp32 ulps
    assert lp_err <= (plain32_lp.double() - ref_lp).abs().max().item()  # no worse than the plain fp32 path
    assert (ent.double() - ref_ent).abs().max().item() <= 1e-6 * ref_ent.abs().max().item()
    assert logits.grad is not None and exact_logits.grad is not None
    assert (logits.grad.double() - exact_logits.grad).abs().max().item() <= 1e-6


def test_only_log_probs_need_a_gradient() -> None:
    # Entropy as a metric only (detached): the backward gets no entropy gradient and equals the plain one.
    logits = torch.tensor([[2.0, 0.0, -1.0]], requires_grad=True)
    lp, ent = logprobs_and_entropy(logits, torch.tensor([0]))
    lp.sum().backward()
    p = torch.softmax(torch.tensor([2.0, 0.0, -1.0]), dim=-1)
    torch.testing.assert_close(logits.grad, (torch.tensor([1.0, 0.0, 0.0]) - p).unsqueeze(0))  # onehot - p
    torch.testing.assert_close(ent, -(p * p.log()).sum().unsqueeze(0))


def test_masked_vocab_entries_add_nothing() -> None:
    # Two -inf entries: a uniform choice among the other two, log p = -log 2 and H = log 2, gradient finite.
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]], requires_grad=True)
    lp, ent = logprobs_and_entropy(logits, torch.tensor([2]))
    torch.testing.assert_close(lp, torch.tensor([-math.log(2)]))
    torch.testing.assert_close(ent, torch.tensor([math.log(2)]))
    (lp + ent).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.5, 0.0, 0.5, 0.0]]))  # dH = 0 at the uniform


def test_bf16_logits_give_fp32_results_and_a_bf16_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(6, 300, generator=gen)).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 300, (6,), generator=gen)
    lp, ent = logprobs_and_entropy(logits, labels)
    ref_lp, ref_ent = _plain(logits.detach(), labels, 1.0)  # the plain path upcasts the same bf16 values
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_and_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    lp, ent = logprobs_and_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)


def test_a_tail_far_below_the_exponent_floor_changes_nothing() -> None:
    """Logits spanning 300 nats (real LM heads put thousands of tokens > 87 nats below the top one): the floor
    that keeps exp on its fast path leaves log-probs, entropy and gradients at fp64's values, including the
    log-prob of a label 250 nats down."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.rand(6, 49152, generator=gen) * -300 + 20).requires_grad_(True)  # top ~20, tail to -280
    labels = logits.detach().argmin(-1)  # each row's least likely token: log p ~ -300
    labels[0] = logits.detach()[0].argmax()
    w_lp, w_ent = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    lp, ent = logprobs_and_entropy(logits, labels)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    exact = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _plain(exact, labels, 1.0)
    ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    assert ref_lp[1:].max().item() < -250  # the labels really are in the floored tail
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-6)
    assert logits.grad is not None and exact.grad is not None
    assert (logits.grad.double() - exact.grad).abs().max().item() <= 1e-6
