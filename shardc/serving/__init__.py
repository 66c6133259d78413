"""Serving a shardc build with an inference engine.

``vllm_plugin`` is vLLM's ``--load-format shardc`` (registered through the ``vllm.general_plugins``
entry point when shardc is installed in vLLM's environment; shardc never depends on vLLM).
``fill`` is its pure part, testable without vLLM: which tensors of a rank's shard fill which of
the engine's parameters, and whether the engine's degrees, pipeline partition and expert
placement are the build's. docs/architecture.md §6 "serve with vLLM".
"""
