"""scripts/receptive_field.py: op cones against the analytic cone, model ERFs, checkpoints, bad arguments."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

import gspn2  # noqa: F401  (registers the gspn2_* models with timm)
from tests.scripts._load import script_module


@pytest.fixture(scope="module")
def rf():
    with script_module("receptive_field") as module:
        yield module


def analytic_cone(H: int, W: int, i: int, j: int, d: int, chunk: int | None) -> torch.Tensor:
    """Inputs that reach output (i, j) of direction d, from the recurrence alone.

    In a direction's canonical frame (line position q, scan step s), h at (q, s) takes x at (q, s) and the
    previous line's state at q-1, q, q+1, so by induction it depends on x at (q', s') exactly when
    s' <= s and |q' - q| <= s - s'; a chunk restarts the scan, so also s' >= the first step of s's chunk.
    Direction 0 has q = row, s = col; 1: q = row, s = W-1-col; 2: q = col, s = row; 3: q = col, s = H-1-row.
    """
    rows = torch.arange(H)[:, None].expand(H, W)
    cols = torch.arange(W)[None, :].expand(H, W)
    if d == 0:
        q, s, q0, s0 = rows, cols, i, j
    elif d == 1:
        q, s, q0, s0 = rows, W - 1 - cols, i, W - 1 - j
    elif d == 2:
        q, s, q0, s0 = cols, rows, j, i
    else:
        q, s, q0, s0 = cols, H - 1 - rows, j, H - 1 - i
    cone = (s <= s0) & ((q - q0).abs() <= s0 - s)
    if chunk is not None:
        cone &= s >= (s0 // chunk) * chunk
    return cone


# ---------------------------------------------------------------------------------------------- op


@pytest.mark.parametrize("size,pixel", [((9, 13), (4, 6)), ((8, 11), (1, 9)), ((7, 7), (0, 0))])
def test_each_direction_is_the_analytic_cone(rf, size, pixel):
    cones = rf.op_cones(size, pixel, chunk=None, gates="uniform")
    for d in range(4):
        expected = analytic_cone(*size, *pixel, d, None)
        assert torch.equal(cones.regions[d], expected), f"direction {d}"
    # The pixel itself is reached in every direction (through lam * x), with the largest weight of its cone.
    assert cones.regions[:, pixel[0], pixel[1]].all()


def test_global_scan_union_covers_the_image(rf):
    H, W = 9, 12
    for pixel in [(0, 0), (4, 5), (8, 11), (2, 10)]:
        cones = rf.op_cones((H, W), pixel, chunk=None)
        assert cones.union.all(), pixel
        # One direction alone never covers it (a cone is at most half the plane plus its edge lines).
        assert not cones.regions.all(dim=(1, 2)).any()


def test_chunk_truncates_the_cones(rf):
    H, W, pixel, chunk = 10, 12, (5, 7), 3
    cones = rf.op_cones((H, W), pixel, chunk=chunk)
    full = rf.op_cones((H, W), pixel, chunk=None)
    for d in range(4):
        assert torch.equal(cones.regions[d], analytic_cone(H, W, *pixel, d, chunk)), f"direction {d}"
    # Columns 0..3 lie in earlier chunks of direction 0 and out of the short cones of 2 and 3.
    assert not cones.union[:, :4].any()
    assert cones.union.sum() < full.union.sum()
    # chunk=1 leaves every direction with the pixel alone.
    single = rf.op_cones((H, W), pixel, chunk=1)
    assert single.union.sum() == 1 and single.union[pixel]


def test_random_and_file_gates(rf, tmp_path):
    """Positive weights of any gates reach the same cone; a gates file is read and shape-checked."""
    size, pixel = (8, 10), (3, 4)
    rand = rf.op_cones(size, pixel, chunk=None, gates="random", seed=3)
    uniform = rf.op_cones(size, pixel, chunk=None, gates="uniform")
    assert torch.equal(rand.regions, uniform.regions)
    assert not torch.allclose(rand.grads, uniform.grads)  # the magnitudes do depend on the gates
    path = tmp_path / "gates.pt"
    torch.save(torch.zeros(4, 3, *size), path)
    from_file = rf.op_cones(size, pixel, chunk=2, gates=str(path))
    assert torch.equal(from_file.grads, rf.op_cones(size, pixel, chunk=2, gates="uniform").grads)
    torch.save(torch.zeros(4, 3, 5, 5), path)
    with pytest.raises(ValueError, match=r"--gates .* has shape \(4, 3, 5, 5\)"):
        rf.op_cones(size, pixel, chunk=None, gates=str(path))
    path.write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="could not be read as a tensor file"):
        rf.op_cones(size, pixel, chunk=None, gates=str(path))


def test_op_main_writes_png_and_json(rf, tmp_path, capsys):
    out = tmp_path / "sub" / "cones.png"
    rf.main(["op", "--size", "7x9", "--pixel", "2", "3", "--out", str(out)])
    summary = json.loads(out.with_suffix(".json").read_text())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["union_fraction"] == 1.0 and summary["pixel"] == [2, 3] and summary["size"] == [7, 9]
    # Direction 0 of (2, 3): columns 0..3, each column c holding rows 2 +- (3 - c) inside the image.
    assert summary["directions"][0]["pixels"] == int(analytic_cone(7, 9, 2, 3, 0, None).sum())
    assert "union: 63 of 63 inputs" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--size", "5", "--pixel", "5", "0"], "--pixel"),
        (["--size", "5", "--chunk", "0"], "--chunk"),
        (["--size", "5", "--gates", "no_such_gates"], "--gates"),
        (["--size", "0"], "--size"),
        (["--size", "5", "--out-of-place"], "unrecognized"),
    ],
)
def test_op_bad_arguments(rf, tmp_path, capsys, argv, message):
    out = tmp_path / "x.png"
    with pytest.raises(SystemExit):
        rf.main(["op", *argv, "--out", str(out)])
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_op_refuses_sizes_where_the_support_could_underflow(rf, tmp_path, capsys):
    """A weight of ~1e-13 over 29 steps is ~1e-377: a zero there would not prove 'unreached'."""
    gates = torch.zeros(4, 3, 30, 30)
    gates[:, 1] = -30.0  # the straight-on neighbour gets sigmoid(-30) / (two halves) ~ 1e-13
    path = tmp_path / "gates.pt"
    torch.save(gates, path)
    with pytest.raises(SystemExit):
        rf.main(["op", "--size", "30", "--gates", str(path), "--out", str(tmp_path / "x.png")])
    assert "float64" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["gates.pt"]
    # The same gates on a short scan are fine, and still reach the analytic cone.
    cones = rf.op_cones((30, 30), (15, 15), chunk=4, gates=str(path))
    assert torch.equal(cones.regions[2], analytic_cone(30, 30, 15, 15, 2, 4))


def test_out_must_be_png_in_a_directory(rf, tmp_path, capsys):
    with pytest.raises(SystemExit):
        rf.main(["op", "--size", "5", "--out", str(tmp_path / "x.jpg")])
    assert "--out must name a .png" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    (tmp_path / "y.json").mkdir()
    for out, message in ((tmp_path / "file" / "x.png", "is not a directory"), (tmp_path / "y.png", "y.json")):
        with pytest.raises(SystemExit):
            rf.main(["op", "--size", "5", "--out", str(out)])
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "y.json"]


# ------------------------------------------------------------------------------------------- model


def test_area_fractions(rf):
    flat = torch.ones(10, 10, dtype=torch.float64)
    fr = rf.area_fractions(flat)
    assert fr["50"]["fraction"] == 0.5 and fr["90"]["fraction"] == 0.9
    peaked = torch.ones(10, 10, dtype=torch.float64)
    peaked[3, 4] = 99 * 1.5  # this pixel holds 60% of the mass
    fr = rf.area_fractions(peaked)
    assert fr["50"]["pixels"] == 1
    # 90% needs 60% + 30% of 247.5: the peak and 75 ones (each 1/247.5 of the mass).
    assert fr["90"]["pixels"] == 1 + 75
    with pytest.raises(ValueError, match="zero everywhere"):
        rf.area_fractions(torch.zeros(4, 4))


def _erf(rf, name, size, seed, stage=-1, batch=2):
    panel = rf.build_timm_panel(name, size, stage, pretrained=False)
    rf.probe_stage(panel, size, torch.device("cpu"))
    images = rf.noise_images(batch, size, seed)
    return panel, rf.erf_map(panel, images, torch.device("cpu"), micro_batch=1)


def test_model_erf_is_deterministic_for_a_seed(rf):
    torch.manual_seed(0)
    panel, a = _erf(rf, "gspn2_micro", (32, 32), seed=1)
    torch.manual_seed(0)
    _, b = _erf(rf, "gspn2_micro", (32, 32), seed=1)
    torch.manual_seed(0)
    _, c = _erf(rf, "gspn2_micro", (32, 32), seed=2)
    assert a.shape == (32, 32) and (a >= 0).all() and a.sum() > 0
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # other images, other map
    assert panel.stage == 3 and panel.info == {"channels": 128, "feature_size": [1, 1], "centre": [0, 0]}


def test_model_main_is_deterministic_for_a_seed(rf, tmp_path):
    """Random-init weights and noise both follow --seed: two runs agree, another seed does not."""
    argv = ["model", "--models", "gspn2_micro", "--img-size", "32", "--batch", "2", "--stage", "2"]
    a = rf.main([*argv, "--seed", "5", "--out", str(tmp_path / "a.png")])
    b = rf.main([*argv, "--seed", "5", "--out", str(tmp_path / "b.png")])
    c = rf.main([*argv, "--seed", "6", "--out", str(tmp_path / "c.png")])
    assert a == b
    assert a["models"][0]["pixels_50"] > 0
    assert a["models"] != c["models"]


def test_model_erf_matches_per_image_gradients(rf):
    """The batched backward (micro-batches of 2) equals the mean of single-image gradients."""
    torch.manual_seed(0)
    panel = rf.build_timm_panel("gspn2_micro", (24, 24), 1, pretrained=False)
    rf.probe_stage(panel, (24, 24), torch.device("cpu"))
    images = rf.noise_images(2, (24, 24), seed=0)
    batched = rf.erf_map(panel, images, torch.device("cpu"), micro_batch=2)
    single = []
    for k in range(2):
        x = images[k : k + 1].clone().requires_grad_(True)
        (feat,) = panel.model.forward_intermediates(x, indices=[1], intermediates_only=True, stop_early=True)
        feat[:, :, feat.shape[2] // 2, feat.shape[3] // 2].sum().backward()
        single.append(x.grad.abs().sum(dim=1)[0].double())
    torch.testing.assert_close(batched, torch.stack(single).mean(0), rtol=1e-5, atol=1e-9)


def test_model_erf_of_global_scans_reaches_every_input(rf):
    """Stage 0 of gspn2_micro at 64x64: with global scans every input pixel reaches the centre feature;
    with scans restarting every step (chunk=1) only the convolutions' neighbourhood does."""
    import timm

    supports = {}
    for chunk in (None, 1):
        torch.manual_seed(0)
        model = timm.create_model("gspn2_micro", stage_chunks=(chunk, None, None, None))
        panel = rf.Panel("gspn2_micro", "test", "test", model, 0, 4, None)
        rf.probe_stage(panel, (64, 64), torch.device("cpu"))
        supports[chunk] = rf.erf_map(panel, rf.noise_images(2, (64, 64), 0), torch.device("cpu"), 2) > 0
    assert supports[None].all()
    local = supports[1]
    assert local[32, 32] and not local[0].any() and not local[:, 0].any() and not local[-1].any()
    assert local.sum() < 0.6 * local.numel()


def test_model_main_with_checkpoint_and_timm_peer(rf, tmp_path, capsys):
    from gspn2.train.checkpoint import CHECKPOINT_FORMAT, save_checkpoint
    from tests.train._helpers import compose_cfg

    torch.manual_seed(0)
    cfg = OmegaConf.to_container(compose_cfg([]), resolve=True)
    import timm

    model = timm.create_model("gspn2_micro", num_classes=10)
    ckpt = tmp_path / "best.pt"
    save_checkpoint(
        {
            "format": CHECKPOINT_FORMAT,
            "model": model.state_dict(),
            "model_name": "gspn2_micro",
            "ema": None,
            "epoch": 3,
            "step": 66,
            "config": cfg,
        },
        ckpt,
    )
    images = tmp_path / "images"
    for k in range(3):
        (images / str(k)).mkdir(parents=True)
        Image.new("RGB", (32, 32), (40 * k, 80, 200 - 50 * k)).save(images / str(k) / f"{k}.png")
    out = tmp_path / "erf.png"
    argv = [
        "model",
        "--checkpoints",
        str(ckpt),
        "--models",
        "resnet10t",
        "--data",
        str(images),
        "--batch",
        "3",
        "--stage",
        "1",
        "--out",
        str(out),
    ]
    summary = rf.main(argv)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.with_suffix(".json").read_text()) == summary
    assert summary["img_size"] == [32, 32]  # the checkpoint's training size
    gspn, peer = summary["models"]
    assert gspn["model"] == "gspn2_micro" and "epoch 3" in gspn["source"] and gspn["reduction"] == 8
    assert peer["model"] == "resnet10t" and peer["source"] == "timm, random init"
    for row in (gspn, peer):
        assert 0 < row["area_fraction_50"] <= row["area_fraction_90"] <= 1
    # The checkpoint's panel is the ERF of exactly those weights, on the images its data config normalises.
    files = rf.list_images(str(images))
    panel = rf.Panel(
        "m",
        "s",
        "c",
        model,
        1,
        4,
        rf._data_of(
            {
                "mean": cfg["data"]["mean"],
                "std": cfg["data"]["std"],
                "crop_pct": 1.0,
                "interpolation": "bicubic",
            }
        ),
    )
    rf.probe_stage(panel, (32, 32), torch.device("cpu"))
    direct = rf.erf_map(panel, rf.load_images(files, (32, 32), panel.data), torch.device("cpu"), 3)
    assert gspn["area_fraction_50"] == rf.area_fractions(direct)["50"]["fraction"]
    assert "gspn2_micro" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--models", "no_such_model_xyz"], "not a registered timm model"),
        (["--models", "gspn2_micro", "--stage", "4"], "out of range for gspn2_micro, which has 4 stages"),
        (["--models", "gspn2_micro", "--batch", "0"], "--batch"),
        (["--models", "gspn2_micro", "--device", "cuda:99"], "--device"),
        (["--models", "gspn2_micro", "--device", "meta"], "--device"),
        (["--models", "gspn2_micro", "--ema"], "--ema needs --checkpoints"),
        ([], "at least one of --models"),
        (["--checkpoints", "no/such.pt"], "does not exist"),
        (["--models", "gspn2_micro", "--data", "no/such/dir"], "--data"),
        (["--models", "gspn2_micro", "--img-size", "3x"], "--img-size"),
        (["--models", "gspn2_micro", "--img-size", "24"], "cannot run at --img-size 24x24 up to stage 3"),
    ],
)
def test_model_bad_arguments(rf, tmp_path, capsys, argv, message):
    out = tmp_path / "x.png"
    with pytest.raises(SystemExit):
        rf.main(["model", *argv, "--out", str(out)])
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_data_folder_with_too_few_images(rf, tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "a.png")
    with pytest.raises(SystemExit):
        rf.main(
            [
                "model",
                "--models",
                "gspn2_micro",
                "--data",
                str(tmp_path / "imgs"),
                "--batch",
                "2",
                "--out",
                str(tmp_path / "x.png"),
            ]
        )
    assert "--batch 2 needs 2 images" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]
