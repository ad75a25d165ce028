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


class NonFiniteError(RuntimeError):
    """A loss, gradient or parameter became NaN or infinite: the run stops before it spoils its checkpoint."""


def check_finite(where: str, **named) -> None:
    """Raises NonFiniteError naming the first of `named` (tensors or numbers) that holds a NaN or an infinity.

    The scripts call it on their losses and gradient norm before each optimiser step, and on their parameters
    before each checkpoint, so that the checkpoint on disk is always the last good state."""
    import torch

    flags = {}  # per device: one host synchronisation for all its quantities, not one per quantity
    for name, value in named.items():
        t = torch.as_tensor(value).detach()
        flags.setdefault(t.device, []).append((name, torch.isfinite(t).all()))
    for items in flags.values():
        if not bool(torch.stack([ok for _, ok in items]).all()):
            raise NonFiniteError(f"non-finite {next(name for name, ok in items if not bool(ok))} {where}")


def check_finite_parameters(where: str, **modules) -> None:
    """check_finite over every parameter and buffer of the given modules, named `<module>.<parameter>`."""
    named = {}
    for prefix, module in modules.items():
        named.update({f"{prefix}.{k}": v for k, v in module.state_dict().items() if v.is_floating_point()})
    check_finite(where, **named)


def non_finite_advice(run_path: str) -> str:
    """The line printed after a NonFiniteError: where the last good checkpoint is, and what to try."""
    import torch

    path = os.path.join(run_path, NAME)
    if not os.path.isfile(path):
        return "no checkpoint was written before it; try a lower --learning-rate"
    step = torch.load(path, map_location="cpu", weights_only=False).get("global_step")
    return (
        f"the last good checkpoint (step {step}) is kept: continue with --resume {run_path}, or start again "
        "with a lower --learning-rate"
    )


def save_model(model: dict, run_path: str) -> str:
    """model.pt (what common/evaluation.py plays), written like the checkpoint: a stopped run can be evaluated."""
    import torch

    path = os.path.join(run_path, "model.pt")
    torch.save(model, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path
