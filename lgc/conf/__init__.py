"""Hydra configs shipped with the package (the repository root links to them as conf/)."""
