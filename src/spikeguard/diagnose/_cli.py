"""The ``spikeguard diagnose`` options and command (cli.py adds the subparser).

The detector flags are generated from DetectorConfig (``--grad-k``, ``--skip-ratio``, ...) and
the search flags from FindConfig, both through ``DiagnoseConfig``, so no default is written twice.
A detector value left at its default is sized to the log by ``replay_config`` (the windows of a
short or sparse log shrink), as ``spikeguard train`` sizes them to the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from .._config_cli import add_config_args, config_from_args, flag_message
from ._detector import DetectorConfig
from .readers import FORMATS
from .spikes import FindConfig

__all__ = ["DiagnoseConfig", "add_arguments", "overrides", "parse_compare", "run"]

_FIELDS = {f.name: f for f in dataclasses.fields(DetectorConfig)}


@dataclass(kw_only=True, frozen=True)
class DiagnoseConfig:
    """The thresholds behind ``spikeguard diagnose``, one flag per leaf field."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """The detector replayed; values left at their defaults are sized to the log."""
    find: FindConfig = field(default_factory=FindConfig)
    """How spikes are found and their evidence measured."""


def overrides(config: DetectorConfig) -> dict[str, Any]:
    """The DetectorConfig fields that differ from the defaults (set on the command line)."""
    base = DetectorConfig()
    return {k: getattr(config, k) for k in _FIELDS if getattr(config, k) != getattr(base, k)}


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
                   help="the log's format (default: from the name, or a console log's content)")
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
    group = p.add_argument_group("detector thresholds (what-if: replay with other values) and "
                                 "the spike search")
    add_config_args(group, DiagnoseConfig)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 2 on bad input (the message on stderr)."""
    from ._columns import parse_map
    from .report import print_summary, write_report
    from .triage import diagnose

    try:
        cfg = config_from_args(DiagnoseConfig, args)
        diag = diagnose(args.log, fmt=args.fmt, mapping=parse_map(args.map),
                        detector=overrides(cfg.detector), ckpt_every=args.ckpt_every,
                        find=cfg.find,
                        compare=parse_compare(args.compare) if args.compare else None,
                        quarantine=args.quarantine)
        if args.report:
            write_report(diag, args.report)
    except ValueError as exc:
        print(f"spikeguard diagnose: {flag_message(exc, DiagnoseConfig)}", file=sys.stderr)
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
