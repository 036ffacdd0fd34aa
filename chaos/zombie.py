"""The zombie probe: a sampled, seeded stream outlives the decode worker it started on.

A seeded request (temperature > 0) is first answered on the healthy stack:
that text is the reference continuation. The same request is then
streamed again; after a few chunks its decode worker (named by the
`kvmesh-route` header) is SIGSTOPped, the ingress migrates the request to
the other decode worker (its log says "retrying request" for this request),
and the paused worker is resumed while the new attempt streams. The
resumed worker still holds the replaced attempt and reads the ingress's
abort only now; it must stop that attempt ("decode attempt stopped",
why=replaced, in its log). The streamed text must equal the reference: the
new worker continues the seeded draws (it skips those of the tokens already
delivered) and the ingress takes nothing from the replaced attempt. A
zombie with the same seed would draw the same tokens, so the text cannot
show a splice by itself; the scripted zombie in
tests/ingress/test_supervisor_bus.py sends a different one.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable

import openai
from kvmesh.chaos.stack import API_KEY, ChaosStack

PROMPT = "A seeded story that outlives the worker it began on, told one sampled word at a time:"
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "seed": 7151}
MAX_TOKENS = 600  # long enough that the new attempt still streams when the paused worker resumes
CHUNKS_BEFORE_PAUSE = 4


def _log_has(stack: ChaosStack, service_id: str, since: int, match: Callable[[dict], bool]) -> bool:
    for line in stack.log(service_id)[since:].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if match(record):
            return True
    return False


def _until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stream(client: openai.OpenAI, model: str):  # noqa: ANN202 - the SDK's streaming response context
    return client.completions.with_streaming_response.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                             stream=True, **SAMPLING)


def probe(stack: ChaosStack, refs_unused: dict[str, str], timeout_s: float = 60.0) -> dict[str, bool]:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = stack.model_dir.name
    with _stream(client, model) as resp:
        reference = "".join(c.choices[0].text for c in resp.parse() if c.choices)
    ingress_mark = len(stack.log("ingress-0"))
    with _stream(client, model) as resp:
        decode = dict(part.split("=", 1) for part in resp.headers["kvmesh-route"].split(";"))["decode"]
        zombie_mark = len(stack.log(decode))
        chunks = iter(resp.parse())
        text: list[str] = []
        request = ""
        while len(text) < CHUNKS_BEFORE_PAUSE:
            chunk = next(chunks)
            request = chunk.id.split("-", 1)[1]  # the ingress logs it as req_<this>
            text += [c.text for c in chunk.choices]
        stack.signal(decode, signal.SIGSTOP)
        try:
            migrated = _until(lambda: _log_has(stack, "ingress-0", ingress_mark, lambda r: (
                r.get("event") == "retrying request" and r.get("stage") == "decode"
                and str(r.get("request_id", "")).endswith(request))), timeout_s)
        finally:
            stack.signal(decode, signal.SIGCONT)
        stopped = _until(lambda: _log_has(stack, decode, zombie_mark, lambda r: (
            r.get("event") == "decode attempt stopped" and r.get("why") == "replaced" and r.get("attempt") == 0
            and str(r.get("request_id", "")).endswith(request))), timeout_s)
        text += [c.text for chunk in chunks for c in chunk.choices]
    return {"zombie_migrated": migrated, "zombie_attempt_stopped": stopped,
            "zombie_output_is_reference": "".join(text) == reference}
