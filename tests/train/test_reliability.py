"""What the trainer guarantees when things go wrong: damaged checkpoints are refused, one trainer per run
directory, one consistent set of epoch artefacts after a kill -9 at any point, no leftover temporary
files, and unreadable images that name themselves and never cost a finished epoch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import gspn2.train.data as data_module
from gspn2.train.checkpoint import CHECKPOINT_FORMAT, CheckpointError, load_checkpoint, save_checkpoint
from gspn2.train.data import DataError, ImageError, build_dataset, read_image, verify_images
from gspn2.train.rundir import (
    LOCK_NAME,
    STAGING_NAME,
    InterruptsDeferred,
    RunDirBusy,
    RunDirLock,
    publish,
    recover,
)
from tests.train._helpers import (
    CONFIGS,
    TINY,
    compose_cfg,
    flip_tensor_byte,
    load_script,
    run_cli,
    run_killed_at,
    snapshot,
    start_forked,
)

# one epoch of 4 steps, no EMA: the shortest run that writes every epoch artefact
QUICK = [*TINY, "ema=none", "trainer.epochs=1"]


@pytest.fixture
def finished_run(short_run, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(short_run[1], run_dir)
    return run_dir


def _eval_cfg(*overrides):
    return compose_cfg(list(overrides), config_name="eval", config_dir=CONFIGS / "eval")


# ------------------------------------------------------------------------- 1. checkpoint integrity


def test_flipped_tensor_byte_is_refused_by_load_and_eval(short_run, eval_script, tmp_path):
    damaged = tmp_path / "damaged.pt"
    shutil.copyfile(short_run[1] / "last.pt", damaged)
    flip_tensor_byte(damaged)
    torch.load(damaged, map_location="cpu", weights_only=True)  # still a readable pickle
    with pytest.raises(CheckpointError, match=rf"{damaged}.*fails its integrity check"):
        load_checkpoint(damaged)
    out = tmp_path / "eval.json"
    with pytest.raises(CheckpointError, match=rf"{damaged}.*fails its integrity check"):
        eval_script.run_eval(_eval_cfg(f"checkpoint={damaged}", f"out={out}"))
    assert not out.exists()


def test_digest_covers_every_entry_whatever_the_keys(tmp_path):
    """Entries the trainer does not know (here an EMA dict under timm's key) are covered too, and so
    are non-tensor values."""
    path = tmp_path / "ckpt.pt"
    state = {
        "format": CHECKPOINT_FORMAT,
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "model_name": "m",
        "epoch": 1,
        "step": 4,
        "config": {"lr": 0.1},
        "state_dict_ema": {"w": torch.ones(3, dtype=torch.bfloat16), "n": torch.tensor(3)},
        "history": [{"val_top1": 12.5}],
    }
    save_checkpoint(state, path)
    assert torch.equal(load_checkpoint(path)["state_dict_ema"]["w"], state["state_dict_ema"]["w"])
    for tamper in (
        lambda s: s["state_dict_ema"]["w"].__setitem__(1, 0.5),
        lambda s: s["history"][0].__setitem__("val_top1", 99.0),
        lambda s: s.__setitem__("extra", 1),
        lambda s: s["model"].__setitem__("w", s["model"]["w"].reshape(3, 2)),
    ):
        raw = torch.load(path, weights_only=True)
        tamper(raw)
        bad = tmp_path / "bad.pt"
        torch.save(raw, bad)  # re-saved without a new digest, like an edit by hand
        with pytest.raises(CheckpointError, match="fails its integrity check"):
            load_checkpoint(bad)


def test_damaged_last_is_refused_untouched_and_resume_from_best_works(
    train_script, finished_run, digits_root, capsys
):
    last = finished_run / "last.pt"
    flip_tensor_byte(last)
    damaged_bytes = last.read_bytes()
    before = snapshot(finished_run)
    overrides = [*TINY, f"data.root={digits_root}", f"run_dir={finished_run}", "trainer.epochs=3"]
    with pytest.raises(CheckpointError, match=rf"{last}.*integrity.*resume={finished_run / 'best.pt'}"):
        train_script.train(compose_cfg(overrides))
    assert snapshot(finished_run) == before  # nothing overwritten, nothing added

    best_epoch = load_checkpoint(finished_run / "best.pt")["epoch"]
    train_script.train(compose_cfg([*overrides, f"resume={finished_run / 'best.pt'}"]))
    resumed = load_checkpoint(last)
    assert resumed["epoch"] == 3 and [h["epoch"] for h in resumed["history"]] == list(range(1, 4))
    best_history = load_checkpoint(finished_run / "best.pt")["history"]
    assert resumed["history"][:best_epoch] == best_history[:best_epoch]
    assert (finished_run / "last.damaged.pt").read_bytes() == damaged_bytes  # kept, not overwritten
    assert "last.damaged.pt" in capsys.readouterr().out


# ------------------------------------------------------------------------------- 2. run-directory lock


def _wait_for(path: Path, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.is_alive(), f"the first trainer exited with {proc.exitcode} (its output is above)"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def _train(overrides: list[str]) -> None:
    load_script("train").train(compose_cfg(overrides))


def test_second_trainer_is_refused_and_a_killed_trainers_lock_is_taken_over(
    train_script, digits_root, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    overrides = [*QUICK, f"data.root={digits_root}", f"run_dir={run_dir}"]
    # another process (from the fork server: no interpreter start-up to wait for) runs a long training
    first = start_forked(_train, [*overrides, "trainer.epochs=500"])
    try:
        _wait_for(run_dir / "config.yaml", first)  # the first trainer is running
        with pytest.raises(RunDirBusy, match=rf"{run_dir}.*in use by another trainer.*pid {first.pid}\b"):
            train_script.train(compose_cfg(overrides))
        assert first.is_alive()
    finally:
        first.kill()  # SIGKILL
        first.join()
    assert first.exitcode == -signal.SIGKILL
    assert (run_dir / LOCK_NAME).exists()  # kill -9 gave it no chance to clean up
    capsys.readouterr()
    train_script.train(compose_cfg(overrides))
    out = capsys.readouterr().out
    assert f"took over the stale lock {run_dir / LOCK_NAME}" in out and f"pid {first.pid}" in out
    assert not (run_dir / LOCK_NAME).exists()  # released on return


def test_lock_is_exclusive_and_released_on_error(train_script, digits_root, tmp_path):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir) as lock:
        assert lock.acquire() is None
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
            RunDirLock(run_dir).acquire()
    assert not run_dir.exists()  # the lock created the folder and, empty, it is removed again
    # a start that fails after taking the lock (here: a data root without its split folders, which the
    # config checks before the lock do not look into) releases it and leaves no folder behind
    (tmp_path / "no_splits").mkdir()
    with pytest.raises(DataError, match="no_splits"):
        train_script.train(
            compose_cfg([*QUICK, f"data.root={tmp_path / 'no_splits'}", "data.prepare=null", f"run_dir={run_dir}"])
        )
    assert not run_dir.exists()
    with RunDirLock(run_dir) as lock:
        assert lock.acquire() is None


@pytest.mark.slow
def test_ddp_ranks_all_stop_when_the_run_dir_is_taken(digits_root, tmp_path):
    run_dir = tmp_path / "run"
    holder = RunDirLock(run_dir)
    holder.acquire()
    try:
        proc = run_cli(
            [
                "--standalone",
                "--nproc_per_node=2",
                "train.py",
                *QUICK,
                f"data.root={digits_root}",
                f"run_dir={run_dir}",
                "trainer.dist_backend=gloo",
            ],
            torchrun=True,
            timeout=180,  # a rank left waiting for rank 0 would hang until this
        )
    finally:
        holder.release()
    assert proc.returncode != 0
    assert proc.stderr.count("in use by another trainer") >= 2, proc.stderr[-3000:]  # both ranks say why


# ------------------------------------------------------------------ 3. one consistent set after a crash


def _assert_consistent(run_dir: Path, epochs: int) -> None:
    last = load_checkpoint(run_dir / "last.pt")
    results = json.loads((run_dir / "results.json").read_text())
    best = load_checkpoint(run_dir / "best.pt")
    assert last["epoch"] == results["epoch"] == epochs
    assert results["history"] == last["history"]
    assert best["epoch"] == results["best_epoch"] == last["best_epoch"]
    assert (run_dir / "curves.png").is_file()
    assert not list(run_dir.glob(".*.tmp")) and not (run_dir / STAGING_NAME).exists()


@pytest.mark.parametrize("point", ["commit", "best.pt", "curves.png"])
def test_kill_during_the_epoch_writes_leaves_one_consistent_set(point, train_script, digits_root, tmp_path):
    """kill -9 before the set is committed (rolled back), in the middle of moving it into place and
    before its last file (both completed on the next start); the re-run then agrees with itself."""
    run_dir = tmp_path / "run"
    overrides = [*QUICK, f"data.root={digits_root}", f"run_dir={run_dir}"]
    target = run_dir / STAGING_NAME / "COMMITTED" if point == "commit" else run_dir / point
    code = run_killed_at(target, overrides)
    assert code == -signal.SIGKILL, f"the child exited with {code}, not killed at {target}"
    train_script.train(compose_cfg(overrides))
    _assert_consistent(run_dir, epochs=1)


def test_a_failing_write_publishes_nothing_and_a_committed_set_is_finished_first(tmp_path):
    """A writer that fails (a full disk) leaves the previous set whole; a set committed but not moved
    into place (its mover failed) is completed before the next one is staged."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    publish(run_dir, {"a.txt": lambda p: p.write_text("1"), "b.txt": lambda p: p.write_text("1")})

    def full_disk(path):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        publish(run_dir, {"a.txt": lambda p: p.write_text("2"), "b.txt": full_disk})
    assert (run_dir / "a.txt").read_text() == (run_dir / "b.txt").read_text() == "1"
    assert not (run_dir / STAGING_NAME).exists()

    staged = run_dir / STAGING_NAME  # what a crash halfway through moving epoch 3 into place leaves
    staged.mkdir()
    (staged / "b.txt").write_text("3")
    manifest = {"files": ["a.txt", "b.txt"], "remove": [], "label": "epoch 3"}
    (staged / "COMMITTED").write_text(json.dumps(manifest))
    (run_dir / "a.txt").write_text("3")
    assert recover(run_dir) == [
        f"completed the interrupted write of epoch 3 in {run_dir} (moved into place: b.txt)"
    ]
    assert (run_dir / "b.txt").read_text() == "3" and not staged.exists()


@pytest.fixture
def python_sigint():
    """SIGINT with Python's own handler (a KeyboardInterrupt), as in a trainer started from a shell."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _ctrl_c(times: int = 1) -> None:
    for _ in range(times):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs in the main thread at its next bytecode


def test_ctrl_c_during_the_writes_waits_for_the_set_then_interrupts(python_sigint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    publish(run_dir, {"a.txt": lambda p: p.write_text("1"), "b.txt": lambda p: p.write_text("1")})

    def interrupted_write(path):
        _ctrl_c()
        path.write_text("2")

    written = []
    with pytest.raises(KeyboardInterrupt), InterruptsDeferred("epoch 2's files"):
        publish(run_dir, {"a.txt": interrupted_write, "b.txt": lambda p: p.write_text("2")})
        written.append("after publish")
    assert written == ["after publish"]  # the Ctrl-C waited for the block's end
    assert (run_dir / "a.txt").read_text() == (run_dir / "b.txt").read_text() == "2"
    assert "Ctrl-C: finishing epoch 2's files first (Ctrl-C again to abandon it)" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with InterruptsDeferred("nothing"):  # no Ctrl-C, no KeyboardInterrupt
        pass


def test_second_ctrl_c_abandons_the_write_and_stays_a_keyboard_interrupt(python_sigint, tmp_path):
    """A second Ctrl-C stops at once; the writer's own cleanup error (torch.save's zip writer raises one
    when a KeyboardInterrupt cuts a record short) does not replace the interrupt."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    publish(run_dir, {"a.txt": lambda p: p.write_text("1")})

    def abandoned_write(path):
        try:
            path.write_text("half")
            _ctrl_c(2)
            path.write_text("2")
        finally:
            raise RuntimeError("unexpected pos 4313728 vs 4313616")

    with pytest.raises(KeyboardInterrupt) as caught, InterruptsDeferred("epoch 2's files"):
        publish(run_dir, {"a.txt": abandoned_write})
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert (run_dir / "a.txt").read_text() == "1" and not (run_dir / STAGING_NAME).exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_without_ctrl_c_passes_through_unchanged(python_sigint, tmp_path):
    with pytest.raises(OSError, match="No space left"), InterruptsDeferred("x"):
        raise OSError(28, "No space left on device")


# ------------------------------------------------------------------------------------ 4. *.tmp cleanup


def test_leftover_tmp_files_are_removed_on_start(train_script, finished_run, digits_root, capsys):
    leftovers = [finished_run / ".last.pt.k2j4x9.tmp", finished_run / ".results.json.q8w1e0.tmp"]
    for p in leftovers:
        p.write_bytes(b"half a file")
    keep = finished_run / "notes.tmp"  # not a name the trainer's atomic writes use
    keep.write_text("mine")
    overrides = [*TINY, f"data.root={digits_root}", f"run_dir={finished_run}", "trainer.epochs=2"]
    train_script.train(compose_cfg(overrides))
    assert not [p for p in leftovers if p.exists()]
    assert keep.read_text() == "mine"
    assert f"removed {leftovers[0]}" in capsys.readouterr().out


# --------------------------------------------------------------------------------------- 5. bad images


@pytest.fixture
def damaged_root(digits_root, tmp_path) -> Path:
    """A small copy of the digits (8 train and 4 val images per class) with one undecodable train image
    and one truncated val JPEG."""
    root = tmp_path / "digits_damaged"
    for split, per_class in (("train", 8), ("val", 4)):
        for cls in sorted((digits_root / split).iterdir()):
            (root / split / cls.name).mkdir(parents=True)
            for img in sorted(cls.iterdir())[:per_class]:
                shutil.copyfile(img, root / split / cls.name / img.name)
    (root / "train" / "5" / "zz_garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    jpeg = root / "val" / "3" / "zz_truncated.jpeg"
    source = read_image(digits_root / "val" / "3" / sorted(os.listdir(digits_root / "val" / "3"))[0])
    source.resize((256, 256)).save(jpeg, quality=95)  # large enough that half a file ends inside the scan
    jpeg.write_bytes(jpeg.read_bytes()[: jpeg.stat().st_size // 2])
    return root


def _damaged_overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *QUICK,
        f"data.root={root}",
        "data.prepare=null",
        "data.train_subset=null",
        "data.val_subset=null",
        "data.batch_size=27",  # 81 training images: 3 whole batches, so every file is read each epoch
        f"run_dir={run_dir}",
        *extra,
    ]


def test_truncated_jpeg_error_names_the_file(damaged_root):
    jpeg = damaged_root / "val" / "3" / "zz_truncated.jpeg"
    with pytest.raises(ImageError, match=rf"{jpeg}.*image file is truncated"):
        read_image(jpeg)
    dataset = build_dataset(damaged_root, "val", None, bad_images="fail", replace=False)
    index = [p for p, _ in dataset.samples].index(str(jpeg))
    with pytest.raises(ImageError, match=str(jpeg)):
        dataset[index]


def test_fail_policy_stops_naming_the_file(train_script, damaged_root, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ImageError, match=str(damaged_root / "train" / "5" / "zz_garbage.png")):
        train_script.train(compose_cfg(_damaged_overrides(damaged_root, run_dir, "data.bad_images=fail")))
    assert not (run_dir / "last.pt").exists()


def test_default_skips_and_counts_bad_images_and_keeps_the_epoch(
    train_script, eval_script, damaged_root, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    train_script.train(compose_cfg(_damaged_overrides(damaged_root, run_dir, "data.num_workers=1")))
    out = capsys.readouterr().out
    record = json.loads((run_dir / "results.json").read_text())["history"][0]
    assert record["skipped_train_images"] == 1 and record["skipped_val_images"] == 1
    assert "zz_garbage.png" in out and "zz_truncated.jpeg" in out
    assert load_checkpoint(run_dir / "last.pt")["epoch"] == 1  # the epoch was kept

    out_json = tmp_path / "eval.json"
    eval_script.run_eval(
        _eval_cfg(f"checkpoint={run_dir / 'last.pt'}", f"out={out_json}", "data.num_workers=0")
    )
    results = json.loads(out_json.read_text())
    assert results["skipped_images"] == 1 and results["images"] == 10 * 4  # the 40 readable val images
    assert "zz_truncated.jpeg" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- 6. data.verify


def test_verify_decodes_every_file_once_and_lists_the_bad_ones(damaged_root, monkeypatch):
    calls: list[str] = []
    lock = threading.Lock()
    real = data_module.read_image

    def counting(path):
        with lock:
            calls.append(str(path))
        return real(path)

    monkeypatch.setattr(data_module, "read_image", counting)
    datasets = [build_dataset(damaged_root, split, None) for split in ("train", "val")]
    bad = verify_images(datasets, threads=4)
    files = sorted(str(p) for p in damaged_root.rglob("*") if p.is_file())
    assert sorted(calls) == files  # each file once
    assert len(bad) == 2
    assert "zz_garbage.png" in bad[0] + bad[1] and "zz_truncated.jpeg" in bad[0] + bad[1]


def test_verify_with_fail_policy_lists_all_bad_files_before_writing(train_script, damaged_root, tmp_path):
    run_dir = tmp_path / "run"
    overrides = _damaged_overrides(damaged_root, run_dir, "data.verify=true", "data.bad_images=fail")
    with pytest.raises(ImageError, match=r"2 unreadable images[\s\S]*zz_garbage.png[\s\S]*zz_truncated.jpeg"):
        train_script.train(compose_cfg(overrides))
    assert not run_dir.exists()
