"""kvmesh as vLLM's KV layer: `KVMeshConnector` (connector.py), loaded by vLLM through its KV-connector interface.

The class is imported on first use, so kvmesh's parts that need no vLLM (hashing, conversion, tests that
drive vLLM from another venv) import this package without vLLM installed.
"""

__all__ = ["KVMeshConnector"]


def __getattr__(name: str):
    if name == "KVMeshConnector":
        from kvmesh.connectors.vllm.connector import KVMeshConnector

        return KVMeshConnector
    raise AttributeError(name)
