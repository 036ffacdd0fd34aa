"""The shipped price file loads, is dated and sourced; a malformed file names its bad key."""

from __future__ import annotations

import pytest
import yaml
from kvmesh.report.prices import (
    DEFAULT_PRICES,
    PriceFileError,
    load_prices,
    parse_prices,
)


def test_the_shipped_file_is_dated_and_sourced() -> None:
    book = load_prices()
    assert book.as_of and book.path == str(DEFAULT_PRICES)
    assert {h.provider for h in book.hosted} == {"openai", "anthropic", "gemini", "deepseek"}
    for h in book.hosted:
        assert h.source.startswith("https://") and h.unconfirmed, h.provider
        assert 0 < h.cached_input < h.input < h.output, h.provider
    anthropic = next(h for h in book.hosted if h.provider == "anthropic")
    assert anthropic.write_multiplier(300) == 1.25 and anthropic.write_multiplier(3600) == 2.0
    assert anthropic.cached_input == pytest.approx(0.1 * anthropic.input)


def test_a_ttl_gets_the_shortest_listed_ttl_covering_it() -> None:
    anthropic = next(h for h in load_prices().hosted if h.provider == "anthropic")
    assert anthropic.write_multiplier(60) == 1.25  # inside 5 min
    assert anthropic.write_multiplier(301) == 2.0  # past 5 min: the 1 h price
    assert anthropic.write_multiplier(7 * 86400) == 2.0  # past the longest: the longest's
    openai = next(h for h in load_prices().hosted if h.provider == "openai")
    assert openai.write_multiplier(300) == 1.0  # no write surcharge: plain input


def test_a_malformed_price_names_its_key(tmp_path) -> None:
    data = yaml.safe_load(DEFAULT_PRICES.read_text())
    data["hosted"]["openai"]["output"] = "cheap"
    with pytest.raises(PriceFileError, match=r"hosted\.openai\.output"):
        parse_prices(data)
    data = yaml.safe_load(DEFAULT_PRICES.read_text())
    del data["rules"]["session_turns"]
    with pytest.raises(PriceFileError, match=r"rules\.session_turns"):
        parse_prices(data)
