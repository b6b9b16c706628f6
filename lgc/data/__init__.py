"""Datasets (plain PyTorch): the embedded digits task and loaders for real datasets."""

from lgc.data.digits import load_digits_split

__all__ = ["load_digits_split"]
