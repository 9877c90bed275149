"""The runtime side: loading and running compiled modules with NumPy and iree.runtime
only (no compiler). `Engine` schedules generation requests over a compiled LM
(continuous batching, runtime.scheduler)."""
from .batched import BatchedLMGenerator  # noqa: F401
from .scheduler import Engine, EngineClosed, QueueFull, Request  # noqa: F401
