"""Predictions for a folder of unlabelled images: top-k classes and probabilities per image, as CSV."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from gspn2.train.data import DataError
from gspn2.train.evaluate import autocast

__all__ = ["ImageFiles", "predict_folder"]


class ImageFiles(Dataset):
    """Every image file under ``root`` (recursively, sorted), with its path relative to ``root``."""

    def __init__(self, root: str | os.PathLike, transform):
        self.root = Path(root)
        self.files = sorted(
            p for p in self.root.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS
        )
        if not self.files:
            raise DataError(f"predict={self.root}: no image files ({', '.join(IMG_EXTENSIONS)}) under it")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path = self.files[i]
        try:
            with Image.open(path) as img:
                image = img.convert("RGB")
        except OSError as e:
            raise DataError(f"cannot read image {path}: {e}") from e
        return self.transform(image), i


@torch.no_grad()
def predict_folder(
    model: torch.nn.Module,
    dataset: ImageFiles,
    device: torch.device,
    precision: str,
    batch_size: int,
    num_workers: int,
    topk: int,
    class_names: list[str] | None = None,
    channels_last: bool = False,
) -> bytes:
    """CSV bytes: ``file, class_1, prob_1, ..., class_k, prob_k`` per image (softmax probabilities);
    ``channels_last`` feeds the images in that memory format."""
    model.eval()
    k = min(topk, model.num_classes)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["file", *[f"{what}_{j}" for j in range(1, k + 1) for what in ("class", "prob")]])
    for images, index in loader:
        images = images.to(device)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(device, precision):
            logits = model(images)
        probs, classes = logits.float().softmax(dim=-1).topk(k, dim=-1)
        for i, p_row, c_row in zip(index.tolist(), probs.tolist(), classes.tolist()):
            row = [str(dataset.files[i].relative_to(dataset.root))]
            for p, c in zip(p_row, c_row):
                row += [class_names[c] if class_names else c, f"{p:.6f}"]
            writer.writerow(row)
    return buf.getvalue().encode()
