"""Specifications: the plan schema, model configs, the Layout (split rules as data), dtypes.

Pure data and arithmetic: everything else reads these, nothing here reads files it was not given.
"""

from .. import lazy_seam

_SEAM = {
    "Plan": "plan", "load_plan": "plan", "plan_from_dict": "plan", "canonical_json": "plan",
    "ModelSpec": "model", "model_from_config": "model", "load_model": "model",
    "Layout": "ranks", "RankLayout": "ranks", "TensorSpec": "ranks", "build_layout": "ranks",
    "DType": "dtypes", "DTYPES": "dtypes",
}
__all__ = sorted(_SEAM)
__getattr__ = lazy_seam(__name__, _SEAM)
