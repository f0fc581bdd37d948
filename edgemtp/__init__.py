"""edgemtp: several tokens per forward pass from a frozen causal LM, by mask-token probing,
with output identical to the model's own decoding.

The core (this package) is numpy-only; backends live in ``edgemtp.runtimes`` and import
their heavy dependencies lazily.
"""

from .api import Model
from .backend import Backend, StepOut
from .config import GenerationConfig
from .engine import Generation, GenerationResult
from .errors import (BackendUnavailableError, BudgetError, ConfigError, EdgeMTPError,
                     ModelLoadError, UnsupportedModelError)
from .metrics import Stats
from .plans import DynamicPlans, Plan, dynamic_plans, static_plan

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendUnavailableError", "BudgetError", "ConfigError", "DynamicPlans",
    "EdgeMTPError", "Generation", "GenerationConfig", "GenerationResult", "Model",
    "ModelLoadError", "Plan", "Stats", "StepOut", "UnsupportedModelError", "dynamic_plans",
    "static_plan",
]
