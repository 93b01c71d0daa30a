import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from spikeguard import (
    GPT,
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    GPTConfig,
    TokenStream,
)
from tests.conftest import ROOT


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _train(model, opt, sched, steps: int = 1) -> None:
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(steps))
    for _ in range(steps):
        loss = model.loss(model(x[:, :-1]), x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def _pair(tmp_path_factory):
    """Checkpoints at steps 2 and 4 of one run, built once; with the step-2 params."""
    root = tmp_path_factory.mktemp("pair")
    model, opt, sched = _setup()
    mgr = CheckpointManager(root / "ck", every=2)
    _train(model, opt, sched, 2)
    mgr.save(2, model=model, optimizer=opt, scheduler=sched)
    at2 = _params(model)
    _train(model, opt, sched, 2)
    mgr.save(4, model=model, optimizer=opt, scheduler=sched)
    return root / "ck", at2


@pytest.fixture
def two_checkpoints(_pair, tmp_path):
    """A private copy of the pair: (manager, params at step 2)."""
    shutil.copytree(_pair[0], tmp_path / "ck")
    return CheckpointManager(tmp_path / "ck", every=2), _pair[1]


def _restore_fresh(mgr, **kw):
    model, opt, sched = _setup(seed=123)
    info = mgr.restore(model=model, optimizer=opt, scheduler=sched, **kw)
    return info, model, opt, sched


def _remanifest(path) -> None:
    """Recompute the manifest to match tampered files, as an attacker with write access would."""
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(path.iterdir()) if p.is_file() and p.name != "MANIFEST.json"}
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"] = files
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


class _Payload:
    """Unpickling this calls os.mkdir(marker): it stands for arbitrary code."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


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
    assert _same(a["model"], b["model"])
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and all(_same(sa[i], sb[i]) for i in sa)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["sched"] == b["sched"] and a["sched"]["last_epoch"] == 6
    assert a["data"] == b["data"] and a["data"]["position"] == 6
    assert a["detector"] == b["detector"] and a["detector"]["ema"]["count"] == 6
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["py_rng"] == b["py_rng"] and (a["np_rng"] == b["np_rng"]).all()


def test_round_trip_restores_every_piece(tmp_path):
    model, opt, sched = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    data = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=32, seed=1)
    for _ in range(3):
        next(data)
    data.skip(5, 8)
    _train(model, opt, sched, 3)
    mgr = CheckpointManager(tmp_path, every=3)
    assert mgr.maybe_save(2, model=model) is None
    mgr.maybe_save(3, model=model, optimizer=opt, scheduler=sched, scaler=scaler, data=data,
                   meta={"note": "x"})
    want_opt, want_sched, want = opt.state_dict(), sched.state_dict(), _params(model)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    data2 = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=32, seed=1)
    model2, opt2, sched2 = _setup(seed=9)
    info = mgr.restore(model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, data=data2)
    assert info.step == 3 and info.healthy and info.skip_ranges == ((5, 8),)
    assert info.meta == {"note": "x"}
    assert _same(_params(model2), want)
    got = opt2.state_dict()
    assert got["param_groups"] == want_opt["param_groups"]
    assert all(_same(got["state"][i], want_opt["state"][i]) for i in want_opt["state"])
    assert sched2.state_dict() == want_sched
    assert scaler2.state_dict() == scaler.state_dict()
    assert data2.state_dict() == data.state_dict()


# -- integrity -------------------------------------------------------------------------------
def _truncate(path):
    f = path / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(path):
    f = path / "__0_0.distcp"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))


def _drop_shard(path):
    (path / "__0_0.distcp").unlink()


@pytest.mark.parametrize(("damage", "message"), [(_truncate, "truncated"), (_flip, "sha256"),
                                                 (_drop_shard, "missing")])
def test_damaged_checkpoint_is_refused_and_the_previous_healthy_one_used(two_checkpoints, damage,
                                                                         message):
    mgr, at2 = two_checkpoints
    damage(mgr.list()[-1].path)
    with pytest.warns(CheckpointWarning, match=message):
        info, model, _, sched = _restore_fresh(mgr)
    assert info.step == 2 and _same(_params(model), at2)
    assert sched.state_dict()["last_epoch"] == 2


def test_every_checkpoint_refused_raises_with_each_reason(two_checkpoints):
    mgr, _ = two_checkpoints
    for c in mgr.list():
        _flip(c.path)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="step_00000002"):
        _restore_fresh(mgr)


# -- security --------------------------------------------------------------------------------
def _stock_load_runs(path, tmp_path, marker) -> bool:
    """Does stock DCP (FileSystemReader + default planner) run the payload? Checked on a copy."""
    copy = tmp_path / "stock"
    shutil.copytree(path, copy)
    model, opt, _ = _setup()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from spikeguard.respond import _ckpt_io

    tensors, _ = _ckpt_io.split(dict(zip(("model", "optim"), get_state_dict(model, opt))))
    try:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(copy))
    except Exception:
        pass
    ran = marker.exists()
    if ran:
        marker.rmdir()
    return ran


def _plant_and_expect_refusal(mgr, path, md, tmp_path, marker, at2, *, match):
    """Write the tampered metadata with a matching manifest, show stock dcp.load runs the payload
    on a copy, then show our restore refuses it, never runs it, and falls back to step 2."""
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _remanifest(path)
    assert _stock_load_runs(path, tmp_path, marker), "the planted payload must be live"
    with pytest.warns(CheckpointWarning, match=match):
        info, model, _, _ = _restore_fresh(mgr)
    assert not marker.exists()
    assert info.step == 2 and _same(_params(model), at2)


def test_payload_in_metadata_is_refused_and_never_runs(two_checkpoints, tmp_path):
    mgr, at2 = two_checkpoints
    path, marker = mgr.list()[-1].path, tmp_path / "pwned-metadata"
    md = pickle.loads((path / ".metadata").read_bytes())  # our own file, before tampering
    md.planner_data = {"x": _Payload(marker)}
    _plant_and_expect_refusal(mgr, path, md, tmp_path, marker, at2,
                              match="posix.mkdir, which DCP never writes")


def test_payload_in_a_bytes_entry_is_refused_and_never_runs(two_checkpoints, tmp_path):
    mgr, at2 = two_checkpoints
    path, marker = mgr.list()[-1].path, tmp_path / "pwned-bytes"
    md = pickle.loads((path / ".metadata").read_bytes())
    fqn = next(k for k in md.state_dict_metadata if "optim" in k)
    shard = path / "__0_0.distcp"
    import io

    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != fqn}
    md.storage_data[MetadataIndex(fqn)] = _StorageInfo("__0_0.distcp", offset, len(buf.getvalue()))
    _plant_and_expect_refusal(mgr, path, md, tmp_path, marker, at2, match="weights_only")


def test_storage_entry_pointing_outside_the_checkpoint_is_refused(two_checkpoints):
    mgr, _ = two_checkpoints
    path = mgr.list()[-1].path
    md = pickle.loads((path / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo("../step_00000002/__0_0.distcp", 0, 16)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _remanifest(path)
    with pytest.warns(CheckpointWarning, match="not a file of this checkpoint"):
        info, _, _, _ = _restore_fresh(mgr)
    assert info.step == 2


# -- health, rotation, atomicity -------------------------------------------------------------
def test_restore_takes_newest_healthy_at_or_before(tmp_path):
    model, opt, sched = _setup()
    mgr = CheckpointManager(tmp_path, every=2, keep=10)
    saved = {}
    for step in (2, 4, 6, 8):
        _train(model, opt, sched)
        mgr.save(step, model=model, optimizer=opt, alerts=["loss_ema_ratio 1.7"] if step == 6 else ())
        saved[step] = _params(model)
    assert [(c.step, c.healthy) for c in mgr.list()] == [(2, True), (4, True), (6, False), (8, True)]
    for at, want in ((7, 4), (8, 8), (3, 2)):
        m, o, _ = _setup(seed=5)
        assert mgr.restore(model=m, optimizer=o, at_or_before=at).step == want
        assert _same(_params(m), saved[want])
    with pytest.raises(CheckpointError, match="at or before step 1"):
        mgr.restore(model=m, at_or_before=1)


def test_rotation_keeps_keep_and_never_the_last_healthy(tmp_path):
    model, _, _ = _setup()
    mgr = CheckpointManager(tmp_path, every=1, keep=3)
    for step in range(1, 8):
        mgr.save(step, model=model, healthy=step <= 3, save_rng=False)
    kept = [(c.step, c.healthy) for c in mgr.list()]
    assert kept == [(3, True), (6, False), (7, False)]
    assert mgr.restore(model=model).step == 3


def test_incomplete_checkpoints_are_invisible_and_cleaned(two_checkpoints, tmp_path):
    mgr, _ = two_checkpoints
    shutil.copytree(mgr.list()[-1].path, tmp_path / "ck" / ".tmp-step_00000006")
    (tmp_path / "ck" / ".tmp-step_00000006" / "MANIFEST.json").unlink()
    shutil.copytree(tmp_path / "ck" / ".tmp-step_00000006", tmp_path / "ck" / "step_00000008")
    assert [c.step for c in mgr.list()] == [2, 4]
    info, _, _, _ = _restore_fresh(mgr)
    assert info.step == 4
    model, opt, _ = _setup()
    mgr.save(10, model=model, optimizer=opt)
    assert not (tmp_path / "ck" / ".tmp-step_00000006").exists()


def test_async_save_commits_the_state_at_call_time(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched)
    mgr = CheckpointManager(tmp_path, every=1, async_save=True)
    mgr.save(1, model=model, optimizer=opt, scheduler=sched)
    want = _params(model)
    _train(model, opt, sched, 2)  # training goes on while the files are written
    mgr.wait()
    assert [c.step for c in mgr.list()] == [1]
    mgr.close()
    info, m2, _, _ = _restore_fresh(mgr)
    assert info.step == 1 and _same(_params(m2), want)


def test_generic_stateful_extra_state_and_bad_arguments(tmp_path):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n, "hist": (1.5, float("nan"))}

        def load_state_dict(self, s):
            self.n = s["n"]
            self.hist = s["hist"]

    model, _, _ = _setup()
    c = Counter()
    c.n = 41
    mgr = CheckpointManager(tmp_path, every=1)
    mgr.save(1, model=model, extra_state={"detector": c})
    c2 = Counter()
    mgr.restore(model=model, extra_state={"detector": c2})
    assert c2.n == 41 and c2.hist[0] == 1.5 and c2.hist[1] != c2.hist[1]
    with pytest.raises(ValueError, match="reserved"):
        mgr.save(2, model=model, extra_state={"data": c})
    with pytest.raises(ValueError, match="every=0"):
        CheckpointManager(tmp_path, every=0)
    with pytest.raises(ValueError, match="keep=0"):
        CheckpointManager(tmp_path, keep=0)


def test_benchmark_smoke(sub_env):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "benchmarks/bench_checkpoint.py", "--smoke"],
                         env=sub_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "restore/dcp.load" in out.stdout and "async/sync blocking" in out.stdout
    assert time.monotonic() - start < 60


def test_rollback_replays_to_onset_skips_the_anomaly_and_records_it(tmp_path):
    def run(rollback: bool, steps: int):
        model, opt, _ = _setup()
        data = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=16, seed=3)
        mgr = CheckpointManager(tmp_path / f"r{rollback}", every=3)
        fed, step, rolled = [], 0, False
        while step < steps:
            x, y = next(data)
            fed.append(x)
            loss = model.loss(model(x), y).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            # an anomaly from onset 5, detected at 8: checkpoint 6's window saw alerts
            if rollback:
                mgr.maybe_save(step, model=model, optimizer=opt, data=data,
                               healthy=rolled or step != 6)
            if rollback and step == 8 and not rolled:
                info = mgr.rollback(onset=5, detection=8, model=model, optimizer=opt, data=data)
                assert info.step == 3
                step, rolled = info.step, True
            step += 1
        return fed, mgr

    plain, _ = run(False, 16)
    fed, mgr = run(True, 10)
    # batches 0..8 fed; roll back to 3: batch 4 replayed, 5..8 skipped, then 9, 10, ...
    expect = [*plain[:9], plain[4], *plain[9:14]]
    assert len(fed) == len(expect) and all(torch.equal(a, b) for a, b in zip(fed, expect))
    last = mgr.list()[-1]
    assert last.step == 9 and last.skip_ranges == ((5, 8),)
