"""`kvmesh kv export -> convert -> import` end to end: the imported KV serves a fresh engine unchanged."""

from __future__ import annotations

import json

from kvmesh.cli.main import app
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.kvconvert.safetensors_io import import_safetensors
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.s3_client import fast_fail_client
from typer.testing import CliRunner

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)


def test_export_convert_import_round_trip(tiny_loaded, s3_server, tmp_path) -> None:
    runner = CliRunner()
    model = str(tiny_loaded.path)
    ids = tiny_loaded.tokenizer.encode("Agents resend long contexts every turn; the KV for them should travel. " * 3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": ids}) + "\n")
    f8, f16, back = (tmp_path / n for n in ("bs8.safetensors", "bs16.safetensors", "back.safetensors"))

    r = runner.invoke(app, ["kv", "export", "--model", model, "--prompts-file", str(prompts), "--out", str(f8),
                            "--block-size", "8"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["kv", "convert", str(f8), str(f16), "--block-size", "16", "--layout", "HND"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["kv", "convert", str(f8), str(tmp_path / "x"), "--block-size", "12"])
    assert r.exit_code == 2 and "cannot re-chunk 8 -> 12: not a multiple" in r.output
    r = runner.invoke(app, ["kv", "convert", str(f16), str(back), "--block-size", "8", "--layout", "NHD"])
    assert r.exit_code == 0, r.output
    a, b = import_safetensors(f8), import_safetensors(back)
    n = len(b)
    assert n >= len(a) - 1 and all(x.header == y.header and bool((x.data == y.data).all()) for x, y in zip(a, b))

    env = {"KVMESH_S3_ENDPOINT": s3_server.endpoint, "KVMESH_S3_ACCESS_KEY": s3_server.access_key,
           "KVMESH_S3_SECRET_KEY": s3_server.secret_key, "KVMESH_S3__BUCKET": "kv-cli-test"}
    r = runner.invoke(app, ["kv", "import", str(f16), "--namespace", "t1", "--model", model], env=env)
    assert r.exit_code == 0 and "chunks written" in r.output, r.output
    r = runner.invoke(app, ["kv", "import", str(f16), "--namespace", "t1", "--model", model], env=env)
    assert r.exit_code == 0 and "0 chunks written" in r.output, r.output

    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, "kv-cli-test", tiny_loaded.fingerprint, chunk_blocks=16)
    fresh = Engine(tiny_loaded, EngineSettings(block_size=16, num_blocks=64))
    hashes = fresh.block_hashes(ids)
    restored = store.load_prefix("t1", hashes)
    assert len(restored) == len(hashes)
    assert fresh.import_blocks([s.to_kv_block() for s in restored]) == len(hashes)
    ref = Engine(tiny_loaded, EngineSettings(block_size=16, num_blocks=64)).generate([ids], GREEDY)[0]
    out = fresh.generate([ids], GREEDY)[0]
    assert out.token_ids == ref.token_ids and out.cached_tokens >= 16 * (len(hashes) - 1)
