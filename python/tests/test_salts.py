"""Cache salts map to scopes only through configured secrets (issue 51:
scopes are not the client's to choose): a guessed salt gets nothing."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

import kvsp
from kvsp.salts import MAX_SALT_OCTETS, SaltScopes

KEY_A = "a1" * 32
KEY_B = "b2" * 32
SALT_A = "tenant-a: 7f3c9e0b5d21"


def sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


@pytest.fixture
def keys(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "a.key").write_text(KEY_A + "\n")
    (tmp_path / "b.key").write_text(KEY_B + "\n")
    return tmp_path


def test_only_a_configured_salt_finds_its_scope(keys: pathlib.Path) -> None:
    s = SaltScopes.from_config({"salts": [{"salt_sha256": sha(SALT_A), "scope_key_file": "a.key"}]}, keys)
    a = kvsp.ScopeKey.from_hex(KEY_A)
    assert s.scope_for(SALT_A) == a
    # Guessed, near, or the configuration's own text: nothing is shared.
    for guess in ("tenant-a", SALT_A + " ", SALT_A.upper(), sha(SALT_A), "", None, "x" * (MAX_SALT_OCTETS + 1)):
        assert s.scope_for(guess) is None, guess
    assert "a1a1" not in repr(s) and sha(SALT_A) not in repr(s) and "1 salts" in repr(s)


def test_the_default_scope_is_configured_not_assumed(keys: pathlib.Path) -> None:
    conf: dict[str, object] = {
        "salts": [{"salt_sha256": sha(SALT_A), "scope_key_file": "a.key"}],
        "default_scope_key_file": "b.key",
    }
    s = SaltScopes.from_config(conf, keys)
    b = kvsp.ScopeKey.from_hex(KEY_B)
    assert s.scope_for(None) == b and s.scope_for("a guess") == b and s.scope_for(SALT_A) != b
    assert SaltScopes().scope_for(None) is None and SaltScopes().scope_for(SALT_A) is None


@pytest.mark.parametrize(
    ("conf", "names"),
    [
        ({"salt": []}, "'salt'"),
        ({"salts": {}}, "a list"),
        ({"salts": [{"salt_sha256": "00" * 32}]}, "exactly"),
        ({"salts": [{"salt_sha256": "00" * 32, "scope_key_file": "a.key", "scope": "x"}]}, "exactly"),
        ({"salts": [{"salt_sha256": "AB" * 32, "scope_key_file": "a.key"}]}, "salt_sha256"),
        ({"salts": [{"salt_sha256": SALT_A, "scope_key_file": "a.key"}]}, "salt_sha256"),
        ({"salts": [{"salt_sha256": "00" * 32, "scope_key_file": "missing.key"}]}, "missing.key"),
        (
            {"salts": [{"salt_sha256": "00" * 32, "scope_key_file": "a.key"}] * 2},
            "earlier entry",
        ),
        ({"default_scope_key_file": 7}, "path or null"),
    ],
)
def test_bad_configurations_are_refused(keys: pathlib.Path, conf: dict[str, object], names: str) -> None:
    with pytest.raises(kvsp.InvalidError) as e:
        SaltScopes.from_config(conf, keys)
    assert names in str(e.value) and "a1a1" not in str(e.value)
