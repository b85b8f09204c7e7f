"""Ref/tag names and target strings. Names never become paths unchecked."""

from __future__ import annotations

import re

from ..errors import InvalidName

__all__ = ["validate_name", "validate_new_name", "validate_component", "parse_target", "MAX_NAME_BYTES"]

MAX_NAME_BYTES = 255
_COMPONENT = re.compile(r"[A-Za-z0-9._-]+\Z")


def validate_component(c: str, what: str = "name component") -> str:
    if not isinstance(c, str) or not _COMPONENT.match(c) or c in (".", "..") or len(c) > MAX_NAME_BYTES:
        raise InvalidName(f"invalid {what} {str(c)[:80]!r}: use at most {MAX_NAME_BYTES} letters, digits, "
                          "'.', '_', '-' (not '.' or '..')")
    return c


def validate_name(name, what: str = "ref name") -> str:
    """A ref or tag name: '/'-separated components of [A-Za-z0-9._-], at most 255 bytes."""
    if not isinstance(name, str):
        raise InvalidName(f"{what} must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidName(f"{what} is empty")
    try:
        n = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidName(f"{what} {name!r} is not valid UTF-8") from None
    if n > MAX_NAME_BYTES:
        raise InvalidName(f"{what} is {n} bytes long; the limit is {MAX_NAME_BYTES}")
    for c in name.split("/"):
        if not c:
            raise InvalidName(f"{what} {name!r} has an empty component")
        if not _COMPONENT.match(c) or c in (".", ".."):
            raise InvalidName(
                f"{what} {name!r}: component {c!r} must be letters, digits, '.', '_', '-' "
                "and not '.' or '..' ('@' and '~' are reserved)")
    return name


def validate_new_name(name, what: str = "ref name") -> str:
    """A name about to be created (a ref by a put, a tag, a job): validate_name, and not
    beginning with '-', which the command line would read as an option (names made by
    earlier versions stay readable: `tsck log STORE -- -rf`)."""
    validate_name(name, what)
    if name.startswith("-"):
        raise InvalidName(f"{what} {name!r} begins with '-': the command line would read it as an option")
    return name


def parse_target(target) -> tuple[str, str, int | None]:
    """-> (kind, text, step): kind 'name' (a ref or tag, or maybe a root-hash prefix:
    the caller looks it up in that order) or 'step' (REF@STEP)."""
    if not isinstance(target, str):
        raise InvalidName(f"target must be a str, got {type(target).__name__}")
    if "@" in target:
        ref, _, step = target.rpartition("@")
        validate_name(ref)
        if not re.fullmatch(r"-?[0-9]{1,30}", step):
            raise InvalidName(f"target {target!r}: the part after '@' must be a step number")
        return "step", ref, int(step)
    validate_name(target, "target")
    return "name", target, None
