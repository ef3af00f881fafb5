"""The GPU input path on a GPU: nvJPEG's batched decode, and the same batches as the CPU-tensor run of
the same pipeline, for worker decoding and nvJPEG decoding (tests/train/test_gpu_data.py checks the
CPU-tensor run against timm and PIL)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torchvision.io import ImageReadMode, decode_jpeg

from gspn2.train.config import AugConfig, DataConfig
from gspn2.train.data import build_dataset, build_transform
from gspn2.train.gpu_data import build_gpu_train_loader, erase_mask
from tests.scripts._load import jpeg_folder

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
pytestmark = [cuda, pytest.mark.cuda]


@pytest.fixture(scope="module")
def jpeg_root(tmp_path_factory):
    return jpeg_folder(tmp_path_factory, "cuda_jpegs", classes=2, train_per_class=16)


def test_nvjpeg_batch_decode_matches_the_cpu_decoder(jpeg_root):
    files = sorted((jpeg_root / "train").rglob("*.JPEG"))
    raw = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files]
    on_gpu = decode_jpeg(raw, mode=ImageReadMode.RGB, device="cuda")
    on_cpu = decode_jpeg(raw, mode=ImageReadMode.RGB)
    assert len(on_gpu) == len(files)
    for g, c in zip(on_gpu, on_cpu):
        assert g.is_cuda and g.dtype == torch.uint8 and g.shape == c.shape
        diff = (g.cpu().float() - c.float()).abs()
        # Two correct decoders: nvJPEG and libjpeg-turbo differ in IDCT rounding and in how they upsample
        # 4:2:0 chroma (on an H200: mean 2.1-3.4 levels per image, up to 28 at colour edges, PSNR 35 dB and more). A wrong decode (channels,
        # orientation, a broken batch entry) is tens of levels off on average and far below 30 dB.
        psnr = 10 * torch.log10(255.0**2 / diff.square().mean())
        assert diff.mean() < 6.0 and psnr > 30.0, (diff.mean().item(), psnr.item())


@pytest.mark.parametrize("gpu_decode", [False, True])
def test_cuda_batches_match_the_cpu_tensor_run(jpeg_root, gpu_decode):
    data = OmegaConf.structured(DataConfig(root=str(jpeg_root), num_classes=2, img_size=224,
                                           gpu_decode=gpu_decode))
    aug = OmegaConf.structured(AugConfig())
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))
    on_gpu = build_gpu_train_loader(dataset, data, aug, 16, "cuda", 1, 0, seed=0, num_workers=2,
                                    pin_memory=True)
    on_cpu = build_gpu_train_loader(dataset, data, aug, 16, "cpu", 1, 0, seed=0, num_workers=0,
                                    pin_memory=False)
    diffs = []
    for epoch in (0, 1):
        on_gpu.sampler.set_epoch(epoch)
        on_cpu.sampler.set_epoch(epoch)
        raws = list(on_cpu.loader)
        for (xg, yg), (xc, yc), raw in zip(on_gpu, on_cpu, raws):
            assert xg.is_cuda and yg.is_cuda and xg.shape == (16, 3, 224, 224) and xg.dtype == torch.float32
            assert torch.equal(yg.cpu(), yc)
            params = raw[2] if gpu_decode else raw[1]
            keep = ~erase_mask(params["erase"], 224, 224).expand_as(xc)  # noise differs per device
            diffs.append((xg.cpu() - xc).abs()[keep].mean().item())
    # nvJPEG: decoder rounding, amplified where RandAugment's ops (equalize, solarize, posterize) have
    # steps; worker decoding: the same uint8 crops on both devices, only the ops' float rounding differs
    assert np.mean(diffs) < 0.05, diffs
    # the same seed and epoch give the same batch again
    on_gpu.sampler.set_epoch(0)
    first = next(iter(on_gpu))[0]
    on_gpu.sampler.set_epoch(0)
    assert torch.equal(first, next(iter(on_gpu))[0])


def test_batches_prepared_ahead_on_a_side_stream_are_the_inline_ones(jpeg_root):
    data = OmegaConf.structured(DataConfig(root=str(jpeg_root), num_classes=2, img_size=224))
    aug = OmegaConf.structured(AugConfig())
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))
    args = (dataset, data, aug, 8, "cuda", 1, 0)
    inline = build_gpu_train_loader(*args, seed=1, num_workers=2, pin_memory=True, ahead=0)
    ahead = build_gpu_train_loader(*args, seed=1, num_workers=2, pin_memory=True, ahead=2)
    for epoch in (0, 1):
        inline.sampler.set_epoch(epoch)
        ahead.sampler.set_epoch(epoch)
        n = 0
        for (xa, ya), (xb, yb) in zip(inline, ahead):
            # work queued on the consumer's stream right away sees the finished batch
            assert torch.equal(xa, xb.clone()) and torch.equal(ya, yb)
            n += 1
        assert n == len(inline) == 4


def test_augmenting_a_worker_batch_never_waits_for_the_gpu(jpeg_root):
    """Queueing a batch's work (upload, RandAugment, erasing) makes no host-device synchronisation: a
    sync would stall the host thread behind the training step's kernels on every op."""
    data = OmegaConf.structured(DataConfig(root=str(jpeg_root), num_classes=2, img_size=224))
    aug = OmegaConf.structured(AugConfig())
    dataset = build_dataset(jpeg_root, "train", build_transform(data, aug, is_training=True))
    loader = build_gpu_train_loader(dataset, data, aug, 16, "cuda", 1, 0, seed=3, num_workers=2,
                                    pin_memory=True)
    loader.sampler.set_epoch(0)
    ops = set()
    for batch in loader.loader:
        ops |= {int(k) for k in batch[1]["ra_op"].flatten().tolist() if k >= 0}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loader.augment(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(ops) >= 5  # the batches exercised several of RandAugment's ops (geometric ones among them)
