"""The checkpoint store at a URL of object storage (checkpoint/location.py) against a real S3
server: a checkpoint is published by its meta.json alone and reads back bitwise; an upload
without one is never loaded and goes at the next start; keep-last-k, a rollback's record and the
checkpoints it supersedes, and what is set aside, all at the URL."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import pytest
import torch

from ddpgpt.checkpoint import location, read, store
from ddpgpt.config.model import ModelConfig
from ddpgpt.model.gpt import GPT
from ddpgpt.run.run_dir import RunDir


def model(seed=0):
    return GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16), seed=seed)


def save(root, step, keep=10, rollbacks=0):
    state = {"model": model(step).state_dict(), "optimizer": {"step": step}}
    return store.save(root, step, state, {"config": {}, "rollbacks": rollbacks}, keep)


@pytest.fixture
def root(s3):
    return s3.bucket("ckpt") + "/run"


def names(s3, url):
    return sorted(p[len(url) - 5 + 1:] for p in s3.fs().find(url[5:]))


def test_a_checkpoint_at_a_url_is_its_objects_meta_json_last_and_reads_back(s3, root, tmp_path):
    path = save(root, 7)
    assert str(path) == f"{root}/step_0000007"
    assert names(s3, root) == ["step_0000007/.metadata", "step_0000007/__0_0.distcp",
                               "step_0000007/meta.json", "step_0000007/trainer.pt"]
    meta = store.read_meta(path)
    local = store.save(tmp_path, 7, {"model": model(7).state_dict(), "optimizer": {"step": 7}},
                       {"config": {}}, 10)
    for name, digest in meta["files"].items():  # hashed on their way out, not read back
        assert digest == hashlib.sha256(s3.fs().cat_file(f"{root[5:]}/step_0000007/{name}")
                                        ).hexdigest(), name
    assert meta["files"]["__0_0.distcp"] == store.read_meta(local)["files"]["__0_0.distcp"]
    assert set(meta["sizes"]) == set(meta["files"])
    found, found_meta = store.find_latest(root)
    weights = read.load(found, found_meta, weights_only=True)["model"]
    assert all(torch.equal(weights[k], v) for k, v in model(7).state_dict().items())


def test_an_upload_without_meta_json_is_never_loaded_and_goes_at_the_next_start(s3, root):
    save(root, 2)
    save(root, 4)
    s3.fs().rm(f"{root[5:]}/step_0000004/meta.json")  # a writer killed before its last object
    path, meta = store.find_latest(root)
    assert (str(path), meta["step"]) == (f"{root}/step_0000002", 2)
    assert [str(p) for p in store.remove_temporaries(root)] == [f"{root}/step_0000004"]
    assert names(s3, root) == [f"step_0000002/{n}" for n in (".metadata", "__0_0.distcp",
                                                              "meta.json", "trainer.pt")]


def test_a_replaced_object_is_found_by_its_size(s3, root):
    path = save(root, 3)
    s3.fs().pipe_file(f"{root[5:]}/step_0000003/__0_0.distcp", b"short")
    with pytest.raises(store.CheckpointError, match=rf"^{path}: __0_0.distcp has 5 bytes, meta"
                                                     r"\.json says \d+ \(replaced or corrupt\)$"):
        store.read_meta(path)


def test_a_replaced_object_of_the_same_size_is_refused_by_its_etag(s3, root):
    """meta.json records each object's ETag at commit; an object rewritten with other bytes of
    the same size is refused in one line, and the newest checkpoint before it is loaded."""
    save(root, 2)
    path = save(root, 3)
    key = f"{root[5:]}/step_0000003/__0_0.distcp"
    data = bytearray(s3.fs().cat_file(key))
    data[-1] ^= 1
    s3.fs().pipe_file(key, bytes(data))
    meta = json.loads((path / "meta.json").read_text())
    assert set(meta["etags"]) == set(meta["files"])
    line = (rf"^{path}: __0_0\.distcp is not the object that was saved \(its ETag is \w+, "
            r"meta\.json says \w+: replaced since\)$")
    with pytest.raises(store.CheckpointError, match=line):
        store.read_meta(path)
    found, _ = store.find_latest(root, quiet=True)
    assert found.name == "step_0000002"


def test_a_checkpoint_moved_keeps_its_etags_and_a_replaced_object_stays_refused(
        s3, root, monkeypatch):
    """A server-side copy of an object uploaded in parts gets another ETag: the copy's meta.json
    records the copies' ETags, except where the source's object had been replaced."""
    for step in (1, 2):
        save(root, step)
    real = location.listed

    def multipart(directory):  # as the server would list copies of multipart uploads
        got = real(directory)
        if "aside" in str(directory):
            got = {n: (size, tag + "-2") for n, (size, tag) in got.items()}
        return got

    monkeypatch.setattr(location, "listed", multipart)
    location.move(location.at(f"{root}/step_0000001"), location.at(f"{root}/aside/step_0000001"))
    assert store.read_meta(location.at(f"{root}/aside/step_0000001"))["step"] == 1
    key = f"{root[5:]}/step_0000002/__0_0.distcp"
    s3.fs().pipe_file(key, bytes(reversed(s3.fs().cat_file(key))))
    location.move(location.at(f"{root}/step_0000002"), location.at(f"{root}/aside/step_0000002"))
    with pytest.raises(store.CheckpointError, match=r"__0_0\.distcp is not the object that was"):
        store.read_meta(location.at(f"{root}/aside/step_0000002"))


def test_keep_last_k_and_a_rollback_record_at_a_url(s3, root):
    for step in (1, 2, 3, 4):
        save(root, step, keep=2)
    assert [s for s, _ in store.step_dirs(root)] == [3, 4]
    store.record_rollback(root, {"to": 3, "rollbacks": 1})
    assert [s for s, _ in store.step_dirs(root)] == [3]  # 4 is superseded at once
    assert [p.name for p in store.superseded(root)] == ["step_0000004"]
    run = RunDir(root)
    aside = run.set_aside("rollback", store.superseded(root))
    assert str(aside).startswith(f"{root}/rollback-")
    assert store.read_meta(location.at(f"{aside}/step_0000004"))["step"] == 4  # moved, whole
    save(root, 4, rollbacks=1)  # the new history's checkpoint spends the record
    assert not location.at(root + "/rollback.json").is_file()
    assert [s for s, _ in store.step_dirs(root)] == [3, 4]
    assert json.loads((location.at(root) / "step_0000004" / "meta.json").read_text())[
        "rollbacks"] == 1


# A re-save of step 4 (other weights: seed 40) in a child forked from this process (its torch and
# s3fs imported already: fsspec starts its event loop and clients anew in a child), which SIGKILLs
# itself just before its KILL_AT-th request that changes the bucket; returns the child's exit
# status and, when it was not killed, how many such requests it made.
CHANGING = ("put_object", "delete_object", "delete_objects", "copy_object",
            "create_multipart_upload", "upload_part", "complete_multipart_upload")


def resave(s3, url, kill_at):
    import s3fs
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            made, real = [0], s3fs.S3FileSystem._call_s3

            async def counting(self, method, *args, **kwargs):
                if method in CHANGING:
                    made[0] += 1
                    if made[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                return await real(self, method, *args, **kwargs)

            s3fs.S3FileSystem._call_s3 = counting
            store.save(url, 4, {"model": model(40).state_dict(), "optimizer": {"step": 4}},
                       {"config": {}}, 10)
            os.write(write_end, str(made[0]).encode())
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(write_end)
    deadline = time.monotonic() + 120  # a hang guard, far above the second a save takes
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the re-save killed at request {kill_at} hung")
        time.sleep(0.02)
    with os.fdopen(read_end) as out:
        made = out.read()
    status = -os.WTERMSIG(done[1]) if os.WIFSIGNALED(done[1]) else os.WEXITSTATUS(done[1])
    return status, int(made) if made else None


@pytest.mark.slow
@pytest.mark.timeout(600)  # a child forked for each of ~15 requests
def test_a_step_saved_again_always_has_a_complete_checkpoint_even_killed_mid_save(s3):
    """Step 4 at the URL is saved again (a rollback re-trained it) and the writer is killed
    before each of the save's requests in turn: the newest complete checkpoint is step 4 at every
    one of them, its weights the old copy's or the new one's, whole, before and after the next
    start's clean-up; an uninterrupted re-save leaves the new copy alone in place."""
    def seeded(url):
        for step in (2, 4):
            save(url, step)
        return url

    url = seeded(s3.bucket("resave") + "/run")
    status, made = resave(s3, url, 0)
    assert status == 0
    assert names(s3, url) == [f"step_000000{step}/{n}" for step in (2, 4) for n in (
        ".metadata", "__0_0.distcp", "meta.json", "trainer.pt")]
    assert made >= 10  # the writes, then the swap's deletes and copies
    copies = {seed: model(seed).state_dict() for seed in (4, 40)}
    for kill_at in range(1, made + 1):
        url = seeded(s3.bucket("resave") + "/run")
        assert resave(s3, url, kill_at) == (-signal.SIGKILL, None), kill_at
        for restart in (False, True):
            if restart:
                store.remove_temporaries(url)
            path, meta = store.find_latest(url)
            weights = read.load(path, meta, weights_only=True)["model"]
            assert meta["step"] == 4 and any(
                all(torch.equal(weights[k], v) for k, v in copy.items())
                for copy in copies.values()), (kill_at, restart, str(path))


def test_an_object_is_a_file_and_not_a_directory(s3, root):
    """A listing of an object's key answers with the object itself: that is not a directory,
    nor something in one."""
    save(root, 1)
    obj, prefix = location.at(f"{root}/step_0000001/meta.json"), location.at(f"{root}/step_0000001")
    assert (obj.is_file(), obj.is_dir(), obj.iterdir()) == (True, False, [])
    assert (prefix.is_file(), prefix.is_dir()) == (False, True)
    assert sorted(p.name for p in prefix.iterdir()) == [".metadata", "__0_0.distcp", "meta.json",
                                                        "trainer.pt"]
    assert location.sizes(obj) == {} and not location.at(f"{root}/nothing").is_dir()
    location.move(obj, location.at(f"{root}/moved.json"))  # an object moves as one
    assert sorted(s3.fs().ls(root[5:])) == [f"{root[5:]}/moved.json", f"{root[5:]}/step_0000001"]


def test_the_background_saver_swaps_a_step_saved_again_in(s3, root, monkeypatch):
    """The training's saver (asynchronous, DCP's writer at the URL) saving step 4 twice: the
    second copy is written beside the first, which is whole until the second is complete, and
    ends in its place, nothing else left behind."""
    from ddpgpt.checkpoint import sharded
    from ddpgpt.checkpoint.saver import Saver
    from ddpgpt.distributed.group import DistEnv

    seen, real = [], store._publish

    def publishing(tmp, final):  # the new copy complete: the previous one is still whole
        meta = store.read_meta(final)
        seen.append(read.load(final, meta, weights_only=True)["model"])
        real(tmp, final)

    monkeypatch.setattr(store, "_publish", publishing)
    saver = Saver(DistEnv(), location.at(root), None, "t", keep=5)
    try:
        for seed in (4, 40):
            held = {f"model.{k}": sharded.whole(v) for k, v in model(seed).state_dict().items()}
            saver.save(4, held, set(held), {"optimizer": {"step": 4}}, {"config": {}}, wait=True)
    finally:
        saver.close()
    assert names(s3, root) == [f"step_0000004/{n}" for n in (".metadata", "__0_0.distcp",
                                                              "meta.json", "trainer.pt")]
    path, meta = store.find_latest(root)
    weights = read.load(path, meta, weights_only=True)["model"]
    assert all(torch.equal(weights[k], v) for k, v in model(40).state_dict().items())
    assert all(torch.equal(seen[-1][k], v) for k, v in model(4).state_dict().items())


def test_a_resave_cut_while_swapped_in_is_put_in_place_at_the_next_start(s3, root, monkeypatch):
    """Step 4 saved again (seed 40) and cut once its previous copy is unpublished and deleted,
    before the new one is moved in: the new copy, complete under its temporary prefix, is step
    4's checkpoint to a reader (the newest, and what --resume of step_0000004 reads); the next
    start (swap.repair) moves it in place with one line naming it, and nothing else is left."""
    from ddpgpt.checkpoint import swap

    for step in (2, 4):
        save(root, step)

    def cut(tmp, final):  # the swap's first half; the process dies before the second
        location.delete_checkpoint(final, "")
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_publish", cut)
    with pytest.raises(KeyboardInterrupt):
        store.save(root, 4, {"model": model(40).state_dict(), "optimizer": {"step": 4}},
                   {"config": {}}, 10)
    monkeypatch.undo()
    copy, meta = store.find_latest(root)
    assert copy.name.startswith(".tmp-step_0000004-") and meta["step"] == 4
    assert swap.standing(location.at(f"{root}/step_0000004")) == copy
    assert swap.repair(root) == [
        f"ddpgpt: note: checkpoint {root}/step_0000004: saving step 4 again was cut short while "
        "swapping the new copy in; the new copy, complete, is back in place, and this start goes "
        "on from it"]
    assert store.remove_temporaries(root) == []
    assert names(s3, root) == [f"step_000000{step}/{n}" for step in (2, 4) for n in (
        ".metadata", "__0_0.distcp", "meta.json", "trainer.pt")]
    path, meta = store.find_latest(root)
    weights = read.load(path, meta, weights_only=True)["model"]
    assert str(path) == f"{root}/step_0000004" and swap.in_place(copy) == path
    assert all(torch.equal(weights[k], v) for k, v in model(40).state_dict().items())
