"""AMK's error types. Every message says what was wrong, where, and what to do."""


class AmkError(Exception):
    """Base of every error AMK raises on purpose."""


class TraceError(AmkError, TypeError):
    """Bad input to an op or to a jitted function: wrong shape, dtype, leaf or missing weight."""


class ValidationError(AmkError, ValueError):
    """A program (or FUSED recipe) that `amk.validate` rejects; carries the full report."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


class DeadlockError(AmkError, RuntimeError):
    """A schedule made no progress: names the stuck tasks and the counter values they wait on."""


class CompileError(AmkError, RuntimeError):
    """NVRTC (or Triton) refused generated source; carries the numbered source and the log."""


class BackendUnavailable(AmkError, RuntimeError):
    """The requested backend cannot run here (no GPU, no cuda-python, no triton)."""
