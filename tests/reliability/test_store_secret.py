"""A weak kernel store secret is refused (issue 28; Note [Store secret strength] in
dynvm._env): DYNVM_STORE_SECRET shorter than 32 bytes or made by hand (one repeated
character, a short string repeated, a run) raises a ConfigError naming the variable and
never showing the value; random secrets of the usual shapes pass."""

from __future__ import annotations

import base64
import secrets

import pytest

from dynvm._env import STORE_SECRET, store_settings
from dynvm.vm.errors import ConfigError


@pytest.mark.parametrize("secret, problem", [
    ("x", "is 1 bytes long, at least 32"),
    ("s3cret-value-123", "is 16 bytes long"),
    # Its id is fixed: pytest-xdist's workers must collect the same ids (Note [Two
    # workers] in tests/_parallel.py), and a random value in one differs in each.
    pytest.param(secrets.token_hex(15) + "a", "is 31 bytes long",
                 id="random 31 characters-is 31 bytes long"),
    ("s" * 64, "1 distinct characters"),
    ("ab" * 32, "2 distinct characters"),
    ("0123456789abcdef" * 3, "16-character string repeated"),
    ("hunter2!" * 4 + "hu", "8-character string repeated"),
    ("abcdefghijklmnopqrstuvwxyz0123456789", "is a run"),
    ("0011223344556677889900112233445566", "is a run"),
])
def test_a_weak_secret_is_refused(secret, problem):
    with pytest.raises(ConfigError, match=STORE_SECRET) as caught:
        store_settings({STORE_SECRET: secret, "DYNVM_STORE_DIR": "/tmp/unused"})
    message = str(caught.value)
    assert problem in message
    if len(secret) >= 8:   # a shorter one may occur in any text
        assert secret not in message and secret[:8] not in message


@pytest.mark.parametrize("make", [
    lambda: secrets.token_hex(16),     # openssl rand -hex 16: 32 characters, 128 bits
    lambda: secrets.token_hex(32),     # the README's openssl rand -hex 32
    lambda: base64.b64encode(secrets.token_bytes(32)).decode(),   # openssl rand -base64 32
    lambda: secrets.token_urlsafe(32),
])
def test_random_secrets_pass(make):
    for _ in range(200):
        secret = make()
        assert store_settings({STORE_SECRET: secret}).secret == secret


def test_a_typed_passphrase_of_32_bytes_passes():
    passphrase = "correct horse battery staple 123"
    assert store_settings({STORE_SECRET: passphrase}).secret == passphrase
