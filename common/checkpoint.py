"""Training checkpoints of a run folder, written atomically: a temporary file, then a rename, so that a run
killed while saving keeps its last good checkpoint."""

from __future__ import annotations

import os

from common.envs import UsageError

NAME = "checkpoint.pt"


def save_checkpoint(state: dict, run_path: str) -> str:
    import torch

    path = os.path.join(run_path, NAME)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def load_checkpoint(run_path: str) -> dict:
    """The checkpoint of `run_path`, or a UsageError saying why there is none."""
    import torch

    path = os.path.join(run_path, NAME)
    if not os.path.isfile(path):
        raise UsageError(f"--resume {run_path}: no {NAME} there (is it a run folder of a run that saved one?)")
    return torch.load(path, map_location="cpu", weights_only=False)
