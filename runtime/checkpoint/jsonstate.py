"""Objects' states as JSON, never pickle: dicts, lists, tuples, numbers, strings, None and tensors.

``encode`` turns a state (an optimizer's hyper-parameters, a learning-rate scheduler's or any
``Stateful`` object's ``state_dict()``) into plain JSON values; what JSON lacks is tagged: a tuple
``{"__tuple__": [...]}``, a dict with keys other than strings ``{"__items__": [[k, v], ...]}``, a
tensor ``{"__tensor__": {"dtype", "shape", "data"}}`` (its values listed exactly: a float64's repr
round-trips), a torch dtype ``{"__dtype__": "float32"}``. ``decode`` is the inverse. Anything else
(a function, an arbitrary object) is refused with the path to it, so loading a checkpoint can only
ever build these values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from autopar.errors import CheckpointError

_TAGS = ("__tuple__", "__items__", "__tensor__", "__dtype__", "__float__")


def encode(obj: Any, path: str = "state") -> Any:
    """``obj`` as JSON values (see the module docstring); raises ``CheckpointError`` naming what cannot be."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        data = t.reshape(-1).tolist()
        if t.is_floating_point():
            data = [encode(x) for x in data]
        return {"__tensor__": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(x, f"{path}[{i}]") for i, x in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(x, f"{path}[{i}]") for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: encode(v, f"{path}.{k}") for k, v in obj.items()}
        return {"__items__": [[encode(k, path), encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]}
    raise CheckpointError(
        f"{path} is a {type(obj).__name__}, which a checkpoint does not store (only numbers, strings, "
        "None, tensors, and lists, tuples and dicts of them; never pickle): give the object a state_dict() "
        "of such values"
    )


def decode(obj: Any) -> Any:
    """The value ``encode`` made ``obj`` from."""
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        tag, value = next(iter(obj.items()))
        if tag == "__tuple__":
            return tuple(decode(x) for x in value)
        if tag == "__items__":
            return {_hashable(decode(k)): decode(v) for k, v in value}
        if tag == "__float__":
            return float(value)
        if tag == "__dtype__":
            return _dtype(value)
        if tag == "__tensor__":
            data = [decode(x) for x in value["data"]]
            return torch.tensor(data, dtype=_dtype(value["dtype"])).reshape(value["shape"])
    return {k: decode(v) for k, v in obj.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{name!r} is not a torch dtype: the checkpoint's state is malformed")
    return dtype


__all__ = ["decode", "encode"]
