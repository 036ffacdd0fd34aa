"""SWE-agent trajectories as a session trace: chained ids, tool calls, timing, interleaving."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from kvmesh.sim.trace import TRACE_BLOCK_TOKENS, load_trace
from kvmesh.sim.trajectories import (
    ID_MASK,
    SessionsConfig,
    Timing,
    Trajectory,
    agent_preset_tokenizer,
    build_trace,
    chain_ids,
    iter_sessions,
    load_trajectories,
    poisson_starts,
    summarize,
    tool_names,
    write_trace,
)
from typer.testing import CliRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAJ_DIR = REPO_ROOT.parent / "shared" / "workloads" / "swe-agent"
needs_trajectories = pytest.mark.skipif(not any(TRAJ_DIR.glob("*.traj")), reason="no SWE-agent trajectories")


@pytest.fixture(scope="module")
def tokenizer():
    return agent_preset_tokenizer()


@pytest.fixture(scope="module")
def pool(tokenizer) -> dict[str, Trajectory]:
    return {t.name: t for t in load_trajectories(TRAJ_DIR, tokenizer)}


def test_chain_ids_share_prefixes_and_salt_only_past_the_shared_part() -> None:
    tokens = list(range(10 * 64))
    a = chain_ids(tokens, b"s1", shared_tokens=3 * 64, block_tokens=64)
    assert a == chain_ids(tokens, b"s1", shared_tokens=3 * 64, block_tokens=64)
    b = chain_ids(tokens, b"s2", shared_tokens=3 * 64, block_tokens=64)
    assert a[:3] == b[:3] and all(x != y for x, y in zip(a[3:], b[3:]))
    changed = tokens[:]
    changed[4 * 64 + 5] += 1
    c = chain_ids(changed, b"s1", shared_tokens=3 * 64, block_tokens=64)
    assert c[:4] == a[:4] and all(x != y for x, y in zip(a[4:], c[4:]))  # a change reaches every later block
    assert len(chain_ids(tokens[:-1], b"s1", block_tokens=64)) == 10 and all(0 <= h <= ID_MASK for h in a)


def test_tool_names_rule() -> None:
    declared = frozenset({"open", "edit", "submit"})
    structured = {"tool_calls": [{"function": {"name": "find_file"}}, {"function": {"name": "bash"}}], "action": "x"}
    assert tool_names(structured, declared) == ("find_file", "bash")
    assert tool_names({"action": "edit 1:2\nfoo\nend_of_edit\n"}, declared) == ("edit",)
    assert tool_names({"action": "python decrypt.py\n"}, declared) == ("bash",)
    assert tool_names({"action": "  \n"}, declared) == () and tool_names({}, declared) == ()


def test_poisson_starts_are_seeded_and_have_the_asked_rate() -> None:
    starts = poisson_starts(4000, rate=2.0, seed=3)
    assert starts == poisson_starts(4000, rate=2.0, seed=3) != poisson_starts(4000, rate=2.0, seed=4)
    assert starts[0] == 0.0 and all(a < b for a, b in zip(starts, starts[1:]))
    assert 1.8 < (len(starts) - 1) / starts[-1] < 2.2
    with pytest.raises(ValueError):
        poisson_starts(3, rate=0.0, seed=0)


@needs_trajectories
def test_pieces_tokenize_like_each_whole_templated_prompt(tokenizer, pool) -> None:
    for name in ("ctf_crypto_eps", "function_calling_simple"):
        raw = json.loads((TRAJ_DIR / f"{name}.traj").read_text())["history"]
        history = [{**m, "content": m.get("content") or ""} for m in raw]
        traj = pool[name]
        for turn in traj.turns:
            text = tokenizer.apply_chat_template(history[: turn.prompt_messages], add_generation_prompt=True)
            assert traj.prompt_tokens(turn) == tokenizer.encode(text)


@needs_trajectories
def test_tool_calls_of_real_trajectories(pool) -> None:
    eps = [t.tools for t in pool["ctf_crypto_eps"].turns]
    # shell commands, then five wrong flags (submit is a tool that answers), then the run's last turn
    assert eps == [("bash",)] * 8 + [("submit",)] * 5 + [()]
    structured = [t.tools for t in pool["function_calling_simple"].turns]
    assert structured == [("find_file",), ("open",), ("edit",), ("bash",), ()]
    assert pool["ctf_crypto_BabyEncryption"].turns[0].tools == ("open",)
    assert all(t.output_tokens > 0 for traj in pool.values() for t in traj.turns)


@needs_trajectories
def test_session_turns_extend_each_other_and_keep_their_order(pool) -> None:
    config = SessionsConfig(sessions=40, rate=0.5, timing=Timing(follow_up=0.6))
    rows = build_trace(list(pool.values()), config)
    times = [r.time_s for r in rows]
    assert times == sorted(times)
    interleaved = False
    position = {id(r): i for i, r in enumerate(rows)}
    follow_ups = 0
    for _, turns in iter_sessions(rows):
        for prev, nxt in zip(turns, turns[1:]):
            full = prev.input_length // TRACE_BLOCK_TOKENS
            assert nxt.hash_ids[:full] == prev.hash_ids[:full] and nxt.time_s > prev.time_s
            assert nxt.input_length > prev.input_length
            follow_ups += prev.tool_calls == ()
        interleaved |= position[id(turns[-1])] - position[id(turns[0])] + 1 > len(turns)
        assert all(len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK_TOKENS) for r in turns)
        assert all(r.input_length + r.output_length <= config.max_tokens for r in turns)
    assert interleaved and follow_ups > 0


@needs_trajectories
def test_a_sub_agent_starts_from_its_parents_context_and_the_parent_waits_for_it(pool, tmp_path: Path) -> None:
    config = SessionsConfig(sessions=30, rate=0.5, timing=Timing(follow_up=0.0), sub_agents=1.0, sub_agent_turns=3)
    rows = build_trace(list(pool.values()), config)
    sessions = dict(iter_sessions(rows))
    children = {sid: turns for sid, turns in sessions.items() if turns[0].parent_session_id is not None}
    assert len(children) >= 20  # nearly every session has a tool call to fork at
    for sid, turns in children.items():
        parent = sessions[turns[0].parent_session_id]
        assert sid == f"{turns[0].parent_session_id}.sub" and all(r.parent_session_id == parent[0].session_id
                                                                  for r in turns)
        [fork] = [r for r in parent if r.tool_calls == ("task",)]
        back = parent[parent.index(fork) + 1]
        shared = (fork.input_length - 8) // TRACE_BLOCK_TOKENS  # the generation prompt is a few tokens
        assert turns[0].hash_ids[:shared] == fork.hash_ids[:shared]  # the parent's context, same ids
        assert fork.time_s < turns[0].time_s and turns[-1].time_s < back.time_s  # the parent waits on it
        assert len(turns) <= 3 and turns[-1].tool_calls == () and all(r.tool_calls for r in turns[:-1])
    path = tmp_path / "forks.jsonl"
    write_trace(rows, path)
    loaded = load_trace(path)
    assert {r.parent_session_id for r in loaded.requests} - {None} == {t[0].parent_session_id for t in children.values()}
    write_trace(rows, path, session_ids=False)  # a client that names no session names no parent either
    assert all(r.parent_session_id is None and r.session_id is None for r in load_trace(path).requests)
    plain = build_trace(list(pool.values()), dataclasses.replace(config, sub_agents=0.0))
    assert all(r.parent_session_id is None and r.tool_calls != ("task",) for r in plain)
    for sid, turns in iter_sessions(plain):  # up to its fork, a session is what it would be without one
        forked = sessions[sid]
        upto = next((i + 1 for i, r in enumerate(forked) if r.tool_calls == ("task",)), len(forked))
        assert [(r.time_s, r.hash_ids) for r in forked[:upto]] == [(r.time_s, r.hash_ids) for r in turns[:upto]]


@needs_trajectories
def test_copies_of_a_trajectory_share_only_the_system_prompt(pool) -> None:
    one = [pool["ctf_crypto_eps"]]
    system_blocks = len([t for p in one[0].pieces[:1] for t in p]) // TRACE_BLOCK_TOKENS
    rows = build_trace(one, SessionsConfig(sessions=2, timing=Timing(follow_up=0.0)))
    firsts = [turns[0].hash_ids for _, turns in iter_sessions(rows)]
    shared = sum(1 for a, b in zip(*firsts) if a == b)
    assert shared == system_blocks > 0
    private = build_trace(one, SessionsConfig(sessions=2, timing=Timing(follow_up=0.0), share_system_prompt=False))
    a, b = (turns[0].hash_ids for _, turns in iter_sessions(private))
    assert not set(a) & set(b)


@needs_trajectories
def test_same_seed_same_file_and_the_reader_parses_it(pool, tmp_path: Path) -> None:
    config = SessionsConfig(sessions=25, rate=1.0, seed=7)
    first, again, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_trace(build_trace(list(pool.values()), config), first)
    write_trace(build_trace(list(pool.values()), config), again)
    write_trace(build_trace(list(pool.values()), dataclasses.replace(config, seed=8)), other)
    assert first.read_bytes() == again.read_bytes() != other.read_bytes()
    trace = load_trace(first)
    stamps = [r.time_s for r in trace.requests]
    assert stamps == sorted(stamps)
    assert {r.session_id for r in trace.requests} == {f"s{i:05d}" for i in range(25)}
    assert any(r.tool_calls == () for r in trace.requests) and any(r.tool_calls for r in trace.requests)


@needs_trajectories
def test_cli_writes_the_trace_and_prints_its_summary(tmp_path: Path) -> None:
    from kvmesh.cli.main import app

    out = tmp_path / "agent.jsonl"
    args = ["trace", "from-trajectories", str(TRAJ_DIR), "--sessions", "6", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    trace = load_trace(out)
    assert summary["requests"] == len(trace.requests) and summary["sessions"] == 6
    assert summary["unique_blocks"] == trace.unique_blocks and 0 < summary["tool_call_turn_fraction"] < 1


def test_summary_counts_overlapping_sessions() -> None:
    from kvmesh.sim.trajectories import TraceRow

    rows = [TraceRow(t, 10, 1, (h,), s, ()) for t, h, s in [(0, 1, "a"), (1, 2, "b"), (2, 3, "a"), (4, 4, "b")]]
    summary = summarize(rows)
    assert (summary["sessions"], summary["unique_blocks"], summary["peak_active_sessions"]) == (2, 4, 2)
    assert summary["span_s"] == 4.0 and summary["tool_call_turn_fraction"] == 0.0


def test_recorded_execution_times_drive_the_gaps(tokenizer, tmp_path: Path) -> None:
    """A hand-made .traj: a retried step missing from the history must not shift the timings."""
    history = [
        {"role": "system", "content": "COMMANDS:\nopen:\n  docstring: opens a file\n"},
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": "Look.\n```\nopen a.py\n```", "action": "open a.py\n"},
        {"role": "user", "content": "1:print(1)"},
        {"role": "assistant", "content": "List.\n```\nls\n```", "action": "ls\n"},
        {"role": "user", "content": "a.py"},
        {"role": "assistant", "content": "Done.\n```\nsubmit\n```", "action": "submit\n"},
    ]
    steps = [{"action": "open a.py\n", "execution_time": 2.5}, {"action": "rm -rf x\n", "execution_time": 9.0},
             {"action": "ls\n", "execution_time": 0.25}, {"action": "submit\n"}]
    (tmp_path / "t.traj").write_text(json.dumps({"history": history, "trajectory": steps}))
    (traj,) = load_trajectories(tmp_path, tokenizer)
    assert [t.tools for t in traj.turns] == [("open",), ("bash",), ()]
    assert [t.tool_s for t in traj.turns] == [2.5, 0.25, None]
    timing = Timing(output_tokens_per_s=100.0, follow_up=0.0)
    rows = build_trace([traj], SessionsConfig(sessions=1, timing=timing))
    gaps = [b.time_s - a.time_s for a, b in zip(rows, rows[1:])]
    expected = [t.output_tokens / 100.0 + t.tool_s for t in traj.turns[:2]]
    assert gaps == pytest.approx(expected)


@needs_trajectories
def test_session_policy_meets_the_targets_where_lru_thrashes(pool, tmp_path: Path) -> None:
    """Private SWE-agent sessions (no shared system prompt), the regime where LRU collapses: at 2 %
    of the unique blocks LRU gets at most half of Belady and the session policy >= 0.8 x Belady and
    >= 1.5 x LRU; at 30 %, where LRU is within 10 % of Belady, no worse than LRU."""
    from kvmesh.sim.run import capacity_for, run_one

    path = tmp_path / "private.jsonl"
    write_trace(build_trace(list(pool.values()), SessionsConfig(sessions=250, share_system_prompt=False)), path)
    trace = load_trace(path)
    rates = {}
    for fraction in (0.02, 0.3):
        capacity = capacity_for(trace, fraction)
        rates[fraction] = {n: run_one(trace, n, capacity).l1_hit_rate for n in ("session", "lru", "belady")}
    small, large = rates[0.02], rates[0.3]
    assert small["lru"] <= 0.5 * small["belady"] and large["lru"] >= 0.9 * large["belady"], rates  # the regimes
    assert small["session"] >= 0.8 * small["belady"] and small["session"] >= 1.5 * small["lru"], rates
    assert large["session"] >= large["lru"], rates
