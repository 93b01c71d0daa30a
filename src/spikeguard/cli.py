"""The ``spikeguard`` command: ``budget``, ``train``, ``sandbox`` and ``diagnose`` (more subcommands
join as they land)."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import warnings
from typing import Any

__all__ = ["EXIT_STATUS", "main"]


def _parse_count(text: str) -> float:
    """'13e9', '13b', '350m' -> a parameter count."""
    t = text.strip().lower()
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(t[-1:], 1.0)
    try:
        return float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a named model nor a parameter count like 13e9 or 13b") from None


def _cmd_budget(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .prevent.budget import MODELS, memory_budget

    shape = MODELS.get(args.model.lower())
    try:
        n_params = shape.n_params if shape else _parse_count(args.model)
    except argparse.ArgumentTypeError as exc:
        print(f"spikeguard budget: {exc} (named: {', '.join(MODELS)})", file=sys.stderr)
        return 2
    layers = args.layers or (shape.n_layers if shape else None)
    hidden = args.hidden or (shape.hidden if shape else None)
    heads = args.heads or (shape.n_heads if shape else None)
    seq = args.seq_len or (shape.seq_len if shape else None)
    known = None not in (layers, hidden, heads, seq)
    try:
        budgets = [memory_budget(n_params, n_gpus=args.gpus, zero_stage=z, recipe=args.recipe,
                                 seq_len=seq if known else None, batch=args.batch,
                                 hidden=hidden if known else None, n_heads=heads if known else None,
                                 n_layers=layers if known else None, recompute=args.recompute,
                                 attention=args.attention)
                   for z in range(4)]
    except ValueError as exc:
        print(f"spikeguard budget: {exc}", file=sys.stderr)
        return 2
    chosen = budgets[args.zero]
    if args.json:
        print(json.dumps(chosen.to_dict(), indent=2))
        return 0
    console = Console(highlight=False, width=max(100, Console().width))
    console.print(f"[bold]{args.model}[/]: {n_params / 1e9:.3g}B params, {args.recipe} AdamW, "
                  f"{chosen.bytes_per_param:g} bytes/param -> {chosen.total_bytes / 1e9:,.2f} GB static")
    parts = " + ".join(f"{v:g} {k}" for k, v in chosen.components.items())
    console.print(f"  per param: {parts}")
    table = Table(title=f"static memory per GPU over {args.gpus} GPU(s) (GB = 1e9 bytes)")
    table.add_column("ZeRO stage")
    table.add_column("per GPU (GB)", justify="right")
    for b in budgets:
        mark = " <- --zero" if b.zero_stage == args.zero else ""
        table.add_row(f"{b.zero_stage}{mark}", f"{b.per_gpu_bytes / 1e9:,.2f}")
    console.print(table)
    if chosen.activation_bytes is not None:
        how = ("full recompute: the layer inputs only" if args.recompute else
               "no recompute; attention " + ("flash (SDPA): no s x s scores stored, --attention "
                                             "eager for a kernel that stores them"
                                             if args.attention == "flash" else
                                             "eager: the s x s scores, softmax and dropout mask "
                                             "stored"))
        console.print(f"  activations: {chosen.activation_bytes / 1e9:,.2f} GB per micro-batch of "
                      f"{args.batch} x {seq} tokens ({layers} layers, 16-bit, {how})")
    else:
        console.print("  activations: give --layers --hidden --heads --seq-len for an estimate")
    return 0


EXIT_STATUS = {0: "done (or the run was already complete)",
               1: "the machine failed the run (a full disk, a checkpoint that could not be "
                  "saved); rerun the same command to resume once it is fixed",
               2: "bad input: a flag, the data, --out, checkpoints that cannot be restored",
               3: "the guard halted the run (Tier 3; the report names the tensor)",
               130: "interrupted (Ctrl-C); rerun the same command to resume"}
"""The exit statuses of ``spikeguard train`` (README's table)."""


def _cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from ._config_cli import config_from_args, flag_message
    from .checkpoint import CheckpointError
    from .train import TrainConfig, TrainInterrupted, train

    try:
        cfg = config_from_args(TrainConfig, args)
        if args.print_config:
            print(json.dumps(dataclasses.asdict(cfg.resolved()), indent=2, default=str))
            return 0
        result = train(cfg)
    except ValueError as exc:
        print(f"spikeguard train: {flag_message(exc, TrainConfig)}", file=sys.stderr)
        return 2
    except TrainInterrupted as exc:
        print(f"spikeguard train: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("spikeguard train: interrupted before training began; rerun the same command (it "
              "resumes from the last checkpoint, if there is one)", file=sys.stderr)
        return 130
    except (CheckpointError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"spikeguard train: {type(exc).__name__}: {first}; the checkpoints written so far "
              f"are intact: rerun the same command to resume once this is fixed", file=sys.stderr)
        return 1
    if result.halted is not None:
        print(str(result.halted), file=sys.stderr)
        print(f"HALT at step {result.halted.step}: {'; '.join(result.halted.reasons)}")
        return 3
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line ("spikeguard train: error: ..."), not usage + error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _cmd_sandbox(args: argparse.Namespace) -> int:
    try:
        from .sandbox.server import serve
    except ImportError as exc:
        print(f"spikeguard sandbox: {exc.name or exc} is not installed; the page needs the web extra: "
              f"pip install 'spikeguard[web]'", file=sys.stderr)
        return 2
    return serve(args.port)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from .diagnose._cli import run

    try:
        return run(args)
    except OSError as exc:  # a report directory that cannot be written, a log that vanished
        where = f" {exc.filename}" if exc.filename else ""
        print(f"spikeguard diagnose: cannot write or read{where}: {exc.strerror or exc}; choose "
              f"a writable --report directory (or check the log's path)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spikeguard diagnose: interrupted", file=sys.stderr)
        return 130


def _one_line_warning(message: Any, category: type[Warning], filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
    """A warning as the command prints it: one line, no source path."""
    text = " ".join(str(message).split())
    print(f"spikeguard: {category.__name__}: {text}", file=file or sys.stderr)


def _add_diagnose(sub: argparse._SubParsersAction) -> None:
    from .diagnose._cli import add_arguments

    p = sub.add_parser("diagnose", help="triage a run's metrics log: spikes, tiers, what-if, report",
                       description="Find the spikes in a run's metrics log, classify each by "
                       "replaying the spike detector, and say what to do (skip, roll back to "
                       "which checkpoint, add z-loss, change precision). Detector values left at "
                       "their defaults are sized to the log (DetectorConfig.for_run; windows "
                       "divided by the stride of a sparse log); window flags count log records.")
    add_arguments(p)
    p.set_defaults(func=_cmd_diagnose)


def build_parser() -> argparse.ArgumentParser:
    from ._config_cli import add_config_args
    from .train import TrainConfig
    from .train.config import SHAPE_FIELDS

    parser = _Parser(prog="spikeguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    from .prevent.budget import ATTENTION, memory_budget

    p = sub.add_parser("budget", help="static memory per parameter, ZeRO stages, activations",
                       description="Static memory of AdamW training per parameter and per GPU at "
                       "each ZeRO stage (the chosen --zero marked <-), and activations of one "
                       "micro-batch when the shape is known.")
    p.add_argument("model", help="a named model (gpt2, gpt2-xl, 7b, 13b, 70b) or a count like 13e9")
    p.add_argument("--gpus", type=int, default=8, help="GPUs to shard over (default 8)")
    p.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage (default 3)")
    p.add_argument("--recipe", default="bf16-mixed", choices=("bf16-mixed", "fp32", "fp16-mixed"))
    p.add_argument("--layers", type=int, help="transformer blocks, for the activation estimate")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--seq-len", type=int, help="sequence length")
    p.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    p.add_argument("--recompute", action="store_true", help="full activation recompute")
    attention = inspect.signature(memory_budget).parameters["attention"].default
    p.add_argument("--attention", choices=ATTENTION, default=attention,
                   help="flash: SDPA/FlashAttention, which stores no attention scores; eager: "
                   f"the s x s scores and softmax stored (default: {attention})")
    p.add_argument("--json", action="store_true", help="print the chosen stage as JSON")
    p.set_defaults(func=_cmd_budget)

    p = sub.add_parser("train", help="train the reference GPT through the Guard, every defense on",
                       description="Train the reference GPT on text that ships with Python (or "
                       "--data) through the Guard. Rerun the same command to resume.",
                       epilog="exit status: " + " | ".join(f"{k}: {v}" for k, v in
                                                          EXIT_STATUS.items()))
    # the model preset and the data decide these (spikeguard.train.config)
    skip = (*(f"gpt.{name}" for name in SHAPE_FIELDS), "guard.detector.vocab_size")
    add_config_args(p, TrainConfig, skip=skip)
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (defaults, --defenses, windows) and exit")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sandbox", help="the loss-spike sandbox page, served on 127.0.0.1 only")
    p.add_argument("--port", type=int, default=8765,
                   help="port on 127.0.0.1 (default 8765; 0 picks a free one)")
    p.set_defaults(func=_cmd_sandbox)

    _add_diagnose(sub)
    _add_oncall(sub)
    return parser


def _add_oncall(sub: argparse._SubParsersAction) -> None:
    from .oncall import respond, watch

    p = sub.add_parser("respond", help="answer a running job's Tier 2 page: rollback, continue, "
                       "halt", description="Answer the open incident of a run started with "
                       "--tier2 ask: the run applies the answer at its next step boundary, the same "
                       "on every rank. A bad answer is refused (exit status 2), nothing written.")
    respond.add_arguments(p)
    p.set_defaults(func=respond.run)
    p = sub.add_parser("watch", help="a run's live state and its incident, with the answers as "
                       "buttons, on 127.0.0.1 only")
    watch.add_arguments(p)
    p.set_defaults(func=watch.run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["diagnose"]:  # only its parser: the train parser imports torch, diagnose needs none
        parser = _Parser(prog="spikeguard", description=__doc__)
        _add_diagnose(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    else:
        parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # put back on return: main() may run inside a program
        warnings.showwarning = _one_line_warning
        return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
