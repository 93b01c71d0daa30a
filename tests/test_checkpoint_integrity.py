"""Restore refuses a damaged or tampered checkpoint, reads nothing outside its directory, and
falls back to the previous healthy one."""

import hashlib
import io
import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from spikeguard.checkpoint import CheckpointError, CheckpointWarning, verify_checkpoint
from tests._ckpt_common import (
    Payload,
    build,
    copy_pair,
    make_pair,
    params,
    remanifest,
    restore_fresh,
    same,
)


@pytest.fixture(scope="module")
def _pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def two_checkpoints(_pair, tmp_path):
    return copy_pair(_pair, tmp_path)


def _flip(name: str, where: float | str):
    """Damage: flip one bit of one byte of ``name`` (at a fraction of its length, or the last
    byte of the first occurrence of a given text) without touching the manifest."""
    def damage(path):
        f = path / name
        raw = bytearray(f.read_bytes())
        if isinstance(where, str):
            i = raw.index(where.encode()) + len(where) - 1
        else:
            i = min(int(len(raw) * where), len(raw) - 1)
        raw[i] ^= 0x01
        f.write_bytes(bytes(raw))
    damage.__name__ = f"flip_{name}_{where}"
    return damage


def _truncate(path):
    f = path / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _drop_shard(path):
    (path / "__0_0.distcp").unlink()


def _refused_and_step_2_used(mgr, at2, match):
    with pytest.warns(CheckpointWarning, match=match):
        info, model, _, sched = restore_fresh(mgr)
    assert info.step == 2 and same(params(model), at2)
    assert sched.state_dict()["last_epoch"] == 2


# -- integrity -------------------------------------------------------------------------------
@pytest.mark.parametrize(("damage", "message"), [
    (_truncate, "truncated"), (_drop_shard, "missing"),
    (_flip("__0_0.distcp", 0.5), "digest"),  # tensor bytes
    (_flip("__0_0.distcp", 0.0), "digest"),  # the first entry's zip header: load fails first
    (_flip("__0_0.distcp", 1.0), "digest"),  # the last byte
    (_flip(".metadata", 0.5), "digest"),  # checked before it is unpickled
    (_flip("rank0.json", 0.5), "digest"),
    (_flip("__0_0.distcp.digests.json", 0.5), "digest"),  # the shard's segment table
    (_flip("info.json", '"world_size":1'), "digest"),  # 1 -> 0: still valid JSON
    (_flip("MANIFEST.json", '"digest":"'), "manifest is unreadable"),
], ids=lambda v: getattr(v, "__name__", v))
def test_damaged_checkpoint_is_refused_and_the_previous_healthy_one_used(two_checkpoints, damage,
                                                                         message):
    mgr, at2 = two_checkpoints
    damage(mgr.list()[-1].path)
    _refused_and_step_2_used(mgr, at2, message)


def test_every_checkpoint_refused_raises_with_each_reason(two_checkpoints):
    mgr, _ = two_checkpoints
    for c in mgr.list():
        _flip("__0_0.distcp", 0.5)(c.path)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="step_00000002"):
        restore_fresh(mgr)


def test_a_checkpoint_of_the_first_manifest_format_still_restores(two_checkpoints):
    """Format 1 listed every file whole as {"size", "sha256": hex}; such a checkpoint loads."""
    mgr, _ = two_checkpoints
    path = mgr.list()[-1].path
    (path / "__0_0.distcp.digests.json").unlink()
    manifest = {"format": "spikeguard-checkpoint/1", "files": {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in path.iterdir() if p.name != "MANIFEST.json"}}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    info, _, _, _ = restore_fresh(mgr)  # a refusal would warn, an error under pytest
    assert info.step == 4 and verify_checkpoint(path)["__0_0.distcp"] > 0
    _flip("__0_0.distcp", 0.5)(path)
    with pytest.raises(ValueError, match="__0_0.distcp does not match its digest"):
        verify_checkpoint(path)


def test_verify_checkpoint_checks_every_file(two_checkpoints):
    mgr, _ = two_checkpoints
    path = mgr.list()[-1].path
    sizes = verify_checkpoint(path)
    assert sizes == {p.name: p.stat().st_size for p in path.iterdir() if p.name != "MANIFEST.json"}
    _flip("rank0.json", 0.5)(path)
    with pytest.raises(ValueError, match="rank0.json does not match its digest"):
        verify_checkpoint(path)


# -- nothing outside the directory -----------------------------------------------------------
def _swap_for_symlink(path, name, target):
    (path / name).unlink()
    (path / name).symlink_to(target)
    remanifest(path)  # the manifest now vouches for the target's bytes, as an attacker's would


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "rank0.json", "MANIFEST.json"])
def test_a_symlinked_file_is_refused_even_with_a_matching_manifest(two_checkpoints, tmp_path,
                                                                   name):
    mgr, at2 = two_checkpoints
    path = mgr.list()[-1].path
    outside = tmp_path / f"outside-{name}"
    shutil.copy(path / name, outside)  # the same bytes, outside the checkpoint
    _swap_for_symlink(path, name, outside)
    if name == "MANIFEST.json":
        (path / name).unlink()
        (path / name).symlink_to(path.parent / "step_00000002" / name)
    _refused_and_step_2_used(mgr, at2, "symbolic links are refused")


def test_a_symlinked_checkpoint_directory_is_not_listed(two_checkpoints, tmp_path):
    mgr, _ = two_checkpoints
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(mgr.list()[-1].path, elsewhere)
    (mgr.directory / "step_00000006").symlink_to(elsewhere)
    assert [c.step for c in mgr.list()] == [2, 4]
    info, _, _, _ = restore_fresh(mgr)
    assert info.step == 4


@pytest.mark.timeout(120)
def test_a_named_pipe_in_place_of_a_shard_is_refused_without_blocking(two_checkpoints):
    mgr, at2 = two_checkpoints
    path = mgr.list()[-1].path
    (path / "__0_0.distcp").unlink()
    os.mkfifo(path / "__0_0.distcp")  # opening it for reading without O_NONBLOCK would hang
    _refused_and_step_2_used(mgr, at2, "not a regular file")


def test_a_manifest_name_leaving_the_directory_is_refused(two_checkpoints):
    mgr, at2 = two_checkpoints
    path = mgr.list()[-1].path
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"]["../step_00000002/__0_0.distcp"] = manifest["files"]["__0_0.distcp"]
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    _refused_and_step_2_used(mgr, at2, "not a plain file name")


# -- security --------------------------------------------------------------------------------
def _stock_load_runs(path, tmp_path, marker) -> bool:
    """Does stock DCP (FileSystemReader + default planner) run the payload? Checked on a copy."""
    copy = tmp_path / "stock"
    shutil.copytree(path, copy)
    model, opt, _ = build()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from spikeguard.checkpoint import io as _ckpt_io

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
    remanifest(path)
    assert _stock_load_runs(path, tmp_path, marker), "the planted payload must be live"
    with pytest.warns(CheckpointWarning, match=match):
        info, model, _, _ = restore_fresh(mgr)
    assert not marker.exists()
    assert info.step == 2 and same(params(model), at2)


def test_payload_in_metadata_is_refused_and_never_runs(two_checkpoints, tmp_path):
    mgr, at2 = two_checkpoints
    path, marker = mgr.list()[-1].path, tmp_path / "pwned-metadata"
    md = pickle.loads((path / ".metadata").read_bytes())  # our own file, before tampering
    md.planner_data = {"x": Payload(marker)}
    _plant_and_expect_refusal(mgr, path, md, tmp_path, marker, at2,
                              match="posix.mkdir, which DCP never writes")


def test_payload_in_a_bytes_entry_is_refused_and_never_runs(two_checkpoints, tmp_path):
    mgr, at2 = two_checkpoints
    path, marker = mgr.list()[-1].path, tmp_path / "pwned-bytes"
    md = pickle.loads((path / ".metadata").read_bytes())
    fqn = next(k for k in md.state_dict_metadata if "optim" in k)
    shard = path / "__0_0.distcp"

    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
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
    remanifest(path)
    with pytest.warns(CheckpointWarning, match="not a file of this checkpoint"):
        info, _, _, _ = restore_fresh(mgr)
    assert info.step == 2


