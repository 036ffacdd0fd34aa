"""A worker's engine backend: what computes the tokens of a prefill or decode worker.

Two backends serve the same fleet protocol (jobs in, token streams out, KV by handles):
vLLM with kvmesh's connector as its KV layer (`vllm_backend.py`, the default where vLLM
is installed) and kvmesh's own paged-KV engine (`native`: shared/serving). The service
processes pick one with `setup_for` (`engine.backend`).
"""
