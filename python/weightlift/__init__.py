"""weightlift: open, plan and load large language models on small machines.

The package is a thin layer over the native module ``weightlift._native``; everything public is
re-exported here.
"""

from weightlift._errors import (
    ClosedError,
    CudaUnavailable,
    DeviceError,
    FormatError,
    LoadCancelled,
    OutOfMemoryError,
    PlanError,
    UnsupportedError,
    WeightliftError,
)
from weightlift._native import (
    CacheSpec,
    Checkpoint,
    Device,
    DeviceUsage,
    ModelSpec,
    Placement,
    Plan,
    RuntimeSpec,
    TensorInfo,
    __version__,
    devices,
    fit,
    open,
    parse_devices,
    plan,
)

__all__ = [
    "CacheSpec",
    "Checkpoint",
    "ClosedError",
    "CudaUnavailable",
    "Device",
    "DeviceError",
    "DeviceUsage",
    "FormatError",
    "LoadCancelled",
    "ModelSpec",
    "OutOfMemoryError",
    "Placement",
    "Plan",
    "PlanError",
    "RuntimeSpec",
    "TensorInfo",
    "UnsupportedError",
    "WeightliftError",
    "__version__",
    "devices",
    "fit",
    "open",
    "parse_devices",
    "plan",
]
