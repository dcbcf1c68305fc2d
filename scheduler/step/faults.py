"""What a step that raises costs: the requests in it, not the scheduler (`docs/design.md`,
"Bad input is the client's error").

An exception out of the image encoder, the forward or the sampler of one step ends each
request that had a chunk in it with a `FailedRequest` (a 500 for its client), releasing
what it held as on an abort. Not isolated this way:

- `torch.AcceleratorError` (an illegal address, a device-side assert, a launch failure):
  CUDA keeps the context poisoned, so every later step would fail too. It propagates,
  the scheduler process exits non-zero and the launcher stops the server, rather than
  serve errors for hours from a dead context.
- Anything that is not an `Exception` (KeyboardInterrupt, SystemExit).

`torch.OutOfMemoryError` is recoverable: once the failed step's tensors are gone the
caching allocator's free blocks go back to the device (`release_device_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STEP_ERROR_STATUS = 500
STEP_ERROR_TYPE = "server_error"  # what the server's errors.error_type gives a 500


@dataclass(frozen=True)
class FailedRequest:
    """A request ended by a failed step, with the message its client reads."""

    request_id: str
    message: str


class RanksOutOfStep(RuntimeError):
    """A tensor-parallel step failed on rank 0 after the other ranks began it: they wait
    in collectives rank 0 will not finish, so the scheduler must stop (the launcher then
    stops the server) rather than go on with the next step."""


def is_isolatable(error: BaseException) -> bool:
    """True when failing the step's requests is enough and the scheduler can go on."""
    return isinstance(error, Exception) and not isinstance(
        error, (torch.AcceleratorError, RanksOutOfStep)
    )


def client_message(error: Exception) -> str:
    """The message a failed request's client reads: what happened, not our internals (the
    traceback is in the scheduler's log)."""
    if isinstance(error, torch.OutOfMemoryError):
        return "the engine ran out of device memory running this request; try again"
    return f"internal error in the engine while running this request: {type(error).__name__}"


def release_device_memory(device: torch.device) -> None:
    """Hands the caching allocator's free blocks back to the device after a step failed
    with an OOM; call it once the exception is no longer referenced, since its traceback
    keeps the step's tensors alive."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
