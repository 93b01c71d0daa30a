"""The Guard inside HF Trainer (:mod:`spikeguard.integrations.hf`), Lightning
(:mod:`spikeguard.integrations.lightning`) and OLMo-core (:mod:`spikeguard.integrations.olmo_core`).

None of these frameworks lets a callback veto an optimizer step, and each may clip before a
callback sees the gradients, so the guard enters through the optimizer: a ``GuardedOptimizer``
whose ``step()`` is ``guard.step()``, an LR scheduler held on a skipped step, and a callback that
logs, stops the run on a halt and writes the report. docs/integrations.md has the HF and
Lightning recipes, docs/adapters.md every stack's.

Importing this package imports no framework; each module imports its own on first use.
"""

__all__: list[str] = []
