"""Where a stage's CPU time goes, from a worker's Chrome trace (``trainer.profile_steps``).

    .venv/bin/python bench/trace_breakdown.py profiles/step_2/actor_update_actor_rank0.json

Reads the trace's ``cpu_op`` events, computes each op's *self* time (its duration minus that of the ops nested in
it on the same thread), and sums self time by category: matmuls (``mm``, ``addmm``, ``bmm``, ``linear``'s
backward), attention (sdpa and its backward), log-softmax / entropy (the fused log-prob chunks: ``log_softmax``,
``logsumexp``, ``softmax``, ``exp``), norms and elementwise (``mul``, ``add``, ``pow``, ``rsqrt``, ``mean``, casts),
the optimizer (``_foreach_*``, AdamW), FSDP collectives and copies, and the rest. Prints a Markdown table and the
top ops by self time. Shares are of the summed self time of all ops (threads other than the main one, e.g. gloo's,
count too; the trace's wall time is printed separately).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention (sdpa fwd + bwd)", re.compile(r"scaled_dot_product|_flash_attention|_efficient_attention|attention")),
    ("matmul (mm / addmm / bmm)", re.compile(r"^aten::(mm|addmm|bmm|matmul|linear|baddbmm|_mkldnn|mkldnn_)")),
    ("log-softmax / entropy", re.compile(r"softmax|logsumexp|^aten::exp$|^aten::log$|gather|entropy")),
    ("optimizer (AdamW)", re.compile(r"_foreach_|adam|Optimizer\.step|lerp|addcmul|addcdiv")),
    ("FSDP / collectives", re.compile(r"c10d|gloo|all_gather|reduce_scatter|allreduce|FSDP|fsdp|split_with_sizes")),
    (
        "norms / elementwise / casts",
        re.compile(r"^aten::(mul|add|sub|div|pow|rsqrt|mean|sum|neg|silu|sigmoid|to|_to_copy|copy_|where|cat|clone)"),
    ),
    ("embedding", re.compile(r"embedding")),
)


def self_times(events: list[dict[str, Any]]) -> dict[str, float]:
    """Self time (us) per op name: duration minus the durations of the ops directly nested in it (per thread)."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "cpu_op" and "dur" in ev:
            by_thread[(ev.get("pid"), ev.get("tid"))].append(ev)
    totals: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[dict[str, Any], float]] = []  # (event, summed child time)
        for ev in evs:
            start = float(ev["ts"])
            while stack and start >= float(stack[-1][0]["ts"]) + float(stack[-1][0]["dur"]):
                done, child = stack.pop()
                totals[done["name"]] += float(done["dur"]) - child
            if stack:
                parent, child = stack[-1]
                stack[-1] = (parent, child + float(ev["dur"]))
            stack.append((ev, 0.0))
        for done, child in stack:
            totals[done["name"]] += float(done["dur"]) - child
    return dict(totals)


def categorize(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    trace = json.loads(args.trace.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    wall = (max(float(e["ts"]) + float(e["dur"]) for e in ops) - min(float(e["ts"]) for e in ops)) / 1e6
    totals = self_times(events)
    total = sum(totals.values()) / 1e6
    groups: dict[str, float] = defaultdict(float)
    for name, us in totals.items():
        groups[categorize(name)] += us / 1e6
    print(f"trace wall time {wall:.2f} s, summed op self time {total:.2f} s")
    print("\n| category | self time (s) | share |")
    print("|---|---|---|")
    for label, seconds in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {seconds:.2f} | {seconds / total:.0%} |")
    print("\n| op | self time (s) | category |")
    print("|---|---|---|")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| `{name}` | {us / 1e6:.2f} | {categorize(name)} |")


if __name__ == "__main__":
    main()
