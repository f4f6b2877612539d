"""Peak memory and time of the actor's log-prob + entropy over a 49k vocabulary: plain chunked vs fused.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_logits.py [--tokens 1024]

One micro-batch's LM head (SmolLM2-135M shapes: hidden 576, vocab 49152) followed by the log-probs and the
entropy, forward and backward, in a fresh process per variant (peak RSS = ``ru_maxrss`` minus the RSS before
the head). ``plain`` is the path the actor used before (a scaled fp32 copy of the logits, then chunked
``logprobs_from_logits`` and a no-grad ``entropy_from_logits``); ``fused`` is ``logprobs_and_entropy``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

HIDDEN, VOCAB = 576, 49152


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _child(variant: str, tokens: int, temperature: float) -> dict[str, float]:
    import torch

    from rlhf_ops.algorithms import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_(True)
    head = (0.05 * torch.randn(VOCAB, HIDDEN, generator=gen)).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen)
    base = _rss_mb()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        logits = hidden @ head.T  # (K, V) fp32: what the model's LM head returns
        if variant == "plain":
            scaled = logits.float() / temperature
            log_probs = logprobs_from_logits(scaled, labels)
            with torch.no_grad():
                entropy_from_logits(scaled.detach())
        else:
            log_probs, _ = logprobs_and_entropy(logits, labels, temperature=temperature)
        log_probs.sum().backward()
        times.append(time.perf_counter() - start)
        del logits, log_probs
        hidden.grad = head.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"peak_over_base_mb": peak - base, "seconds_median": sorted(times)[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="response positions in the micro-batch (K)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--child", choices=["plain", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.tokens, args.temperature)))
        return
    logits_mb = args.tokens * VOCAB * 4 / 2**20
    print(f"K={args.tokens} positions x V={VOCAB}: one fp32 (K, V) logits tensor = {logits_mb:.0f} MiB")
    for variant in ("plain", "fused"):
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens)]
        cmd += ["--temperature", str(args.temperature)]
        out = json.loads(
            subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
        print(
            f"{variant:6s} peak over base {out['peak_over_base_mb']:7.0f} MiB "
            f"({out['peak_over_base_mb'] / logits_mb:.1f} x logits), fwd+bwd {out['seconds_median']:.3f} s"
        )


if __name__ == "__main__":
    main()
