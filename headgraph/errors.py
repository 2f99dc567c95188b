"""Errors the CLI turns into one clear line and an exit code (no traceback unless --debug), and the one check of
a closed set's value (`check_choice`)."""

from typing import get_args


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (a driver's `message` where it has one), at most 200 characters,
    for a one-line error that names the cause."""
    text = (getattr(error, "message", None) or str(error)).strip()
    return (text.splitlines() or [type(error).__name__])[0][:200]


def check_choice(value, closed, what: str):
    """`value` when it is a member of the closed set `closed` (a `Literal` type), else a UsageError naming the
    value and the members. Each closed set is declared as a Literal in its module and checked there with this.

    >>> from typing import Literal
    >>> check_choice("bh", Literal["none", "bh"], "correction")
    'bh'
    >>> check_choice("BH", Literal["none", "bh"], "correction")
    Traceback (most recent call last):
    ...
    headgraph.errors.UsageError: unknown correction 'BH': use one of none, bh
    """
    members = get_args(closed)
    if value not in members:
        raise UsageError(f"unknown {what} {value!r}: use one of {', '.join(members)}")
    return value


class HeadgraphError(Exception):
    """A user-facing failure: its message is one line that says what to do."""

    exit_code = 1


class UsageError(HeadgraphError):
    """Bad arguments or parameters."""

    exit_code = 2


class ModelUnavailable(HeadgraphError):
    """A model name or folder that cannot be resolved or loaded offline."""

    exit_code = 2


class BadWeights(HeadgraphError):
    """Weights that are corrupt, mismatched, of the wrong shape or non-finite."""

    exit_code = 2


class StoreUnavailable(HeadgraphError):
    """A graph store that cannot be reached, opened or authenticated against."""

    exit_code = 3


class ReadOnlyViolation(HeadgraphError):
    """A statement a read-only entry point (headgraph cypher, the stores' reads) refuses: anything but a pure read."""

    exit_code = 2
