"""How much KV cache fits, and what each request reserves of it.

    memory       a GPU's memory as vLLM divides it: weights, overhead, the KV pool
    reservation  the reservation rule: ceil((prompt + max_tokens) / block_size) blocks
    measured     a capacity a running vLLM reported (/v1/models + /metrics, startup log, capacity
                 file), and the one fetch of a live server that calibrate and --metrics-url share
    engine_memory  the same for SGLang (mem_fraction_static) and TensorRT-LLM (free_gpu_memory_fraction)
    engine_logs  a capacity SGLang or TensorRT-LLM reported (startup logs, /server_info, /metrics)
    plan         the capacity of one model on one deployment, estimated or measured, by engine
"""
