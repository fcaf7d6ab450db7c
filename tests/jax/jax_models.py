"""A small JAX policy-value net for the backend tests, and the factory a
spawned evaluator calls.  Importable without JAX (it is imported inside
the functions), so that a spawn worker never loads it."""
from __future__ import annotations

from typing import Any

import numpy as np

from backend_contract import TRIGGER, pv_outputs

HIDDEN = 16


def params_of(seed: int, dtype: Any = np.float32) -> dict[str, dict[str, np.ndarray]]:
    """The net's params, a fixed function of seed: a hidden layer over the
    flattened state, a 7-way policy head and a value head."""
    rng = np.random.default_rng(seed)

    def layer(n_in: int, n_out: int) -> dict[str, np.ndarray]:
        return {"w": rng.uniform(-0.3, 0.3, (n_in, n_out)).astype(dtype),
                "b": rng.uniform(-0.3, 0.3, (n_out,)).astype(dtype)}

    return {"hidden": layer(84, HIDDEN), "policy": layer(HIDDEN, 7), "value": layer(HIDDEN, 1)}


def apply_fn(outputs: str = "dict") -> Any:
    """apply(params, x): outputs "dict" ({"policy", "value" of shape (n, 1)}),
    "tuple" ((value, policy), unnamed), "named" (a named tuple (value,
    policy)) or "policy" (the policy alone)."""
    import jax.numpy as jnp

    def apply(params: Any, x: Any) -> Any:
        h = jnp.tanh(x.reshape(x.shape[0], -1).astype(params["hidden"]["w"].dtype)
                     @ params["hidden"]["w"] + params["hidden"]["b"])
        p = h @ params["policy"]["w"] + params["policy"]["b"]
        v = jnp.tanh(h @ params["value"]["w"] + params["value"]["b"])
        return pv_outputs(outputs, p, v)

    return apply


def reference(outputs: str, params: Any) -> Any:
    """apply_fn called directly (not compiled): its outputs as declared."""
    import jax

    f = apply_fn(outputs)

    def ref(x: np.ndarray) -> dict[str, np.ndarray]:
        with jax.disable_jit():
            out = f(params, x)
        if isinstance(out, dict):
            p, v = out["policy"], out["value"]
        elif isinstance(out, tuple):
            v, p = out
        else:
            return {"policy": np.asarray(out, np.float32)}
        return {"policy": np.asarray(p, np.float32), "value": np.asarray(v, np.float32)[:, 0]}

    return ref


def pv_factory() -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process only."""
    from shmeval.backends.jax import JaxModel

    return JaxModel(apply_fn("dict"), params_of(0))


def misbehaving_apply() -> Any:
    """apply_fn("dict") that fails when the first value of a state is
    TRIGGER * k: k=1 raises in a host callback, 5 gives a NaN value."""
    import jax
    import jax.numpy as jnp

    pv = apply_fn("dict")

    def check(first: Any) -> Any:
        if (np.asarray(first) == TRIGGER).any():
            raise RuntimeError("state out of range")
        return np.zeros((), np.float32)

    def apply(params: Any, x: Any) -> Any:
        out = pv(params, x)
        first = x[:, 0, 0, 0]
        ok = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), first)
        nan = jnp.where(first == 5 * TRIGGER, jnp.nan, 0.0)[:, None]
        return {"policy": out["policy"] + ok, "value": out["value"] + nan}

    return apply
