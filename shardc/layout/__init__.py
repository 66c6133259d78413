"""Specifications: the plan schema, model configs, the Layout (split rules as data), dtypes.

Pure data and arithmetic: everything else reads these, nothing here reads files it was not given.
The re-exports are plain imports (go-to-definition works); none of these modules imports numpy or
torch at import time.
"""

from .dtypes import DTYPES, DType
from .model import ModelSpec, load_model, model_from_config
from .plan import Plan, canonical_json, load_plan, plan_from_dict
from .ranks import Layout, RankLayout, TensorSpec, build_layout

__all__ = ["DTYPES", "DType", "Layout", "ModelSpec", "Plan", "RankLayout", "TensorSpec", "build_layout",
           "canonical_json", "load_model", "load_plan", "model_from_config", "plan_from_dict"]
