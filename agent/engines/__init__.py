"""Engine adapters: the engine-neutral interface (:mod:`agent.engines.base`) and
one package per engine (``vllm``). Only an engine's own package imports it."""
