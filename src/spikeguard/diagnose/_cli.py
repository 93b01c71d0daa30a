"""The ``spikeguard diagnose`` options and command (cli.py adds the subparser).

The detector flags are generated from DetectorConfig (``--grad-k``, ``--skip-ratio``, ...) and
the search flags from FindConfig, so no default is written twice. A detector flag left out keeps
the value ``replay_config`` sizes to the log (the windows of a short or sparse log shrink).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from .._config_cli import add_config_args, config_from_args, flag_message
from ..respond.detector import DetectorConfig
from .readers import FORMATS
from .spikes import FindConfig

__all__ = ["add_arguments", "parse_compare", "run"]

_FIELDS = {f.name: f for f in dataclasses.fields(DetectorConfig)}


def parse_compare(text: str) -> dict[str, Any]:
    """``"grad_k=5,skip_ratio=2.0"`` -> {"grad_k": 5.0, "skip_ratio": 2.0}, typed by the field's
    default; ValueError naming a pair that is not ``field=value`` of DetectorConfig."""
    out: dict[str, Any] = {}
    for pair in text.split(","):
        if not pair.strip():
            continue
        name, sep, value = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or name not in _FIELDS:
            raise ValueError(f"--compare {pair.strip()!r}: write FIELD=VALUE pairs of "
                             f"DetectorConfig, e.g. grad_k=5,skip_ratio=2.0 (fields: "
                             f"{', '.join(_FIELDS)})")
        default = _FIELDS[name].default
        v = value.strip()
        try:
            if v.lower() == "none" and default is None:
                out[name] = None
            elif isinstance(default, int) or default is None:
                out[name] = int(v)
            else:
                out[name] = float(v)
        except ValueError:
            kind = "an integer" if isinstance(default, int) or default is None else "a number"
            raise ValueError(f"--compare {name}={v!r}: {name} takes {kind}") from None
    if not out:
        raise ValueError("--compare needs at least one FIELD=VALUE pair, e.g. grad_k=5")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The diagnose options on parser ``p``."""
    p.add_argument("log", help="metrics.jsonl, trainer_state.json, metrics.csv, a CSV, a W&B "
                   "history CSV, a TensorBoard event file, or a run directory holding one")
    p.add_argument("--format", dest="fmt", default="auto", choices=FORMATS,
                   help="the log's format (default: from the name)")
    p.add_argument("--map", action="append", default=[], metavar="COL=METRIC",
                   help="read column COL as METRIC (loss, grad_norm, log_z, nan_frac, lr, "
                   "loss_ema_ratio, grad_scale, step); repeat or comma-separate")
    p.add_argument("--ckpt-every", type=int, default=None, metavar="N",
                   help="the run's checkpoint interval in steps: rollback steps become checkpoints")
    p.add_argument("--json", action="store_true", help="print the diagnosis as one JSON object")
    p.add_argument("--report", metavar="OUT", help="write a report with plots (.html or .md)")
    p.add_argument("--compare", metavar="FIELD=VALUE,...",
                   help="replay a second detector configuration side by side, e.g. "
                   "grad_k=5,skip_ratio=2.0")
    p.add_argument("--quarantine", metavar="PATH",
                   help="the run's quarantine file (default: quarantine.jsonl beside the log)")
    det = p.add_argument_group("detector thresholds (what-if: replay with other values)")
    add_config_args(det, DetectorConfig)  # type: ignore[arg-type]
    # unset flags stay None, so replay_config can size the windows to the log
    p.set_defaults(**dict.fromkeys(_FIELDS))
    find = p.add_argument_group("spike search")
    add_config_args(find, FindConfig)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 2 on bad input (the message on stderr)."""
    from ._columns import parse_map
    from .report import print_summary, write_report
    from .triage import diagnose

    overrides = {k: getattr(args, k) for k in _FIELDS if getattr(args, k) is not None}
    try:
        find = config_from_args(FindConfig, args)
        diag = diagnose(args.log, fmt=args.fmt, mapping=parse_map(args.map),
                        detector=overrides, ckpt_every=args.ckpt_every, find=find,
                        compare=parse_compare(args.compare) if args.compare else None,
                        quarantine=args.quarantine)
        if args.report:
            write_report(diag, args.report)
    except ValueError as exc:
        msg = flag_message(exc, FindConfig) if "FindConfig." in str(exc) else \
            flag_message(exc, DetectorConfig)
        print(f"spikeguard diagnose: {msg}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"spikeguard diagnose: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(diag.to_dict(), indent=1))
    else:
        print_summary(diag)
        if args.report:
            print(f"report: {args.report}")
    return 0
