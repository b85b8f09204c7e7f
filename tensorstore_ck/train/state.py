"""TrainState: what a run needs to continue exactly, captured and put back (the state of
its objects and every RNG stream)."""

from __future__ import annotations

import random

import numpy as np
import torch

from ..errors import InvalidArgument

__all__ = ["TrainState", "capture_rng", "restore_rng"]


def capture_rng(numpy_generators: dict | None = None) -> dict:
    """Every RNG stream a training step may draw from: python, numpy's global state
    and the given numpy Generators, torch CPU and each CUDA device."""
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "numpy_generators": {k: g.bit_generator.state for k, g in (numpy_generators or {}).items()},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict, numpy_generators: dict | None = None) -> None:
    """Put back what capture_rng() took (CUDA devices: as many as both sides have)."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    for k, g in (numpy_generators or {}).items():
        g.bit_generator.state = rng["numpy_generators"][k]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        for i in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[i], i)


def _has_state(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


_COMPONENTS = ("model", "optimizer", "scheduler", "scaler", "dataloader")


def _not_stateful(name: str, obj, *, tensors: bool) -> InvalidArgument:
    what = "must have state_dict() and load_state_dict()" + (", or be a tensor" if tensors else "")
    hint = ""
    if isinstance(obj, torch.utils.data.DataLoader):
        hint = ("; a torch DataLoader cannot say where it stands: use tsck.ResumableDataLoader or "
                "torchdata's StatefulDataLoader")
    elif isinstance(obj, dict):
        hint = "; pass the object itself (the model, not model.state_dict()), so a restore loads into it"
    return InvalidArgument(f"TrainState {name}= {what} (got {type(obj).__name__}){hint}")


class TrainState:
    """Everything a run needs to continue exactly: captured by state_dict(), put back by load_state_dict().

    model, optimizer, scheduler, scaler, dataloader and the other keyword objects are
    anything with state_dict() and load_state_dict() (torch's protocol, what DCP calls
    Stateful). The data loader's position is captured the same way: tsck's
    ResumableDataLoader, torchdata's StatefulDataLoader (what Lightning and accelerate
    resume with) or any loader of your own with that pair; a plain torch DataLoader has
    no position to capture and is refused. A keyword object may also be a tensor (a
    counter, an EMA buffer): stored as is, copied back into the same tensor on restore.
    Every RNG stream is captured besides (capture_rng)."""

    def __init__(self, model=None, optimizer=None, scheduler=None, scaler=None, dataloader=None, *,
                 numpy_generators: dict | None = None, step: int = 0, **objects):
        self.components = {k: v for k, v in zip(_COMPONENTS, (model, optimizer, scheduler, scaler, dataloader))
                           if v is not None}
        for name, obj in self.components.items():
            if not _has_state(obj):
                raise _not_stateful(name, obj, tensors=False)
        for name, obj in objects.items():
            if not (_has_state(obj) or isinstance(obj, torch.Tensor)):
                raise _not_stateful(name, obj, tensors=True)
        self.objects = objects
        self.numpy_generators = dict(numpy_generators or {})
        for name, g in self.numpy_generators.items():
            if not isinstance(g, np.random.Generator):
                raise InvalidArgument(f"numpy_generators[{name!r}] is not a numpy Generator")
        self.step = step

    @classmethod
    def from_dict(cls, state: dict, *, numpy_generators: dict | None = None) -> "TrainState":
        """A TrainState of a dict {name: Stateful object or tensor} (what DCP's save and
        load take): model, optimizer, scheduler, scaler and dataloader by those names, the
        rest as keyword objects. Anything else (a plain number, a state_dict() instead of
        its object) is refused here, naming the key: nothing could be restored into it."""
        if not isinstance(state, dict):
            raise InvalidArgument(f"TrainState.from_dict takes a dict, got {type(state).__name__}")
        parts, objects = {}, {}
        for k, v in state.items():
            if not isinstance(k, str) or not k:
                raise InvalidArgument(f"state= keys must be non-empty str, got {k!r}")
            if not (_has_state(v) or isinstance(v, torch.Tensor)):
                raise _not_stateful(k, v, tensors=True)
            if k in _COMPONENTS and not isinstance(v, torch.Tensor):
                parts[k] = v
            else:
                objects[k] = v
        ts = cls(**parts, numpy_generators=numpy_generators)
        ts.objects = objects  # not as keywords: a key such as "step" is an object here
        return ts

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            **{k: v.state_dict() for k, v in self.components.items()},
            "objects": {k: v if isinstance(v, torch.Tensor) else v.state_dict() for k, v in self.objects.items()},
            "rng": capture_rng(self.numpy_generators),
        }

    def checkout_targets(self) -> dict:
        """The into= tree that checks this state out into its live objects: modules and
        optimizers as themselves (tensors filled in place, a DTensor's local shard from the
        blocks it needs only; then their load_state_dict(); a fresh optimizer over DTensor
        parameters gets DTensor state), the rest read as stored. FSDP2 needs it: a sharded
        model refuses whole plain tensors in load_state_dict. load_checked_out() finishes."""
        def live(obj):
            return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
        return {"step": None, **{k: v if live(v) else None for k, v in self.components.items()},
                "objects": {k: v if live(v) or isinstance(v, torch.Tensor) else None for k, v in self.objects.items()},
                "rng": None}

    def load_checked_out(self, sd: dict) -> None:
        """The tree checkout(into=checkout_targets()) returned: what it did not load already."""
        for k, v in self.components.items():
            if k not in sd:
                raise InvalidArgument(f"snapshot has no {k!r} to restore")
            if sd[k] is not v:
                v.load_state_dict(sd[k])
        for k, v in self.objects.items():
            if sd["objects"][k] is not v:
                _load_object(v, sd["objects"][k])
        restore_rng(sd["rng"], self.numpy_generators)
        self.step = sd["step"]

    def load_state_dict(self, sd: dict) -> None:
        for k, v in self.components.items():
            if k not in sd:
                raise InvalidArgument(f"snapshot has no {k!r} to restore")
            v.load_state_dict(sd[k])
        for k, v in self.objects.items():
            _load_object(v, sd["objects"][k])
        restore_rng(sd["rng"], self.numpy_generators)
        self.step = sd["step"]


def _load_object(obj, stored) -> None:
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():  # a parameter or buffer is updated in place, as into= does
            obj.copy_(stored)
    else:
        obj.load_state_dict(stored)


def as_state(state) -> TrainState | None:
    """state= as the manager takes it: a TrainState, or a dict of Stateful objects and
    tensors (TrainState.from_dict); anything else is refused when the manager is made,
    not at the first snapshot."""
    if state is None or isinstance(state, TrainState):
        return state
    if callable(getattr(state, "state_dict", None)) and hasattr(state, "step"):
        return state  # TrainState's own protocol (state_dict(), step): a class of the user's that speaks it
    if isinstance(state, dict):
        return TrainState.from_dict(state)
    raise InvalidArgument(f"CheckpointManager state= takes a TrainState or a dict of objects with "
                          f"state_dict()/load_state_dict() and tensors, got {type(state).__name__}"
                          + (" (wrap it: TrainState(model=...) or state={'model': ...})" if _has_state(state) else ""))
