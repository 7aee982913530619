"""The closed config model: defaults, YAML loading, every error is a ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import Config, load_config
from app.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_defaults_are_the_embedded_demo() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.tee.mode == "embedded-simulator"
    assert cfg.dataset.source == "bundled-sample"
    assert cfg.base_model.source == "tiny-llama"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.schema_version == 1


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("tee: {mode: sgx}\n", "tee.mode"),
        ("unknown_key: 1\n", "unknown_key"),
        ("training: {max_steps: 0}\n", "training.max_steps"),
        ("dataset: {source: encrypted-file}\n", "dataset"),
        ("dataset: {key: {source: file}}\n", "dataset.key"),
        ("base_model: {sha256: nothex}\n", "base_model.sha256"),
        ("training: {lora: {component_: x}}\n", "training.lora.component_"),
    ],
)
def test_invalid_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert field in err.value.message


@pytest.mark.parametrize("text", ["[1, 2]\n", "a: [\n"])
def test_non_mapping_or_bad_yaml(tmp_path: Path, text: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError):
        load_config(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "nope.yaml")


def test_canonical_json_is_stable() -> None:
    assert Config().canonical_json() == Config().canonical_json()
    assert b" " not in Config().canonical_json()
