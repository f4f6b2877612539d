"""``rlhf prepare-data``: command-line arguments to a :class:`PrepareSpec`, the result printed as JSON."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from rlhf_ops.config.errors import one_line
from rlhf_ops.data.prepare import DataQualityError, PrepareSpec, prepare_dataset


def prepare_from_args(args: argparse.Namespace) -> int:
    """Runs ``rlhf prepare-data``: prints the result as JSON; exit 0, 2 (bad input) or 3 (data quality).

    ``args``: :class:`PrepareSpec` fields by name (None keeps the default), ``out``, ``run_id``, ``tokenizer`` (a
    directory or ``builtin:tiny-llama``), ``field`` (``OURS=THEIRS`` strings) and ``no_chat_template``.
    """
    try:
        pairs = [item.partition("=") for item in args.field or []]
        if not all(ours and sep and theirs for ours, sep, theirs in pairs):
            raise ValueError(f"--field takes OURS=THEIRS (e.g. prompt=question), got {args.field}")
        options = {k: v for k, v in vars(args).items() if k in PrepareSpec.model_fields and v is not None}
        options.update(field_map={o: t for o, _, t in pairs}, apply_chat_template=not args.no_chat_template)
        spec = PrepareSpec(**options)
        from rlhf_ops.data.images import load_tokenizer_or_processor
        from rlhf_ops.models.resolve import resolve_model_path

        tokenizer = load_tokenizer_or_processor(resolve_model_path(args.tokenizer))  # a VLM's: its processor
        result = prepare_dataset(spec, out_url=args.out, run_id=args.run_id, tokenizer=tokenizer)
    except ValidationError as exc:  # one line per problem, no pydantic banner
        print("error: " + "; ".join(one_line(str(e["msg"])) for e in exc.errors()), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3 if isinstance(exc, DataQualityError) else 2
    print(result.model_dump_json(indent=2))
    return 0
