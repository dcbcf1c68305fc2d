"""What every role shares: the wire types and their transport.

Its public surface for code outside the roles (benchmarks):

- `Sampling`: a request's sampling parameters, as every role passes them;
- `PromptInput`: an in-process prompt (token ids, and images with their spans), what
  `Engine.add_request` takes.

The names resolve on first use (PEP 562), so importing the package loads nothing (the
server process imports it before torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from iris_serve.ipc.local import PromptInput
    from iris_serve.ipc.messages import Sampling

__all__ = ["PromptInput", "Sampling"]


def __getattr__(name: str) -> Any:
    value: Any
    if name == "PromptInput":
        from iris_serve.ipc.local import PromptInput as value  # torch: only when asked for
    elif name == "Sampling":
        from iris_serve.ipc.messages import Sampling as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
