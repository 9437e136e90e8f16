"""The generated schema check (config/schema_check.py) is of the schema, and says what a
freshly compiled one says."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import Any

import fastjsonschema
import pytest

from reconciler.config import schema, schema_check
from tests.support.host import REPO


def test_the_generated_check_is_of_the_current_schema() -> None:
    path = os.path.join(REPO, "reconciler", "schemas", "reconciler.schema.json")
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    assert digest == schema_check.SCHEMA_SHA256, \
        "reconciler/config/schema_check.py is stale: run python3 scripts/gen-schema-check.py"
    if schema_check.VERSION == fastjsonschema.VERSION:
        assert schema._pregenerated() is schema_check.validate
    else:  # made by another fastjsonschema: compiled as before
        assert schema._pregenerated() is None


def test_a_stale_generated_check_is_not_used(monkeypatch) -> None:
    monkeypatch.setattr(schema_check, "SCHEMA_SHA256", "0" * 64)
    assert schema._pregenerated() is None


def test_the_generator_reproduces_the_module_with_this_fastjsonschema() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_schema_check", os.path.join(REPO, "scripts", "gen-schema-check.py"))
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with open(gen.OUTPUT) as fh:
        shipped = fh.read()
    if f'VERSION = "{fastjsonschema.VERSION}"' not in shipped:
        pytest.skip(f"generated with another fastjsonschema than {fastjsonschema.VERSION}")
    assert gen.generate() == shipped


DOCS: list[Any] = [
    {"version": 1},
    {"version": 1, "bridges": [{"name": "br0", "mtu": 1500}]},
    {"version": 1, "bridges": [{"name": "br0", "mtu": 10}]},
    {"version": 2},
    {"version": 1, "bridges": [{"name": "-bad"}]},
    {"version": 1, "subnets": [{"name": "s", "bridge": "br0", "cidr": "10.0.0.0/24"}],
     "allocs": [{"id": "a-1", "subnet": "s", "ports": [{"host": 80, "to": 8080}]}]},
    {"version": 1, "allocs": [{"id": "a-1", "subnet": "s", "ports": [{"host": 0, "to": 1}]}]},
    {"version": 1, "allocs": [{"id": "a", "subnet": "s", "unknown": True}]},
    {"version": 1, "docker_networks": [{"name": "n", "subnet": "10.1.0.0/24"}]},
    [],
    "version: 1",
]


@pytest.mark.parametrize("doc", DOCS)
def test_the_generated_check_agrees_with_a_compiled_one(doc: Any) -> None:
    compiled = fastjsonschema.compile(schema.schema())

    def verdict(check: Any) -> bool:
        try:
            check(doc)
        except fastjsonschema.JsonSchemaException:
            return False
        return True

    assert verdict(schema_check.validate) == verdict(compiled)
