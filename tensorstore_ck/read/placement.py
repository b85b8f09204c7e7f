"""Device placement of the tensors a checkout reads: torch.load's map_location.

A checkout reads every block into CPU memory; where a fresh tensor then goes is
decided here, from the device it was saved on and the caller's map_location (None,
a device, a dict from saved location to location, or a callable, with torch.load's
meanings). A device this process lacks is refused (DeviceUnavailable) before
anything is allocated or read, so a snapshot saved on GPUs fails clearly on a host
without them instead of half-way through.
"""

from __future__ import annotations

import torch

from ..errors import CheckoutMismatch, DeviceUnavailable, InvalidArgument
from ..format.tree import format_path

__all__ = ["check_map_location", "device_available", "Placement"]


def check_map_location(ml):
    """torch.load's map_location: None, a device (str or torch.device), a dict from saved
    location to location, or a callable(tensor, location) -> tensor (None: the default)."""
    if ml is None or callable(ml):
        return ml
    if isinstance(ml, dict):
        out = {}
        for k, v in ml.items():
            out[str(_device(k, "map_location key"))] = str(_device(v, "map_location value"))
        return out
    return str(_device(ml, "map_location"))


def _device(d, what: str) -> torch.device:
    if not isinstance(d, (str, torch.device)):
        raise InvalidArgument(f"{what} must be a device (str or torch.device), got {type(d).__name__}")
    try:
        return torch.device(d)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgument(f"{what} {d!r} is not a device: {e}") from None


def device_available(dev: torch.device) -> bool:
    """Whether this process can put a tensor on `dev`."""
    if dev.type == "cpu":
        return True
    if dev.type == "meta":
        return False  # no data there: a snapshot never restores onto it
    mod = getattr(torch, dev.type, None)
    try:
        if mod is None or not mod.is_available():
            return False
        return dev.index is None or dev.index < mod.device_count()
    except Exception:  # noqa: BLE001 - backends' probes fail in their own ways
        return False


class Placement:
    """Where the fresh tensors of one checkout of `snapshot` go (map_location already
    checked by check_map_location)."""

    def __init__(self, map_location, snapshot: str):
        self.map_location = map_location
        self.snapshot = snapshot

    def where(self, saved: str | None, path):
        """Where a fresh tensor saved on `saved` goes, by map_location (torch.load's
        meanings): None for the CPU, else (device, None) or (None, location) for a callable.
        A device this process lacks is refused before anything is read."""
        loc = saved or "cpu"
        ml = self.map_location
        if callable(ml):
            return None, loc
        dest = loc if ml is None else ml.get(loc, loc) if isinstance(ml, dict) else ml
        return self._device_for(dest, loc, path)

    def _device_for(self, dest: str, loc: str, path):
        if dest == "cpu":
            return None
        try:
            dev = torch.device(dest)
        except (RuntimeError, ValueError, TypeError):
            dev = None
        if dev is None or not device_available(dev):
            where = "was saved on" if dest == loc else "is mapped to"
            raise DeviceUnavailable(f"the tensor at {format_path(path) or 'top'} of snapshot {self.snapshot[:16]} "
                                    f"{where} {dest[:64]!r}, which this process does not have; pass "
                                    "map_location='cpu' (or another device, a dict or a callable, as for "
                                    "torch.load) to checkout")
        return dev, None

    def move(self, t: torch.Tensor, place, path) -> torch.Tensor:
        dev, loc = place
        if dev is not None:
            return t.to(dev)
        try:
            out = self.map_location(t, loc)
        except Exception as e:  # noqa: BLE001 - the caller's function
            raise CheckoutMismatch(f"map_location({loc!r}) failed for the tensor at {format_path(path) or 'top'}: "
                                   f"{type(e).__name__}: {e}") from e
        if out is None:  # torch.load's default: where it was saved
            saved = self._device_for(loc, loc, path)
            return t if saved is None else t.to(saved[0])
        if not isinstance(out, torch.Tensor) or out.dtype != t.dtype or out.shape != t.shape:
            raise CheckoutMismatch(f"map_location({loc!r}) returned {type(out).__name__} for the tensor at "
                                   f"{format_path(path) or 'top'}: it must return the tensor it was given, moved")
        return out
