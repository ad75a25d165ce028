"""The actors of an actor/learner script (IMPALA, V-MPO): processes that step envpool with a copy of the
learner's network and write unrolls into shared memory, and the learner's side that hands out batches of them.
No equation lives here: what an actor computes and stores at each step is the script's own `act` function.

An unroll is a slot of T+1 rows per env: row t holds what came with observation t (the observation, the reward
and end flags that arrived with it) and what the actor did there. The last row of an unroll is also the first row
of the env's next unroll, so the learner can bootstrap from it. Keys starting with `core_` hold one recurrent
state per slot: the one the network had before the slot's first row."""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass, field

import numpy as np
import torch

from common.envs import EpisodeTracker, make_env
from common.processes import check_workers, exit_if_orphaned, raise_worker_error, stop_workers, worker_entry


@dataclass
class ActorConfig:
    """What one actor process runs: its task (a game of a multi-task run: `task` is its index), its envs, their
    seed and threads, the unroll length and the device of its copy of the network."""

    env_id: str
    num_envs: int
    unroll_length: int
    env_batch_size: int
    seed: int
    device: str
    env_threads: int
    task: int = 0
    env_options: dict = field(default_factory=dict)  # more options of common.envs.make_env

    def make_envs(self):
        """The actor's envpool, in async mode: `recv` returns `env_batch_size` of the envs at a time."""
        return make_env(
            self.env_id,
            self.num_envs,
            self.seed,
            batch_size=self.env_batch_size,
            training=True,
            num_threads=self.env_threads,
            **self.env_options,
        )


def check_games(args) -> list[str]:
    """The games of a multi-task run (`--env-ids`, presets expanded; empty for one game): Atari games, and as
    many actors per game. Raises UsageError."""
    from common.envs import UsageError, env_spec, is_atari
    from common.evaluation import PRESETS, expand_env_ids

    games = expand_env_ids(args.env_ids)
    for game in games:
        env_spec(game, discrete=True)
        if not is_atari(game):
            raise UsageError(
                f"--env-ids takes Atari games (e.g. Pong-v5 Breakout-v5, or a preset: "
                f"{', '.join(PRESETS)}); {game} is not one"
            )
    if games and args.num_actors % len(games):
        raise UsageError(
            f"--num-actors {args.num_actors} must be a multiple of the number of games ({len(games)}) so "
            "that every game gets the same share of the actors"
        )
    return games


def check_pool_args(args) -> int:
    """The options of an actor/learner run, checked before any work (UsageError): the unroll length, the batch
    over the learner processes (and its minibatches, where the script has them), the envs per actor and their
    async batch, a run of at least one batch. Returns the number of learner processes."""
    from common.envs import UsageError
    from common.run import world_size

    world = world_size()
    if args.unroll_length < 1:
        raise UsageError(f"--unroll-length must be at least 1, got {args.unroll_length}")
    if args.batch_size < 1 or args.batch_size % world:
        raise UsageError(
            f"--batch-size {args.batch_size} must be a positive multiple of the number of learner processes ({world})"
        )
    if args.num_actors < 1 or args.num_envs < args.num_actors or args.num_envs % args.num_actors:
        raise UsageError(f"--num-envs {args.num_envs} must be a positive multiple of --num-actors {args.num_actors}")
    per_actor = args.num_envs // args.num_actors
    if not 0 <= args.env_batch_size <= per_actor:
        raise UsageError(
            f"--env-batch-size {args.env_batch_size} must be between 1 and the envs per actor "
            f"({per_actor}), or 0 for half of them"
        )
    steps_per_update = args.batch_size * args.unroll_length
    if args.total_timesteps < steps_per_update:
        raise UsageError(
            f"--total-timesteps {args.total_timesteps} is less than one batch "
            f"(batch-size x unroll-length = {steps_per_update} steps)"
        )
    minibatches = getattr(args, "num_minibatches", world)  # the V-MPO scripts' minibatches, one set per learner
    if minibatches < 1 or minibatches % world or args.batch_size % minibatches:
        raise UsageError(
            f"--num-minibatches {minibatches} must divide --batch-size {args.batch_size} and be "
            f"a multiple of the number of learner processes ({world})"
        )
    return world


def recurrent_buffer_specs(observation_space, num_actions, args) -> dict:
    """The unroll buffers that `act_recurrent` fills: name → (shape of one slot, dtype); uint8 frames stay uint8,
    T = `args.unroll_length`, and with `args.use_lstm` the LSTM state (`args.lstm_size`) before each unroll."""
    obs_dtype = torch.uint8 if observation_space.dtype == np.uint8 else torch.float32
    T, obs_shape, use_lstm, lstm_size = args.unroll_length, observation_space.shape, args.use_lstm, args.lstm_size
    specs = {
        "obs": ((T + 1, *obs_shape), obs_dtype),
        "reward": ((T + 1,), torch.float32),
        "ended": ((T + 1,), torch.bool),
        "terminated": ((T + 1,), torch.bool),
        "first": ((T + 1,), torch.bool),
        "action": ((T + 1,), torch.long),
        "prev_action": ((T + 1,), torch.long),
        "logits": ((T + 1, num_actions), torch.float32),
        "version": ((T + 1,), torch.long),
        "task": ((T + 1,), torch.long),
    }
    if use_lstm:
        specs.update(core_h=((lstm_size,), torch.float32), core_c=((lstm_size,), torch.float32))
    return specs


def actor_configs(args, rank, device, games=(), **env_options) -> list[ActorConfig]:
    """One ActorConfig per actor process of learner `rank` (`args`: num_envs, num_actors, unroll_length,
    env_batch_size, seed, env_id). With `games` (a multi-task run), actor a plays game a mod G, so every game
    gets the same share of the actors, with the full Atari action set. Envs per actor: num_envs / num_actors,
    stepped `env_batch_size` at a time (0: half of them) by the cores the learner leaves free."""
    from common.run import world_size

    envs_per_actor = args.num_envs // args.num_actors
    env_threads = max(1, ((os.cpu_count() or 2) // world_size() - torch.get_num_threads()) // args.num_actors)
    if games:
        env_options = {**env_options, "full_action_space": True}
    tasks = list(games) or [args.env_id]
    return [
        ActorConfig(
            env_id=tasks[a % len(tasks)],
            num_envs=envs_per_actor,
            unroll_length=args.unroll_length,
            env_batch_size=args.env_batch_size or max(1, envs_per_actor // 2),
            seed=args.seed + 1000 * rank + a,
            device=str(device),
            env_threads=env_threads,
            task=a % len(tasks),
            env_options=env_options,
        )
        for a in range(args.num_actors)
    ]


@dataclass
class ActorLink:
    """What an actor process shares with its learner: the published network and its version counter, the unroll
    buffers, the free and full slot queues, the message queue and the learner's pid."""

    agent: torch.nn.Module
    version: torch.Tensor
    buffers: dict
    free_q: object
    full_q: object
    msg_q: object
    parent_pid: int
    seen: int = -1  # the version the actor's copy holds

    def local_agent(self, device):
        """The actor's copy of the published network, on `device`; `refresh` keeps it current."""
        agent = type(self.agent)(**self.agent.config).to(device)
        self.seen = -1
        self.refresh(agent)
        return agent

    def refresh(self, agent):
        """Load the published network into `agent` if the learner has published since; returns its version."""
        latest = int(self.version.item())
        if latest != self.seen:
            agent.load_state_dict(self.agent.state_dict())
            self.seen = latest
        return latest

    def report(self, *msg):
        self.msg_q.put(msg)


class UnrollWriter:
    """The actor's side of the slots: `write(ids, row, core_state)` stores one row for each env in `ids` (any
    order, any subset: envpool's async mode); a slot that reaches T+1 rows goes to the learner and the env
    continues in a free slot whose row 0 is a copy of the full one's row T."""

    def __init__(self, link: ActorLink, num_envs: int, unroll_length: int):
        self.link, self.T = link, unroll_length
        self.slot = np.array([self.next_slot() for _ in range(num_envs)])
        self.pos = np.zeros(num_envs, np.int64)

    def next_slot(self):
        while True:
            try:
                return self.link.free_q.get(timeout=1.0)
            except queue.Empty:
                exit_if_orphaned(self.link.parent_pid)

    def write(self, ids, row, core_state=None):
        """`row`: name → `[len(ids), ...]` CPU tensor; `core_state`: name (`core_*`) → the state before this row,
        `[len(ids), ...]`, stored where the row opens a slot."""
        buffers, T = self.link.buffers, self.T
        sl, p = torch.from_numpy(self.slot[ids]), torch.from_numpy(self.pos[ids])
        for k, v in row.items():
            buffers[k][sl, p] = v
        core_state = core_state or {}
        start = p == 0  # an env's first unroll: its state is the one before row 0
        for k, v in core_state.items():
            buffers[k][sl[start]] = v[start]
        self.pos[ids] += 1
        for i in np.flatnonzero(self.pos[ids] == T + 1):
            e = ids[i]
            new = self.next_slot()
            for k in row:
                buffers[k][new, 0] = buffers[k][self.slot[e], T]
            for k, v in core_state.items():  # row T's state opens the next slot
                buffers[k][new] = v[i]
            self.link.full_q.put(int(self.slot[e]))
            self.slot[e], self.pos[e] = new, 1


class ActorPool:
    """The learner's side: starts one process per entry of `cfgs` running `act(actor_id, cfg, link)`, hands out
    batches of full unrolls (`next_batch`), publishes the learner's network to the actors (`publish`), collects
    episode reports (`poll`: `("episode", ...)` messages land in `episodes`) and stops the actors (`close`)."""

    def __init__(self, act, cfgs, agent, specs, batch_size, device):
        ctx = torch.multiprocessing.get_context("spawn")
        self.batch_size, self.device = batch_size, device
        num_slots = sum(cfg.num_envs for cfg in cfgs) + 4 * batch_size
        buffers = {k: torch.zeros((num_slots, *shape), dtype=dt).share_memory_() for k, (shape, dt) in specs.items()}
        shared_agent = type(agent)(**agent.config)
        shared_agent.load_state_dict(agent.state_dict())
        shared_agent.share_memory()
        version = torch.zeros(1, dtype=torch.long).share_memory_()
        self.link = ActorLink(shared_agent, version, buffers, ctx.Queue(), ctx.Queue(), ctx.Queue(), os.getpid())
        for i in range(num_slots):
            self.link.free_q.put(i)
        self.episodes = []
        self.procs = []
        for a, cfg in enumerate(cfgs):
            p = ctx.Process(
                target=worker_entry, daemon=True, name=f"actor-{a}", args=(act, a, self.link.msg_q, a, cfg, self.link)
            )
            p.start()
            self.procs.append(p)

    def poll(self):
        """Collect episode reports; raise WorkerError with the traceback if an actor died."""
        while True:
            try:
                msg = self.link.msg_q.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "episode":
                self.episodes.append(msg[1:])
            else:
                raise_worker_error(msg, "actor")
        check_workers(self.procs, self.link.msg_q, "actor", must_live=True)

    def next_batch(self, on_wait=None):
        """`batch_size` unrolls on the learner's device: time-major `[T+1, B, ...]`, `core_*` as `[B, ...]`.
        `on_wait(ready)` is called while the batch is being collected, with the number of unrolls it has so far."""
        idx = []
        while len(idx) < self.batch_size:
            try:
                idx.append(self.link.full_q.get(timeout=1.0))
            except queue.Empty:
                self.poll()
            if on_wait is not None:
                on_wait(len(idx))
        self.poll()
        idx_t = torch.tensor(idx)
        batch = {k: v[idx_t] for k, v in self.link.buffers.items()}
        for i in idx:
            self.link.free_q.put(i)
        pin = self.device.type == "cuda"
        out = {}
        for k, v in batch.items():
            v = v if k.startswith("core_") else v.transpose(0, 1)
            out[k] = (v.pin_memory() if pin else v).to(self.device, non_blocking=True)
        return out

    @property
    def agent(self):
        """The network the actors act with (in shared memory)."""
        return self.link.agent

    @property
    def version(self):
        """How many times the learner has published: a one-element tensor in shared memory."""
        return self.link.version

    def publish(self, state):
        """Copy `state` (a state_dict: parameters and buffers) into the network the actors act with; they load
        it at their next step."""
        with torch.no_grad():
            for dst, src in zip(self.link.agent.state_dict().values(), state.values()):
                dst.copy_(src)
        self.link.version += 1

    def close(self):
        stop_workers(self.procs)


def sample_action(agent, obs, prev_action, reward, first, state):
    """The acting network's action at `[1, B, ...]` inputs: a sample of the softmax over its logits. Returns
    (action, logits, state after)."""
    logits, _, state_after = agent(obs, prev_action, reward, first, state)
    return torch.distributions.Categorical(logits=logits[0]).sample(), logits[0], state_after


def act_recurrent(link: ActorLink, cfg: ActorConfig, policy=sample_action) -> None:
    """The loop of a discrete-action actor whose network takes the previous action and reward and may carry an
    LSTM state (impala_vtrace, vmpo_atari). For each batch of envs that envpool returns: the latest published
    network, `policy(agent, obs, prev_action, reward, first, state)` → (action, logits, state after) with `[1, B,
    ...]` inputs on the actor's device, the actions sent (the envs step during the bookkeeping), and a row written:
    obs, reward, ended (the episode ended with this observation: the next step is envpool's reset step),
    terminated, first, action, prev_action, logits, version (of the network that acted), task; and the LSTM state
    before the row where it opens an unroll."""
    n, device = cfg.num_envs, torch.device(cfg.device)
    envs = cfg.make_envs()
    agent = link.local_agent(device)
    unrolls = UnrollWriter(link, n, cfg.unroll_length)
    ended = np.zeros(n, bool)
    prev_action = torch.zeros(n, dtype=torch.long)
    state = agent.initial_state(n, device)
    tracker = EpisodeTracker(n)
    envs.async_reset()
    while True:
        obs, reward, term, trunc, info = envs.recv()
        ids = info["env_id"]
        exit_if_orphaned(link.parent_pid)
        seen = link.refresh(agent)
        ids_t = torch.from_numpy(ids).long()
        ids_dev = ids_t.to(device)
        first = torch.from_numpy(ended[ids])
        obs_t, reward_t = torch.from_numpy(obs), torch.from_numpy(reward).float()
        prev = torch.where(first, 0, prev_action[ids_t])
        state_before = tuple(s[ids_dev] for s in state)
        with torch.no_grad():
            inputs = (obs_t, prev, reward_t, first)
            action, logits, state_after = policy(agent, *(x.to(device)[None] for x in inputs), state_before)
        action_cpu = action.cpu()
        envs.send(action_cpu.numpy(), ids)  # the envs step while this process does the bookkeeping

        done_now = term | trunc
        row = {
            "obs": obs_t,
            "reward": reward_t,
            "ended": torch.from_numpy(done_now),
            "terminated": torch.from_numpy(term),
            "first": first,
            "action": action_cpu,
            "prev_action": prev,
            "logits": logits.cpu(),
            "version": torch.full((len(ids),), seen, dtype=torch.long),
            "task": torch.full((len(ids),), cfg.task, dtype=torch.long),
        }
        core = None
        if agent.core is not None:
            core = dict(zip(("core_h", "core_c"), (s.cpu() for s in state_before)))
            for s, s_new in zip(state, state_after):
                s[ids_dev] = s_new
        unrolls.write(ids, row, core)
        prev_action[ids_t] = action_cpu
        ended[ids] = done_now
        for _, score, length in tracker.step(ids, reward, term, trunc, info):
            link.report("episode", score, length, cfg.task)
