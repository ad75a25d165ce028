"""Network parts shared by the scripts: torsos, a recurrent core, and heads.

Every torso maps observations `[N, *obs_shape]` to features `[N, out_features]`; pixel observations
(uint8) are scaled to [0, 1] inside the torso so that buffers can stay uint8.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def _scale(x: torch.Tensor) -> torch.Tensor:
    """Pixels `[N, C, H, W]` as floats in [0, 1], stored channels-last: oneDNN's convolutions on a CPU run 1.5-2x
    faster so (the deep torso's update on 2 cores: benchmarks/README.md), the values and the math unchanged."""
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    return x.contiguous(memory_format=torch.channels_last)


class ShallowTorso(nn.Module):
    """The shallow Atari network of A3C (Mnih et al. 2016) used by IMPALA (Espeholt et al. 2018, Fig. 3 left):
    conv 16 8x8/4, conv 32 4x4/2, fully connected 256, ReLUs; a convolution per (channels, (kernel, stride)) pair.
    `NATURE` makes it the DQN network of Mnih et al. (2015), conv 32 8x8/4, conv 64 4x4/2, conv 64 3x3/1, fc 512."""

    def __init__(self, obs_shape, channels=(16, 32), hidden=256, kernels=((8, 4), (4, 2))):
        super().__init__()
        sizes = zip((obs_shape[0], *channels), channels, kernels)
        convs = [m for c_in, c_out, (k, s) in sizes for m in (nn.Conv2d(c_in, c_out, k, stride=s), nn.ReLU())]
        self.convs = nn.Sequential(*convs, nn.Flatten())
        with torch.no_grad():
            n = self.convs(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = nn.Linear(n, hidden)
        self.out_features = hidden

    def forward(self, x):
        return F.relu(self.fc(self.convs(_scale(x))))


NATURE = dict(channels=(32, 64, 64), hidden=512, kernels=((8, 4), (4, 2), (3, 1)))  # ShallowTorso's settings


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ResNetTorso(nn.Module):
    """IMPALA's deep network (Espeholt et al. 2018, Fig. 3 right): three sections, each a 3x3 conv, a 3x3/2
    max-pool and two residual blocks (15 conv layers in all), then ReLU and a 256-unit layer.
    Channels (16, 32, 32) as in IMPALA; (64, 128, 128) as in V-MPO (Song et al. 2020)."""

    def __init__(self, obs_shape, channels=(16, 32, 32), hidden=256):
        super().__init__()
        c, h, w = obs_shape
        layers = []
        for out in channels:
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1)]
            layers += [ResidualBlock(out), ResidualBlock(out)]
            c = out
        self.sections = nn.Sequential(*layers, nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            n = self.sections(torch.zeros(1, obs_shape[0], h, w)).shape[1]
        self.fc = nn.Linear(n, hidden)
        self.out_features = hidden

    def forward(self, x):
        return F.relu(self.fc(self.sections(_scale(x))))


class MLPTorso(nn.Module):
    """Fully connected torso for vector observations."""

    def __init__(self, obs_dim, hidden=(64, 64), activation=nn.Tanh):
        super().__init__()
        layers, n = [], obs_dim
        for h in hidden:
            layers += [nn.Linear(n, h), activation()]
            n = h
        self.net = nn.Sequential(*layers)
        self.out_features = n

    def forward(self, x):
        return self.net(x.flatten(1).float())


def make_torso(obs_shape, network="shallow", channels=None, mlp_hidden=(64, 64)):
    """Pixel observations `[C, H, W]` get a conv torso (`shallow` or `deep`), vectors an MLP."""
    if len(obs_shape) == 3:
        torso = {"shallow": ShallowTorso, "deep": ResNetTorso}[network]
        return torso(obs_shape, **({"channels": tuple(channels)} if channels else {}))
    return MLPTorso(int(math.prod(obs_shape)), mlp_hidden)


class LSTMCore(nn.Module):
    """An LSTM fed the torso features, the previous action (one-hot) and the previous reward (IMPALA, V-MPO);
    with `action_reward_inputs=False` the features alone (A3C), and `prev_action`, `prev_reward` are ignored.

    `forward` runs a time-major sequence `[T, B, F]`; where `first[t]` is True the state is zeroed before
    step t (a new episode starts there). The state is a pair `(h, c)` of `[B, hidden]` tensors.
    """

    def __init__(self, in_features, num_actions, hidden=256, action_reward_inputs=True):
        super().__init__()
        self.num_actions, self.hidden, self.action_reward_inputs = num_actions, hidden, action_reward_inputs
        self.cell = nn.LSTMCell(in_features + (num_actions + 1 if action_reward_inputs else 0), hidden)
        self.out_features = hidden

    def initial_state(self, batch_size, device=None):
        z = torch.zeros(batch_size, self.hidden, device=device)
        return (z, z.clone())

    def forward(self, features, prev_action, prev_reward, first, state):
        T, B = first.shape
        x = features.view(T, B, -1)
        if self.action_reward_inputs:
            one_hot = F.one_hot(prev_action.long(), self.num_actions).float()
            x = torch.cat([x, one_hot, prev_reward.view(T, B, 1).float()], dim=-1)
        h, c = state
        outs = []
        for t in range(T):
            keep = (~first[t]).float().unsqueeze(-1)
            h, c = self.cell(x[t], (h * keep, c * keep))
            outs.append(h)
        return torch.stack(outs), (h, c)


class RunningNorm(nn.Module):
    """Observation normalisation by running statistics: `forward(x)` = clip((x − mean) / sqrt(var + ε), ±clip).

    `update(x)` folds a batch `[..., D]` into the mean and variance (the parallel-variance rule of Chan et al.;
    under torch.distributed the batch moments of every process are summed first, so all processes keep the
    same statistics). The statistics are buffers: they travel with `state_dict()` into `model.pt`.
    """

    def __init__(self, dim, clip=10.0, eps=1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x):
        d = self.mean.shape[0]
        x = x.reshape(-1, d).double()
        moments = torch.cat([x.new_tensor([x.shape[0]]), x.sum(0), (x * x).sum(0)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(moments)
        n = moments[0]
        if n == 0:
            return
        batch_mean = moments[1 : d + 1] / n
        batch_var = (moments[d + 1 :] / n - batch_mean**2).clamp(min=0)
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, x):
        z = (x.float() - self.mean.float()) / torch.sqrt(self.var.float() + self.eps)
        return z.clamp(-self.clip, self.clip)


# ---------------------------------------------------------------------------------------------------------
# Initialisation. None of the papers states one; it decides whether a pixel network starts state-blind.


def init_weights_(module: nn.Module) -> nn.Module:
    """Every Linear, Conv2d and LSTMCell weight of `module` orthogonal with gain √2 (CleanRL, Cleanba), biases zero,
    in place, and each residual block's last conv zero, so that the block starts as the identity (Goyal et al. 2017;
    orthogonal, the deep torso's features grew until they saturated the LSTM: docs/vmpo_atari.md); a script
    re-initialises its output layers afterwards. Why not PyTorch's default: docs/vmpo_atari.md."""
    for m in module.modules():
        weights, biases = [], []
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            weights, biases = [m.weight], [m.bias]
        elif isinstance(m, nn.LSTMCell):
            weights, biases = [m.weight_ih, m.weight_hh], [m.bias_ih, m.bias_hh]
        for w in weights:
            nn.init.orthogonal_(w, math.sqrt(2))
        for b in biases:
            if b is not None:
                nn.init.zeros_(b)
    for block in (m for m in module.modules() if isinstance(m, ResidualBlock)):
        nn.init.zeros_(block.conv1.weight)
    return module


def init_output_(layer: nn.Linear, std: float) -> nn.Linear:
    """An output layer with small weights (`std` · orthogonal, or zeros for 0) and zero bias: CleanRL's 0.01 for
    policy logits keeps the first policy near uniform without making it state-blind."""
    if std == 0:
        nn.init.zeros_(layer.weight)
    else:
        nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


# ---------------------------------------------------------------------------------------------------------
# Batched networks: N networks side by side, one per learner of a population (P3S), trained as one.


class Linears(nn.Module):
    """N linear layers side by side, one per learner: `[N, B, in] -> [N, B, out]` as one batched matmul, so that the
    whole population's forward and backward passes are one set of kernels. Slice i of `weight` `[N, out, in]` and
    `bias` `[N, out]` is learner i's `nn.Linear`; all N start as the same one (P3S's Algorithm 1, line 1). `init`
    "xavier": Xavier-uniform weights, zero biases (the P3S authors' td3/misc/mlp.py); "torch": PyTorch's default,
    as TD3's own code has it."""

    def __init__(self, num_learners, in_features, out_features, init="xavier"):
        super().__init__()
        layer = nn.Linear(in_features, out_features)
        if init == "xavier":
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.weight = nn.Parameter(layer.weight.detach().expand(num_learners, -1, -1).clone())
        self.bias = nn.Parameter(layer.bias.detach().expand(num_learners, -1).clone())

    def forward(self, x):
        # y^T = W x^T + b, computed feature-major ([N, out, B]) and returned as its transposed view: the gradient of
        # W (grad^T x) then comes out in W's own layout, where y = x W^T + b would give a transposed one that autograd
        # copies into W's layout (docs/p3s_td3.md, "Speed on a CPU"). A layer fed by another gets a contiguous x^T.
        return torch.baddbmm(self.bias.unsqueeze(2), self.weight, x.transpose(1, 2)).transpose(1, 2)


def batched_mlp(sizes, num_learners, out_activation=None, init="xavier"):
    """N ReLU MLPs of layer sizes `sizes`, side by side (`Linears`): `[N, B, sizes[0]] -> [N, B, sizes[-1]]`."""
    layers = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        layers += [Linears(num_learners, n_in, n_out, init), nn.ReLU()]
    return nn.Sequential(*layers[:-1], *([out_activation] if out_activation is not None else []))


# ---------------------------------------------------------------------------------------------------------
# Diagnostics that tell learning from a stall early.


@torch.no_grad()
def logits_std_across_states(logits: torch.Tensor) -> torch.Tensor:
    """How much the policy depends on the state: logits `[..., A]` centred per state (softmax ignores a shift),
    then the standard deviation of each action's logit over all states, averaged over actions. Near 0: a
    state-blind policy (whatever it learns is a per-action bias)."""
    z = logits.reshape(-1, logits.shape[-1]).float()
    z = z - z.mean(-1, keepdim=True)
    return z.std(0, unbiased=False).mean()


@torch.no_grad()
def dead_units(features: torch.Tensor) -> torch.Tensor:
    """Fraction of ReLU units `[..., F]` that are zero on every state of the batch."""
    f = features.reshape(-1, features.shape[-1])
    return (f <= 0).all(0).float().mean()


@torch.no_grad()
def grad_norms_by_layer(module: nn.Module) -> dict[str, torch.Tensor]:
    """The gradient norm of each layer (the parameters of one Linear, Conv2d or LSTMCell), named by its path."""
    norms = {}
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.LSTMCell)):
            grads = [p.grad for p in m.parameters(recurse=False) if p.grad is not None]
            if grads:
                norms[name] = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return norms


def check_channels(network: str, channels) -> None:
    """`--channels`: 3 values for the deep (ResNet) torso, 2 for the shallow one, or none (the defaults)."""
    from common.envs import UsageError

    count = {"deep": 3, "shallow": 2}.get(network)
    if count and len(channels) not in (0, count):
        raise UsageError(f"--channels for the {network} network takes {count} values, got {channels}")
