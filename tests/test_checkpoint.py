import errno
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch
import xxhash

from spikeguard import CheckpointManager, TokenStream
from spikeguard.checkpoint import CheckpointError, CheckpointWarning
from spikeguard.checkpoint.manager import rollback_target
from tests._ckpt_common import (
    build,
    copy_pair,
    make_pair,
    params,
    reopen,
    restore_fresh,
    same,
    train_steps,
)
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def _pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def two_checkpoints(_pair, tmp_path):
    return copy_pair(_pair, tmp_path)


# -- save, kill, resume ----------------------------------------------------------------------
def test_save_kill_resume_equals_uninterrupted_bit_for_bit(tmp_path, sub_env):
    cmd = [sys.executable, "-m", "tests._ckpt_worker"]
    common = ["--steps", "6", "--every", "2"]
    full = subprocess.Popen([*cmd, str(tmp_path / "a"), str(tmp_path / "full.pt"), *common],
                            env=sub_env, cwd=ROOT, stderr=subprocess.PIPE)
    killed = subprocess.run([*cmd, str(tmp_path / "b"), str(tmp_path / "x.pt"), *common,
                             "--kill-after", "4"], env=sub_env, cwd=ROOT, capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert not (tmp_path / "x.pt").exists()
    resumed = subprocess.run([*cmd, str(tmp_path / "b"), str(tmp_path / "res.pt"), *common,
                              "--resume"], env=sub_env, cwd=ROOT, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    _, err = full.communicate(timeout=120)
    assert full.returncode == 0, err.decode()[-2000:]
    a = torch.load(tmp_path / "full.pt", weights_only=False)  # written by our own test worker
    b = torch.load(tmp_path / "res.pt", weights_only=False)
    assert same(a["model"], b["model"])
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and all(same(sa[i], sb[i]) for i in sa)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["sched"] == b["sched"] and a["sched"]["last_epoch"] == 6
    assert a["data"] == b["data"] and a["data"]["position"] == 6
    assert a["detector"] == b["detector"] and a["detector"]["ema"]["count"] == 6
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["py_rng"] == b["py_rng"] and (a["np_rng"] == b["np_rng"]).all()


def test_round_trip_restores_every_piece(tmp_path):
    model, opt, sched = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    data = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=32, seed=1)
    for _ in range(3):
        next(data)
    data.skip(5, 8)
    train_steps(model, opt, sched, 3)
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                            data=data, every=3)
    assert mgr.maybe_save(2) is None
    mgr.maybe_save(3, meta={"note": "x"})
    want_opt, want_sched, want = opt.state_dict(), sched.state_dict(), params(model)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    data2 = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=32, seed=1)
    model2, opt2, sched2 = build(seed=9)
    info = reopen(mgr, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2,
                  data=data2).restore()
    assert info.step == 3 and info.healthy and info.skip_ranges == ((5, 8),)
    assert info.meta == {"note": "x"}
    assert same(params(model2), want)
    got = opt2.state_dict()
    assert got["param_groups"] == want_opt["param_groups"]
    assert all(same(got["state"][i], want_opt["state"][i]) for i in want_opt["state"])
    assert sched2.state_dict() == want_sched
    assert scaler2.state_dict() == scaler.state_dict()
    assert data2.state_dict() == data.state_dict()


# -- health, rotation, atomicity -------------------------------------------------------------
def test_restore_takes_newest_healthy_at_or_before(tmp_path):
    model, opt, sched = build()
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, every=2, keep=10)
    saved = {}
    for step in (2, 4, 6, 8):
        train_steps(model, opt, sched)
        mgr.save(step, alerts=["loss_ema_ratio 1.7"] if step == 6 else ())
        saved[step] = params(model)
    assert [(c.step, c.healthy) for c in mgr.list()] == [(2, True), (4, True), (6, False), (8, True)]
    for at, want in ((7, 4), (8, 8), (3, 2)):
        m, o, _ = build(seed=5)
        assert reopen(mgr, model=m, optimizer=o).restore(at_or_before=at).step == want
        assert same(params(m), saved[want])
    with pytest.raises(CheckpointError, match="at or before step 1"):
        reopen(mgr, model=m).restore(at_or_before=1)


def test_rotation_keeps_keep_and_never_the_last_healthy(tmp_path):
    model, _, _ = build()
    mgr = CheckpointManager(tmp_path, model=model, every=1, keep=3)
    for step in range(1, 8):
        mgr.save(step, healthy=step <= 3, save_rng=False)
    kept = [(c.step, c.healthy) for c in mgr.list()]
    # an incident is open from step 4: the healthy ones before it are kept apart from keep=3
    assert kept == [(1, True), (2, True), (3, True), (5, False), (6, False), (7, False)]
    assert mgr.restore().step == 3
    for step in range(8, 11):  # three healthy ones after it close the incident
        mgr.save(step, save_rng=False)
    assert [c.step for c in mgr.list()] == [8, 9, 10]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_raises_or_warns_and_its_alerts_carry_to_the_next(tmp_path, async_save):
    model, opt, _ = build()
    for on_error in ("raise", "warn"):
        mgr = CheckpointManager(tmp_path / on_error, model=model, optimizer=opt, every=2,
                                async_save=async_save, on_error=on_error)
        mgr.save(2)
        mgr.wait()
        blocker = tmp_path / on_error / ".tmp-step_00000004"
        blocker.write_bytes(b"")  # the save's directory cannot be made: an OSError
        if on_error == "raise":
            with pytest.raises(CheckpointError, match=r"step 4 could not be saved .*"
                               r"File exists.* the checkpoint at step 2 is intact; fix the cause"):
                mgr.save(4, alerts=["4: loss spike"])
                mgr.wait()
        else:
            with pytest.warns(CheckpointWarning, match="training goes on without it"):
                assert mgr.save(4, alerts=["4: loss spike"]) \
                    in (None, tmp_path / "warn" / "step_00000004")
                mgr.wait()
            blocker.unlink()
            mgr.save(6)
            mgr.save(8)
            mgr.close()
        listed = [(c.step, c.healthy, c.alerts) for c in mgr.list()]
        assert listed[0] == (2, True, ())
        assert listed[1:] == ([] if on_error == "raise" else
                              [(6, False, ("4: loss spike",)), (8, True, ())])
        assert reopen(mgr, model=build(seed=3)[0]).restore(at_or_before=5).step == 2
        mgr.close()


def test_a_ctrl_c_inside_dcps_write_is_an_interrupt_not_a_failed_save(tmp_path, monkeypatch):
    """A SIGINT that lands while DCP writes a shard (a synchronous save: the write runs on the
    main thread, where Python raises KeyboardInterrupt): DCP catches it and raises a
    CheckpointException around it. That is no failure of the machine (which spikeguard train
    answers with exit 1) but the Ctrl-C (exit 130, "rerun to resume"). The partial files go,
    the checkpoint before stays the newest."""
    import signal

    from spikeguard.checkpoint.safe_reader import HashingWriter

    model, opt, _ = build()
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, every=2, async_save=False)
    mgr.save(2)
    write = HashingWriter.write_data

    def interrupted(self, plan, planner):  # a real SIGINT, at a known point of the write
        signal.raise_signal(signal.SIGINT)
        return write(self, plan, planner)

    monkeypatch.setattr(HashingWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(4)
    monkeypatch.setattr(HashingWriter, "write_data", write)
    assert [c.step for c in mgr.list()] == [2]
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    mgr.close()


def test_enospc_efbig_and_edquot_are_one_condition_a_full_disk():
    from spikeguard.checkpoint.io import save_failure

    for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        e = OSError(code, os.strerror(code))
        wrapped = RuntimeError("a write failed")
        wrapped.__cause__ = e
        assert save_failure(wrapped) == (True, f"OSError: [Errno {code}] {os.strerror(code)}")
        # DCP reports another rank's failure as text only
        text = RuntimeError(f"rank 1:\nTraceback (most recent call last):\n  ...\n"
                            f"OSError: [Errno {code}] {os.strerror(code)}: '__1_0.distcp'\n")
        assert save_failure(text)[0]
    assert save_failure(OSError(errno.EACCES, "Permission denied")) == \
        (False, "OSError: [Errno 13] Permission denied")


def test_incomplete_checkpoints_are_invisible_and_cleaned(two_checkpoints, tmp_path):
    mgr, _ = two_checkpoints
    shutil.copytree(mgr.list()[-1].path, tmp_path / "ck" / ".tmp-step_00000006")
    (tmp_path / "ck" / ".tmp-step_00000006" / "MANIFEST.json").unlink()
    shutil.copytree(tmp_path / "ck" / ".tmp-step_00000006", tmp_path / "ck" / "step_00000008")
    assert [c.step for c in mgr.list()] == [2, 4]
    info, _, _, _ = restore_fresh(mgr)
    assert info.step == 4
    model, opt, _ = build()
    reopen(mgr, model=model, optimizer=opt).save(10)
    assert not (tmp_path / "ck" / ".tmp-step_00000006").exists()


def test_async_save_commits_the_state_at_call_time_hashed_in_the_writer_thread(tmp_path):
    model, opt, sched = build()
    train_steps(model, opt, sched)
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, every=1,
                            async_save=True)
    mgr.save(1)
    want = params(model)
    train_steps(model, opt, sched, 2)  # training goes on while the files are written
    mgr.wait()
    assert [c.step for c in mgr.list()] == [1]
    path = mgr.list()[0].path
    # the shard and DCP's metadata were hashed by the thread that wrote them, not this one
    main = threading.current_thread().name
    assert {"__0_0.distcp", ".metadata"} <= mgr.io_stats.threads.keys()
    assert mgr.io_stats.threads["__0_0.distcp"] != main
    assert mgr.io_stats.threads[".metadata"] != main
    assert mgr.io_stats.hashed["__0_0.distcp"] == (path / "__0_0.distcp").stat().st_size
    mgr.close()
    info, m2, _, _ = restore_fresh(mgr)
    assert info.step == 1 and same(params(m2), want)
    sync = CheckpointManager(tmp_path / "sync", model=model, optimizer=opt, every=1)
    sync.save(1)
    assert sync.io_stats.threads["__0_0.distcp"] == main


def test_async_save_copies_params_and_optimizer_state_off_the_training_thread(tmp_path):
    """save() returns before the parameters and the optimizer state are copied (the writer
    thread is held busy here); the optimizer's next step() waits for that copy, so the
    checkpoint holds the state at the call. A buffer changed right after save(), as a forward
    may change one, was copied at the call."""
    model, opt, sched = build()
    model.register_buffer("seen", torch.zeros(3))
    train_steps(model, opt, sched)
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, every=1, keep=5,
                            async_save=True)
    mgr.save(1)
    mgr.wait()
    release = threading.Event()
    mgr._executor.submit(release.wait)  # the writer thread is busy until released
    train_steps(model, opt, sched)
    want = params(model)
    want_opt = {i: {k: v.clone() for k, v in st.items()}
                for i, st in opt.state_dict()["state"].items()}
    mgr.save(2)  # returns, nothing copied yet
    model.seen.add_(1.0)
    threading.Timer(0.3, release.set).start()
    start = time.perf_counter()
    train_steps(model, opt, sched)  # its optimizer.step() waits for the copy
    held = time.perf_counter() - start
    assert held >= 0.25 and mgr.staging.waited >= 0.25, (held, mgr.staging.waited)
    mgr.close()
    m2, o2, s2 = build(seed=123)
    m2.register_buffer("seen", torch.full((3,), 7.0))
    info = reopen(mgr, model=m2, optimizer=o2, scheduler=s2).restore()
    assert info.step == 2 and same(params(m2), want)
    got = o2.state_dict()["state"]
    assert all(torch.equal(got[i][k], v) for i, st in want_opt.items() for k, v in st.items())


def test_async_saves_go_on_when_torch_closes_the_stager_after_each_stage(tmp_path):
    """torch 2.11's DefaultStager closes its inner copier after every stage (emptying its copy
    table): the second async save then failed with KeyError: <class 'type'> (seen on the GPU
    machine). Here the stager is made to behave as 2.11's does; three saves in a row commit."""
    from torch.distributed.checkpoint.staging import DefaultStager

    model, opt, sched = build()
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, every=1, keep=5,
                            async_save=True)
    original = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):  # what 2.11's _stage does
        out = original(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return out

    DefaultStager._stage = stage_then_close
    try:
        wants = {}
        for step in (1, 2, 3):
            train_steps(model, opt, sched, 1)
            mgr.save(step)
            wants[step] = params(model)
        mgr.close()
    finally:
        DefaultStager._stage = original
    assert [c.step for c in mgr.list()] == [1, 2, 3]
    info, m2, _, _ = restore_fresh(mgr)
    assert info.step == 3 and same(params(m2), wants[3])


def test_each_file_is_hashed_once_by_its_writer_and_read_once_on_restore(tmp_path):
    """The counts that used to be a wall-time bound: a save hashes every byte it writes exactly
    once and reads nothing; a restore opens each file it needs once and hashes each byte once.
    The shard is digested per entry DCP wrote (its segment table), so a rank that reads only
    some entries of a shard hashes only those."""
    model, opt, sched = build()
    train_steps(model, opt, sched)
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, every=1)
    path = mgr.save(1)
    sizes = {p.name: p.stat().st_size for p in path.iterdir()}
    assert set(sizes) == {"__0_0.distcp", "__0_0.distcp.digests.json", ".metadata",
                          "rank0.json", "info.json", "MANIFEST.json"}
    written = {k: v for k, v in sizes.items() if k != "MANIFEST.json"}
    assert dict(mgr.io_stats.hashed) == written and not mgr.io_stats.opened
    table = json.loads((path / "__0_0.distcp.digests.json").read_text())["segments"]
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own file, for the test
    entries = sorted((i.offset, i.length) for i in metadata.storage_data.values())
    assert [(o, n) for o, n, _ in table] == entries  # one segment per entry, nothing else
    shard = (path / "__0_0.distcp").read_bytes()
    assert all(f"xxh3:{xxhash.xxh3_128(shard[o:o + n]).hexdigest()}" == d for o, n, d in table)
    _, model2, _, _ = restore_fresh(mgr)
    reader = restore_fresh.last
    assert dict(reader.io_stats.hashed) == written
    assert dict(reader.io_stats.opened) == {name: 1 for name in sizes}
    assert same(params(model2), params(model))


_REFERENCE = {"sha256": lambda b: hashlib.sha256(b).hexdigest(),
              "crc32": lambda b: f"{zlib.crc32(b):08x}"}


@pytest.mark.parametrize("algo", sorted(_REFERENCE))
def test_other_digests_on_request(tmp_path, algo):
    model, opt, sched = build()
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, every=1,
                            digest=algo)
    path = mgr.save(1)
    files = json.loads((path / "MANIFEST.json").read_text())["files"]
    want = _REFERENCE[algo]((path / "rank0.json").read_bytes())
    assert files["rank0.json"]["digest"] == f"{algo}:{want}"
    table = json.loads((path / "__0_0.distcp.digests.json").read_text())["segments"]
    shard = (path / "__0_0.distcp").read_bytes()
    assert all(d == f"{algo}:" + _REFERENCE[algo](shard[o:o + n]) for o, n, d in table)
    _, model2, _, _ = restore_fresh(mgr)  # the reader takes the algorithm from each digest
    assert same(params(model2), params(model))
    with pytest.raises(ValueError, match="digest='md5' is not one of"):
        CheckpointManager(tmp_path, digest="md5")


def test_import_spikeguard_leaves_dcp_unimported(sub_env):
    code = ("import sys, spikeguard; "
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported DCP'; "
            "spikeguard.CheckpointManager('unused'); "
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'constructor imported DCP'")
    out = subprocess.run([sys.executable, "-c", code], env=sub_env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_generic_stateful_extra_state_and_bad_arguments(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n, "hist": (1.5, float("nan"))}

        def load_state_dict(self, s):
            self.n = s["n"]
            self.hist = s["hist"]

    model, _, _ = build()
    c = Counter()
    c.n = 41
    mgr = CheckpointManager(tmp_path, model=model, states={"detector": c}, every=1)
    mgr.save(1)
    c2 = Counter()
    reopen(mgr, model=model, states={"detector": c2}).restore()
    assert c2.n == 41 and c2.hist[0] == 1.5 and c2.hist[1] != c2.hist[1]
    with pytest.raises(ValueError, match="reserved"):
        mgr.register(rng=c)
    with pytest.raises(ValueError, match="already saves another 'detector'"):
        mgr.register(detector=c2)
    mgr.register(detector=c)  # the same object again: nothing to do
    with pytest.raises(TypeError, match="has no state_dict"):
        mgr.register(probe=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'model'"):
        mgr.save(2, model=model)  # the states are registered once, not passed on every call
    with pytest.raises(ValueError, match="no model to save"):
        CheckpointManager(tmp_path / "empty").save(1)
    with pytest.raises(ValueError, match="every=0"):
        CheckpointManager(tmp_path, every=0)
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointManager(tmp_path, keep=0)


@pytest.mark.parametrize("enabled", [True, False])
def test_save_and_restore_pause_the_cycle_collector_and_keep_its_setting(tmp_path, enabled):
    """DCP's short-lived objects must die by reference count, not be promoted by collections
    that run mid-call (they trigger full collections of the whole process later)."""
    import gc

    seen = []

    class Probe:
        def state_dict(self):
            seen.append(("save", gc.isenabled()))
            return {}

        def load_state_dict(self, state):
            seen.append(("restore", gc.isenabled()))

    ran = []

    def count(phase, info):
        if phase == "start":
            ran.append(info["generation"])

    model, opt, sched = build()
    train_steps(model, opt, sched, 1)
    mgr = CheckpointManager(tmp_path, model=model, optimizer=opt, states={"probe": Probe()},
                            every=1)
    threshold = gc.get_threshold()
    (gc.enable if enabled else gc.disable)()
    gc.set_threshold(1, 1, 1)  # a collection on nearly every allocation, were it running
    gc.callbacks.append(count)
    try:
        mgr.save(1)
        mgr.restore()
        after = gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
        gc.enable()
    assert seen == [("save", False), ("restore", False)]
    assert after is enabled
    assert ran == [] or (enabled and len(ran) < 20), ran  # between the calls only


def test_benchmark_smoke(sub_env):
    out = subprocess.run([sys.executable, "benchmarks/bench_checkpoint.py", "--smoke"],
                         env=sub_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ratios = dict(re.findall(r"^(restore/dcp\.load|async/sync blocking) ratio (\S+)", out.stdout,
                             re.MULTILINE))
    assert ratios.keys() == {"restore/dcp.load", "async/sync blocking"}, out.stdout
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in ratios.values()), ratios
    counts = re.search(r"restore hashed (\S+) bytes per byte it read, opened each file (\d+)x",
                       out.stdout)
    assert counts and float(counts[1]) == 1.0 and counts[2] == "1", out.stdout


def test_rollback_target_predates_the_update_before_the_onset():
    assert rollback_target(57_182, 1000) == 57_000
    assert rollback_target(57_001, 1000) == 56_000  # checkpoint 57,000 holds update 57,000
    assert rollback_target(57_002, 1000) == 57_000
    assert rollback_target(1_500, 1000) == 1000 and rollback_target(1_001, 1000) is None
    assert rollback_target(1_002, 1000) == 1000
    assert rollback_target(57_182, [56_000, 57_000, 58_000]) == 57_000
    assert rollback_target(57_001, [56_000, 57_000]) == 56_000
    assert rollback_target(5, []) is None
    with pytest.raises(ValueError, match="checkpoints=0"):
        rollback_target(10, 0)


def test_rollback_restores_before_update_onset_minus_one_and_skips_the_range(tmp_path):
    """Checkpoints every 3 steps; an anomaly from onset 7 detected at 9. Checkpoint 6 is
    healthy but holds update 6 = onset - 1, which may be the cause: the rollback restores 3,
    replays batches 4..6 and skips 7..9."""
    def run(rollback: bool, steps: int):
        model, opt, _ = build()
        data = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=16, seed=3)
        mgr = CheckpointManager(tmp_path / f"r{rollback}", model=model, optimizer=opt, data=data,
                                every=3)
        fed, step, rolled, listed = [], 0, False, None
        while step < steps:
            x, y = next(data)
            fed.append(x)
            loss = model.loss(model(x), y).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rollback:  # checkpoint 9's window saw the anomaly
                mgr.maybe_save(step, healthy=rolled or step != 9)
            if rollback and step == 9 and not rolled:
                listed = [(c.step, c.healthy) for c in mgr.list()]
                # the guard's rollback: the newest healthy checkpoint at or before onset - 2,
                # then the stream skips the batches of steps onset..detection
                info = mgr.restore(at_or_before=rollback_target(
                    7, [c.step for c in mgr.list() if c.healthy]))
                data.skip(7, 9)
                assert info.step == 3
                step, rolled = info.step, True
            step += 1
        return fed, mgr, listed

    plain, _, _ = run(False, 16)
    fed, mgr, listed = run(True, 12)
    assert listed == [(3, True), (6, True), (9, False)]
    # batches 0..9 fed; back to 3: batches 4, 5, 6 replayed, 7..9 skipped, then 10, 11, ...
    expect = [*plain[:10], *plain[4:7], *plain[10:15]]
    assert len(fed) == len(expect) and all(torch.equal(a, b) for a, b in zip(fed, expect))
    last = mgr.list()[-1]
    assert last.step == 9 and last.healthy and last.skip_ranges == ((7, 9),)
