"""Rollout engines outside this process: vLLM-Omni (``vllm_omni.py``: the engine's request and result mapping;
``vllm_omni_names.py``: its weight names mapped to ours)."""
