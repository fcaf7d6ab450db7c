"""Small PyTorch models for the backend tests, and the factories spawned
evaluators call.  Importable without PyTorch (it is imported inside the
functions), so that a spawn worker that unpickles something of this
module's never loads it."""
from __future__ import annotations

from typing import Any

import numpy as np

from backend_contract import TRIGGER, pv_outputs


def seeded_weights(module: Any, seed: int) -> list[np.ndarray]:
    """Weights for ``module`` in state_dict order, a fixed function of
    seed (integer buffers, such as a batch norm's counter, stay 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for name, t in module.state_dict().items():
        if not t.is_floating_point():
            out.append(np.zeros(tuple(t.shape), np.int64))
            continue
        a = rng.uniform(-0.3, 0.3, tuple(t.shape))
        if name.endswith("running_var"):  # a variance is positive
            a = np.abs(a) + 0.5
        out.append(a.astype(np.float32))
    return out


def pv_net(seed: int = 0, outputs: str = "dict") -> Any:
    """A policy-value net: conv, batch norm, a 7-way policy head and a
    tanh value head of shape (n, 1) (served as a declared scalar).
    outputs: "dict" ({"policy", "value"}), "tuple" ((value, policy),
    unnamed), "named" (a named tuple (value, policy)) or "policy" (the
    policy tensor alone)."""
    import torch

    class PVNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(4)
            self.policy = torch.nn.Linear(168, 7)
            self.value = torch.nn.Linear(168, 1)

        def forward(self, x: Any) -> Any:
            h = torch.relu(self.norm(self.conv(x.permute(0, 3, 1, 2)))).flatten(1)
            p, v = self.policy(h), torch.tanh(self.value(h))
            return pv_outputs(outputs, p, v)

    net = PVNet()
    state = net.state_dict()
    net.load_state_dict({k: torch.from_numpy(w) for k, w in zip(state, seeded_weights(net, seed))})
    return net.eval()


def reference(net: Any) -> Any:
    """The net called directly: its outputs as declared (dict, value a scalar)."""
    import torch

    def ref(x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            out = net(torch.from_numpy(x))
        if isinstance(out, dict):
            p, v = out["policy"], out["value"]
        elif isinstance(out, tuple):
            v, p = out
        else:
            return {"policy": out.numpy()}
        return {"policy": p.numpy(), "value": v.numpy()[:, 0]}

    return ref


def pv_factory() -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process only."""
    import torch

    from shmeval.backends.torch import TorchModel

    torch.set_num_threads(1)
    return TorchModel(pv_net(seed=0))


def misbehaving_net() -> Any:
    """pv_net (dict outputs, the value as declared: shape (n,)) that fails
    when the first value of a state is TRIGGER * k: k=1 raises, 2 returns
    an output on another device, 3 adds a tensor of another device, 4
    returns a policy of 5 values, 5 a NaN value, 6 raises CUDA's
    out-of-memory error, 7 a complex policy."""
    import torch

    net = pv_net(0, "dict")

    class Misbehaving(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Any) -> Any:
            out = self.net(x)
            out["value"] = out["value"][:, 0]
            kind = int(x[:, 0, 0, 0].max().item() // TRIGGER)
            if kind == 1:
                raise RuntimeError("state out of range")
            if kind == 2:
                out["policy"] = out["policy"].to("meta")
            if kind == 3:
                out["value"] = out["value"] + torch.zeros(1, device="meta")
            if kind == 4:
                out["policy"] = out["policy"][:, :5]
            if kind == 5:
                out["value"] = out["value"] * float("nan")
            if kind == 6:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
            if kind == 7:
                out["policy"] = out["policy"].to(torch.complex64)
            return out

    return Misbehaving().eval()


#: What PyTorch raises, from then on, once a kernel's assert failed on the GPU.
DEVICE_ASSERT = "CUDA error: device-side assert triggered"


def failing_device_net(fail_at: int, flag: str) -> Any:
    """pv_net (dict outputs) on a device that fails for good at its
    ``fail_at``-th call on served states (the warm-up's batches of zeros do
    not count): that call and every later one raise PyTorch's error after a
    device-side assert.  Only in the first process to get there (``flag``,
    a path, says one did): a restarted process works."""
    import os

    import torch

    net = pv_net(0, "dict")

    class FailingDevice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.calls = 0
            self.lost = False
            self.failing = not os.path.exists(flag)

        def forward(self, x: Any) -> Any:
            if bool(x.any()):
                self.calls += 1
            if self.failing and (self.lost or self.calls >= fail_at):
                if not self.lost:
                    open(flag, "w").close()
                self.lost = True
                raise RuntimeError(DEVICE_ASSERT)
            return self.net(x)

    return FailingDevice().eval()


def failing_device_factory(flag: str) -> Any:
    """Evaluator.spawn's factory of a TorchModel over failing_device_net,
    served as the module is (a frozen trace would leave its failure out)."""
    import torch

    from shmeval.backends.torch import TorchModel

    torch.set_num_threads(1)
    return TorchModel(failing_device_net(3, flag), freeze=False)


#: A MuZero-style net's sizes: observations of OBS values, hidden states of
#: HIDDEN, ACTIONS actions.
OBS, HIDDEN, ACTIONS = 8, 6, 4


def muzero_net(seed: int = 0) -> Any:
    """A MuZero-style net of representation, dynamics and prediction
    functions, serving two methods: ``initial_inference(observation)`` ->
    {hidden_state, policy, value} and ``recurrent_inference(hidden_state,
    action)`` -> {hidden_state, reward, policy, value} (action an int64
    index; the value a scalar per row, the reward an (n, 1) column).  Its
    methods are marked for TorchScript, so that torch.jit.script keeps
    them."""
    import torch

    class MuZeroNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.representation = torch.nn.Linear(OBS, HIDDEN)
            self.dynamics = torch.nn.Linear(HIDDEN + ACTIONS, HIDDEN)
            # Folded into the linear layers before them by freezing: a
            # frozen function holds weights of its own.
            self.representation_norm = torch.nn.BatchNorm1d(HIDDEN)
            self.dynamics_norm = torch.nn.BatchNorm1d(HIDDEN)
            self.reward = torch.nn.Linear(HIDDEN, 1)
            self.policy = torch.nn.Linear(HIDDEN, ACTIONS)
            self.value = torch.nn.Linear(HIDDEN, 1)
            self.actions = ACTIONS

        def prediction(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.policy(h), torch.tanh(self.value(h))[:, 0]

        @torch.jit.export
        def initial_inference(self, observation: torch.Tensor) -> dict[str, torch.Tensor]:
            h = torch.relu(self.representation_norm(self.representation(observation)))
            p, v = self.prediction(h)
            return {"hidden_state": h, "policy": p, "value": v}

        @torch.jit.export
        def recurrent_inference(self, hidden_state: torch.Tensor,
                                action: torch.Tensor) -> dict[str, torch.Tensor]:
            a = torch.nn.functional.one_hot(action, self.actions).to(hidden_state.dtype)
            h = torch.relu(self.dynamics_norm(self.dynamics(torch.cat([hidden_state, a], 1))))
            p, v = self.prediction(h)
            return {"hidden_state": h, "reward": self.reward(h), "policy": p, "value": v}

        def forward(self, observation: torch.Tensor) -> dict[str, torch.Tensor]:
            return self.initial_inference(observation)

    net = MuZeroNet()
    state = net.state_dict()
    net.load_state_dict({k: torch.from_numpy(w) for k, w in zip(state, seeded_weights(net, seed))})
    return net.eval()


#: A masked AlphaZero net's board: PLANES planes of ROWS x COLS; a move per column.
PLANES, ROWS, COLS = 2, 6, 7


def masked_net(seed: int = 0) -> Any:
    """An AlphaZero-style net of two named inputs, ``planes`` (float32
    (PLANES, ROWS, COLS)) and ``mask`` (bool (COLS,), the legal moves):
    forward(planes, mask) -> {policy: probabilities, 0 where illegal,
    value}."""
    import torch

    class MaskedNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(PLANES, 4, 3, padding=1)
            self.policy = torch.nn.Linear(4 * ROWS * COLS, COLS)
            self.value = torch.nn.Linear(4 * ROWS * COLS, 1)

        def forward(self, planes: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
            h = torch.relu(self.conv(planes)).flatten(1)
            logits = self.policy(h).masked_fill(~mask, float("-inf"))
            return {"policy": torch.softmax(logits, 1), "value": torch.tanh(self.value(h))}

    net = MaskedNet()
    state = net.state_dict()
    net.load_state_dict({k: torch.from_numpy(w) for k, w in zip(state, seeded_weights(net, seed))})
    return net.eval()
