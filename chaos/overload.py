"""The overload probe: a burst far above the ingress's in-flight limit.

The chaos stack runs the ingress with `max_in_flight` = OVERLOAD_LIMIT (the
steady load stays below it). A burst of BURST concurrent greedy requests
must split into admitted ones, which answer the reference within the latency
bound, and rejected ones, which get 429/503 with a Retry-After header at
once instead of queueing without bound.
"""

from __future__ import annotations

import threading
import time

import openai
from kvmesh.chaos.load import PROMPTS
from kvmesh.chaos.stack import API_KEY, ChaosStack

OVERLOAD_LIMIT = 6
BURST = 18
ADMITTED_BOUND_S = 20.0  # an admitted request of this size finishes well inside this on a loaded 2-core box
REJECT_BOUND_S = 2.0  # a rejection is immediate, not a queue


def probe(stack: ChaosStack, refs: dict[str, str]) -> dict[str, bool]:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    results: list[tuple[str, float, str | None, int | None, str | None]] = []  # prompt, s, text, status, retry-after
    lock = threading.Lock()
    go = threading.Barrier(BURST)

    def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        go.wait()
        started = time.monotonic()
        try:
            r = client.completions.create(model=stack.model_dir.name, prompt=prompt, max_tokens=24, temperature=0)
            row = (prompt, time.monotonic() - started, r.choices[0].text, None, None)
        except openai.APIStatusError as exc:
            row = (prompt, time.monotonic() - started, None, exc.status_code, exc.response.headers.get("retry-after"))
        with lock:
            results.append(row)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    admitted = [r for r in results if r[2] is not None]
    rejected = [r for r in results if r[2] is None]
    return {
        "overload_all_answered": len(results) == BURST,
        "overload_some_rejected": bool(rejected),
        "overload_rejections_retriable": all(r[3] in (429, 503) and r[4] is not None and r[1] <= REJECT_BOUND_S
                                             for r in rejected),
        "overload_admitted_identical": all(r[2] == refs[r[0]] for r in admitted),
        "overload_admitted_within_bound": all(r[1] <= ADMITTED_BOUND_S for r in admitted),
    }
