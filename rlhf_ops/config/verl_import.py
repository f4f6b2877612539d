"""``rlhf config from-verl``: a verl launch script, override list or YAML becomes a preset file here.

verl's example scripts pass Hydra overrides to ``python3 -m verl.trainer.main_ppo``, one per continued line,
with shell variables set earlier in the script (``TP=${1:-4}``, ``train_files="['$a', '$b']"``). This module
expands those variables as the shell would (the script's own assignments, then the environment, then a
``${VAR:-default}``), reads the ``key=value`` words after the module, translates them with the same table
as the command line (:mod:`rlhf_ops.config.verl_compat`) and writes the preset with a header that lists every
key it could not carry over and why.
"""

from __future__ import annotations

import ast
import operator
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlhf_ops.config.errors import ConfigError, ConfigProblem
from rlhf_ops.config.loader import build_config, parse_override
from rlhf_ops.config.verl_compat import DOCS, Translation, flatten, nest, translate

_ENTRY_MODULE = re.compile(r"verl\.trainer\.main_\w+")
_ASSIGNMENT = re.compile(r"^\s*(?:export\s+|local\s+)?([A-Za-z_]\w*)=(.*)$")
_ARRAY_START = re.compile(r"^\s*(?:local\s+|declare\s+-a\s+)?([A-Za-z_]\w*)=\((.*)$")
_ARRAY_USE = re.compile(r"\"?\$\{(\w+)\[[@*]\]\}\"?")
_ARITHMETIC = re.compile(r"\$\(\(([^()]*(?:\([^()]*\)[^()]*)*)\)\)")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_SHELL_OPERATORS = ("|", "||", "&&", ";", "&")
VERL_DEVICE = "cuda"  # verl's trainer.device default (ours is cpu)
VERL_REWARD = "default"  # verl's default_compute_score: the rule reward chosen by each row's data_source


@dataclass
class Conversion:
    """What ``from-verl`` made of a source: the native mapping, and each verl key and what became of it."""

    preset: dict[str, Any]
    translation: Translation
    problems: list[ConfigProblem] = field(default_factory=list)  # refused keys and unreadable words
    notes: list[str] = field(default_factory=list)


def _integer(node: ast.AST) -> int:
    """An integer expression of ``$((...))`` (``+ - * /`` on integers); anything else raises ValueError."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        op = _OPERATORS.get(ast.FloorDiv if isinstance(node.op, ast.Div) else type(node.op))
        if op is not None:
            return int(op(_integer(node.left), _integer(node.right)))
    raise ValueError("not shell integer arithmetic")


def _arithmetic(match: re.Match[str]) -> str:
    try:
        return str(_integer(ast.parse(match.group(1).strip(), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError):
        return match.group(0)  # left as written: reported as an unset variable


def _braced(text: str, start: int) -> int:
    """The index just past the ``}`` that closes the ``${`` at ``start`` (nested ``${...}`` allowed)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    return len(text)


def _parameter(inner: str, variables: Mapping[str, str]) -> str | None:
    """``NAME``, ``NAME:-default`` or ``NAME-default`` (the inside of ``${...}``); None when NAME is unset."""
    match = re.match(r"(\w+)(?::?-(.*))?$", inner, re.S)
    if not match:
        return None
    if match.group(1) in variables:
        return variables[match.group(1)]
    default = match.group(2)
    return _expand(default, variables).strip("\"'") if default is not None else None


def _expand(text: str, variables: Mapping[str, str]) -> str:
    """``${ARR[@]}``, ``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``$((1024 * 2))`` replaced as bash would;
    an unknown variable without a default stays as written (and is reported)."""
    text = _ARRAY_USE.sub(lambda m: variables.get(f"{m.group(1)}[@]", m.group(0)), text)
    out, i = [], 0
    while i < len(text):
        if text.startswith("${", i):
            end = _braced(text, i + 1)
            value = _parameter(text[i + 2 : end - 1], variables)
            out.append(text[i:end] if value is None else value)
            i = end
        elif (name := re.match(r"\$(\w+)", text[i:])) and not text.startswith("$((", i):
            out.append(variables.get(name.group(1), name.group(0)))
            i += len(name.group(0))
        else:
            out.append(text[i])
            i += 1
    return _ARITHMETIC.sub(_arithmetic, "".join(out))


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote: the words as written
        return text.split()


def _assign(line: str, variables: dict[str, str]) -> None:
    """A shell assignment (``NAME=value``, ``export NAME=value``) recorded with its value expanded."""
    match = _ASSIGNMENT.match(line)
    if match and not re.search(r"\$\((?!\()|`", match.group(2)):  # $(command): not run here
        words = _words(_expand(match.group(2), variables))
        variables[match.group(1)] = " ".join(words)


def script_overrides(text: str, environ: Mapping[str, str]) -> tuple[list[str], list[ConfigProblem]]:
    """The ``key=value`` words a verl script passes to ``verl.trainer.main_ppo`` (or a bare override list)."""
    text = re.sub(r"\\\r?\n", " ", text)  # line continuations: one command per line
    variables, command = dict(environ), None
    lines = iter(text.splitlines())
    for line in lines:
        if _ENTRY_MODULE.search(line):
            command = line
            break
        if array := _ARRAY_START.match(line):  # NAME=( word ... ) over one or more lines
            body = array.group(2)
            while not body.rstrip().endswith(")"):
                body += "\n" + next(lines, ")")
            words = _words(_expand(body.rstrip()[:-1], variables))
            variables[f"{array.group(1)}[@]"] = " ".join(shlex.quote(word) for word in words)
            continue
        _assign(line, variables)
    words = _words(_expand(command if command is not None else text, variables))
    if command is not None:
        words = words[next(i for i, w in enumerate(words) if _ENTRY_MODULE.search(w)) + 1 :]
    overrides, problems = [], []
    for word in words:
        if word in _SHELL_OPERATORS or word.startswith((">", "2>", "1>")):
            break  # "| tee log", "2>&1": the command ends
        if word.startswith("--config-name") and "megatron" in word:
            problems.append(
                ConfigProblem(word, "Megatron-LM configs have no counterpart here", "use FSDP (actor.fsdp)")
            )
        elif word.startswith("-") or word in ("$@", "$*") or "=" not in word:
            continue  # Hydra options (--config-path) and the script's own arguments
        elif "$" in word.partition("=")[2]:
            key = word.partition("=")[0]
            problems.append(
                ConfigProblem(
                    key, f"uses a shell variable the script does not set ({word})", "set it or edit the value"
                )
            )
        else:
            overrides.append(word)
    return overrides, problems


def _pairs(overrides: list[str]) -> tuple[list[tuple[str, Any]], list[ConfigProblem]]:
    pairs, problems = [], []
    for item in overrides:
        try:
            path, value = parse_override(item)
        except ConfigError as exc:
            problems += exc.problems
            continue
        pairs.append((".".join(path), value))
    return pairs, problems


def convert(text: str, *, is_yaml: bool, environ: Mapping[str, str]) -> Conversion:
    """A verl YAML (``is_yaml``) or script / override list as a preset mapping here, with what was left out."""
    problems: list[ConfigProblem] = []
    if is_yaml:
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError("the verl YAML is not a mapping; pass a verl config file or a launch script")
        pairs = flatten(data)
    else:
        overrides, problems = script_overrides(text, environ)
        pairs, bad = _pairs(overrides)
        problems += bad
    translation = translate(pairs)
    conversion = Conversion(nest(translation.pairs), translation, problems + translation.problems)
    if not any(key in ("trainer.device", "resources.device") for key, _ in pairs):
        conversion.preset.setdefault("resources", {})["device"] = VERL_DEVICE
        conversion.notes.append(f"resources.device={VERL_DEVICE}: verl's default device (trainer.device)")
    reward = conversion.preset.get("reward", {})
    if "reward_fn" not in reward and "model_path" not in reward:
        conversion.preset.setdefault("reward", {})["reward_fn"] = VERL_REWARD
        conversion.notes.append(f"reward.reward_fn={VERL_REWARD}: verl's default reward (scored by data_source)")
    return conversion


def render(conversion: Conversion, *, source: str) -> str:
    """The preset file: a header saying where it came from and what was not carried over, then the YAML."""
    lines = [f"# Converted from verl ({source}) by `rlhf config from-verl`; the key names are explained in {DOCS}."]
    if conversion.problems:
        lines.append("# Not carried over (no counterpart here):")
        lines += [f"#   {problem}" for problem in conversion.problems]
    if conversion.translation.inert:
        lines.append("# Dropped, no effect here:")
        lines += [f"#   {key}={value!r}: {why}" for key, value, why in conversion.translation.inert]
    lines += [f"# Note: {note}" for note in conversion.notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(conversion.preset, sort_keys=False)


def report(conversion: Conversion) -> list[str]:
    """What the command prints: counts, every key not carried over, and whether the preset validates."""
    out = [
        f"carried over: {len(conversion.translation.pairs)} setting(s); dropped with no effect: "
        f"{len(conversion.translation.inert)}; not carried over: {len(conversion.problems)}"
    ]
    out += [f"  not carried over: {problem}" for problem in conversion.problems]
    try:
        build_config(conversion.preset)
    except ConfigError as exc:
        out.append("the preset does not validate yet (set these, e.g. with overrides):")
        out += [f"  {problem}" for problem in exc.problems]
    return out


def from_verl_command(source: str, *, out: str | None, environ: Mapping[str, str]) -> int:
    """``rlhf config from-verl SOURCE [-o OUT]``: the preset to OUT (or stdout), the report to stderr; 0 or 2."""
    import sys
    from pathlib import Path

    path = Path(source)
    if not path.is_file():
        print(f"error: {source}: no such file; pass a verl launch script, override list or YAML", file=sys.stderr)
        return 2
    try:
        conversion = convert(path.read_text(), is_yaml=path.suffix in (".yaml", ".yml"), environ=environ)
    except (ValueError, yaml.YAMLError) as exc:
        print(f"error: {source}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    text = render(conversion, source=path.name)
    if out:
        Path(out).write_text(text)
    else:
        print(text, end="")
    for line in report(conversion):
        print(line, file=sys.stderr)
    return 0
