"""Crash-safe checkpoints: atomic publish with fsync, sha256 validation, fallback, keep-last-k."""

import json
import os
import shutil

import pytest
import torch

from ddpgpt.checkpoint import location, read, store, swap
from ddpgpt.checkpoint import read as load_module
from ddpgpt.checkpoint.store import CheckpointError
from ddpgpt.config.model import ModelConfig
from ddpgpt.model.gpt import GPT
from tests.helpers import json_error


def model(seed=0):
    return GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=16), seed=seed)


def save(run, step, keep=10, seed=None):
    state = {"model": model(step if seed is None else seed).state_dict(),
             "optimizer": {"step": step}}
    return store.save(run / "checkpoints", step, state, {"config": {}}, keep)


def find_latest(run):
    return store.find_latest(run / "checkpoints")


def load_into(path, target):
    read.load_weights(path, target,
                      read.load(path, store.read_meta(path))["model"])


def test_save_is_complete_and_validated(tmp_path):
    path = save(tmp_path, 7)
    assert path == tmp_path / "checkpoints" / "step_0000007"
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata", "__0_0.distcp", "meta.json", "trainer.pt"]
    meta = store.read_meta(path)
    assert meta["step"] == 7 and meta["format_version"] == 3
    assert set(meta["files"]) == {".metadata", "__0_0.distcp", "trainer.pt"}
    # no temp dir left
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000007"]
    loaded = model(seed=99)
    load_into(path, loaded)
    assert all(torch.equal(a, b)
               for a, b in zip(loaded.state_dict().values(), model(7).state_dict().values()))
    assert read.load(path, meta)["optimizer"] == {"step": 7}


def test_files_and_directory_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", os.path.basename(b))),
                                                    real_rename(a, b))[1])
    save(tmp_path, 1)
    rename = events.index(("rename", "step_0000001"))
    synced = {name for kind, name in events[:rename] if kind == "fsync"}
    assert {"__0_0.distcp", ".metadata.tmp", "trainer.pt", "meta.json"} <= synced
    assert any(name.startswith(".tmp-step_0000001") for name in synced)  # the directory itself
    assert ("fsync", "checkpoints") in events[rename:]  # and its parent after the rename


def test_latest_falls_back_past_partial_and_corrupt(tmp_path, capsys):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step_0000004" / "meta.json").unlink()  # partial: never published its marker
    weights = root / "step_0000003" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # corrupt: sha256 no longer matches
    path, meta = find_latest(tmp_path)
    assert path.name == "step_0000002" and meta["step"] == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ddpgpt: warning: skipping checkpoint: {root / 'step_0000004'}: incomplete checkpoint "
        "(no meta.json); falling back to step_0000002",
        f"ddpgpt: warning: skipping checkpoint: {root / 'step_0000003'}: __0_0.distcp does "
        "not match its sha256 in meta.json (corrupt); falling back to step_0000002",
    ]


def test_corrupt_meta_falls_back(tmp_path, capsys):
    save(tmp_path, 1)
    save(tmp_path, 2)
    meta = tmp_path / "checkpoints" / "step_0000002" / "meta.json"
    meta.write_text('{"format_version": 1, "st')
    assert find_latest(tmp_path)[0].name == "step_0000001"
    assert capsys.readouterr().err == (f"ddpgpt: warning: skipping checkpoint: {meta}: corrupt "
                                       f"meta.json ({json_error(meta.read_text())}); falling back "
                                       "to step_0000001\n")


def test_no_valid_checkpoint_is_an_error(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "checkpoints" / "step_0000001" / "trainer.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        find_latest(tmp_path)
    assert str(e.value) == (f"no valid checkpoint in {tmp_path}: "
                            f"{tmp_path / 'checkpoints' / 'step_0000001'}: trainer.pt is missing; "
                            "move the bad ones away, or pass --reset to set them aside "
                            "and start over")


def test_newer_format_is_refused(tmp_path):
    path = save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = 99
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as e:
        find_latest(tmp_path)
    assert str(e.value) == (f"{path}: checkpoint format version 99 is newer than this ddpgpt "
                            "reads (3); upgrade ddpgpt (pip install -U ddpgpt)")


def test_keep_last_k(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_0000004", "step_0000005"]


def test_temporaries_are_removed_at_startup(tmp_path):
    """What interrupted saves and deletes leave behind; complete checkpoints stay."""
    save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    leftovers = [root / ".tmp-step_0000002-99999", root / ".old-step_0000001-5",
                 root / ".del-step_0000001-6"]
    for path in leftovers:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x" * 100)
    assert sorted(store.remove_temporaries(root)) == sorted(leftovers)
    assert [p.name for p in root.iterdir()] == ["step_0000001"]


def test_failed_delete_warns_and_keeps_the_newest(tmp_path, monkeypatch, capsys):
    save(tmp_path, 1, keep=1)
    real = shutil.rmtree

    def refuse(path, *a, **kw):
        if os.path.basename(path).startswith(".del-step_0000001"):
            raise PermissionError(13, "Permission denied")
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", refuse)
    save(tmp_path, 2, keep=1)  # does not raise
    # Renamed out of the way (so no reader takes it), deleted by the next start's cleanup.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        f".del-step_0000001-{os.getpid()}", "step_0000002"]
    assert find_latest(tmp_path)[0].name == "step_0000002"
    assert capsys.readouterr().err == (f"ddpgpt: warning: could not delete old checkpoint "
                                       f"{tmp_path / 'checkpoints' / 'step_0000001'} "
                                       "(Permission denied); training goes on\n")


def test_resaving_a_step_replaces_it(tmp_path):
    save(tmp_path, 3, seed=1)
    path = save(tmp_path, 3, seed=2)
    loaded = model(seed=99)
    load_into(path, loaded)
    assert torch.equal(loaded.wte.weight, model(2).wte.weight)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000003"]


def test_a_failed_replacement_keeps_the_previous_copy(tmp_path, monkeypatch):
    """Saving a step that exists moves the old copy aside first; if the new one cannot take its
    place, the old one goes back: the step stays a complete checkpoint, as the error says."""
    save(tmp_path, 3, seed=1)
    real_rename = os.rename

    def rename(a, b):
        if os.path.basename(a).startswith(".tmp-step_0000003"):
            raise OSError(5, "Input/output error", a)
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(store.WriteError, match="Input/output error"):
        save(tmp_path, 3, seed=2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_0000003"]
    loaded = model(seed=99)
    load_into(find_latest(tmp_path)[0], loaded)
    assert torch.equal(loaded.wte.weight, model(1).wte.weight)


def test_a_resave_killed_between_its_renames_keeps_the_previous_copy(tmp_path):
    """Saving a step that exists renames the previous copy aside, then the new one into place:
    a process killed between the two renames leaves no step_0000003. The copy aside is step 3's
    checkpoint to a reader (the newest, and what --resume of step_0000003 reads), and the next
    start puts it back in place (swap.repair, under the run's lock: one line naming it) instead
    of deleting it with the temporaries."""
    save(tmp_path, 2)
    save(tmp_path, 3, seed=1)
    root = tmp_path / "checkpoints"
    os.rename(root / "step_0000003", root / ".old-step_0000003-77")  # the state a kill leaves
    shutil.copytree(root / "step_0000002", root / ".tmp-step_0000003-77")
    aside = root / ".old-step_0000003-77"
    assert find_latest(tmp_path)[0] == aside and swap.standing(root / "step_0000003") == aside
    assert swap.in_place(aside) == aside  # standing: read where it is until repaired
    assert swap.repair(root) == [
        f"ddpgpt: note: checkpoint {root / 'step_0000003'}: saving step 3 again was cut short "
        "while swapping the new copy in; the previous copy is back in place, and this start goes "
        "on from it"]
    store.remove_temporaries(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002", "step_0000003"]
    assert swap.in_place(aside) == root / "step_0000003"
    path, meta = find_latest(tmp_path)
    loaded = model(seed=99)
    load_into(path, loaded)
    assert meta["step"] == 3 and torch.equal(loaded.wte.weight, model(1).wte.weight)
    assert swap.repair(root) == []  # nothing left to put back


def test_a_parent_that_cannot_be_synced_after_the_rename_is_a_warning(tmp_path, monkeypatch,
                                                                      capsys):
    """The rename published the checkpoint: a failed fsync of its parent afterwards is said, and
    the save counts (it is not reported as failed while its directory is there)."""
    real_fsync = location.fsync  # the store syncs a local directory through location.sync

    def fsync(path):
        if path.name == "checkpoints":
            raise OSError(5, "Input/output error")
        real_fsync(path)

    monkeypatch.setattr(location, "fsync", fsync)
    path = save(tmp_path, 2)
    assert find_latest(tmp_path)[0] == path
    err = capsys.readouterr().err
    assert (f"ddpgpt: warning: checkpoint {path} is written, but its directory could not be "
            "synced (Input/output error); it may not survive a power loss") in err


def test_weights_of_another_shape_are_one_line(tmp_path):
    path = save(tmp_path, 1)
    other = GPT(ModelConfig(n_layer=1, n_head=1, n_embd=16, block_size=4, vocab_size=16))
    with pytest.raises(CheckpointError,
                       match=rf"^{path}: weights do not fit this model \(size mismatch"):
        load_into(path, other)


def test_load_latest_skips_a_checkpoint_pruned_while_read(tmp_path, monkeypatch):
    """A running training prunes the newest checkpoint between `find_latest` and the read: the
    reader takes the next newest instead of failing."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    root, real_load = tmp_path / "checkpoints", read.load

    def pruned_first(path, meta, **kw):
        if path.name == "step_0000002":  # deleted the way prune deletes: renamed away, then removed
            os.rename(path, root / ".del-step_0000002-1")
            shutil.rmtree(root / ".del-step_0000002-1")
        return real_load(path, meta, **kw)

    monkeypatch.setattr(load_module, "load", pruned_first)
    path, meta, state = read.load_latest(root)
    assert (path.name, meta["step"]) == ("step_0000001", 1)
    assert torch.equal(state["model"]["wte.weight"], model(1).wte.weight)


def test_readers_never_fail_while_a_training_prunes(tmp_path):
    """The race `eval`/`sample` lost 7 times in 20 against a run with keep_checkpoints = 1: here
    a thread saves with keep 1 as fast as it can while the reader loads the latest 200 times."""
    import threading

    save(tmp_path, 0, keep=1)
    stop, errors = threading.Event(), []

    def train():
        step = 1
        while not stop.is_set():
            save(tmp_path, step, keep=1)
            step += 1

    writer = threading.Thread(target=train)
    writer.start()
    try:
        for _ in range(200):
            try:
                path, meta, state = read.load_latest(tmp_path / "checkpoints")
                assert torch.equal(state["model"]["wte.weight"], model(meta["step"]).wte.weight)
            except CheckpointError as e:
                errors.append(e)
    finally:
        stop.set()
        writer.join()
    assert errors == []
