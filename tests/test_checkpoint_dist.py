import pickle

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed


def _fsdp_model_and_optimizer(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from spikeguard import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, rank: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 17), generator=gen)
        loss = model.loss(model(x[:, :-1]), x[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _local(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.to_local().clone() for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        for name, t in state.items():
            out[f"o.{i}.{name}"] = (t.to_local() if hasattr(t, "to_local") else t).clone()
    return out


def _save_restore(rank: int, world_size: int, directory: str) -> dict:
    from spikeguard import CheckpointManager, TokenStream

    model, opt = _fsdp_model_and_optimizer(seed=0)
    data = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=32, seed=1, rank=rank,
                                   world_size=world_size)
    mgr = CheckpointManager(directory, model=model, optimizer=opt, data=data, every=2,
                            async_save=True)
    _train(model, opt, rank, 2)
    for _ in range(2):
        next(data)
    torch.manual_seed(1000 + rank)  # per-rank RNG stream
    mgr.save(2)
    want, want_rng = _local(model, opt), torch.get_rng_state()
    _train(model, opt, rank, 2)  # on the default group, while the save runs on its own group
    mgr.wait()
    saved = dict(mgr.io_stats.hashed)
    next(data)
    mgr.save(4, healthy=False)
    mgr.close()

    model2, opt2 = _fsdp_model_and_optimizer(seed=7)
    data2 = TokenStream.from_corpus("pydoc", batch_size=2, seq_len=32, seed=1, rank=rank,
                                    world_size=world_size)
    reader = CheckpointManager(directory, model=model2, optimizer=opt2, data=data2)
    info = reader.restore()
    got = _local(model2, opt2)
    sizes = {p.name: p.stat().st_size for p in info.path.iterdir()}
    return {"step": info.step, "same": want.keys() == got.keys()
            and all(torch.equal(want[k], got[k]) for k in want),
            "n": len(want), "rng": torch.equal(torch.get_rng_state(), want_rng),
            "position": data2.position, "sizes": sizes, "saved": saved,
            "read": dict(reader.io_stats.opened), "hashed": dict(reader.io_stats.hashed),
            "listed": [(c.step, c.healthy) for c in mgr.list()]}


@pytest.mark.dist
def test_fsdp2_sharded_async_save_and_restore_on_two_gloo_ranks(tmp_path):
    results = run_distributed(_save_restore, 2, str(tmp_path / "ck"), timeout=180)
    for r in results:
        assert r["step"] == 2 and r["same"] and r["n"] > 10
        assert r["rng"] and r["position"] == 2
        assert r["listed"] == [(2, True), (4, False)]
    sizes = results[0]["sizes"]
    assert results[1]["sizes"] == sizes
    shards = ["__0_0.distcp", "__1_0.distcp"]
    tables = [f"{s}.digests.json" for s in shards]
    assert {*shards, *tables, "rank0.json", "rank1.json", "MANIFEST.json", ".metadata",
            "info.json"} == set(sizes)
    # each rank hashed exactly the files it wrote (rank 0 also DCP's metadata and info.json)
    assert results[0]["saved"] == {n: sizes[n] for n in (shards[0], tables[0], "rank0.json",
                                                         ".metadata", "info.json")}
    assert results[1]["saved"] == {n: sizes[n] for n in (shards[1], tables[1], "rank1.json")}
    # on restore each rank opens each file it needs once and hashes all of its own shard; of
    # the other rank's shard only the entries DCP stored there once for both (the optimizer's
    # replicated step counts), not the whole file
    replicated = _replicated_bytes(tmp_path / "ck" / "step_00000002")
    assert sum(replicated.values()) > 0  # there is such state, and it was read where it lies
    assert sum(r["hashed"].get(s, 0) for r in results for s in shards) == \
        sizes[shards[0]] + sizes[shards[1]] + sum(replicated.values())
    for rank, r in enumerate(results):
        own, other = shards[rank], shards[1 - rank]
        mine = [own, tables[rank], f"rank{rank}.json", ".metadata", "info.json"]
        assert {n: r["hashed"][n] for n in mine} == {n: sizes[n] for n in mine}
        assert set(r["read"].values()) == {1} and set(mine) < set(r["read"])
        assert r["hashed"].get(other, 0) == replicated.get(other, 0) < 0.1 * sizes[other]


def _replicated_bytes(path) -> dict[str, int]:
    """Per shard file, the bytes of its entries that hold a whole tensor (replicated state such
    as AdamW's step counts, stored once by DCP for all ranks), from DCP's metadata."""
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own file, for the test
    out: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        tensor = metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in tensor.chunks if tuple(c.offsets) == tuple(index.offset))
        if tuple(chunk.sizes) == tuple(tensor.size):
            out[info.relative_path] = out.get(info.relative_path, 0) + info.length
    return out
