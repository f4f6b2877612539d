"""The individual pre-flight checks: model folders, tokenizer, reward function, data files, stores, tracking.

Each check returns a list of :class:`~rlhf_ops.config.ConfigProblem` (the dotted config key, what is wrong,
the fix) and never raises for a user mistake. They are torch-free on purpose: the Airflow ``preflight``
task runs them in the scheduler's worker, so model folders are read with ``json`` (``config.json``,
``tokenizer_config.json``, safetensors headers), never through transformers. Anything that talks to the
network runs under a deadline (:func:`within`), so an unreachable endpoint costs seconds, not minutes.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rlhf_ops.config import ConfigProblem

Problem = ConfigProblem
T = TypeVar("T")

BUILTIN_PREFIX = "builtin:"
NETWORK_TIMEOUT_S = 10.0
# A tokenizer needs one of these (fast tokenizer, sentencepiece, BPE vocab, WordPiece vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Short botocore timeouts and one retry: a probe that hangs tells the user less than one that fails fast.
_S3_PROBE_OPTIONS = {
    "config_kwargs": {
        "connect_timeout": 3,
        "read_timeout": 5,
        "retries": {"mode": "standard", "total_max_attempts": 2},
    }
}


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` in a daemon thread; raises :class:`TimeoutError` if it has not returned after ``seconds``.

    The thread is abandoned, not killed (Python cannot); it is a daemon so it never holds the process.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="preflight-probe")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---- model folders ------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (a Git LFS pointer, a truncated download), or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name} is {size} bytes, not a safetensors file"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 << 20):
            return f"{path.name} is not a safetensors file (a Git LFS pointer or a truncated download?)"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return f"{path.name} has an unreadable safetensors header"
    ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__" and "data_offsets" in t]
    if 8 + header_len + max(ends, default=0) > size:
        return f"{path.name} is truncated ({size} bytes, its header needs {8 + header_len + max(ends)})"
    return None


def _weights_problems(key: str, folder: Path) -> list[Problem]:
    fix = f"point {key} at a complete HF model folder (save_pretrained writes the weights)"
    for index_name in WEIGHT_INDEXES:
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(_read_json(index)["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as exc:
                return [Problem(key, f"{index} is not a weight index ({_short(exc)})", fix)]
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                return [Problem(key, f"{index_name} lists shards missing from {folder}: {', '.join(missing)}", fix)]
            files = [folder / s for s in shards]
            break
    else:
        files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
        if not files:
            return [Problem(key, f"{folder} has no weights (*.safetensors, *.bin or a sharded index)", fix)]
    bad = [why for f in files if f.suffix == ".safetensors" and (why := _safetensors_problem(f))]
    return [Problem(key, f"in {folder}: {why}", fix) for why in bad]


def check_model_dir(key: str, path: str | None) -> list[Problem]:
    """``path`` is an HF model folder: a ``config.json`` with a ``model_type``, complete weights.

    ``builtin:`` models are built where they are used and pass.
    """
    if path is None or path.startswith(BUILTIN_PREFIX):
        return []
    folder = Path(path)
    if not folder.is_dir():
        fix = "put the HF model folder on a path every node can read (nothing is downloaded at run time)"
        return [Problem(key, f"{path} is not a folder visible here", fix)]
    config_file = folder / "config.json"
    fix = f"point {key} at an HF model folder (save_pretrained or `rlhf model import-gguf` writes one)"
    if not config_file.is_file():
        return [Problem(key, f"{path} has no config.json", fix)]
    try:
        config = _read_json(config_file)
    except (OSError, ValueError) as exc:
        return [Problem(key, f"{config_file} is not valid JSON ({_short(exc)})", fix)]
    if not isinstance(config, dict) or not config.get("model_type"):
        return [Problem(key, f"{config_file} has no model_type", fix)]
    try:
        return _weights_problems(key, folder)
    except OSError as exc:  # unreadable weights (permissions, a broken mount)
        return [Problem(key, f"cannot read the weights in {folder} ({_short(exc)})", fix)]


# ---- tokenizer ----------------------------------------------------------------------------------
def _token(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class TokenizerInfo:
    """What pre-flight reads from a tokenizer folder without loading it."""

    has_files: bool
    has_chat_template: bool
    pad_token: str | None
    eos_token: str | None


def read_tokenizer_info(folder: Path) -> TokenizerInfo:
    """Tokenizer files, chat template and pad / eos tokens from ``tokenizer_config.json`` & co."""
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as in transformers
        try:
            loaded = _read_json(folder / name)
        except (OSError, ValueError):
            continue
        if isinstance(loaded, dict):
            config.update({k: v for k, v in loaded.items() if v is not None})
    template = bool(config.get("chat_template")) or any(
        (folder / name).is_file() for name in ("chat_template.jinja", "chat_template.json")
    )
    return TokenizerInfo(
        has_files=any((folder / name).is_file() for name in TOKENIZER_FILES),
        has_chat_template=template,
        pad_token=_token(config.get("pad_token")),
        eos_token=_token(config.get("eos_token")),
    )


def check_tokenizer(key: str, path: str, *, chat_prompts: bool, notes: list[str]) -> list[Problem]:
    """Tokenizer files, a chat template when chat prompts go through it, and a usable pad / eos token."""
    if path.startswith(BUILTIN_PREFIX) or not Path(path).is_dir():
        return []  # built where used; a missing folder is reported by check_model_dir
    info = read_tokenizer_info(Path(path))
    problems = []
    if not info.has_files:
        problems.append(
            Problem(key, f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)})", "save the tokenizer there too")
        )
    if chat_prompts and not info.has_chat_template:
        problems.append(
            Problem(
                "data.apply_chat_template",
                f"the prompts are chat messages but the tokenizer in {path} has no chat template",
                "set data.apply_chat_template=false (message contents are joined) or add a chat template",
            )
        )
    if info.eos_token is None:
        problems.append(
            Problem(
                key,
                f"the tokenizer in {path} has no eos_token (the trainer stops and masks responses at it)",
                'add "eos_token": "<end-of-turn token>" to its tokenizer_config.json',
            )
        )
    elif info.pad_token is None:
        notes.append(f"{key}: no pad token; the platform pads with the eos token {info.eos_token!r}")
    elif info.pad_token == info.eos_token:
        notes.append(
            f"{key}: pad == eos ({info.eos_token!r}); a response keeps its first eos in the mask and the reward, "
            "the padding after it is masked"
        )
    return problems


# ---- reward function ----------------------------------------------------------------------------
def check_reward_fn(spec: str | None) -> list[Problem]:
    """``reward.reward_fn`` imports and takes ``(data_source, solution_str, ground_truth, extra_info)``."""
    if spec is None:
        return []
    from rlhf_ops.rewards.registry import check_reward_fn as check

    try:
        check(spec)
    except ValueError as exc:
        # check_reward_fn's line names the key itself ("reward.reward_fn: ..." / "reward.reward_fn='x': ...")
        text = str(exc).removeprefix("reward.reward_fn: ").removeprefix("reward.reward_fn=")
        message, _, fix = text.partition("; ")
        return [Problem("reward.reward_fn", message, fix.rstrip(".") or "fix the reward function")]
    except Exception as exc:  # user code: anything can happen at import time
        return [Problem("reward.reward_fn", f"importing {spec!r} raised {_short(exc)}", "fix the reward module")]
    return []


# ---- multi-turn tools -----------------------------------------------------------------------------
def check_multi_turn(cfg: Any) -> list[Problem]:
    """``rollout.multi_turn.tools`` and ``.interaction`` import and build (``python`` is built by the workers)."""
    if not cfg.enable:
        return []
    from rlhf_ops.agent.registry import WORKER_BUILTIN_TOOLS, load_interaction, load_tools
    from rlhf_ops.agent.tools import ToolLimits, tool_examples

    problems: list[Problem] = []
    built: dict[str, Any] = {}
    checks = [
        (
            "rollout.multi_turn.tools",
            lambda: built.update(
                load_tools([t for t in cfg.tools if t not in WORKER_BUILTIN_TOOLS], limits=ToolLimits())
            ),
        ),
        ("rollout.multi_turn.interaction", lambda: load_interaction(cfg.interaction)),
    ]
    for key, check in checks:
        try:
            check()
        except ValueError as exc:  # the registry's line names the key itself
            message, _, fix = str(exc).removeprefix(f"{key}: ").partition("; ")
            problems.append(Problem(key, message, fix.rstrip(".") or "fix the spec"))
        except Exception as exc:  # user code: anything can happen at import time
            problems.append(Problem(key, f"building it raised {_short(exc)}", "fix the module"))
    if cfg.tool_prompt == "example" and not problems and not tool_examples(built):
        problems.append(
            Problem(
                "rollout.multi_turn.tool_prompt",
                f"'example' shows a worked call of a tool with an example() method, and none of {list(cfg.tools)} "
                "has one",
                "set rollout.multi_turn.tool_prompt=schemas, or add the calculator tool or an example() to yours",
            )
        )
    return problems


# ---- data files ---------------------------------------------------------------------------------
def open_url(url: str) -> tuple[Any, str]:
    """``(fs, path)`` of a data or store URL, with short network timeouts on S3."""
    from rlhf_ops.storage import open_store
    from rlhf_ops.storage.stores import url_scheme

    return open_store(url, storage_options=_S3_PROBE_OPTIONS if url_scheme(url) == "s3" else None)


@dataclass(frozen=True)
class DataColumns:
    """What one data file holds, read from its schema (Parquet) or its first rows (JSONL)."""

    rows: int | None  # None: not known without reading the whole file
    columns: frozenset[str]
    chat_prompts: bool


def _parquet_columns(fs: Any, path: str, prompt_key: str) -> DataColumns:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        meta = pq.ParquetFile(f)
        schema = meta.schema_arrow
        rows = meta.metadata.num_rows
    names = set(schema.names)
    for field in schema:  # nested columns (verl's reward_model.ground_truth) by their dotted name
        if pa.types.is_struct(field.type):
            names |= {f"{field.name}.{child.name}" for child in field.type}
    chat = prompt_key in schema.names and pa.types.is_list(schema.field(prompt_key).type)
    return DataColumns(rows, frozenset(names), chat)


def _jsonl_columns(fs: Any, path: str, prompt_key: str, sample: int = 64) -> DataColumns:
    rows: list[dict[str, Any]] = []
    with fs.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                row = json.loads(line)  # ValueError names the line's position
                if not isinstance(row, dict):
                    raise ValueError(f"line {number} is not a JSON object")
                rows.append(row)
            if len(rows) >= sample:
                break
    # A key counts only if every sampled row has it: a column missing from some rows fails mid-run.
    per_row = [set(r) | {f"{k}.{c}" for k, v in r.items() if isinstance(v, dict) for c in v} for r in rows]
    columns = set.intersection(*per_row) if per_row else set()
    chat = bool(rows) and isinstance(rows[0].get(prompt_key), list)
    return DataColumns(None if len(rows) >= sample else len(rows), frozenset(columns), chat)


def _hf_dataset_columns(fs: Any, path: str, prompt_key: str) -> DataColumns:
    """Columns of an HF ``datasets`` folder (``save_to_disk``) from its ``dataset_info.json`` features."""
    with fs.open(f"{path}/dataset_info.json", "rt", encoding="utf-8") as f:
        features = json.load(f).get("features") or {}
    names = set(features)
    for name, feature in features.items():  # a struct is a plain mapping of sub-features (no "_type")
        if isinstance(feature, dict) and "_type" not in feature:
            names |= {f"{name}.{child}" for child in feature}
    prompt = features.get(prompt_key)
    chat = isinstance(prompt, list) or (isinstance(prompt, dict) and prompt.get("_type") in ("List", "Sequence"))
    return DataColumns(None, frozenset(names), chat)


def read_data_columns(url: str, *, prompt_key: str, timeout_s: float = NETWORK_TIMEOUT_S) -> DataColumns:
    """Columns of one ``.parquet`` / ``.jsonl`` file or HF datasets folder at any fsspec URL.

    Raises:
        FileNotFoundError: nothing at ``url``. OSError, ValueError, TimeoutError: it cannot be read.
    """

    def read() -> DataColumns:
        fs, path = open_url(url)
        if not fs.exists(path):
            raise FileNotFoundError(f"{url} does not exist")
        if url.endswith(".parquet"):
            return _parquet_columns(fs, path, prompt_key)
        if url.endswith((".jsonl", ".json")):
            return _jsonl_columns(fs, path, prompt_key)
        if fs.isdir(path) and fs.exists(f"{path}/dataset_info.json"):
            return _hf_dataset_columns(fs, path, prompt_key)
        raise ValueError(f"{url} is neither .parquet, .jsonl nor an HF datasets folder (save_to_disk)")

    return within(timeout_s, read)


def check_data_files(
    key: str, urls: Sequence[str], *, prompt_key: str, ground_truth_key: str | None
) -> tuple[list[Problem], bool]:
    """Each file is readable and has the prompt (and, for rule rewards, ground-truth) column.

    Returns:
        ``(problems, whether any prompt is chat messages)``. ``builtin:`` tasks are generated where used.
    """
    problems, chat = [], False
    fix = "fix the URL, or run `rlhf prepare-data` and point data at its train.parquet / val.parquet"
    for url in urls:
        if url.startswith(BUILTIN_PREFIX):
            continue
        try:
            found = read_data_columns(url, prompt_key=prompt_key)
        except FileNotFoundError:
            problems.append(Problem(key, f"{url} does not exist", fix))
            continue
        except Exception as exc:  # any store or format error (botocore's are neither OSError nor ValueError)
            problems.append(Problem(key, f"cannot read {url} ({_short(exc)})", fix))
            continue
        chat = chat or found.chat_prompts
        if found.rows == 0:
            problems.append(Problem(key, f"{url} has no rows", "point it at a non-empty file"))
            continue
        for field_key, column in (("data.prompt_key", prompt_key), ("data.ground_truth_key", ground_truth_key)):
            if column is not None and column not in found.columns:
                shown = ", ".join(sorted(c for c in found.columns if "." not in c)) or "none"
                problems.append(
                    Problem(
                        field_key,
                        f"{url} has no column {column!r} (columns: {shown})",
                        f"set {field_key} to the file's column, or map it with `rlhf prepare-data --field`",
                    )
                )
    return problems, chat


# ---- stores and tracking ------------------------------------------------------------------------
def check_remote_store(key: str, url: str, *, probe_dir: str, timeout_s: float = NETWORK_TIMEOUT_S) -> list[Problem]:
    """Write and delete a small file under ``probe_dir`` (a URL under the store) to prove write access."""
    from rlhf_ops.storage import redact_url

    probe = f"{probe_dir.rstrip('/')}/.preflight-{uuid.uuid4().hex[:8]}"

    def touch() -> None:
        fs, path = open_url(probe)
        fs.pipe_file(path, b"ok\n")
        fs.rm_file(path)

    try:
        within(timeout_s, touch)
    except Exception as exc:  # any store error: wrong endpoint, credentials, bucket, permissions
        fix = "check the URL, the endpoint (AWS_ENDPOINT_URL), the credentials and write permission"
        return [Problem(key, f"cannot write to {redact_url(url)} ({_short(exc)})", fix)]
    return []


def check_resume_checkpoint(mode: str, *, timeout_s: float = NETWORK_TIMEOUT_S) -> list[Problem]:
    """An explicit ``trainer.resume_mode`` names a committed checkpoint (its ``MANIFEST.json`` is there)."""
    if mode in ("auto", "disable"):
        return []
    from rlhf_ops.storage.manifest import is_complete

    def complete() -> bool:
        if "://" in mode and not mode.startswith("file://"):
            fs, path = open_url(mode)
            return is_complete(path, fs=fs)
        return is_complete(mode.removeprefix("file://"))

    fix = "point it at a global_step_<N> folder with a MANIFEST.json, or use trainer.resume_mode=auto"
    try:
        if within(timeout_s, complete):
            return []
        return [Problem("trainer.resume_mode", f"{mode} is not a complete checkpoint (no valid MANIFEST.json)", fix)]
    except Exception as exc:
        return [Problem("trainer.resume_mode", f"cannot read {mode} ({_short(exc)})", fix)]


def check_tracking(uri: str | None, *, timeout_s: float = 5.0) -> list[Problem]:
    """An ``http(s)://`` MLflow tracking server answers (any HTTP status counts: auth is MLflow's job)."""
    from rlhf_ops.storage import redact_url

    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or not uri.startswith(("http://", "https://")):
        return []  # a local store or a database URI: MLflow opens it itself
    key = "tracking.mlflow_uri"
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        return []  # it answered
    except (OSError, ValueError) as exc:
        fix = "start the server, fix the URI (or MLFLOW_TRACKING_URI), or drop 'mlflow' from trainer.logger"
        return [Problem(key, f"MLflow at {redact_url(uri)} does not answer ({_short(exc)})", fix)]
    return []
