"""A stand-in "script" for evaluation tests: `make_eval_policy` of a uniformly random policy over
`checkpoint["num_actions"]` actions (with `full_action_space`, the 18 Atari actions of any game)."""

import numpy as np


def make_eval_policy(checkpoint, num_envs, device="cpu", greedy=False):
    rng = np.random.default_rng(checkpoint.get("seed", 0))

    def policy(obs, rewards, first):
        return rng.integers(0, checkpoint["num_actions"], len(first))

    return policy
