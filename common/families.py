"""Defaults by task family: `--env-id` alone picks the settings of its family, a flag the user gives wins.

Each script keeps its own table next to its `Args`:

    FAMILY_DEFAULTS = {
        "atari": ("the paper's Atari settings (Table G.1)", {}),
        "classic": ("settings measured on CartPole-v1 (README)", {"learning_rate": 3e-3, ...}),
    }

A family missing from the table, and every family under `--preset paper`, runs with the `Args` defaults,
which are the paper's. A table may also hold `"<family>_cpu"`: the settings for a run with no usable GPU (no
CUDA device, or `--no-cuda`), where the paper's network and batch would be far too slow (Atari on a CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

FAMILY_NAMES = {"atari": "Atari", "mujoco": "MuJoCo / dm_control", "classic": "classic control"}
PAPER = "the paper's settings (the Args defaults)"


def task_family(env_id: str) -> str:
    """'atari', 'mujoco' (Gym MuJoCo and dm_control) or 'classic' (classic control, Box2D and other small tasks),
    from envpool's spec of `env_id`."""
    from common.envs import env_spec

    kind = type(env_spec(env_id)).__name__  # an unknown id: a UsageError saying what would be right
    if kind.startswith("Atari"):
        return "atari"
    if kind.startswith(("Gym", "Dmc")):
        return "mujoco"
    return "classic"


def family_of(args) -> str:
    """The family of a run's task; several games at once (`--env-ids`) are Atari."""
    return "atari" if getattr(args, "env_ids", ()) else task_family(args.env_id)


def uses_gpu(args) -> bool:
    """Whether the run will have a GPU: `--cuda` (the default) and a CUDA device."""
    if not getattr(args, "cuda", False):
        return False
    import torch

    return torch.cuda.is_available()


def family_key(args, table: dict) -> str:
    """The table entry of the run: its family, or `<family>_cpu` where the table has one and no GPU is used."""
    family = family_of(args)
    if f"{family}_cpu" in table and not uses_gpu(args):
        return f"{family}_cpu"
    return family


def given_flags(argv: list[str]) -> set[str]:
    """The `Args` field names that a command line sets (`--num-envs 4`, `--num-envs=4`, `--no-use-lstm`)."""
    names = set()
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=", 1)[0].replace("-", "_")
            names.add(name)
            if name.startswith("no_"):
                names.add(name[3:])
    return names


def with_family_defaults(args, table: dict, argv: list[str] | None = None):
    """`args` with its family's defaults for every field the command line did not set.

    Nothing changes under `--preset paper`, on `--resume` (the run keeps its own arguments) or for a family the
    table does not list. Returns the new args."""
    if args.preset == "paper" or getattr(args, "resume", ""):
        return args
    _, overrides = table.get(family_key(args, table), (PAPER, {}))
    given = given_flags(sys.argv[1:] if argv is None else argv)
    return dataclasses.replace(args, **{k: v for k, v in overrides.items() if k not in given})


def describe_defaults(args, table: dict) -> tuple[str, str]:
    """(family, where the defaults came from) for the start-up line and args.json."""
    family = family_of(args)
    if args.preset == "paper":
        return family, PAPER + ", forced by --preset paper"
    key = family_key(args, table)
    source, overrides = table.get(key, (PAPER, {}))
    if key.endswith("_cpu"):
        source = f"no GPU: {source}; --preset paper for the paper's"
    if overrides:
        source += ": " + ", ".join(f"{k.replace('_', '-')} {_show(v)}" for k, v in overrides.items())
    return family, source


def write_args(run_path: str, args, table: dict) -> None:
    """Prints the run's task family and where its defaults came from, and writes args.json (every argument, plus
    `task_family` and `defaults_from`) in the run folder."""
    family, source = describe_defaults(args, table)
    print(f"task family: {FAMILY_NAMES[family]}; defaults: {source}", flush=True)
    with open(os.path.join(run_path, "args.json"), "w") as f:
        json.dump({**dataclasses.asdict(args), "task_family": family, "defaults_from": source}, f, indent=2)


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
