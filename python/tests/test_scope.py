"""A scope key never shows its octets (issue 48: the key never in repr, logs or
exceptions)."""

from __future__ import annotations

import logging
import pickle

import pytest

import kvsp

HEX = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"


def test_key_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    key = kvsp.ScopeKey.from_hex(HEX)
    for shown in (repr(key), str(key), f"{key}", f"{key!r}", f"{key}", repr([key]), repr({"k": key})):
        assert "0102" not in shown and "REDACTED" in shown
    with caplog.at_level(logging.INFO):
        logging.getLogger("t").info("key %s", key)
    assert "0102" not in caplog.text
    with pytest.raises(kvsp.SecretError):
        pickle.dumps(key)
    with pytest.raises(TypeError):
        __import__("json").dumps(key)


def test_bad_key_error_does_not_echo_it() -> None:
    with pytest.raises(kvsp.InvalidError) as e:
        kvsp.ScopeKey.from_hex(HEX.upper())
    assert "0A0B" not in str(e.value)


def test_keys_compare_by_value() -> None:
    assert kvsp.ScopeKey.from_hex(HEX) == kvsp.ScopeKey.from_hex(HEX + "\n")
    assert kvsp.ScopeKey.from_hex(HEX) != kvsp.ScopeKey.from_hex("ff" + HEX[2:])


def test_chain_resumes_and_forks() -> None:
    key = kvsp.ScopeKey.from_hex(HEX)
    compat = kvsp.CompatID(bytes(32))
    toks = list(range(40))
    whole = kvsp.block_keys(key, compat, 4, toks)
    c = kvsp.Chain(key, compat, 4)
    c.extend(toks[:16])
    fork = c.clone()
    assert c.extend(toks[16:]) == whole[4:]
    assert fork.extend(toks[16:]) == whole[4:]
    resumed = kvsp.Chain(key, compat, 4, prev=whole[3], blocks=4)
    assert resumed.extend(toks[16:]) == whole[4:]
    with pytest.raises(kvsp.InvalidError):
        c.push(1 << 32)
