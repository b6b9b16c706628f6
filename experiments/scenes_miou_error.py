"""How well one run's validation mIoU on the Fashion scenes is known: a bootstrap over the scenes.

    python experiments/scenes_miou_error.py RUN_DIR [--resamples 1000] [--out FILE]

Loads the run's last checkpoint (a PSPNet trained with ``data=fashion_scenes``), predicts every
validation scene, keeps each scene's confusion matrix, and resamples the scenes with replacement:
the spread of the resampled mIoU is the sampling error of that run's score due to the finite
validation set (not the spread between seeds, which the comparison's intervals measure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import OmegaConf


def per_scene_confusions(model: torch.nn.Module, dataset, classes: int, batch: int = 100) -> np.ndarray:
    """``(scenes, classes, classes)`` confusion counts (label, prediction) of every scene."""
    out = np.zeros((len(dataset), classes, classes), np.int64)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), batch):
            items = [dataset[i] for i in range(start, min(start + batch, len(dataset)))]
            images = torch.stack([image for image, _ in items])
            preds = model(images).argmax(1)
            for offset, (_, mask) in enumerate(items):
                pairs = mask.flatten() * classes + preds[offset].flatten()
                out[start + offset] = np.bincount(pairs.numpy(), minlength=classes * classes).reshape(classes, classes)
    return out


def miou(confusion: np.ndarray) -> float:
    """Mean over the classes present in labels or predictions of TP / (TP + FP + FN) (torchmetrics' rule)."""
    tp = np.diag(confusion).astype(float)
    union = confusion.sum(0) + confusion.sum(1) - tp
    return float(np.mean(tp[union > 0] / union[union > 0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    config = OmegaConf.create(json.loads((args.run / "summary.json").read_text())["config"])
    data = hydra.utils.instantiate(config.data)
    data.setup("fit")
    model = hydra.utils.instantiate(config.model, num_classes=data.num_classes, in_channels=data.in_channels)
    state = torch.load(args.run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    confusions = per_scene_confusions(model, data.val_set, data.num_classes)
    rng = np.random.default_rng(0)
    scenes = len(confusions)
    resampled = [miou(confusions[rng.integers(0, scenes, scenes)].sum(0)) for _ in range(args.resamples)]
    result = {
        "run": str(args.run),
        "scenes": scenes,
        "miou": miou(confusions.sum(0)),
        "bootstrap_sd_points": 100 * float(np.std(resampled, ddof=1)),
        "bootstrap_95_points": [100 * float(q) for q in np.percentile(resampled, [2.5, 97.5])],
        "resamples": args.resamples,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
