"""docs/configuration.md is what ``python -m kspipe.config.reference`` writes from the schemas,
and it names every key of the config the command composes, with its default."""

import re
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from kspipe.config import compose
from kspipe.config.reference import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_page_is_written_from_the_schemas():
    assert PAGE.read_text() == render(), (
        "docs/configuration.md is out of date: python -m kspipe.config.reference "
        "docs/configuration.md"
    )


def leaves(node, prefix=""):
    """``{dotted key: value}`` of a plain container; an empty mapping is a value."""
    if isinstance(node, dict) and node:
        found = {}
        for key, value in node.items():
            found.update(leaves(value, f"{prefix}{key}."))
        return found
    return {prefix[:-1]: node}


def test_the_page_names_every_key_the_command_composes_with_its_default():
    cfg = OmegaConf.to_container(compose([]), resolve=False)
    page = dict(re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", PAGE.read_text(), re.M))
    composed = leaves(cfg)
    assert len(composed) >= 100
    missing = sorted(set(composed) - set(page))
    assert not missing, f"docs/configuration.md lacks {missing}"
    for key, value in composed.items():
        written = yaml.safe_load(page[key].replace("\\|", "|"))
        assert written == value, f"{key}: the page says {page[key]}, the config {value!r}"
