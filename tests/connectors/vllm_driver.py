"""Run vLLM offline on a list of calls, with or without kvmesh's connector; print what each call returned.

Run by tests/connectors with the vLLM venv's python (vLLM spawns processes, hence the main guard):

    python vllm_driver.py MODEL_DIR CALLS_JSON OUT_JSON [--connector] [--no-prefix-caching] [--wait-s3 N]
        [--worker-id ID] [--peers ID,...] [--hold FILE]

CALLS_JSON: [{"prompt_token_ids": [...], "cache_salt": "..." (optional), "max_tokens": n}, ...].
OUT_JSON: [{"tokens": [...], "cached": num_cached_tokens}, ...]. `--wait-s3 N` waits (up to a minute)
until the bucket holds at least N objects before exiting: the L3 uploads run in the background.
`--worker-id` and `--peers` go to the connector's extra config. `--hold FILE`: after writing OUT_JSON, stay
up (and keep the L2 slab) until FILE exists, at most 15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def wait_for_objects(count: int, timeout_s: float = 60.0) -> int:
    from minio import Minio

    client = Minio(os.environ["KVMESH_S3_ENDPOINT"], access_key=os.environ["KVMESH_S3_ACCESS_KEY"],
                   secret_key=os.environ["KVMESH_S3_SECRET_KEY"], secure=False)
    bucket = os.environ["KVMESH_S3__BUCKET"]
    deadline = time.monotonic() + timeout_s
    while True:
        have = sum(1 for _ in client.list_objects(bucket, recursive=True))
        if have >= count or time.monotonic() > deadline:
            return have
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("calls")
    ap.add_argument("out")
    ap.add_argument("--connector", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--wait-s3", type=int, default=0)
    ap.add_argument("--worker-id", default="")
    ap.add_argument("--peers", default="")
    ap.add_argument("--hold", default="")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.connector:
        kwargs["kv_transfer_config"] = {"kv_connector": "KVMeshConnector",
                                        "kv_connector_module_path": "kvmesh.connectors.vllm",
                                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                        "kv_connector_extra_config": {
                                            **({"worker_id": args.worker_id} if args.worker_id else {}),
                                            "peers": [p for p in args.peers.split(",") if p]}}
    llm = LLM(model=args.model, dtype="float32", block_size=32, max_model_len=2048, gpu_memory_utilization=0.3,
              enable_prefix_caching=not args.no_prefix_caching, **kwargs)
    results = []
    with open(args.calls) as f:
        calls = json.load(f)
    for call in calls:
        prompt = {"prompt_token_ids": call["prompt_token_ids"]}
        if call.get("cache_salt"):
            prompt["cache_salt"] = call["cache_salt"]
        out = llm.generate([prompt], SamplingParams(max_tokens=call["max_tokens"], temperature=0), use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
    objects = wait_for_objects(args.wait_s3) if args.wait_s3 else None
    with open(args.out + ".tmp", "w") as f:
        json.dump({"calls": results, "s3_objects": objects}, f)
    os.replace(args.out + ".tmp", args.out)
    deadline = time.monotonic() + 900
    while args.hold and not os.path.exists(args.hold) and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
