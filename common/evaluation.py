"""Evaluate a saved model of any script: N episodes with envpool, game scores per episode.

    python -m common.evaluation runs/<run>/model.pt --episodes 10 [--capture-video] [--greedy]

A `model.pt` is a dict with at least `script` (the module that wrote it), `env_id`, and what that script's
`make_eval_policy(checkpoint, num_envs, device, greedy)` needs to rebuild its policy. Episodes are played
with the evaluation settings (for Atari: no end-of-life episodes, no reward clipping, up to 30 no-ops,
108,000 frames at most) and scored as the raw reward summed over the whole game.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import struct
import sys
import zlib

import numpy as np

from common.envs import EpisodeTracker, make_env


def evaluate(checkpoint: dict, episodes: int = 10, num_envs: int | None = None, seed: int = 0, device="cpu",
             greedy: bool = False, video_dir: str | None = None) -> list[float]:
    """Plays `episodes` episodes and returns their game scores. Each env plays a fixed quota of episodes,
    so short episodes are not favoured. With `video_dir`, env 0's first episode is written there."""
    module = importlib.import_module(checkpoint["script"])
    num_envs = num_envs or min(episodes, 8)
    quota = np.full(num_envs, episodes // num_envs) + (np.arange(num_envs) < episodes % num_envs)
    env = make_env(checkpoint["env_id"], num_envs, seed, training=False, render=video_dir is not None)
    policy = module.make_eval_policy(checkpoint, num_envs, device, greedy)
    tracker = EpisodeTracker(num_envs)
    obs, info = env.reset()
    ids = info["env_id"]
    rewards, first, ended = np.zeros(num_envs, np.float32), np.ones(num_envs, bool), np.zeros(num_envs, bool)
    scores = [[] for _ in range(num_envs)]
    frames, recording = [], video_dir is not None
    while any(len(s) < q for s, q in zip(scores, quota)):
        if recording:
            frames.append(env.render()[0])
        actions = policy(obs, rewards, first)
        obs, rewards, term, trunc, info = env.step(actions, ids)
        ids = info["env_id"]
        for e, score, _ in tracker.step(ids, rewards, term, trunc, info):
            if len(scores[e]) < quota[e]:
                scores[e].append(score)
            if e == 0 and recording:
                recording = False
                write_apng(os.path.join(video_dir, "videos", "eval_episode_0.png"), frames)
        first, ended = ended, term | trunc  # the obs after an episode's last one starts the next episode
    return [s for per_env in scores for s in per_env]


def write_apng(path: str, frames: list, fps: int = 30) -> None:
    """Writes RGB frames `[H, W, 3]` uint8 as an animated PNG (plays in any web browser); needs no codec."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    h, w = frames[0].shape[:2]

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    out = [b"\x89PNG\r\n\x1a\n", chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)),
           chunk(b"acTL", struct.pack(">II", len(frames), 0))]
    seq = 0
    for i, frame in enumerate(frames):
        out.append(chunk(b"fcTL", struct.pack(">IIIIIHHBB", seq, w, h, 0, 0, 1, fps, 0, 0)))
        seq += 1
        raw = np.concatenate([np.zeros((h, 1), np.uint8), np.ascontiguousarray(frame).reshape(h, w * 3)], 1)
        data = zlib.compress(raw.tobytes(), 6)
        if i == 0:
            out.append(chunk(b"IDAT", data))
        else:
            out.append(chunk(b"fdAT", struct.pack(">I", seq) + data))
            seq += 1
    out.append(chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(b"".join(out))


def main(argv=None):
    p = argparse.ArgumentParser(description="Evaluate a saved model.pt of any script of this project.")
    p.add_argument("model", help="path to a run's model.pt")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--num-envs", type=int, default=None)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--greedy", action="store_true", help="take the most probable action instead of sampling")
    p.add_argument("--capture-video", action="store_true", help="write the first episode under <run>/videos/")
    p.add_argument("--cuda", action="store_true")
    a = p.parse_args(argv)
    if not os.path.isfile(a.model):
        sys.exit(f"error: no such file: {a.model}")
    if a.episodes < 1:
        sys.exit(f"error: --episodes must be at least 1, got {a.episodes}")
    import torch

    checkpoint = torch.load(a.model, map_location="cpu", weights_only=False)
    sys.path.insert(0, os.getcwd())
    device = "cuda" if a.cuda and torch.cuda.is_available() else "cpu"
    scores = evaluate(checkpoint, a.episodes, a.num_envs, a.seed, device, a.greedy,
                      os.path.dirname(os.path.abspath(a.model)) if a.capture_video else None)
    print(json.dumps({"env_id": checkpoint["env_id"], "episodes": len(scores), "mean": float(np.mean(scores)),
                      "std": float(np.std(scores)), "scores": scores}))
    return scores


if __name__ == "__main__":
    main()
