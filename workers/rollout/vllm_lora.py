"""Adapter-only weight sync into vLLM (``rollout.lora_sync=adapter``): the engine keeps the base weights it loaded
from the model folder at start-up (frozen under LoRA, as in the actor) and serves the policy's current adapter.

How (vLLM's own LoRA support; vLLM 0.32 has no in-memory adapter loading in its public API):
- The engine starts with ``enable_lora=True``, ``max_lora_rank`` = the smallest rank vLLM allows that is >= the
  policy's (its ranks are 1, 8, 16, 32, ...), one adapter per batch and one in its CPU cache.
- Each sync writes the adapter as a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) in
  ``/dev/shm`` and registers it under a new ``LoRARequest`` (name ``policy-<v>``, int id ``v``: a new id per
  policy version, since vLLM caches adapters by id). ``add_lora`` loads it at once, so the folder is deleted
  right after; the previous version is removed. Every generation request carries the current request.
- Memory: the base weights are never re-sent, so on CPU ``free_cache_engine`` frees the KV cache only (the packed
  base weights stay: rebuilding them would need the full weights again).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = ["VLLM_LORA_RANKS", "AdapterSlot", "lora_engine_kwargs", "vllm_max_lora_rank"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""
ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_SHM = Path("/dev/shm")


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``rank`` adapter."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"model.lora.rank={rank} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower it or set "
        "rollout.lora_sync=merged"
    )


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """vLLM engine arguments that let it serve one rank-``rank`` adapter at a time."""
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(rank), "max_loras": 1, "max_cpu_loras": 1}


class AdapterSlot:
    """The adapter an in-process ``vllm.LLM`` serves: one ``LoRARequest`` per policy version.

    Attributes:
        request: The current ``LoRARequest`` (None before the first :meth:`load`: the base model is served).
        last_bytes: Bytes of the adapter tensors of the last :meth:`load`.
    """

    def __init__(self, llm: Any, *, parent: Path | None = None) -> None:
        self.llm = llm
        self.parent = parent if parent is not None else (_SHM if _SHM.is_dir() else None)
        self.request: Any = None
        self.last_bytes = 0
        self._version = 0

    def load(self, tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> None:
        """Registers ``tensors`` (PEFT's saved names, ``base_model.model.<layer>.lora_A.weight``) with PEFT's
        ``config`` as the next version, loaded now; the previous version is removed from the engine.

        Raises:
            ValueError: ``tensors`` is empty.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not tensors:
            raise ValueError("update_adapter got no adapter tensors; the policy has no LoRA adapter to send")
        version = self._version + 1
        folder = Path(tempfile.mkdtemp(prefix=f"rlhf-adapter-{version}-", dir=self.parent))
        try:
            cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
            save_file(cpu, str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
            (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(config), sort_keys=True, default=str))
            request = LoRARequest(lora_name=f"policy-{version}", lora_int_id=version, lora_path=str(folder))
            self.llm.llm_engine.add_lora(request)  # loads the folder now; it is not read again
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if self.request is not None:
            self.llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.request, self._version = request, version
        self.last_bytes = sum(t.numel() * t.element_size() for t in cpu.values())
