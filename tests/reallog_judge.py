"""Judge ``spikeguard diagnose`` on the real-log set against its hand labels (labels.json).

``judge(name, diagnosis)`` says whether a diagnosis agrees with the label of ``name``: the log's
format and interval, no spike on a healthy log, each labelled event found with a tier in its
range, nothing unlabelled above ``other_max_tier``, and, where the label counts them, the scaler
skips. ``python tests/reallog_judge.py`` prints the table docs/diagnose.md quotes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REAL = Path(__file__).parent / "data" / "reallogs"
LABELS = {k: v for k, v in json.loads((REAL / "labels.json").read_text()).items()
          if not k.startswith("_")}


def overlaps(entry, steps):
    return entry.start <= steps[1] and steps[0] <= entry.end


def judge(name, d):
    """(True, "") when diagnosis ``d`` of log ``name`` is as labelled, else (False, why)."""
    lab = LABELS[name]
    if d.log.format != lab["format"]:
        return False, f"format {d.log.format} (labelled {lab['format']})"
    if d.log.stride != lab["interval"]:
        return False, f"interval {d.log.stride} (labelled {lab['interval']})"
    entries = d.spikes + d.below
    if lab["healthy"] and d.spikes:
        s = d.spikes[0]
        return False, f"a healthy log got Tier {s.tier} at {s.start}-{s.end} ({s.cause})"
    for want in lab["spikes"]:
        hits = [s for s in entries if overlaps(s, want["steps"])]
        if not hits:
            return False, f"missed {want['what']} at {want['steps']}"
        lo, hi = want["tier"]
        if not any(lo <= s.tier <= hi for s in hits):
            got = ", ".join(f"Tier {s.tier} ({s.cause})" for s in hits)
            return False, f"{want['what']}: {got}, labelled Tier {lo}-{hi}"
    for s in d.spikes:
        if not any(overlaps(s, w["steps"]) for w in lab["spikes"]) and \
                s.tier > lab["other_max_tier"]:
            return False, f"unlabelled Tier {s.tier} at {s.start}-{s.end} ({s.cause})"
    want = lab.get("scaler_skips")
    if want is not None:
        got = d.precision.scaler_skips if getattr(d, "precision", None) else None
        if got != want:
            return False, f"scaler skips counted {got}, labelled {want}"
    return True, ""


def verdicts():
    """{name: (ok, why, what diagnose said)} over the whole set, diagnose errors included."""
    from spikeguard.diagnose import diagnose

    out = {}
    for name in sorted(LABELS):
        try:
            d = diagnose(REAL / name)
        except (ValueError, ImportError) as exc:
            out[name] = (False, f"not read: {str(exc)[:90]}", "")
            continue
        ok, why = judge(name, d)
        said = "; ".join(f"Tier {s.tier} {s.start}-{s.end}: {s.cause}" for s in d.spikes[:2]) \
            or "no spike"
        out[name] = (ok, why, said)
    return out


if __name__ == "__main__":
    res = verdicts()
    for name, (ok, why, _) in res.items():
        print(f"| `{name}` | {LABELS[name]['format']} | {'as labelled' if ok else why} |")
    print(f"{sum(ok for ok, _, _ in res.values())} of {len(res)} judged as labelled",
          file=sys.stderr)
