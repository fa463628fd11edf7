"""tests/support/devdeps.py, as tests/conftest.py installs it: `pytest.importorskip` of a module of the
`[dev]` extra fails the test (a broken install must not pass as quiet skips), unless
STREAMDILOCO_TEST_ALLOW_MISSING_DEV=1 allows it; any other module still skips as before.
"""

from __future__ import annotations

import sys

import pytest

from tests.support.devdeps import ALLOW_ENV, dev_distributions, is_dev_module


def test_the_dev_extras_modules_are_known_by_their_import_names():
    assert {"transformers", "wandb", "playwright", "pyyaml", "kubernetes-validate"} <= dev_distributions()
    for module in (
        "transformers",
        "accelerate",
        "tokenizers",
        "wandb",
        "tensorboard.backend.event_processing.event_accumulator",
        "playwright.sync_api",
        "kubernetes_validate",
        "jsonschema",
        "yaml",
    ):
        assert is_dev_module(module), module
    for module in ("torch", "grpc", "numpy", "no_such_module_anywhere"):
        assert not is_dev_module(module), module


def test_importorskip_of_a_missing_dev_module_fails_and_names_the_extra(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # its import fails as when it is not installed
    with pytest.raises(pytest.fail.Exception) as e:
        pytest.importorskip("wandb", reason="wandb is not installed")
    message = str(e.value)
    assert message.startswith(
        "wandb comes with the [dev] extra (pip install -e '.[dev]'), but it did not import"
    )
    assert "wandb is not installed" in message and f"{ALLOW_ENV}=1" in message


def test_the_environment_lets_a_partial_install_skip(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(pytest.skip.Exception):
        pytest.importorskip("wandb")


def test_a_module_outside_the_dev_extra_still_skips_and_an_installed_one_imports(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        pytest.importorskip("no_such_module_anywhere")
    assert pytest.importorskip("yaml").safe_load("a: 1") == {"a": 1}
