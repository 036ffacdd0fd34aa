"""freeze_startup_heap: after it, a full collection no longer walks the service's startup objects."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import gc, json
import kvmesh.eviction.service  # a control-plane service's imports (torch among them)
before = len(gc.get_objects(generation=2))
from kvmesh.service.heap import freeze_startup_heap
frozen = freeze_startup_heap()
print(json.dumps({"before": before, "frozen": frozen, "after": len(gc.get_objects(generation=2))}))
"""


def test_startup_objects_leave_the_collected_generations():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] > 50_000  # what a full collection walked
    assert got["frozen"] >= got["before"]
    assert got["after"] < got["before"] // 100
