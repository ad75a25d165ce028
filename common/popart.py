"""PopArt: adaptive normalisation of value targets that Preserves Outputs Precisely while Adaptively Rescaling
Targets (van Hasselt et al. 2016, "Learning values across many orders of magnitude"; Hessel et al. 2018,
"Multi-task deep reinforcement learning with PopArt").

A linear value layer whose outputs live in normalised space, one output per task, with per-task statistics
μ (first moment) and ν (second moment) of the unnormalised targets, σ = sqrt(ν − μ²) clamped to
[scale_lower, scale_upper]. `update` moves the statistics toward the batch moments with step size β and
rescales the layer, W' = W σ/σ', b' = (σ b + μ − μ')/σ', so that σ'·(W'x + b') + μ' = σ·(Wx + b) + μ for every x.
A task with no sample in the batch keeps its statistics. Under torch.distributed the batch moments are
averaged over the processes first, so that every process keeps the same statistics and the same layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class PopArt(nn.Module):
    def __init__(self, in_features: int, num_tasks: int = 1, beta: float = 1e-4, scale_lower=1e-2, scale_upper=1e6):
        super().__init__()
        self.linear = nn.Linear(in_features, num_tasks)
        self.beta, self.scale_lower, self.scale_upper = beta, scale_lower, scale_upper
        self.register_buffer("mu", torch.zeros(num_tasks))
        self.register_buffer("nu", torch.ones(num_tasks))  # second moment: σ = 1 at the start
        self.register_buffer("sigma", torch.ones(num_tasks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised values `[..., num_tasks]`."""
        return self.linear(x)

    def normalize(self, values: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        return (values - self.mu[task_ids]) / self.sigma[task_ids]

    def unnormalize(self, values: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        return values * self.sigma[task_ids] + self.mu[task_ids]

    @torch.no_grad()
    def update(self, targets: torch.Tensor, task_ids: torch.Tensor, beta: float | None = None) -> None:
        """Moves μ, ν toward the batch moments of the unnormalised `targets` of each task (`task_ids` has the
        targets' shape) with step size `beta` (default: the module's β), and rescales the layer so that
        unnormalised outputs do not change."""
        beta = self.beta if beta is None else beta
        n = self.mu.shape[0]
        t, ids = targets.reshape(-1).to(self.mu.dtype), task_ids.reshape(-1).long()
        sums = torch.stack(
            [torch.zeros(n, device=t.device, dtype=t.dtype).index_add_(0, ids, t**p) for p in (0, 1, 2)]
        )  # counts, Σ G, Σ G² per task
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        count, first, second = sums
        seen = count > 0
        batch_mu = first / count.clamp(min=1)
        batch_nu = second / count.clamp(min=1)
        mu_old, sigma_old = self.mu.clone(), self.sigma.clone()
        self.mu.copy_(torch.where(seen, (1 - beta) * self.mu + beta * batch_mu, self.mu))
        self.nu.copy_(torch.where(seen, (1 - beta) * self.nu + beta * batch_nu, self.nu))
        variance = (self.nu - self.mu**2).clamp(min=0)
        self.sigma.copy_(variance.sqrt().clamp(self.scale_lower, self.scale_upper))
        # Preserve outputs: σ'(W'x + b') + μ' = σ(Wx + b) + μ.
        self.linear.weight.mul_((sigma_old / self.sigma).unsqueeze(-1))
        self.linear.bias.copy_((sigma_old * self.linear.bias + mu_old - self.mu) / self.sigma)
