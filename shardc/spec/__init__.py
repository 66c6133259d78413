"""Specifications: the plan schema, model configs, the Layout (split rules as data), dtypes."""
