"""scripts/make_image_folder.py: size distribution, a tiny folder, determinism, refusals, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

SCRIPT = "make_image_folder"  # the `bench` fixture (tests/scripts/conftest.py) imports it

TINY = dict(classes=3, train_per_class=2, val_per_class=1)


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_size_distribution_is_imagenet_like(bench):
    rng = np.random.default_rng(0)
    sizes = np.array([bench.draw_size(rng) for _ in range(20000)])
    long_side, short_side = sizes.max(1), sizes.min(1)
    assert tuple(np.median(sizes, axis=0)) == (500, 375)
    # long / short in [1, 16/9] up to the rounding of the short side to whole pixels
    assert (long_side >= short_side).all() and (long_side / (short_side + 0.5) <= 16 / 9).all()
    assert 0.79 < np.mean(long_side == 500) < 0.83
    assert 0.13 < np.mean(long_side < 500) < 0.17 and long_side.min() >= 120
    assert 0.03 < np.mean(long_side > 500) < 0.05 and long_side.max() <= 1800
    oblong = sizes[sizes[:, 0] != sizes[:, 1]]
    assert 0.77 < np.mean(oblong[:, 0] > oblong[:, 1]) < 0.83  # landscape
    assert 440 < sizes[:, 0].mean() < 490 and 370 < sizes[:, 1].mean() < 410


def test_tiny_folder_layout_and_summary(bench, tmp_path):
    root = tmp_path / "fake"
    summary = bench.make_image_folder(root, **TINY, workers=1)
    files = sorted(root.rglob("*.JPEG"))
    assert len(files) == summary.images == 9
    assert sorted(p.name for p in (root / "train").iterdir()) == ["c0000", "c0001", "c0002"]
    assert sorted(p.name for p in (root / "val").iterdir()) == ["c0000", "c0001", "c0002"]
    assert all(len(list((root / "train" / c).iterdir())) == 2 for c in ("c0000", "c0001", "c0002"))
    sizes = []
    for path in files:
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            sizes.append(img.size)
            img.load()
    assert summary.total_bytes == sum(p.stat().st_size for p in files)
    assert summary.mean_file_bytes == pytest.approx(summary.total_bytes / 9)
    assert summary.mean_width == pytest.approx(np.mean([s[0] for s in sizes]))
    assert summary.mean_height == pytest.approx(np.mean([s[1] for s in sizes]))
    # each file has the size its own random stream draws, and real content: not a flat image
    _, split, cls, name = files[0].relative_to(tmp_path).parts
    img = bench.render(0, split, int(cls[1:]), int(name.split("_")[1].split(".")[0]))
    assert Image.open(files[0]).size == img.size
    assert np.asarray(img, dtype=np.float32).std() > 20
    assert summary.mean_file_bytes > 30_000  # a flat or tiny image would be a few KB


def test_classes_differ_in_style(bench):
    styles = [bench.class_style(0, c) for c in range(5)]
    assert len({s.shape for s in styles}) == 5
    assert len({s.palette for s in styles}) == 5


def test_deterministic_for_any_worker_count(bench, tmp_path, capsys):
    bench.main([str(tmp_path / "a"), "--classes", "3", "--train-per-class", "2", "--val-per-class", "1",
                "--workers", "1"])
    assert "wrote 9 JPEGs (6 train, 3 val, 3 classes)" in capsys.readouterr().out
    bench.make_image_folder(tmp_path / "b", **TINY, workers=2)
    bench.make_image_folder(tmp_path / "c", **TINY, workers=1, seed=1)
    a, b, c = (_files(tmp_path / x) for x in "abc")
    assert a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)


def test_refuses_a_non_empty_folder_unless_forced(bench, tmp_path):
    root = tmp_path / "fake"
    (root / "train" / "c0000").mkdir(parents=True)
    stale = root / "train" / "c0000" / "stale.JPEG"
    stale.write_bytes(b"old")
    (root / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not empty; pass --force"):
        bench.make_image_folder(root, **TINY)
    assert _files(root) == {"notes.txt": b"keep me", "train/c0000/stale.JPEG": b"old"}
    with pytest.raises(SystemExit):
        bench.main([str(root), "--classes", "3"])
    bench.make_image_folder(root, **TINY, force=True)
    assert not stale.exists() and (root / "notes.txt").read_text() == "keep me"
    assert len(list(root.rglob("*.JPEG"))) == 9


def test_root_that_is_a_file(bench, tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        bench.make_image_folder(path, **TINY, force=True)


@pytest.mark.parametrize(
    "key,value,error,flag",
    [("classes", 0, ValueError, "--classes"), ("train_per_class", 0, ValueError, "--train-per-class"),
     ("val_per_class", 0, ValueError, "--val-per-class"), ("quality", 0, ValueError, "--quality"),
     ("quality", 101, ValueError, "--quality"), ("workers", 0, ValueError, "--workers"),
     ("seed", -1, ValueError, "--seed"), ("classes", 1.5, TypeError, "--classes"),
     ("train_per_class", True, TypeError, "--train-per-class"), ("force", 1, TypeError, "--force")],
)
def test_bad_arguments_write_nothing(bench, tmp_path, key, value, error, flag):
    root = tmp_path / "fake"
    with pytest.raises(error, match=flag):
        bench.make_image_folder(root, **{**TINY, key: value})
    assert not root.exists()


@pytest.mark.parametrize("argv,flag", [(["--classes", "0"], "--classes"), (["--workers", "0"], "--workers"),
                                       (["--json", "/nonexistent/dir/s.json"], "--json")])
def test_cli_names_the_bad_flag(bench, tmp_path, capsys, argv, flag):
    root = tmp_path / "fake"
    with pytest.raises(SystemExit) as exit_info:
        bench.main([str(root), *argv])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert not root.exists()
