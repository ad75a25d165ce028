"""envpool environments for every script: one place that knows the Atari preprocessing and checks env ids."""

from __future__ import annotations

import ctypes
import difflib
import os
import subprocess
import sys
import warnings

import numpy as np

# Gymnasium warns that envpool's float64 MuJoCo bounds get cast to float32; nothing to act on.
warnings.filterwarnings("ignore", message=".*precision lowered by casting.*")

# envpool draws MuJoCo (Gym and dm_control) offscreen, for `--capture-video`, through a libEGL that the process
# loaded before envpool itself (Mesa's draws on the CPU where there is no GPU); without one it ends the process
# from C. So it is loaded here, first, where present; frames are 240 x 240.
EGL_LIBRARY, MUJOCO_FRAME = "libEGL.so.1", 240
try:
    EGL_LOADED = "envpool" not in sys.modules and bool(ctypes.CDLL(EGL_LIBRARY, mode=ctypes.RTLD_GLOBAL))
except OSError:
    EGL_LOADED = False


class UsageError(Exception):
    """Bad input found before any work starts: the scripts print it as one line and exit with status 2."""


def require(condition, message: str) -> None:
    """UsageError(`message`) unless `condition` holds (a NaN fails every comparison, so it is refused too)."""
    if not condition:
        raise UsageError(message)


def require_in(interval: str, args, names: str) -> None:
    """UsageError for the first of the flags `names` (attribute names of `args`, space-separated) whose value lies
    outside `interval`, written as in mathematics: "[0, 1)", "(0, inf)"."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    for name in names.split():
        value = getattr(args, name)
        above = value > low if interval[0] == "(" else value >= low
        below = value < high if interval[-1] == ")" else value <= high
        require(above and below, f"--{name.replace('_', '-')} must be in {interval}, got {value}")


def _envpool():
    import envpool  # imported lazily so that importing a script touches no environment library

    return envpool


def env_spec(env_id: str, discrete: bool | None = None):
    """The envpool spec of `env_id`, or a UsageError saying what would be right."""
    envpool = _envpool()
    known = envpool.list_all_envs()
    if env_id not in known:
        close = difflib.get_close_matches(env_id, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see envpool.list_all_envs()"
        raise UsageError(f"unknown env id {env_id!r}: envpool has no such environment{hint}")
    spec = envpool.make_spec(env_id)
    is_discrete = hasattr(spec.action_space, "n")
    if discrete is not None and discrete != is_discrete:
        kind, need = "discrete", "continuous-action env (e.g. HalfCheetah-v4, Pendulum-v1)"
        if discrete:
            kind, need = "continuous", "discrete-action env (e.g. Breakout-v5, CartPole-v1)"
        raise UsageError(f"{env_id} has {kind} actions; this script needs a {need}")
    if not is_discrete and len(spec.action_space.shape) != 1:
        raise UsageError(f"{env_id} has actions of shape {spec.action_space.shape}; the scripts need a vector")
    if not is_discrete and not (np.isfinite(spec.action_space.low).all() and np.isfinite(spec.action_space.high).all()):
        raise UsageError(f"{env_id} has an unbounded action space; the scripts need a box")
    return spec


def flat_obs_dim(spec) -> int:
    """Length of an observation once `flatten_obs` has made one vector of it (dm_control gives a dict)."""
    space = spec.observation_space
    shapes = [space[k].shape for k in sorted(space.keys())] if hasattr(space, "keys") else [space.shape]
    return int(sum(np.prod(s, dtype=np.int64) for s in shapes))


def flatten_obs(obs) -> np.ndarray:
    """A batch of observations as float32 `[N, D]`: a dict of arrays (dm_control) is concatenated in sorted key
    order, one vector per env."""
    if isinstance(obs, dict):
        n = len(next(iter(obs.values())))
        return np.concatenate([np.asarray(obs[k], np.float32).reshape(n, -1) for k in sorted(obs)], axis=1)
    obs = np.asarray(obs, np.float32)
    return obs.reshape(obs.shape[0], -1)


def to_env_action(action, low, high):
    """Policy actions in [-1, 1]^d mapped to the env's box [low, high], clipped (what is learned from stays as is)."""
    return np.clip(low + (action + 1.0) * 0.5 * (high - low), low, high)


def is_atari(env_id: str) -> bool:
    return "episodic_life" in _envpool().make_spec(env_id).config._fields


def task_family(env_id: str) -> str:
    """'atari', 'mujoco' (Gym MuJoCo and dm_control) or 'classic' (classic control, Box2D, ...): the family whose
    defaults a script takes for `env_id` (a UsageError for an unknown id)."""
    kind = type(env_spec(env_id)).__name__
    return "atari" if kind.startswith("Atari") else "mujoco" if kind.startswith(("Gym", "Dmc")) else "classic"


def check_render(env_id: str) -> None:
    """`--capture-video`: for a MuJoCo task, one frame drawn in a child process first (a failure there cannot end
    this one), or a UsageError saying what to install."""
    if task_family(env_id) != "mujoco":
        return
    if not EGL_LOADED:
        raise UsageError(
            f"--capture-video of {env_id}: envpool was imported before common.envs could load {EGL_LIBRARY}, "
            "or this machine has none (install Mesa's EGL, e.g. apt install libegl1, or a GPU driver)"
        )
    probe = (
        f"import ctypes; ctypes.CDLL({EGL_LIBRARY!r}, mode=ctypes.RTLD_GLOBAL); import envpool; "
        f"e = envpool.make({env_id!r}, env_type='gymnasium', num_envs=1, render_mode='rgb_array', "
        "render_width=8, render_height=8); e.reset(); assert e.render().shape == (1, 8, 8, 3)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise UsageError(
            f"--capture-video of {env_id} draws with offscreen OpenGL (EGL), which failed here ({why}): install "
            "Mesa's EGL (e.g. apt install libegl1) or a GPU driver, or leave the flag out"
        )


def make_env(env_id: str, num_envs: int, seed: int, batch_size: int | None = None, training: bool = True,
             render: bool = False, num_threads: int | None = None, episodic_life: bool | None = None,
             reward_clip: bool | None = None, full_action_space: bool = False):  # fmt: skip
    """An envpool (gymnasium API) of `num_envs` copies; async when `batch_size < num_envs`.

    Atari (Espeholt et al. 2018, Table G.1; Mnih et al. 2015): 84x84 grey, 4 stacked frames, action repeat 4
    with a max-pool over the last 2 frames, up to 30 no-op starts, at most 108,000 frames (27,000 steps) an
    episode, sticky actions off. For training only (`training=True`), a lost life ends the training episode
    and rewards are clipped to [-1, 1]; the raw reward stays in `info["reward"]` and `info["terminated"]`
    marks game over, so game scores are always the unclipped sum over all lives. `episodic_life` and
    `reward_clip` override these two training settings (V-MPO's single-task Atari uses neither).
    `full_action_space` gives every Atari game all 18 actions (one policy for many games).
    """
    envpool = _envpool()
    batch_size = batch_size or num_envs
    threads = num_threads or min(batch_size, os.cpu_count() or 1)
    kwargs = dict(env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=seed, num_threads=threads)
    if is_atari(env_id):
        life, clip = (training if x is None else x for x in (episodic_life, reward_clip))
        kwargs.update(episodic_life=life, reward_clip=clip, noop_max=30, stack_num=4, frame_skip=4)
        kwargs.update(repeat_action_probability=0.0, max_episode_steps=27000, full_action_space=full_action_space)
    if render:
        kwargs["render_mode"] = "rgb_array"
        if task_family(env_id) == "mujoco":
            kwargs.update(render_width=MUJOCO_FRAME, render_height=MUJOCO_FRAME)
    return envpool.make(env_id, **kwargs)


class EpisodeTracker:
    """Game scores from envpool steps: the raw (unclipped) reward summed over all lives until game over or
    time-limit truncation. The step that follows an episode end is envpool's reset step (action ignored,
    reward 0): it is not counted in the length."""

    def __init__(self, num_envs: int):
        self.ret = np.zeros(num_envs, np.float64)
        self.len = np.zeros(num_envs, np.int64)
        self.ended = np.zeros(num_envs, bool)

    def step(self, env_ids, rewards, terminated, truncated, info):
        """Returns a list of (env_id, score, length) for the games that ended at this step."""
        raw = info.get("reward", rewards)
        game_over = np.asarray(info.get("terminated", terminated)).astype(bool) | truncated
        real = ~self.ended[env_ids]
        self.ret[env_ids] += np.where(real, raw, 0.0)
        self.len[env_ids] += real
        self.ended[env_ids] = terminated | truncated
        done = []
        for i in np.flatnonzero(game_over):
            e = env_ids[i]
            done.append((int(e), float(self.ret[e]), int(self.len[e])))
            self.ret[e], self.len[e] = 0.0, 0
        return done
