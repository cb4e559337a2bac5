"""Every config key reaches the code it controls (issue 12): each field of every schema
dataclass is read somewhere besides its declaration (pdtool/schema.py) and the value checks
(pdtool/rules/values.py), or is listed below with the reason. A key added to the schema that no
code reads fails here, so it is wired or removed before users set it and see nothing change."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pdtool import schema

ROOT = Path(__file__).resolve().parent.parent
#: where a key is read: the packages and the job templates (tests, docs and yaml are not readers)
READERS = ("pdtool", "transfer", "templates")
NOT_READERS = {"pdtool/schema.py", "pdtool/rules/values.py"}
#: words too common for a word search (`.name`, `.version` are attributes of many objects):
#: these fields count as read only through their group, e.g. `engine.version`
QUALIFIED = {("EngineConfig", "version"): r"engine\.version\b",
             ("RouterConfig", "policy"): r"(router|rp|r)\.policy\b"}
#: fields read by no code on purpose, with the reason
ALLOWED: dict[tuple[str, str], str] = {}


def _sources() -> str:
    texts = []
    for top in READERS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = str(path.relative_to(ROOT))
            if path.suffix in (".py", ".j2", ".sh") and rel not in NOT_READERS:
                texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


def _schema_fields() -> list[tuple[str, str]]:
    classes = [c for c in vars(schema).values()
               if isinstance(c, type) and dataclasses.is_dataclass(c)
               and c.__module__ == schema.__name__]
    return [(c.__name__, f.name) for c in classes for f in dataclasses.fields(c)]


def test_every_schema_field_is_read_by_the_code_or_listed_with_a_reason():
    text = _sources()
    fields = _schema_fields()
    assert ("ModelConfig", "num_layers") in fields and ("NicConfig", "gpus") in fields
    unread = []
    for cls, name in fields:
        if (cls, name) in ALLOWED:
            continue
        pattern = QUALIFIED.get((cls, name),
                                rf"\.{name}\b|\[\s*[\"']{name}[\"']\s*\]|[\"']{name}[\"']\s*[,)]")
        if not re.search(pattern, text):
            unread.append(f"{cls}.{name}")
    assert not unread, f"schema fields no code reads (wire them, or remove them): {unread}"
    for key, why in ALLOWED.items():
        assert key in fields and why, key  # the allow-list names real fields, with a reason


def test_the_removed_keys_stay_removed():
    fields = set(_schema_fields())
    # (model.experts_per_token came back with a reader: pdtool size's active parameters)
    for gone in [("ModelConfig", "num_shared_experts"), ("ModelConfig", "num_mtp_layers")]:
        assert gone not in fields, gone


def test_every_key_has_a_type_and_a_line_of_meaning():
    """`pdtool config --keys` reads each key's meaning from the comment beside its field in
    pdtool/schema.py: a key added without one fails here."""
    from pdtool.keys import schema_keys

    keys = schema_keys()
    assert len({k.key for k in keys}) == len(keys) > 100
    assert [k.key for k in keys if not (k.type and k.meaning)] == []
    by_key = {k.key: k for k in keys}
    assert by_key["transfer.lanes"].meaning.startswith("receive endpoints per decode rank")
    assert by_key["transfer.lanes"].meaning.endswith("1 elsewhere)")  # continued below its line
    assert by_key["cluster.nics[].kind"].type == "str"
    assert by_key["launcher.env.decode"].type == "dict[str, str]"
