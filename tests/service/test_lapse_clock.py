"""The watch's lapse bookkeeping (`_Seen`) against the rule it implements, scanned the slow way.

Rule: a worker lapses when no heartbeat arrived for `LAPSE_FACTOR` x its TTL after its latest
one; it is reported once, then forgotten; a new heartbeat re-arms it. The next wait is the time
to the earliest deadline among workers still live, clamped to [0.05, _MAX_WAIT_S].
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.service.watch import _MAX_WAIT_S, LAPSE_FACTOR, _Seen

WORKERS = [f"w{i}" for i in range(6)]

steps = st.lists(st.one_of(
    st.tuples(st.just("beat"), st.sampled_from(WORKERS), st.sampled_from([0.5, 1.0, 5.0])),
    st.tuples(st.just("forget"), st.sampled_from(WORKERS), st.just(0.0)),
    st.tuples(st.just("tick"), st.just(""), st.floats(0.0, 10.0)),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_lapses_match_a_scan_of_every_worker(ops):
    seen, model = _Seen(), {}  # model: worker -> (arrival, ttl)
    now, revision = 0.0, 0
    for op, wid, x in ops:
        if op == "beat":
            revision += 1
            seen.saw(wid, revision, x, now)
            model[wid] = (now, x)
            assert seen.revision(wid) == revision
        elif op == "forget":
            seen.forget(wid)
            model.pop(wid, None)
        else:
            now += x
        expected = sorted(w for w, (at, ttl) in model.items() if at + ttl * LAPSE_FACTOR < now)
        assert sorted(seen.lapsed(now)) == expected
        for w in expected:  # as the watch does: reported down, then forgotten
            seen.forget(w)
            del model[w]
        waits = [at + ttl * LAPSE_FACTOR - now for at, ttl in model.values()]
        assert seen.until_next_lapse(now) == min(_MAX_WAIT_S, max(0.05, min(waits, default=_MAX_WAIT_S)))


def test_stale_entries_do_not_pile_up():
    seen = _Seen()
    for t in range(10_000):  # one worker beating every second for hours
        seen.saw("w", t, 1.0, float(t))
        assert seen.lapsed(float(t)) == []
    assert len(seen._deadlines) <= 3  # only deadlines not yet passed remain
