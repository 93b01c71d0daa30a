"""torchtitan 0.3.0 on a laptop: CPU ranks over gloo, torch 2.13, no downloads.

    import spikeguard.integrations.torchtitan_cpu as titan_cpu   # before anything imports torchtitan
    config = titan_cpu.laptop(config)     # a torchtitan Trainer.Config (its registry's, parsed)

Importing this module applies the smallest patches that let torchtitan's Trainer and debug model
run on CPU ranks, each only where it is needed (docs/torchtitan.md, "torchtitan on a laptop",
says why each exists):

1. ``triton`` absent: torchtitan.trainer imports the MinimalAsyncEP Triton kernels
   (torchtitan.distributed.minimal_async_ep.kernels) at import time; a stand-in module whose
   kernels raise when called (expert parallelism on a GPU is the only user).
2. ``datasets`` absent: torchtitan.components.validate imports the Hugging Face text loaders
   at import time; a stand-in whose ``load_dataset`` raises (the byte data below needs none).
3. No accelerator: ``torchtitan.tools.utils`` falls back to ``"cuda"``; set ``"cpu"`` and a
   device module with the few calls its memory monitor makes.
4. FlexAttention has no backward on CPU (torch raises NotImplementedError): the debug model's
   attention runs as SDPA with the block mask made dense (same mask, same math).
5. ``torch.distributed.set_timeout`` (what torchtitan's ``set_pg_timeouts`` calls after the
   first step, after a ``barrier(device_ids=...)`` that gloo rejects) is not in torch 2.13:
   a barrier, and the timeouts stay as they were.
6. gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2's reduce-scatter uses for torchtitan's
   gradient divide factor of 1.0: FSDP2's own ``set_force_sum_reduction_for_comms(True)``
   makes it a SUM (times 1.0, the same numbers).
7. torchtitan compiles ``create_block_mask`` with inductor, which on CPU builds C++ kernels for
   seconds in every process: the same function runs eagerly (the same mask).

Then ``ByteTokenizer`` (bytes as tokens), ``CorpusLoader`` (torchtitan's
``ParallelAwareDataloader`` over the Python docs' text, which ships with Python) and
``laptop(config)``, which points a config at them and makes the CPU choices (fp32, no activation
checkpointing, no CUDA graphs, no validation, plain ``fully_shard``). ``debug_config`` is the
debug model made small, as the tests and examples/torchtitan_train.py use it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["PATCHES", "ByteTokenizer", "CorpusLoader", "debug_config", "laptop"]

PATCHES: list[str] = []
"""The patches applied in this process, by number and name."""


def _raise(*_: Any, **__: Any) -> Any:
    raise RuntimeError("not available on CPU ranks (spikeguard.integrations.torchtitan_cpu "
                       "stands in for it at import)")


def _stub_kernels() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    for name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel",
                 "expand_topk_grad_kernel", "fill_combine_metadata_kernel",
                 "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(mod, name, _raise)
    sys.modules[mod.__name__] = mod
    PATCHES.append("1 triton kernels")


def _stub_datasets() -> None:
    if importlib.util.find_spec("datasets") is not None:
        return
    ds, ds_dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    ds.Dataset = type("Dataset", (), {})
    ds.load_dataset = _raise
    ds_dist.split_dataset_by_node = _raise
    ds.distributed = ds_dist
    sys.modules.update({"datasets": ds, "datasets.distributed": ds_dist})
    PATCHES.append("2 datasets")


class _CpuDevice:
    """torch.cpu plus the calls torchtitan's DeviceMemoryMonitor makes (no memory stats)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    def current_device(self) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}


def _cpu_device() -> None:
    import torchtitan.tools.utils as tt_utils

    if torch._utils._get_available_device_type() is not None:
        return
    tt_utils.device_type, tt_utils.device_module = "cpu", _CpuDevice()
    PATCHES.append("3 cpu device")


def _dense_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any = None,
                block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                return_aux: Any = None, kernel_options: Any = None) -> tuple[torch.Tensor, None]:
    """FlexAttention's contract for the debug model's call (a block mask, no score_mod, no
    log-sum-exp returned) through SDPA with the mask evaluated densely."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or (return_aux is not None and return_aux.lse):
        raise NotImplementedError("the CPU attention stand-in takes no score_mod and returns "
                                  "no lse")
    mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2],
                       device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, None


def _flex_on_cpu() -> None:
    if torch.cuda.is_available():
        return
    import torchtitan.models.common.attention as tt_attention

    tt_attention.FlexAttention._compiled_flex_attn = _dense_flex
    PATCHES.append("4 flex attention")
    tt_attention._compiled_create_block_mask = tt_attention.create_block_mask
    PATCHES.append("7 eager create_block_mask")


def _pg_timeouts() -> None:
    import torch.distributed as dist
    import torchtitan.distributed.utils as tt_dist

    if hasattr(dist, "set_timeout"):
        return

    def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
        dist.barrier()

    tt_dist.set_pg_timeouts = set_pg_timeouts
    PATCHES.append("5 set_pg_timeouts")


def _sum_reduction() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    divide = tt_fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        divide(model)
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend() == "gloo":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    PATCHES.append("6 gloo sum reduction")


_stub_kernels()
_stub_datasets()
_cpu_device()
_flex_on_cpu()
_pg_timeouts()
_sum_reduction()

# torchtitan's own components, imported only once the patches are in
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import TrainingConfig  # noqa: E402


class ByteTokenizer(BaseTokenizer):
    """Bytes as tokens (vocabulary 256 inside the debug model's 2,048): no files to load."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, **_: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], **_: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return 256


class _CorpusDataset(torch.utils.data.IterableDataset):
    """Sequences of the Python docs' bytes, each at an offset drawn from its global index (the
    batches are exchangeable: a run that leaves some out sees the same text as one that does
    not), one document per sequence (positions 0..seq_len-1); the batches named in ``poison`` are one token repeated, the last
    of the debug model's vocabulary, which the bytes never hold (a corrupt shard). Stateful: the
    sample index."""

    def __init__(self, seq_len: int, batch: int, rank: int, world: int,
                 poison: tuple[int, ...]) -> None:
        from ..data import load_corpus

        self.tokens = load_corpus("pydoc").train
        self.seq_len, self.batch, self.rank, self.world = seq_len, batch, rank, world
        self.poison = set(poison)
        self.i = 0

    def __iter__(self) -> Any:
        n = self.seq_len + 1
        while True:
            j = self.i * self.world + self.rank
            lo = int(np.random.default_rng(j).integers(len(self.tokens) - n))
            x = torch.from_numpy(self.tokens[lo:lo + n].astype(np.int64))
            if self.i // self.batch in self.poison:
                x = torch.full((n,), 2047, dtype=torch.int64)
            self.i += 1
            yield {"input": x[:-1], "positions": torch.arange(self.seq_len)}, x[1:]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = int(state["i"])


class CorpusLoader(ParallelAwareDataloader):
    """torchtitan's ParallelAwareDataloader (a StatefulDataLoader) over ``_CorpusDataset``."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        poison: tuple[int, ...] = field(default_factory=tuple)
        """Batch indices (per rank) that are a corrupt shard."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = 1,
                 **_: Any) -> None:
        ds = _CorpusDataset(seq_len, local_batch_size, dp_rank, dp_world_size, config.poison)
        super().__init__(ds, dp_rank=dp_rank, dp_world_size=dp_world_size,
                         batch_size=local_batch_size, num_workers=0,
                         snapshot_every_n_steps=snapshot_every_n_steps)


def laptop(cfg: Any, *, poison: tuple[int, ...] = ()) -> Any:
    """``cfg`` (a torchtitan ``Trainer.Config``) changed in place for CPU ranks, and returned:
    the byte tokenizer and the corpus loader (``poison``: per-rank batch indices that are a
    corrupt shard), fp32 parameters (FSDP2's bf16 all-gathers and matmuls are slow on CPU), no
    activation checkpointing, no CUDA graphs, no validation (its loader downloads),
    ``fully_shard`` over the ``fsdp`` mesh (``spmd_backend="partial_dtensor"``), the fused
    AdamW kernel, the global batch from the ranks, and the seed fixed (a clean run is a
    baseline). Sizes (steps, sequence length, batch) stay as ``cfg`` has them."""
    cfg.tokenizer = ByteTokenizer.Config()
    cfg.dataloader = CorpusLoader.Config(poison=tuple(poison))
    world = _world()
    t = cfg.training
    accumulate = max(1, (t.global_batch_size or 0) // max(1, t.local_batch_size * world))
    t.global_batch_size = t.local_batch_size * world * accumulate
    t.disable_cuda_graphs, t.mixed_precision_param = True, "float32"
    cfg.activation_checkpoint = None
    cfg.validator.enable = False
    cfg.optimizer.implementation = "fused"
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.debug.seed = 0
    return cfg


def debug_config(out: str, *, steps: int, guard: Any, poison: tuple[int, ...] = (),
                 interval: int = 4, layers: int = 2, seq_len: int = 32, batch: int = 2,
                 accumulate: int = 1, two_optimizers: bool = False,
                 keep_latest_k: int = 0) -> Any:
    """torchtitan's llama3 debug model config (its own registry entry: dim 256, vocab 2,048,
    FlexAttention, AdamW, warmup + linear decay) made small for CPU through ``laptop``:
    ``layers`` of its 6 layers, ``accumulate`` micro-batches a step (torchtitan's gradient
    accumulation); ``two_optimizers``: the norms' params on an Adam of their own (half the LR),
    the rest on the debug model's AdamW; checkpoints every ``interval`` steps in ``out``
    (``keep_latest_k``: torchtitan's retention, 0 keeps all); the guard's loss; FSDP2 over all
    ranks (torchtitan's default dp_shard=-1)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from .torchtitan import guarded

    base = llama3_debugmodel()
    del base.model_spec.model.layers[layers:]
    cfg = guarded(base, guard=guard)
    cfg.training = TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=steps,
                                  global_batch_size=batch * accumulate * _world(),
                                  max_norm=guard.clip)
    laptop(cfg, poison=poison)
    cfg.lr_scheduler.warmup_steps = 2
    cfg.metrics.log_freq = 1_000_000
    cfg.dump_folder = str(out)
    cfg.checkpoint = CheckpointManager.Config(enable=True, interval=interval,
                                              last_save_model_only=False,
                                              keep_latest_k=keep_latest_k)
    if two_optimizers:  # torchtitan's param groups: the norms on their own optimizer and LR
        from torchtitan.components.optimizer import ParamGroupConfig

        rest = cfg.optimizer.param_groups[0]
        norms = ParamGroupConfig(pattern=r"norm", optimizer_name="Adam",
                                 optimizer_kwargs={"lr": 4e-4, "betas": (0.9, 0.95), "eps": 1e-8})
        cfg.optimizer.param_groups = [norms, rest]
    return cfg


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
