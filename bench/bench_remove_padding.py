"""Benchmark: remove padding and dynamic batch size against padded fixed micro-batches, on skewed lengths.

Run (CPU, one process, 2 threads; 3.5-4.5 minutes on 2 cores at load average below 5, 10 at a load of 10)::

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_remove_padding.py

Notation: B = sequences, P = prompt width, R = response width (the longest response), T = P + R.

Model: the tiny Llama widened to hidden 256, 4 layers, 4 heads (head_dim 64), MLP 1024 (4.24M fp32 parameters),
FSDP2 on a 1-rank gloo group, sdpa attention. Batch: ``--num-seqs`` sequences, most of ``--short`` total tokens,
``--num-long`` of ``--long`` tokens, every row padded to T (prompts left-padded, responses right-padded), as a
rollout hands them to the actor. Four variants of :class:`workers.actor.DataParallelPPOActor`, same process,
same model, same batch:

1. ``padded+fixed`` (baseline): rows of width T, ``--micro-batch-size`` rows per micro-batch;
2. ``rmpad+fixed``: ``use_remove_padding`` (valid tokens of a micro-batch packed into one row), same rows;
3. ``padded+dynamic``: micro-batches by a ``--max-token-len`` budget of valid tokens, rows still of width T;
4. ``rmpad+dynamic``: both.

Each timed run restores the initial weights and builds a fresh AdamW first (untimed), then times
``compute_log_prob`` and ``update_policy`` (``--mini-batches`` optimizer steps, one PPO epoch), so every variant
does the same work from the same state. One warm-up round, then ``--repeats`` rounds; each round runs all four
variants, in an order rotated by one every round (a load spike on the shared machine hits every variant alike).
Reported: median seconds and the speed-up over the baseline (baseline seconds / variant seconds), the tokens the
model forwarded per call (counted by a forward pre-hook) against the valid ones, the micro-batches per call, and
the peak RSS while each variant ran (psutil, sampled every 10 ms). Checks: ``actor/pg_loss`` of every variant
within 1e-4 of the baseline's, and the log-probs on response tokens within 1e-4 (the speed-up is not from doing
different work). ``old_log_probs`` are the baseline's log-probs plus noise, so PPO ratios differ from 1 and
``pg_loss`` depends on the forward (with ratio 1 it would only be minus the mean advantage).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from rlhf_ops.config.batch_plan import MeshPlan, PPOPlan  # noqa: E402
from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, OptimConfig  # noqa: E402
from rlhf_ops.models.tiny import build_tiny_model_dir  # noqa: E402
from rlhf_ops.protocol import DataProto  # noqa: E402
from workers.actor import DataParallelPPOActor  # noqa: E402
from workers.fsdp import apply_fsdp2, build_device_mesh, build_lr_scheduler, build_optimizer, load_hf_model  # noqa: E402

PROMPT_WIDTH = 16  # P; prompt lengths are drawn in [8, 16]
VOCAB_LOW, VOCAB_HIGH = 4, 84  # token ids of the tiny tokenizer's characters (0-3 are special)
TOLERANCE = 1e-4
TIMES = ("update wall", "update cpu", "log_prob wall", "log_prob cpu")


@dataclass(frozen=True)
class Variant:
    """One actor configuration under test."""

    name: str
    remove_padding: bool
    dynamic: bool


VARIANTS = (
    Variant("padded+fixed", remove_padding=False, dynamic=False),
    Variant("rmpad+fixed", remove_padding=True, dynamic=False),
    Variant("padded+dynamic", remove_padding=False, dynamic=True),
    Variant("rmpad+dynamic", remove_padding=True, dynamic=True),
)


@dataclass
class Measurements:
    """What the timed runs of one variant recorded."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {key: [] for key in TIMES})
    """Per timed round: wall and process CPU seconds of ``update_policy`` and ``compute_log_prob``."""
    pg_loss: float = float("nan")
    log_probs: Tensor | None = None
    update_tokens: int = 0  # tokens forwarded by one update_policy call
    update_calls: int = 0  # micro-batches (forwards) of one update_policy call
    log_prob_tokens: int = 0
    log_prob_calls: int = 0
    peak_rss: int = 0


# ------------------------------------------------------------------------------------------------ batch
def make_skewed_batch(
    num_seqs: int, *, num_long: int, short: tuple[int, int], long: tuple[int, int], seed: int
) -> DataProto:
    """A PPO batch whose total lengths (prompt + response) are mostly in ``short``, ``num_long`` in ``long``.

    Rows are padded to T = P + R: prompts (B, P) left-padded, responses (B, R) right-padded, R the longest
    response; the longest row has exactly ``long[1]`` tokens. The long rows sit at seeded random positions.
    ``old_log_probs`` and ``advantages`` are filled in by :func:`add_ppo_inputs`.
    """
    g = torch.Generator().manual_seed(seed)
    totals = torch.randint(short[0], short[1] + 1, (num_seqs,), generator=g)
    long_rows = torch.randperm(num_seqs, generator=g)[:num_long]
    totals[long_rows] = torch.randint(long[0], long[1] + 1, (num_long,), generator=g)
    totals[long_rows[0]] = long[1]
    prompt_lens = torch.randint(8, PROMPT_WIDTH + 1, (num_seqs,), generator=g)
    prompt_lens[long_rows[0]] = PROMPT_WIDTH
    response_lens = totals - prompt_lens  # (B,) >= 1 since short[0] > PROMPT_WIDTH
    width = int(response_lens.max())  # R
    prompt_mask = (torch.arange(PROMPT_WIDTH) >= (PROMPT_WIDTH - prompt_lens).unsqueeze(1)).long()  # (B, P)
    response_mask = (torch.arange(width) < response_lens.unsqueeze(1)).long()  # (B, R)
    prompts = torch.randint(VOCAB_LOW, VOCAB_HIGH, (num_seqs, PROMPT_WIDTH), generator=g) * prompt_mask
    responses = torch.randint(VOCAB_LOW, VOCAB_HIGH, (num_seqs, width), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (B, T)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),  # (B, T)
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),  # (B, T), 0 at the first valid token
        "response_mask": response_mask,
    }
    return DataProto.from_dict(tensors=tensors)


def add_ppo_inputs(data: DataProto, log_probs: Tensor, *, seed: int) -> DataProto:
    """Adds ``old_log_probs`` = ``log_probs`` + N(0, 0.3) and a per-sequence advantage of N(0, 1), both (B, R)."""
    g = torch.Generator().manual_seed(seed + 1)
    mask = data.batch["response_mask"]  # type: ignore[index]
    rows, width = mask.shape
    old = log_probs + 0.3 * torch.randn(rows, width, generator=g)  # ratios exp(+-0.3): some clipped at 0.2
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width) * mask
    return data.union(DataProto.from_dict(tensors={"old_log_probs": old, "advantages": advantages.contiguous()}))


# ------------------------------------------------------------------------------------------------ model
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_policy(model_dir: Path) -> nn.Module:
    """The FSDP2-wrapped policy on the 1-rank gloo group (fp32, sdpa)."""
    model = load_hf_model(model_dir, kind="causal_lm", attn_implementation="sdpa")
    return apply_fsdp2(model, build_device_mesh(1), FSDPConfig())


def make_plan(args: argparse.Namespace, *, dynamic: bool) -> PPOPlan:
    """What ``derive_batch_plan`` gives one rank for these sizes (one PPO epoch)."""
    mini = args.num_seqs // args.mini_batches
    micro = min(args.micro_batch_size, mini)
    return PPOPlan(
        mesh=MeshPlan(world_size=1, dp_size=1, sp_size=1, replicate_size=1, shard_size=1),
        mini_batch_size=mini,
        mini_batch_size_per_rank=mini,
        micro_batch_size_per_rank=micro,
        num_mini_batches=args.mini_batches,
        ppo_epochs=1,
        use_dynamic_bsz=dynamic,
        max_token_len_per_rank=args.max_token_len,
        log_prob_micro_batch_size_per_rank=args.log_prob_micro_batch_size,
        log_prob_max_token_len_per_rank=2 * args.max_token_len,  # no backward: twice the budget, as verl does
    )


def make_actor(model: nn.Module, initial: list[Tensor], variant: Variant, plan: PPOPlan) -> DataParallelPPOActor:
    """Restores the initial weights and returns an actor with a fresh AdamW (so every run starts alike)."""
    with torch.no_grad():
        for param, saved in zip(model.parameters(), initial, strict=True):
            param.copy_(saved)
    optim = OptimConfig(lr=1e-5)
    optimizer = build_optimizer(model, optim)
    scheduler = build_lr_scheduler(optimizer, optim, total_steps=10)
    config = ActorConfig(use_remove_padding=variant.remove_padding, use_dynamic_bsz=variant.dynamic)
    return DataParallelPPOActor(model, optimizer, scheduler, config=config, algorithm=AlgorithmConfig(), plan=plan)


# ------------------------------------------------------------------------------------------------ probes
class TokenCounter:
    """Counts the model's forward calls and the token positions (``input_ids.numel()``) they were given."""

    def __init__(self, model: nn.Module) -> None:
        self.tokens = 0
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        input_ids: Tensor = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.tokens += int(input_ids.numel())
        self.calls += 1

    def take(self) -> tuple[int, int]:
        """(tokens, calls) since the last call, then resets."""
        counts = (self.tokens, self.calls)
        self.tokens = self.calls = 0
        return counts


class PeakRss:
    """Context manager: the peak resident set size of this process while it was open (sampled every 10 ms)."""

    def __init__(self) -> None:
        self.peak = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(0.01)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


# ------------------------------------------------------------------------------------------------ runs
def timed_run(
    actor: DataParallelPPOActor, data: DataProto, counter: TokenCounter, result: Measurements
) -> dict[str, float]:
    """Runs ``compute_log_prob`` then ``update_policy`` once; stores counts, pg_loss and peak RSS in ``result``.

    Returns:
        Seconds by :data:`TIMES` key: wall (``perf_counter``) and CPU of this process (``process_time``, all
        threads; on a shared machine it moves less than wall time with the other jobs' load).
    """
    counter.take()
    with PeakRss() as rss:
        wall, cpu = time.perf_counter(), time.process_time()
        log_probs, _ = actor.compute_log_prob(data)
        log_prob_wall, log_prob_cpu = time.perf_counter() - wall, time.process_time() - cpu
        log_prob_counts = counter.take()
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = actor.update_policy(data)
        update_wall, update_cpu = time.perf_counter() - wall, time.process_time() - cpu
    result.peak_rss = max(result.peak_rss, rss.peak)
    result.log_prob_tokens, result.log_prob_calls = log_prob_counts
    result.update_tokens, result.update_calls = counter.take()
    result.pg_loss, result.log_probs = metrics["actor/pg_loss"], log_probs
    return dict(zip(TIMES, (update_wall, update_cpu, log_prob_wall, log_prob_cpu), strict=True))


def run_rounds(
    model: nn.Module, data: DataProto, args: argparse.Namespace, counter: TokenCounter
) -> dict[str, Measurements]:
    """A warm-up round and ``args.repeats`` timed rounds of every variant, in an order rotated every round."""
    initial = [p.detach().clone() for p in model.parameters()]
    plans = {v.name: make_plan(args, dynamic=v.dynamic) for v in VARIANTS}
    results = {v.name: Measurements() for v in VARIANTS}
    for round_index in range(args.repeats + 1):
        shift = round_index % len(VARIANTS)
        seen = []
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            actor = make_actor(model, initial, variant, plans[variant.name])
            seconds = timed_run(actor, data, counter, results[variant.name])
            if round_index > 0:  # round 0 is the warm-up
                for key, value in seconds.items():
                    results[variant.name].seconds[key].append(value)
            seen.append(f"{variant.name} {seconds['update wall']:.1f}+{seconds['log_prob wall']:.1f}s")
        label = "warm-up" if round_index == 0 else f"round {round_index}"
        print(f"  {label} wall (update+log-prob): {', '.join(seen)}; load {os.getloadavg()[0]:.1f}", flush=True)
    return results


# ------------------------------------------------------------------------------------------------ report
def check_same_work(results: dict[str, Measurements], response_mask: Tensor) -> None:
    """Asserts every variant's pg_loss and response log-probs match the baseline's within TOLERANCE."""
    base = results[VARIANTS[0].name]
    assert base.log_probs is not None
    valid = response_mask.bool()
    for name, result in results.items():
        assert result.log_probs is not None
        lp_diff = float((result.log_probs - base.log_probs)[valid].abs().max())
        loss_diff = abs(result.pg_loss - base.pg_loss)
        print(
            f"  {name:15s} pg_loss {result.pg_loss:+.7f} (|diff| {loss_diff:.1e}), max |log-prob diff| {lp_diff:.1e}"
        )
        if loss_diff > TOLERANCE or lp_diff > TOLERANCE:
            raise AssertionError(f"{name} differs from the baseline by more than {TOLERANCE}: not the same work.")


def print_tables(results: dict[str, Measurements], *, valid_tokens: int, padded_tokens: int) -> None:
    """Markdown tables: median seconds and speed-up over the baseline; work done and peak RSS."""
    medians = {name: {k: statistics.median(v) for k, v in r.seconds.items()} for name, r in results.items()}
    base = medians[VARIANTS[0].name]
    print(f"\nvalid tokens {valid_tokens}, padded batch B x T = {padded_tokens} ({padded_tokens / valid_tokens:.1f}x)")
    rounds = len(results[VARIANTS[0].name].seconds["update wall"])
    print(f"\nmedian seconds over {rounds} rounds [min]; speed-up = baseline median / variant median")
    print("| variant | " + " | ".join(f"{key} s | speed-up" for key in TIMES) + " |")
    print("|---|" + "---|---|" * len(TIMES))
    for name, median in medians.items():
        cells = []
        for key in TIMES:
            low = f" [{min(results[name].seconds[key]):.2f}]" if key.endswith("wall") else ""
            cells.append(f"{median[key]:.2f}{low} | {base[key] / median[key]:.2f}x")
        print(f"| {name} | {' | '.join(cells)} |")
    work = "tokens forwarded: update / log-prob | forwards (micro-batches): update / log-prob"
    print(f"\n| variant | {work} | peak RSS MiB |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r.update_tokens} / {r.log_prob_tokens} | {r.update_calls} / {r.log_prob_calls}"
            f" | {r.peak_rss / 2**20:.0f} |"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32, help="B")
    parser.add_argument("--num-long", type=int, default=3, help="Sequences drawn from --long.")
    parser.add_argument("--short", type=int, nargs=2, default=(32, 64), help="Total length range of most rows.")
    parser.add_argument("--long", type=int, nargs=2, default=(512, 768), help="Total length range of long rows.")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="Rows per update micro-batch (fixed).")
    parser.add_argument("--log-prob-micro-batch-size", type=int, default=16, help="Rows per log-prob micro-batch.")
    parser.add_argument("--max-token-len", type=int, default=2048, help="Valid-token budget (dynamic; x2 log-prob).")
    parser.add_argument("--mini-batches", type=int, default=2, help="Optimizer steps per update_policy.")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="Timed rounds after the warm-up round.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.num_seqs % args.mini_batches:
        parser.error(f"--num-seqs {args.num_seqs} must be a multiple of --mini-batches {args.mini_batches}.")
    if not 1 <= args.num_long <= args.num_seqs:
        parser.error(f"--num-long must be in [1, --num-seqs]; got {args.num_long}.")
    if args.short[0] <= PROMPT_WIDTH or args.long[1] > args.max_token_len:
        parser.error(f"need --short above {PROMPT_WIDTH} (the prompt width) and --long below --max-token-len.")
    return args


def main() -> None:
    args = parse_args()
    load_start = os.getloadavg()
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load average {load_start}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_rmpad_") as tmp:
            model_dir = build_tiny_model_dir(
                Path(tmp) / "model",
                hidden_size=256,
                num_layers=args.layers,
                num_heads=4,
                num_kv_heads=4,
                intermediate_size=1024,
                max_position_embeddings=2048,
            )
            model = build_policy(model_dir)
        data = make_skewed_batch(
            args.num_seqs, num_long=args.num_long, short=tuple(args.short), long=tuple(args.long), seed=args.seed
        )
        baseline = make_actor(
            model, [p.detach().clone() for p in model.parameters()], VARIANTS[0], make_plan(args, dynamic=False)
        )
        data = add_ppo_inputs(data, baseline.compute_log_prob(data)[0], seed=args.seed)
        batch = data.batch
        assert batch is not None
        valid, padded = int(batch["attention_mask"].sum()), batch["input_ids"].numel()
        num_params = sum(p.numel() for p in model.parameters())
        print(f"model {num_params / 1e6:.2f}M params; batch B x T = {tuple(batch['input_ids'].shape)}")
        counter = TokenCounter(model)
        results = run_rounds(model, data, args, counter)
        print_tables(results, valid_tokens=valid, padded_tokens=padded)
        print("\nsame work check (tolerance 1e-4):")
        check_same_work(results, batch["response_mask"])
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"\nprocess peak RSS {peak_mib:.0f} MiB; load average at start {load_start}, at end {os.getloadavg()}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
