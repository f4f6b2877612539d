"""Token log-probs and entropy from logits, in fp32 and chunked over rows to bound peak memory.

:func:`logprobs_and_entropy` is what the actor uses: both in one pass, with a backward that recomputes the
softmax per chunk, so no (N, V) fp32 intermediate is kept for autograd.

Shape notation: N...: any leading dims (e.g. B, T or a packed total-token dim), V: vocab size.
Results are fp32 whatever the logits dtype (a bf16 log-softmax keeps ~3 significant digits, too few for
the PPO ratio). Only one chunk of rows is upcast at a time, so an fp32 copy of the whole (N, V) logits is
never materialised in the forward pass. Rows are shifted by their max first, so the final subtraction
does not cancel digits away when logits are large.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_BYTES = 16 << 20
"""fp32 bytes of one chunk of the fused pass (its default ``chunk_size``: 85 rows of a 49k vocabulary).

Each chunk makes a few (rows, V) fp32 temporaries; with whole micro-batches as one chunk (150-180 rows in the SmolLM2
bench) each was 30-35 MB, above glibc's 32 MiB ceiling for heap blocks, so every one was a fresh ``mmap`` whose pages
all fault in on first touch. At 16 MiB they stay heap blocks that the next chunk reuses, and the pass's peak extra
memory is a few x 16 MiB whatever the micro-batch size.
"""

EXP_FLOOR = -87.0
"""Floor of the exponent in the fused pass: exp(-87) = 1.6e-38, still a normal fp32 number.

ATen's vectorised ``exp`` leaves its fast path for finite inputs below about -87 (where the result is denormal or
zero): measured on this project's CPUs, a (165, 49152) fp32 chunk of shifted real logits took 60-78 ms against
1.4 ms floored (2 threads). A real 49k-vocabulary softmax has thousands of such entries per row. The floor moves
each of those probabilities by less than 1.6e-38 (the row's sum is >= 1 after the max shift), and each entropy
term ``p * z`` by less than 1.6e-38 x 87, 20 orders of magnitude below fp32's resolution of the results.
"""


def _check_chunk(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 (rows of logits upcast at once), got {chunk_size}.")


def _shifted(rows: Tensor) -> Tensor:
    """fp32 rows minus their max (a constant per row, so no gradient flows through it).

    Both results are invariant to the shift, and with logits near 0 the final subtraction keeps full fp32
    precision: with logits ~1e3, ``z - logsumexp(z)`` would lose 5 digits to cancellation.
    """
    rows = rows.float()
    return rows - rows.max(dim=-1, keepdim=True).values.detach()


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``: ``z[label] - logsumexp(z)``.

    Args:
        logits: (N..., V), any float dtype.
        labels: (N...) token ids, integer dtype.
        chunk_size: Rows (flattened leading positions) processed per step.

    Returns:
        (N...) fp32 log-probs; differentiable w.r.t. ``logits``.
    """
    _check_chunk(chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the logits shape without the vocab dim, "
            f"{tuple(logits.shape[:-1])}."
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_labels = labels.reshape(-1, 1)  # (N, 1)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = _shifted(flat_logits[start : start + chunk_size])
        picked = rows.gather(-1, flat_labels[start : start + chunk_size]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(rows, dim=-1))
    if not pieces:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(labels.shape)


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of ``softmax(logits)`` in the stable form ``logsumexp(z) - sum(softmax(z) * z)``.

    Args:
        logits: (N..., V), any float dtype.
        chunk_size: Rows (flattened leading positions) processed per step.

    Returns:
        (N...) fp32 entropy in nats; differentiable w.r.t. ``logits``.
    """
    _check_chunk(chunk_size)
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = _shifted(flat_logits[start : start + chunk_size])
        probs = torch.softmax(rows, dim=-1)
        # where(): a -inf logit (masked vocab entry) has p = 0 and must add 0, not 0 * -inf = NaN.
        p_times_z = torch.where(probs > 0, probs * rows, torch.zeros_like(rows))
        pieces.append(torch.logsumexp(rows, dim=-1) - p_times_z.sum(dim=-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(logits.shape[:-1])


class _FusedLogProbEntropy(torch.autograd.Function):
    """Log-probs of ``labels`` and entropies of ``softmax(logits / temperature)`` in one chunked pass.

    Saves only the logits (the LM head's output, alive anyway) and three floats per row (row max, shifted
    ``logsumexp``, entropy); the backward recomputes the softmax one chunk at a time and writes the gradient
    chunk by chunk into one buffer. The plain path keeps a scaled fp32 copy, a shifted copy per chunk (saved
    by ``logsumexp``) and, with an entropy bonus, the softmax: 2-4 extra (N, V) fp32 tensors; this keeps none.
    Logits of -inf (masked vocab entries) are clamped to -1e30 after the shift. Before the exponential, the shifted
    logits (and log p in the backward) are floored at :data:`EXP_FLOOR` (see there); the gathered log-prob is
    taken before the floor, so it is exact.
    """

    @staticmethod
    def _shifted_chunk(
        logits: Tensor, start: int, end: int, temperature: float, row_max: Tensor, *, clamp: bool = True
    ) -> Tensor:
        z = logits[start:end].float() / temperature  # (c, V) fp32, a fresh buffer: safe to modify in place
        z.sub_(row_max[start:end].unsqueeze(-1))
        return z.clamp_(min=-1e30) if clamp else z  # -inf -> -1e30 (the backward floors at EXP_FLOOR instead)

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, logits: Tensor, labels: Tensor, temperature: float, chunk_size: int
    ) -> tuple[Tensor, Tensor]:
        n = logits.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy, lse = torch.empty_like(log_probs), torch.empty_like(log_probs)
        row_max = torch.empty_like(log_probs)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            row_max[start:end] = logits[start:end].max(dim=-1).values.float() / temperature
            z = _FusedLogProbEntropy._shifted_chunk(logits, start, end, temperature, row_max)  # max 0: exp <= 1
            picked = z.gather(-1, labels[start:end].unsqueeze(-1)).squeeze(-1)  # before the floor: exact
            e = torch.exp(z.clamp_(min=EXP_FLOOR))
            total = e.sum(dim=-1)  # (c,) >= 1
            lse[start:end] = torch.log(total)
            # H = lse - sum(p * z) with p = e / total; the shift leaves both terms' difference unchanged.
            entropy[start:end] = lse[start:end] - (e * z).sum(dim=-1) / total
            log_probs[start:end] = picked - lse[start:end]
        ctx.save_for_backward(logits, labels, row_max, lse, entropy)
        ctx.set_materialize_grads(False)  # a detached (metric-only) entropy then reaches backward as None
        ctx.temperature, ctx.chunk_size = temperature, chunk_size  # type: ignore[attr-defined]
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor, None, None, None]:
        logits, labels, row_max, lse, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature, chunk_size = ctx.temperature, ctx.chunk_size  # type: ignore[attr-defined]
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            end = min(start + chunk_size, logits.shape[0])
            log_p = _FusedLogProbEntropy._shifted_chunk(logits, start, end, temperature, row_max, clamp=False)
            log_p.sub_(lse[start:end].unsqueeze(-1)).clamp_(min=EXP_FLOOR)  # (c, V) log p, floored as in forward
            probs = torch.exp(log_p)
            g = torch.zeros_like(log_p)
            if grad_entropy is not None:  # dH / dz_k = -p_k (log p_k + H)
                g.sub_(probs * (log_p + entropy[start:end].unsqueeze(-1)) * grad_entropy[start:end].unsqueeze(-1))
            if grad_log_probs is not None:  # d log p_y / dz_k = 1[k = y] - p_k
                gl = grad_log_probs[start:end].unsqueeze(-1)
                g.sub_(probs * gl).scatter_add_(-1, labels[start:end].unsqueeze(-1), gl)
            grad[start:end] = g.div_(temperature)
        return grad, None, None, None


def logprobs_and_entropy(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Log-probs of ``labels`` and the entropy under ``softmax(logits / temperature)``, fused and chunked.

    Equal to ``log_softmax(logits.float() / temperature)`` gathered at ``labels`` and to its entropy (within
    fp32 rounding), with gradients for both, but without materialising any (N, V) fp32 copy of the logits
    beyond one chunk (see :class:`_FusedLogProbEntropy`). Detach the entropy when it is only a metric.

    Args:
        logits: (N..., V), any float dtype.
        labels: (N...) token ids, integer dtype.
        temperature: Logits are divided by it (in fp32) before the softmax.
        chunk_size: Rows (flattened leading positions) upcast at once; None: as many as fit in
            :data:`CHUNK_BYTES` of fp32 (85 rows of a 49k vocabulary).

    Returns:
        ``(log_probs, entropy)``, both (N...) fp32; differentiable w.r.t. ``logits``.
    """
    if chunk_size is None:
        chunk_size = max(1, CHUNK_BYTES // (4 * max(1, logits.shape[-1])))
    _check_chunk(chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the logits shape without the vocab dim, "
            f"{tuple(logits.shape[:-1])}."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (logits are divided by it), got {temperature}.")
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    if flat.shape[0] == 0:
        zeros = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
        return zeros, zeros.clone()
    log_probs, entropy = _FusedLogProbEntropy.apply(flat, labels.reshape(-1).long(), float(temperature), chunk_size)
    return log_probs.reshape(labels.shape), entropy.reshape(labels.shape)
