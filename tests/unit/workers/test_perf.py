"""MFU from the architecture (hand-counted FLOPs), the device peak, and per-stage memory / profiler traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_ops.config.schema import LoraConfig
from rlhf_ops.protocol import DataProto
from workers.fsdp import load_hf_model
from workers.fsdp.lora import apply_lora
from workers.utils.perf import flops_model, gpu_peak_flops, measured_cpu_peak_flops, mfu, peak_flops
from workers.utils.profiling import StageMonitor, monitored, trace_path

# The tiny Llama: 2 layers, hidden 64, 2 heads (head_dim 32, kv heads 2), intermediate 128, vocab 84, untied.
# Linear in x out per layer: q, k, v, o 64 x 64 = 4096 each; gate, up, down 64 x 128 = 8192 each -> 40960;
# x 2 layers = 81920, + lm_head 64 x 84 = 5376 -> 87296 multiply-adds per token.
TINY_LINEAR = 87296
# Attention forward: 4 * layers * heads * head_dim * causal pairs = 4 * 2 * 2 * 32 = 512 per pair.
# Sequences of 3 and 5 valid tokens: 3*4/2 + 5*6/2 = 6 + 15 = 21 pairs -> 10752 FLOPs.
SEQ_LENS = [3, 5]
ATTN = 512 * 21


def test_tiny_llama_flops_by_hand(tiny_model_dir: str) -> None:
    fm = flops_model(load_hf_model(tiny_model_dir, kind="causal_lm"))
    assert (fm.trained_linear_params, fm.frozen_linear_params) == (TINY_LINEAR, 0)
    assert (fm.num_layers, fm.num_heads, fm.head_dim) == (2, 2, 32)
    assert fm.train_flops(SEQ_LENS) == 6 * TINY_LINEAR * 8 + 3 * ATTN  # 4,222,464


def test_lora_counts_the_frozen_base_at_4x_and_the_adapters_at_6x(tiny_model_dir: str) -> None:
    # Rank 4 on every linear but the head: r * (in + out) per adapter: q/k/v/o 4 * 128 = 512 each (2048),
    # gate/up/down 4 * (64 + 128) = 768 each (2304) -> 4352 per layer, 8704 in all; the whole base is frozen.
    model = apply_lora(load_hf_model(tiny_model_dir, kind="causal_lm"), LoraConfig(rank=4))
    fm = flops_model(model)
    assert (fm.trained_linear_params, fm.frozen_linear_params) == (8704, TINY_LINEAR)
    assert fm.train_flops(SEQ_LENS) == (6 * 8704 + 4 * TINY_LINEAR) * 8 + 3 * ATTN


def test_gqa_and_a_tied_head_are_counted_by_their_real_shapes() -> None:
    # 1 layer, hidden 64, 2 query heads of 32, 1 kv head: q 64x64, k 64x32, v 64x32, o 64x64 = 12288;
    # mlp 3 x 64 x 96 = 18432; tied head 64 x 50 = 3200 (counted once, as the head's matmul) -> 33920.
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=96,
        vocab_size=50,
        num_hidden_layers=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    fm = flops_model(model)
    assert fm.trained_linear_params == 33920
    # 6 x num_parameters (the old estimate) would count the norms and, for an untied model, the embedding too.
    assert sum(p.numel() for p in model.parameters()) == 33920 + 3 * 64
    assert fm.train_flops([10]) == 6 * 33920 * 10 + 3 * 4 * 1 * 2 * 32 * 55


def test_device_peaks() -> None:
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12 and gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12 and gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("Some Future GPU") == 100e12
    measured = measured_cpu_peak_flops(dtype=torch.float32, num_threads=torch.get_num_threads())
    assert 1e8 < measured < 1e14  # a real matmul rate, not a nominal 1 TFLOP/s
    assert peak_flops(torch.device("cpu")) == measured  # cached: measured once per process
    assert mfu(flops=measured, seconds=2.0, device=torch.device("cpu")) == pytest.approx(0.5)


def test_peak_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_PEAK_FLOPS", "2e12")
    assert peak_flops(torch.device("cpu")) == 2e12


def test_stage_monitor_measures_the_stage_peak_and_traces_profiled_steps(tmp_path: Path) -> None:
    monitor = StageMonitor(
        role="actor", rank=1, device=torch.device("cpu"), profile_steps=(3,), profile_dir=str(tmp_path)
    )
    with monitor.stage("small", step=1):
        pass
    with monitor.stage("big", step=3):
        block = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB of float32, touched
        block.add_(1.0)
        del block
    metrics = monitor.pop_metrics()
    # The sampled RSS peak of "big" is at least 0.2 GiB above "small"'s (256 MiB were resident inside it).
    assert metrics["memory/actor/big/peak_rss_gb"] - metrics["memory/actor/small/peak_rss_gb"] > 0.2
    # 256 MiB freshly mapped and touched: 65,536 pages of 4 KiB fault in (128 of 2 MiB with transparent huge
    # pages always on); the empty stage faults in a few pages at most (the sampler thread's stack).
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    huge = thp.exists() and "[always]" in thp.read_text()
    assert metrics["memory/actor/big/minor_faults"] >= (100 if huge else 60_000)
    assert metrics["memory/actor/small/minor_faults"] < 100
    assert monitor.pop_metrics() == {}
    trace = trace_path(tmp_path, step=3, role="actor", stage="big", rank=1)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    assert not (tmp_path / "step_1").exists()  # step 1 was not profiled


class _Worker:
    def __init__(self, tmp: Path) -> None:
        self.monitor = StageMonitor(role="critic", rank=0, device=torch.device("cpu"), profile_dir=str(tmp))

    @monitored("values")
    def values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"values": torch.zeros(len(data), 1)})

    @monitored("update_critic", report=True)
    def update(self, data: DataProto) -> DataProto:
        return DataProto(meta_info={"metrics": {"critic/vf_loss": 0.5}})


def test_monitored_methods_report_every_stage_with_the_last_one(tmp_path: Path) -> None:
    worker = _Worker(tmp_path)
    data = DataProto.from_dict({"x": torch.zeros(2, 1)})
    worker.values(data)
    metrics = worker.update(data).meta_info["metrics"]
    assert metrics["critic/vf_loss"] == 0.5
    assert {"memory/critic/values/peak_rss_gb", "memory/critic/update_critic/peak_rss_gb"} <= set(metrics)
    assert np.isfinite(metrics["memory/critic/values/peak_rss_gb"])


def test_smollm2_flops_by_hand() -> None:
    # SmolLM2-135M: 30 layers, hidden 576, 9 query heads of 64, 3 kv heads (GQA), intermediate 1536, vocab
    # 49152, tied head. Per layer q 576x576 = 331776, k and v 576x192 = 110592 each, o 331776 -> 884736;
    # mlp 3 x 576 x 1536 = 2654208 -> 3538944; x 30 = 106168320; + head 576 x 49152 = 28311552 -> 134479872.
    from tests.support.real_model import smollm2_path

    model = load_hf_model(smollm2_path(), kind="causal_lm", meta=True)  # shapes only, no weights read
    fm = flops_model(model)
    assert fm.trained_linear_params == 134_479_872
    assert (fm.num_layers, fm.num_heads, fm.head_dim) == (30, 9, 64)
    # One sequence of 100 tokens, forward + backward: weights 6 x 134479872 x 100; attention 3 x the forward's
    # 4 x 30 x 9 x 64 x (100 x 101 / 2).
    assert fm.train_flops([100]) == 6 * 134_479_872 * 100 + 3 * 4 * 30 * 9 * 64 * 5050
