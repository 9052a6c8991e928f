"""reshard's errors: one hierarchy. Every error reshard raises is a :class:`ReshardError` (a
``RuntimeError``) whose ``code`` names its kind (an :class:`ErrorCode` value), whose ``tasks``
lists the task ids involved, and whose ``retryable`` says whether making the same call again on
every PE is what to do next (a collective call that every PE failed alike with nothing done, or a
run given up on a late or stalled peer that left the service usable); where a kind means what a
built-in exception means, its class is that too, so ``except ValueError`` or
``except TimeoutError`` catch reshard's as Python code expects::

    try:
        svc.schedule()
    except reshard.ReshardTimeoutError as error:     # also a TimeoutError
        ...                                          # error.code == reshard.ErrorCode.TIMEOUT
    except reshard.InvalidArgumentError as error:    # also a ValueError
        print(error.tasks)

Ctrl-C in a blocked call raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import enum
from typing import Iterable, Type

from . import _core

ReshardError = _core.ReshardError
# A ValueError too; codes "invalid argument" and "validation".
InvalidArgumentError = _core.InvalidArgumentError
ReshardTypeError = _core.ReshardTypeError  # an InvalidArgumentError and a TypeError
ReshardTimeoutError = _core.ReshardTimeoutError  # and TimeoutError
UnsupportedError = _core.UnsupportedError  # and NotImplementedError
InvalidStateError = _core.InvalidStateError
PeerFailureError = _core.PeerFailureError
IntegrityError = _core.IntegrityError
SystemCallError = _core.SystemCallError  # and OSError

__all__ = ["ErrorCode", "IntegrityError", "InvalidArgumentError", "InvalidStateError",
           "PeerFailureError", "ReshardError", "ReshardTimeoutError", "ReshardTypeError",
           "SystemCallError", "UnsupportedError"]


class ErrorCode(str, enum.Enum):
    """The kinds of :class:`ReshardError` (``error.code``); each equals its text, so
    ``error.code == "timeout"`` and ``error.code == ErrorCode.TIMEOUT`` read alike."""

    INVALID_ARGUMENT = "invalid argument"
    INVALID_STATE = "invalid state"
    VALIDATION = "validation"
    TIMEOUT = "timeout"
    PEER_FAILURE = "peer failure"
    SYSTEM = "system"
    UNSUPPORTED = "unsupported"
    INTEGRITY = "integrity"

    def __str__(self) -> str:
        return self.value


def refusal(message: str, tasks: Iterable[int] = (),
            kind: Type[ReshardError] = InvalidArgumentError) -> ReshardError:
    """An error as the library raises them: ``kind`` (an InvalidArgumentError unless said), its
    class's code, the tasks named."""
    error = kind(message)
    error.code = kind.code
    error.tasks = list(tasks)
    return error


def type_refusal(message: str) -> ReshardError:
    """A refusal of an object of the wrong type (a ReshardTypeError: also a TypeError)."""
    return refusal(message, kind=ReshardTypeError)


def state_refusal(message: str) -> ReshardError:
    """A refusal of a call made out of order or without what it needs first (an
    InvalidStateError: also a RuntimeError)."""
    return refusal(message, kind=InvalidStateError)
