"""Forward + backward of the actor's log-probs on one micro-batch of one GRPO group: full width vs padding columns
cut vs the shared prompt forwarded once (``actor.share_prompt_prefix``).

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_trim_padding.py [--model DIR] [--repeats 3]

The real SmolLM2-135M-Instruct (fp32, sdpa, the ``smollm2-135m-grpo-cpu`` preset's settings), one micro-batch
of 8 rows of one GRPO group (the same prompt of P tokens, 8 sampled responses in R = 64 columns), as the
update forwards it without remove padding. ``full`` forwards all P + R columns (the path before
``workers.utils.trim_padding``); ``trimmed`` is ``response_log_probs`` as the actor calls it without
remove padding; ``shared`` packs the group's prompt once and its 8 responses after it (``workers.utils.shared_prompt``,
``actor.share_prompt_prefix=true``). Scenarios
are response lengths of that preset's rollouts: ``early`` (one sample of the group ran to the 64-token limit,
as ~30% of samples do at the start: nothing to cut) and ``late`` (the lengths after ~10 steps, when the model
stops at its answer). Prints seconds per forward + backward (median) and the ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

SCENARIOS = {
    "early": [64, 31, 18, 40, 27, 22, 35, 29],
    "late": [24, 31, 18, 40, 27, 22, 35, 29],
}
PROMPT, RESPONSE = 90, 64


def _batch(lengths: list[int], vocab: int) -> dict:
    import torch

    from rlhf_ops.padding import compute_position_ids

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (PROMPT,), generator=gen)
    rows, masks = [], []
    for n in lengths:
        response = torch.randint(10, vocab, (n,), generator=gen)
        rows.append(torch.cat([prompt, response, torch.full((RESPONSE - n,), 2)]))
        masks.append(torch.cat([torch.ones(PROMPT + n), torch.zeros(RESPONSE - n)]).long())
    mask = torch.stack(masks)
    return {"input_ids": torch.stack(rows), "attention_mask": mask, "position_ids": compute_position_ids(mask)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_ops.models.resolve import resolve_model_path
    from workers.actor.forward import _padded_logits, _token_log_probs, response_log_probs

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(args.model), dtype=torch.float32, attn_implementation="sdpa"
    )
    stats = {"calculate_entropy": True, "entropy_requires_grad": False, "temperature": 0.7}

    def full(b: dict) -> torch.Tensor:
        logits, labels = _padded_logits(model, **b, response_length=RESPONSE, keep_logits=True)
        return _token_log_probs(logits, labels, **stats)[0]

    def trimmed(b: dict) -> torch.Tensor:
        return response_log_probs(model, **b, response_length=RESPONSE, **stats)[0]

    def shared(b: dict) -> torch.Tensor:
        return response_log_probs(model, **b, response_length=RESPONSE, share_prompts=True, **stats)[0]

    results: dict[str, dict[str, float]] = {}
    for name, lengths in SCENARIOS.items():
        b = _batch(lengths, model.config.vocab_size)
        mask = b["attention_mask"][:, -RESPONSE:]
        row: dict[str, float] = {}
        for variant, fn in (("full", full), ("trimmed", trimmed), ("shared", shared)):
            times = []
            for _ in range(args.repeats):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                (fn(b) * mask).sum().backward()
                times.append(time.perf_counter() - start)
            row[f"{variant}_s"] = sorted(times)[len(times) // 2]
        row["speedup"] = row["full_s"] / row["trimmed_s"]
        row["shared_speedup"] = row["full_s"] / row["shared_s"]
        row["columns_full"] = PROMPT + RESPONSE
        row["columns_trimmed"] = PROMPT + max(lengths)
        results[name] = row
        print(
            f"{name:6s} responses {lengths}: full {row['full_s']:.2f} s ({PROMPT + RESPONSE} columns), "
            f"trimmed {row['trimmed_s']:.2f} s ({PROMPT + max(lengths)} columns): {row['speedup']:.2f}x; "
            f"shared prompt {row['shared_s']:.2f} s ({PROMPT + sum(lengths)} tokens): {row['shared_speedup']:.2f}x"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
