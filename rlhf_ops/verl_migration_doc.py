"""``docs/verl_migration.md``, generated from the tables the code reads (verl keys, field_map transforms).

``python scripts/gen_verl_docs.py`` rewrites the page; a test fails when the page and the table differ.
"""

from __future__ import annotations

from typing import Any

from rlhf_ops.config.verl_keys import VERL_KEYS, Carry, Drop
from rlhf_ops.data.field_transforms import TRANSFORMS

_INTRO = """# Coming from verl

The configuration here follows verl's names where it can; the keys differ in their root
(`actor_rollout_ref.actor.*` is `actor.*`) and in a few places listed below. You can keep using verl's
names:

- **On the command line and in YAML**: `rlhf config show tiny-cpu actor_rollout_ref.actor.optim.lr=1e-6
  trainer.n_gpus_per_node=8` is accepted, and the resolved config is shown (and stored) under the names here
  (`actor.optim.lr`, `resources.nproc_per_node`). A preset YAML may hold verl's sections
  (`actor_rollout_ref:`, `custom_reward_function:`) too. Hydra's `+key=value` is accepted as `key=value`.
- **A whole verl run**: `rlhf config from-verl run_qwen2-7b.sh -o my_preset.yaml` reads the overrides a verl
  launch script passes to `python3 -m verl.trainer.main_ppo` (shell variables such as `$HOME`, `${TP:-4}`
  and line continuations are expanded as the shell would), or a verl YAML, and writes a preset file here.
  Its header and the command's output list every key it could not carry over and why;
  `rlhf config show my_preset.yaml` then shows the result. Keys it sets that verl defaults but this
  platform does not: `resources.device=cuda`, and `reward.reward_fn=default` (verl's reward chosen by each
  row's `data_source`) when the script names no reward.
- **Keys with no counterpart** (Megatron-LM, TensorRT-LLM, vLLM engine tuning...) are refused in one line
  that names the verl key, says why, and names the closest key here. Where the verl value is what this
  platform does anyway (`actor_rollout_ref.actor.strategy=fsdp`, `trainer.critic_warmup=0`), the key is
  accepted and has no effect. verl's unset values (`null`) and Hydra interpolations (`${...}`) have no effect.

verl's dataset preprocessing (`examples/data_preprocess/gsm8k.py`, `math_dataset.py`) is done by
`field_map` transforms when the data is prepared (`rlhf prepare-data --field`, a pipeline spec's
`data.field_map`, the trigger form):

| transform | what it does |
| --- | --- |
{transforms}

For GSM8K, as verl prepares it:

```yaml
field_map:
  prompt: "question|template:{} Let's think step by step and output the final answer after \\"####\\"."
  ground_truth: "answer|gsm8k_final_answer"
```

Rows whose answer cannot be extracted go to `rejected.jsonl` with the reason.
"""


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    return f"`{_cell(value)}`"


def migration_markdown() -> str:
    """The whole page, deterministic (the table's order)."""
    transforms = "\n".join(f"| `{name}` | {_cell(t.summary)} |" for name, t in TRANSFORMS.items())
    lines = [_INTRO.replace("{transforms}", transforms).rstrip(), "", "## verl keys with a counterpart here", ""]
    lines += ["| verl key | key here | note |", "| --- | --- | --- |"]
    for key, entry in VERL_KEYS.items():
        if isinstance(entry, Carry):
            natives = ", ".join(_code(native) for native in entry.natives)
            notes = [entry.note] if entry.note else []
            if entry.convert is not None:
                notes.append((entry.convert.__doc__ or "").strip().rstrip("."))
            notes += [f"`{value}` is refused: {why}" for value, why in entry.refuse.items()]
            lines.append(f"| {_code(key)} | {natives} | {_cell('; '.join(notes))} |")
    lines += [
        "",
        "Keys of `data`, `critic`, `algorithm` and `trainer` with the same name here (e.g. `data.train_batch_size`, "
        "`algorithm.adv_estimator`, `algorithm.kl_ctrl.kl_coef`, `critic.ppo_mini_batch_size`) are taken as they are.",
        "",
        "## verl keys with no counterpart",
        "",
        "A key ending in `.*` stands for every key under it that is not listed on its own.",
        "",
        "| verl key | why | closest key here | accepted with no effect |",
        "| --- | --- | --- | --- |",
    ]
    for key, entry in VERL_KEYS.items():
        if isinstance(entry, Drop):
            native = _code(entry.native) if entry.native else ""
            inert = ", ".join(_code(value) for value in entry.inert)
            lines.append(f"| {_code(key)} | {_cell(entry.reason)} | {native} | {inert} |")
    return "\n".join(lines) + "\n"
