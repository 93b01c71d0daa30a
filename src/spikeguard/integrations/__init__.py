"""The Guard inside HF Trainer (:mod:`spikeguard.integrations.hf`) and Lightning
(:mod:`spikeguard.integrations.lightning`).

Neither framework lets a callback veto an optimizer step, and both may clip before a callback
sees the gradients, so the guard enters through the optimizer: a ``GuardedOptimizer`` whose
``step()`` is ``guard.step()``, an LR scheduler held on a skipped step, and a callback that logs,
stops the run on a halt and writes the report. docs/integrations.md has both recipes.

Importing this package imports neither framework; each module imports its own on first use.
"""

__all__: list[str] = []
