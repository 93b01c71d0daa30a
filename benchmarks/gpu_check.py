"""Checks that need a CUDA GPU; on a machine without one it says so and exits 0.

Each check is a function returning (passed, detail); add yours to CHECKS.

- flex_softcap_speed: soft-capped flex_attention (cap 50, causal) fwd+bwd at >= 0.9 of the
  throughput of uncapped flex_attention (causal), bf16, interleaved runs;
- flex_softcap_matches_eager: the capped flex output and gradients equal the eager fp32 path;
- stats_and_sinks: device running median / EMA equal the host versions bit for bit on CUDA, and
  the gate's calls plus a JsonlSink.log of CUDA tensors run under set_sync_debug_mode("error");
- torchao_fp8_step: fp8 training through torchao on the eligible linears, with the amax monitor;
- guard_no_sync: guarded fused-AdamW steps (healthy and skipped) under set_sync_debug_mode("error"),
  and the guard's overhead beyond clip + step on the GPU;
- nccl_collectives: spikeguard._dist on a one-rank NCCL group without the one-rank shortcut (the
  CUDA path of a CPU vote), and checkpoints saved and restored under NCCL alone;
- torchtitan_guard: the torchtitan integration's tests on the GPUs (benchmarks/gpu_titan.py).

    PYTHONPATH=src:. python benchmarks/gpu_check.py [--smoke]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import spikeguard as sg
from benchmarks import gpu_titan
from spikeguard.prevent.attention import attention

__all__ = [
    "CHECKS",
    "flex_softcap_matches_eager",
    "flex_softcap_speed",
    "guard_no_sync",
    "main",
    "nccl_collectives",
    "stats_and_sinks",
    "torchao_fp8_step",
]


def _qkv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=gen).mul_(2).requires_grad_()
            for _ in range(3)]


def _cuda_medians(cases: dict[str, Callable[[], None]], reps: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):  # the first calls compile
        for fn in cases.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(ts) for name, ts in times.items()}


def flex_softcap_speed(smoke: bool = False) -> tuple[bool, str]:
    shape = (2, 4, 256, 64) if smoke else (8, 16, 2048, 128)
    q, k, v = _qkv(shape, torch.bfloat16)
    grad = torch.randn_like(q)

    def case(cap: float | None, backend: str) -> Callable[[], None]:
        def run() -> None:
            out = attention(q, k, v, causal=True, softcap=cap, backend=backend)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    ms = _cuda_medians({"flex capped": case(50.0, "flex"), "flex uncapped": case(None, "flex"),
                        "sdpa uncapped": case(None, "sdpa")}, reps=5 if smoke else 20)
    ratio = ms["flex uncapped"] / ms["flex capped"]
    detail = (f"shape {shape} bf16 fwd+bwd: flex capped {ms['flex capped']:.3f} ms, flex uncapped "
              f"{ms['flex uncapped']:.3f} ms, sdpa uncapped {ms['sdpa uncapped']:.3f} ms; "
              f"capped/uncapped flex throughput {ratio:.3f} (target >= 0.9), "
              f"vs sdpa {ms['sdpa uncapped'] / ms['flex capped']:.3f}")
    return ratio >= 0.9, detail


def flex_softcap_matches_eager(smoke: bool = False) -> tuple[bool, str]:
    q, k, v = _qkv((2, 4, 256, 64), torch.float32, seed=1)
    grad = torch.randn_like(q)
    out_f = attention(q, k, v, softcap=5.0, backend="flex")
    gf = torch.autograd.grad(out_f, (q, k, v), grad)
    out_e = attention(q, k, v, softcap=5.0, backend="eager")
    ge = torch.autograd.grad(out_e, (q, k, v), grad)
    errs = [float((a - b).abs().max()) for a, b in zip((out_f, *gf), (out_e, *ge))]
    return max(errs) < 1e-3, f"fp32 max |flex - eager| over out, dq, dk, dv: {max(errs):.2e} (< 1e-3)"


CHECKS: dict[str, Callable[[bool], tuple[bool, str]]] = {
    "flex_softcap_speed": flex_softcap_speed,
    "flex_softcap_matches_eager": flex_softcap_matches_eager,
}


def stats_and_sinks(smoke: bool = False) -> tuple[bool, str]:
    """Device running median / EMA equal the host versions bit for bit on CUDA, and the gate's
    calls plus a JsonlSink.log of CUDA tensors run under ``set_sync_debug_mode("error")``."""
    from spikeguard.measure.stats import EMA, DeviceEMA, DeviceRunningMedian, RunningMedian
    from spikeguard.record import StepMetrics, metrics_record
    from spikeguard.sinks import JsonlSink, read_metrics

    dev = torch.device("cuda")
    rng = random.Random(0)
    med, ema = DeviceRunningMedian(500, device=dev), DeviceEMA(1e-3, device=dev)
    hmed, hema = RunningMedian(500), EMA(1e-3)
    xs = torch.tensor([rng.lognormvariate(0, 0.5) * (8 if rng.random() < 0.02 else 1)
                       for _ in range(3000)], dtype=torch.float32, device=dev)
    flags = []
    for x in xs:
        flag = med.exceeds(x, 3.0) | (ema.ratio(x) > 2.0)
        med.update(x, flag)
        ema.update(x, flag)
        flags.append(flag)
    host_x = xs.tolist()
    n_flag = 0
    for x, flag in zip(host_x, flags):
        # the same rules on host floats: x > 3 x median, x / EMA_{t-1} > 2 (history not empty)
        want = (len(hmed) > 0 and x > 3.0 * hmed.value) or (hema.count > 0 and x / hema.value > 2.0)
        assert bool(flag) == want
        n_flag += want
        if not want:
            hmed.update(x)
            hema.update(x)
    assert med.value.item() == hmed.value and ema.value.item() == hema.value
    assert med.values() == hmed.values()
    detail = f"stats: device == host bit for bit over {len(host_x)} CUDA steps ({n_flag} flagged)"

    out = Path(tempfile.mkdtemp()) / "m.jsonl"
    sink = JsonlSink(out)
    loss = torch.ones((), device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            loss = loss * 1.01
            flag = med.exceeds(loss, 3.0) | (ema.ratio(loss) > 2.0)
            med.update(loss, flag)
            ema.update(loss, flag)
            sink.log(metrics_record(StepMetrics(step=step, loss=loss, grad_norm=loss * 2,
                                                nan_frac=0.0), tier=flag.to(torch.int64)), step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sink.close()
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(20))
    assert abs(got[-1]["loss"] - 1.01 ** 20) < 1e-5
    return True, detail + "; sinks + gate: no synchronizing CUDA call in 20 steps"


CHECKS["stats_and_sinks"] = stats_and_sinks


def torchao_fp8_step(smoke: bool = False) -> tuple[bool, str]:
    """Real fp8 training through torchao (the optional ``fp8`` extra) on the bench GPT: only the
    fp8-eligible linears are converted, a few bf16-autocast steps run with finite loss, and the
    AmaxMonitor reports a finite headroom for every converted linear after its first step."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return False, "torchao is not installed (pip install 'spikeguard[fp8]'); fp8 step not run"
    from spikeguard.measure.fp8 import AmaxMonitor, fp8_eligible

    torch.manual_seed(0)
    cfg = sg.GPTConfig.tiny() if smoke else sg.GPTConfig.bench()
    model = sg.GPT(cfg).cuda()
    eligible = {n for n, m in model.named_modules() if fp8_eligible(n, m)}
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fp8_eligible(fqn, m))
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    if converted != eligible:
        return False, f"converted {sorted(converted ^ eligible)} differ from the eligible set"
    monitor = AmaxMonitor()
    monitor.hook(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), device="cuda")
    losses, heads = [], []
    for step in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.loss(model(x), x)
        loss = getattr(out, "loss", out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        heads.append(monitor.flush(step).get("fp8_headroom_min", float("nan")))
    ok = all(map(math.isfinite, losses)) and all(map(math.isfinite, heads[1:])) and len(converted) > 0
    return ok, (f"{len(converted)} Float8Linear layers, losses {losses[0]:.3f} -> {losses[-1]:.3f}, "
                f"min headroom per step {[round(h, 3) for h in heads[1:]]}")


CHECKS["torchao_fp8_step"] = torchao_fp8_step


def guard_no_sync(smoke: bool = False) -> tuple[bool, str]:
    """A guarded fused-AdamW step on CUDA under ``set_sync_debug_mode("error")``, its input ids
    passed (``tokens=``, the input-token check on the device): healthy steps and the steps that
    skip (a random-byte batch after arming; the gate decides on the device)
    raise nothing, and the skipped step left params untouched. Attribution of a skip, one step
    later, reads the skipped batch's per-sequence losses on the host by design: it alone runs
    outside the error mode, and the steps it examined are reported. Then the guard's overhead
    beyond clip + step + schedule, as a share of the median step (CUDA events; interleaved with
    a plain loop)."""
    torch.manual_seed(0)
    cfg = sg.GPTConfig.tiny() if smoke else sg.GPTConfig.bench()
    model = sg.GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sg.schedules.warmup_cosine(
        warmup_steps=2, total_steps=10_000))
    guard = sg.Guard(model, opt, scheduler=sched, precision=sg.PrecisionPolicy(kind="bf16-mixed"),
                     config=sg.GuardConfig(detector=sg.DetectorConfig(arm_after=5)))
    assert guard.read_lag == 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    text = torch.randint(0, 64, (8, cfg.seq_len + 1), device="cuda", generator=gen)
    n_steps, bad_at = 12, 9
    torch.cuda.synchronize()
    verdicts, before, after, synced, attributed = [], None, None, [], []
    attribute = guard._attribute  # the attribute stage of a withheld step (guard/guard.py)

    def attribute_may_sync(p, out):  # the one place a host read is by design
        torch.cuda.set_sync_debug_mode(0)
        try:
            return attribute(p, out)
        finally:
            attributed.append(p.step)
            torch.cuda.set_sync_debug_mode("error")

    guard._attribute = attribute_may_sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(n_steps):
            try:
                x = text if t != bad_at else torch.randint(0, cfg.vocab_size, text.shape,
                                                           device="cuda", generator=gen)
                with guard.autocast():
                    out = model.loss(model(x[:, :-1]), x[:, 1:])
                out.loss.backward()
                if t == bad_at:
                    before = [p.detach().clone() for p in model.parameters()]
                verdicts += guard.step(out, tokens=x[:, :-1])  # the input-token check too
                if t == bad_at:
                    after = [p.detach().clone() for p in model.parameters()]
            except RuntimeError as e:  # name the step and our innermost frames
                if "synchronizing" not in str(e):
                    raise
                frames = [f for f in traceback.extract_tb(e.__traceback__)
                          if "spikeguard" in f.filename or "gpu_check" in f.filename][-4:]
                synced = [f"step {t}"] + [f"{Path(f.filename).name}:{f.lineno} {f.line}"
                                          for f in frames]
                break
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if synced:
        guard.close()
        return False, "a synchronizing CUDA call at " + " <- ".join(reversed(synced[1:])) + \
            f" ({synced[0]}, skip at {bad_at})"
    verdicts += guard.flush()
    by_step = {v.step: v for v in verdicts}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    verdict_ok = by_step[bad_at].skip and unchanged and sorted(by_step) == list(range(n_steps))
    # overhead: guard.step vs the plain tail, CUDA-event timed
    plain = sg.GPT(cfg).cuda()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)

    def tail_plain() -> None:
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        popt.step()
        popt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"plain": [], "guard": [], "step": []}
    for _ in range(10 if smoke else 50):
        for name, (m, tail) in {"plain": (plain, tail_plain),
                                "guard": (model, None)}.items():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m.loss(m(text[:, :-1]), text[:, 1:])
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record()
            out.loss.backward()
            mid.record()
            if tail is None:
                guard.step(out, tokens=text[:, :-1])
            else:
                tail()
            end.record()
            end.synchronize()
            times[name].append(mid.elapsed_time(end))
            if name == "plain":
                times["step"].append(start.elapsed_time(end))
    guard.close()
    over = (statistics.median(times["guard"]) - statistics.median(times["plain"])) / \
        statistics.median(times["step"])
    return verdict_ok, (f"{n_steps} guarded steps, skip at {bad_at} left params "
                        f"{'untouched' if unchanged else 'CHANGED'}; no synchronizing call "
                        f"outside attribution (skipped steps it examined: {attributed}); "
                        f"guard beyond clip+step: {over:.2%} of the step")


CHECKS["guard_no_sync"] = guard_no_sync

def nccl_collectives(smoke: bool = False) -> tuple[bool, str]:
    """spikeguard._dist on a one-rank NCCL group with the one-rank shortcut off, so the CUDA
    path runs: a CPU vote goes to the GPU and back, barrier on the collective device, and a
    CheckpointManager save/restore (sync, then async on its own gloo group) under NCCL alone.
    Several NCCL ranks stay untested (one GPU)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from spikeguard import _dist

    if dist.is_initialized():
        return False, "a process group is already initialised in this process"
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    try:
        config = dist.get_backend_config()
        picked = _dist.collective_device()
        vote = torch.tensor([3], dtype=torch.int64)  # on the CPU, as CheckpointManager's votes
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _dist.all_reduce(vote, shortcut=False)
        ran = [e.name for e in prof.events() if "allreduce" in e.name or "all_reduce" in e.name]
        on_gpu = torch.ones(2, device=dev)
        _dist.all_reduce(on_gpu, op=dist.ReduceOp.MAX, shortcut=False)
        _dist.barrier()
        ok = (picked == dev and vote.device.type == "cpu" and vote.item() == 3 and bool(ran)
              and on_gpu.tolist() == [1.0, 1.0] and "cuda" in config)
        detail = (f"backend config {config!r}; collective device {picked}; CPU vote reduced on "
                  f"the GPU ({sorted(set(ran)) or 'no all_reduce seen'}), value kept; barrier passed")
        model = sg.GPT(sg.GPTConfig.tiny()).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (2, 33), device=dev)
        model.loss(model(x[:, :-1]), x[:, 1:]).loss.backward()
        opt.step()
        want = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with tempfile.TemporaryDirectory() as tmp:
            for async_save in (False, True):
                mgr = sg.CheckpointManager(Path(tmp) / str(async_save), model=model,
                                           optimizer=opt, every=1, async_save=async_save)
                mgr.save(1)
                mgr.close()
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                info = mgr.restore()
                same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
                ok = ok and info.step == 1 and same
                kind = "async" if async_save else "sync"
                detail += f"; {kind} save + restore {'ok' if same else 'DIFFER'}"
        return ok, detail
    finally:
        dist.destroy_process_group()


CHECKS["nccl_collectives"] = nccl_collectives
CHECKS["torchtitan_guard"] = gpu_titan.torchtitan_guard


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small shapes, few repetitions")
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; skipping every GPU check")
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    failed = 0
    for name, check in CHECKS.items():
        if args.only is not None and name not in args.only:
            continue
        torch._dynamo.reset()  # each check compiles afresh (a graph cached by one broke the next)
        try:
            ok, detail = check(args.smoke)
        except Exception as exc:  # report every check, even when one breaks
            ok, detail = False, f"raised {type(exc).__name__}: {exc}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
