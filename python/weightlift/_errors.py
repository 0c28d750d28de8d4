"""The exception hierarchy. The native module raises these classes by name."""


class WeightliftError(Exception):
    """Base class of every weightlift error."""


class FormatError(WeightliftError, ValueError):
    """A checkpoint file is corrupt, truncated or unsupported."""


class OutOfMemoryError(WeightliftError, MemoryError):
    """A plan or an allocation does not fit on its device.

    From the planner it carries ``shortfalls`` (one dict per short device: ``device``,
    ``needed``, ``available``, ``missing``, ``what``) and ``fixes`` (strings, cheapest first).
    """

    shortfalls: list[dict[str, object]]
    fixes: list[str]

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.shortfalls = []
        self.fixes = []


class PlanError(WeightliftError, ValueError):
    """A plan request that is invalid: a device spec, a size, an option or a device map."""


class GrammarError(WeightliftError, ValueError):
    """A GBNF grammar that cannot be used (``grammar=``, ``LlamaGrammar``): the message names
    the line and column or the rule, what was expected and what was found. Also raised when a
    grammar-constrained generation cannot go on (no token can continue the grammar)."""


class DeviceError(WeightliftError, RuntimeError):
    """A device is missing, unusable, or failed an operation."""


class CudaUnavailable(DeviceError):
    """CUDA was asked for, but no driver or GPU is present (or the build has no CUDA)."""


class UnsupportedError(WeightliftError):
    """A valid request that this build does not support (type, architecture, operation)."""


class ClosedError(WeightliftError, ValueError):
    """An operation on a checkpoint (or model) that has been closed."""


class ContextFullError(WeightliftError, ValueError):
    """Tokens that do not fit the cache: the prompt is longer than n_ctx, or the cache is full."""


class LoadCancelled(WeightliftError):
    """A load was cancelled by its progress callback or by Ctrl-C; nothing stays allocated."""


__all__ = [
    "ClosedError",
    "ContextFullError",
    "CudaUnavailable",
    "DeviceError",
    "FormatError",
    "GrammarError",
    "LoadCancelled",
    "OutOfMemoryError",
    "PlanError",
    "UnsupportedError",
    "WeightliftError",
]
