"""The console logs big runs write, read by content into raw columns (``readers.read_log``).

Each format is recognised by the lines it writes, whatever the file is called:

* ``megatron``: Megatron-LM, Megatron-DeepSpeed and NeMo 1 ``iteration N/ M | key: value |`` lines
  (``lm loss`` or ``loss``, ``grad norm``, ``loss scale``, ``learning rate``, ``number of skipped
  iterations``, ``number of nan iterations``). A value cut off at the end of a pasted line (no
  closing ``|``) is no value.
* ``nemo``: NeMo 2 ``Training epoch E, iteration I/N | ... | global_step: S | reduced_train_loss:
  L |`` lines (the step is ``global_step``).
* ``deepspeed``: DeepSpeed's loss-scaler lines (``OVERFLOW! ... Attempted loss scale: A, reducing
  to B``, ``Grad overflow on iteration N``, ``[Rank 0] step=N, skipped=K``) with the Hugging Face
  progress bar (``123/4000 [``) that dates them, and the Trainer's ``{'loss': ...}`` rows.
* ``hfconsole``: the Trainer's ``{'loss': ..., 'grad_norm': ..., 'learning_rate': ...}`` console
  rows alone (no step: rows are numbered from 0, unless they carry ``'step'``).
* ``fairseq``: ``num_updates=N`` progress lines (``loss=``, ``gnorm=``, ``loss_scale=``, ``lr=``)
  and the ``| epoch E | loss X | ... | num_updates N |`` summaries; ``valid`` lines are left out.
* ``nanogpt``: ``iter N: loss X, time T`` (evaluation lines ``step N: train loss X, val loss Y``
  are left out); ``litgpt``: ``iter N step S: loss X, iter time: T``.
* ``llmc``: llm.c's ``step N/M | train loss X | norm G | lr R`` console lines and its ``main.log``
  ``s:N trl:X`` lines (``tel:`` validation lines left out).
* ``moddednanogpt``: ``step:N/M train_loss:X train_time:T`` (``val_loss`` lines left out).
* ``mlx``: mlx-lm's ``Iter N: Train loss X, Learning Rate R`` (``Val loss`` lines left out).

Every format yields the same raw columns (``step``, ``loss``, ``grad_norm``, ``lr``,
``grad_scale``, ``scale_tried``, ``skipped_iters``, ``nan_iters``), with None for a value the line does not carry, and
``assemble`` turns them into a log as it does for a CSV.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TEXT_FORMATS", "accepted_formats", "read_text", "sniff"]

_NUM = (r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|[nN]a[nN]|[iI]nf(?:inity)?"
        r"|INF(?:INITY)?)")
_KEYS = ("step", "loss", "grad_norm", "lr", "grad_scale", "scale_tried", "skipped_iters",
         "nan_iters")

Row = dict[str, Any]


def _num(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


# ---- Megatron-LM / Megatron-DeepSpeed / NeMo 1 -------------------------------------------------

_MEG_HEAD = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_MEG_MAP = {"lm loss": "loss", "loss": "loss", "grad norm": "grad_norm", "learning rate": "lr",
            "loss scale": "grad_scale", "number of skipped iterations": "skipped_iters",
            "number of nan iterations": "nan_iters"}


def _megatron(line: str) -> Row | None:
    """One iteration line: ``| name: value |`` fields split on the pipes (a value cut off at
    the end of the line, without its closing pipe, is no value)."""
    head = _MEG_HEAD.search(line)
    if head is None or "validation loss" in line or "Training epoch" in line:
        return None
    row: Row = {"step": int(head.group(1))}
    parts = line[head.end():].split("|")
    for part in parts[:-1]:  # the text after the last pipe has no closing pipe
        key, _, value = part.partition(":")
        metric = _MEG_MAP.get(key.strip().lower())
        if metric is not None and (metric != "loss" or "loss" not in row):
            row[metric] = _num(value.strip())
    return row


# ---- NeMo 2 ----------------------------------------------------------------------------------

_NEMO_HEAD = re.compile(r"Training epoch \d+, iteration \d+/\d+ \|")
_NEMO_KV = re.compile(r"(\w[\w ]*?):\s*(" + _NUM + r")\s*(?:\||$)", re.I)
_NEMO_MAP = {"global_step": "step", "reduced_train_loss": "loss", "lr": "lr",
             "grad_norm": "grad_norm", "gradient_norm": "grad_norm", "loss_scale": "grad_scale"}


def _nemo(line: str) -> Row | None:
    head = _NEMO_HEAD.search(line)
    if head is None:
        return None
    row: Row = {}
    for key, value in _NEMO_KV.findall(line, head.end()):
        metric = _NEMO_MAP.get(key.strip())
        if metric is not None:
            row[metric] = _num(value)
    if row.get("step") is None:
        return None
    row["step"] = int(row["step"])
    return row


# ---- Hugging Face console rows and DeepSpeed's loss scaler -------------------------------------

_HF_ROW = re.compile(r"\{'(?:loss|grad_norm|learning_rate|epoch)'[^{}]*\}")
_HF_KV = re.compile(r"'(\w+)':\s*'?(" + _NUM + r")'?", re.I)
_HF_MAP = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "lr", "step": "step"}
_TQDM = re.compile(r"\|\s*(\d+)/\d+\s*\[")
_OVERFLOW = re.compile(r"OVERFLOW!.*?Attempted loss scale:\s*(" + _NUM + r")(?:,\s*reducing to\s*("
                       + _NUM + r"))?|Overflow detected\. Skipping step\. Attempted loss scale:\s*("
                       + _NUM + r")(?:,\s*reducing to\s*(" + _NUM + r"))?", re.I)
_DS_STEP = re.compile(r"\bstep=(\d+),\s*skipped=(\d+)")
_AT_MIN = re.compile(r"loss scale already at minimum", re.I)


def _hf_row(text: str) -> Row:
    row: Row = {}
    for key, value in _HF_KV.findall(text):
        metric = _HF_MAP.get(key)
        if metric is not None:
            row[metric] = _num(value)
    if "step" in row and row["step"] is not None:
        row["step"] = int(row["step"])
    return row


def _hfconsole(lines: list[str]) -> list[Row]:
    rows: list[Row] = []
    for line in lines:
        for m in _HF_ROW.finditer(line):
            row = _hf_row(m.group(0))
            if "train_runtime" in m.group(0) or not ({"loss", "grad_norm"} & set(row)):
                continue  # the closing summary, or an evaluation row
            row.setdefault("step", len(rows))
            rows.append(row)
    return rows


def _deepspeed(lines: list[str]) -> list[Row]:
    """Rows dated by the progress bar (or DeepSpeed's own ``step=N``): the Trainer's loss rows,
    and one ``skipped_iters`` per OVERFLOW line with the scale it left (``grad_scale``). A scale
    'already at minimum' is recorded as a scale of 1 that could not be lowered."""
    rows: list[Row] = []
    step: int | None = None
    for line in lines:
        bar = _TQDM.findall(line)
        if bar:
            step = int(bar[-1])
        ds = _DS_STEP.search(line)
        if ds is not None:
            step = int(ds.group(1))
        if step is None:
            continue
        for m in _HF_ROW.finditer(line):
            row = _hf_row(m.group(0))
            if {"loss", "grad_norm"} & set(row) and "train_runtime" not in m.group(0):
                row["step"] = step
                rows.append(row)
        ov = _OVERFLOW.search(line)
        if ov is not None:
            tried = _num(ov.group(1) or ov.group(3))
            after = _num(ov.group(2) or ov.group(4))
            rows.append({"step": step, "skipped_iters": 1.0, "scale_tried": tried,
                         "grad_scale": after if after is not None else tried})
        elif _AT_MIN.search(line):
            rows.append({"step": step, "skipped_iters": 1.0, "scale_tried": 1.0,
                         "grad_scale": 1.0})
    return rows


# ---- fairseq ---------------------------------------------------------------------------------

_FS_KV = re.compile(r"\b(loss|gnorm|loss_scale|lr|num_updates)[= ](" + _NUM + r")(?=[,\s|]|$)")
_FS_MAP = {"loss": "loss", "gnorm": "grad_norm", "loss_scale": "grad_scale", "lr": "lr",
           "num_updates": "step"}


def _fairseq(line: str) -> Row | None:
    if "num_updates" not in line or "valid" in line:
        return None
    row: Row = {}
    for key, value in _FS_KV.findall(line):
        row.setdefault(_FS_MAP[key], _num(value))
    if row.get("step") is None:
        return None
    row["step"] = int(row["step"])
    return row


# ---- one-pattern formats ---------------------------------------------------------------------

_SIMPLE: dict[str, tuple[re.Pattern[str], tuple[str, ...]]] = {
    "litgpt": (re.compile(r"^\s*iter (\d+) step \d+: loss (" + _NUM + r"), iter time", re.I),
               ("step", "loss")),
    "nanogpt": (re.compile(r"\biter (\d+): loss (" + _NUM + r"),", re.I), ("step", "loss")),
    "llmc": (re.compile(r"^\s*step\s+(\d+)/\d+\s*[|:]\s*(?:train )?loss (" + _NUM
                        + r")(?:\s*\|\s*norm (" + _NUM + r"))?(?:\s*\|\s*lr (" + _NUM + r"))?",
                        re.I), ("step", "loss", "grad_norm", "lr")),
    "llmc_main": (re.compile(r"^s:(\d+) trl:(" + _NUM + r")(?: lr:(" + _NUM + r"))?(?: norm:("
                             + _NUM + r"))?", re.I), ("step", "loss", "lr", "grad_norm")),
    "moddednanogpt": (re.compile(r"^step:(\d+)/\d+ train_loss:(" + _NUM + r")", re.I),
                      ("step", "loss")),
    "mlx": (re.compile(r"^\s*Iter (\d+): Train loss (" + _NUM + r")(?:, Learning Rate ("
                       + _NUM + r"))?", re.I), ("step", "loss", "lr")),
}


# the same patterns over a whole file at once (one findall: a million lines in about a second);
# no part may cross a line, so the blanks are [ \t], never \s; no leading \b, ^ or blanks, so
# that each pattern opens with a literal ("iter ", "step") the regex engine searches for; a
# number is any run of characters up to a blank, pipe or comma (numpy converts them, and a
# capture that is no number sends the file to the line parser)
_SIMPLE_ML = {name: re.compile(p.pattern.replace(_NUM, r"[^ \t|,\n]+").replace(r"\s", r"[ \t]")
                               .removeprefix(r"\b").removeprefix("^").removeprefix(r"[ \t]*"),
                               re.M)
              for name, (p, _) in _SIMPLE.items()}


def _simple_columns(name: str, text: str) -> dict[str, Any]:
    """Raw columns of a one-pattern format: (values, missing) per key, '' captures missing."""
    import numpy as np

    keys = _SIMPLE[name][1]
    gc_was_on = gc.isenabled()
    gc.disable()  # a million fresh tuples: a collection would only walk them
    try:
        found = _SIMPLE_ML[name].findall(text)
        cols = list(zip(*found)) if found and isinstance(found[0], tuple) else [found]
    finally:
        if gc_was_on:
            gc.enable()
    if not found:
        return {}
    out: dict[str, Any] = {}
    for key, cells in zip(keys, cols):
        if "" not in cells:  # every line has it: one conversion of the strings
            try:
                out[key] = (np.array(cells, dtype=np.float64), np.zeros(len(cells), dtype=bool))
                continue
            except ValueError:
                return {}
        arr = np.array(cells, dtype=str)
        missing = arr == ""
        if missing.all():
            continue
        try:
            vals = np.where(missing, "nan", arr).astype(np.float64)
        except ValueError:  # a capture that is no number: the line parser decides
            return {}
        out[key] = (vals, missing)
    return out


def _simple(name: str) -> Callable[[str], Row | None]:
    pattern, keys = _SIMPLE[name]

    def parse(line: str) -> Row | None:
        m = pattern.search(line)
        if m is None:
            return None
        row: Row = {k: _num(v) for k, v in zip(keys, m.groups()) if v is not None}
        row["step"] = int(m.group(1))
        return row

    return parse


_LINE_PARSERS: dict[str, Callable[[str], Row | None]] = {
    "megatron": _megatron, "nemo": _nemo, "fairseq": _fairseq,
    **{name: _simple(name) for name in _SIMPLE},
}
_WHOLE_PARSERS: dict[str, Callable[[list[str]], list[Row]]] = {
    "deepspeed": _deepspeed, "hfconsole": _hfconsole}

TEXT_FORMATS = ("megatron", "nemo", "deepspeed", "hfconsole", "fairseq", "nanogpt", "litgpt",
                "llmc", "moddednanogpt", "mlx")
"""The console formats read by content (``llmc`` includes llm.c's ``main.log``)."""

_DESCRIBE = {
    "megatron": "Megatron-LM / Megatron-DeepSpeed / NeMo 1 'iteration N/ M | lm loss: ... |'",
    "nemo": "NeMo 2 'Training epoch E, iteration I/N | ... reduced_train_loss: ...'",
    "deepspeed": "DeepSpeed 'OVERFLOW! ... Attempted loss scale' with the progress bar",
    "hfconsole": "the HF Trainer's \"{'loss': ..., 'grad_norm': ...}\" rows",
    "fairseq": "fairseq 'loss=... num_updates=...'",
    "nanogpt": "nanoGPT 'iter N: loss X, time T'",
    "litgpt": "litgpt 'iter N step S: loss X, iter time: T'",
    "llmc": "llm.c 'step N/M | train loss X | norm G' or main.log 's:N trl:X'",
    "moddednanogpt": "modded-nanogpt 'step:N/M train_loss:X'",
    "mlx": "mlx-lm 'Iter N: Train loss X'",
}


def accepted_formats() -> str:
    """One line naming every format diagnose reads."""
    return ("metrics.jsonl, trainer_state.json, a CSV (Lightning, W&B or named columns), "
            "TensorBoard events, and console logs: " + "; ".join(_DESCRIBE.values()))


def _score(name: str, lines: list[str]) -> int:
    if name in _WHOLE_PARSERS:
        rows = _WHOLE_PARSERS[name](lines)
        if name == "deepspeed":  # the scaler's lines make it DeepSpeed, not the Trainer rows
            return sum(1 for r in rows if "skipped_iters" in r) * 2 + len(rows)
        return len(rows)
    if name == "llmc":
        return sum(1 for line in lines if _LINE_PARSERS["llmc"](line)
                   or _LINE_PARSERS["llmc_main"](line))
    parse = _LINE_PARSERS[name]
    return sum(1 for line in lines if len(parse(line) or ()) > 1)


def sniff(head: list[str]) -> str | None:
    """The console format whose lines are most of those in ``head`` (None when none match)."""
    scores = {name: _score(name, head) for name in TEXT_FORMATS}
    best = max(scores, key=lambda k: scores[k])
    return best if scores[best] > 0 else None


def read_text(path: Path, fmt: str, warnings: list[str]) -> dict[str, Any]:
    """Raw columns (``_KEYS``) of a console log in format ``fmt``; lines of no format are passed over."""
    text = path.read_text(errors="replace")
    if fmt in _SIMPLE:
        for name in (fmt, "llmc_main") if fmt == "llmc" else (fmt,):
            cols = _simple_columns(name, text)
            if cols:
                return cols
    lines = text.splitlines()
    if fmt in _WHOLE_PARSERS:
        rows = _WHOLE_PARSERS[fmt](lines)
    else:
        parses = [_LINE_PARSERS[fmt]] + ([_LINE_PARSERS["llmc_main"]] if fmt == "llmc" else [])
        rows = []
        for line in lines:
            for parse in parses:
                row = parse(line)
                if row is not None:
                    rows.append(row)
                    break
    if not rows:
        raise ValueError(f"{path}: no {fmt} lines ({_DESCRIBE.get(fmt, fmt)}) in this file")
    if fmt == "hfconsole" and rows[0].get("step") == 0 and "'step'" not in text:
        warnings.append(f"{path.name}: the Trainer's console rows carry no step: numbered from "
                        "0 in file order (pass --map or a trainer_state.json for real steps)")
    return {k: [r.get(k) for r in rows] for k in _KEYS if any(k in r for r in rows)}
