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
from dataclasses import dataclass

import numpy as np
import torch

from common.processes import check_workers, exit_if_orphaned, raise_worker_error, stop_workers, worker_entry


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
        num_slots = sum(cfg["num_envs"] for cfg in cfgs) + 4 * batch_size
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

    def next_batch(self):
        """`batch_size` unrolls on the learner's device: time-major `[T+1, B, ...]`, `core_*` as `[B, ...]`."""
        idx = []
        while len(idx) < self.batch_size:
            try:
                idx.append(self.link.full_q.get(timeout=1.0))
            except queue.Empty:
                self.poll()
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
