"""What kvtune knows about each serving engine, one module per engine.

    vllm    defaults by version and GPU size, the V0/V1 boundary, metric names, startup-log lines,
            and the endpoints its OpenAI-compatible server exposes

Engines are an axis, not a branch in every function: capacity, render, check, bench and the
gateway import an engine's facts from its module. SGLang and TensorRT-LLM will sit beside vllm.
"""
