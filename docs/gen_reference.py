"""Generate the reference tables in docs/ from the pydantic models, so they cannot drift.

    python docs/gen_reference.py          # rewrite the generated blocks in place
    python docs/gen_reference.py --check  # exit 1 if a page is stale (tests/test_docs.py runs this check)

A generated block sits between ``<!-- BEGIN generated:NAME -->`` and ``<!-- END generated:NAME -->``.
"""
from __future__ import annotations

import json
import re
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

DOCS = Path(__file__).resolve().parent


def _default(field) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value, default=str) + "`"


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation)
    text = re.sub(r"typing\.|pathlib\.|attestation\.policy\.|app\.config(?:_training|_base)?\.", "", text)
    return "`" + text.replace("|", "\\|") + "`"


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        path = prefix + name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(_rows(annotation, path + "."))
            continue
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{path}` | {_type(annotation)} | {_default(field)} | {desc} |")
        for member in typing.get_args(annotation):  # a union with a section, e.g. trusted_root: "intel" | {...}
            if isinstance(member, type) and issubclass(member, BaseModel):
                rows.extend(_rows(member, path + "."))
    return rows


def table(model: type[BaseModel]) -> str:
    return "\n".join(["| field | type | default | meaning |", "|---|---|---|---|", *_rows(model)])


def blocks() -> dict[str, tuple[str, str]]:
    """{block name: (page, generated text)}"""
    from app.config import Config
    from attestation.policy import Policy

    return {"config": ("configuration.md", table(Config)), "policy": ("verifier.md", table(Policy))}


def render(page_text: str, name: str, body: str) -> str:
    begin, end = f"<!-- BEGIN generated:{name} -->", f"<!-- END generated:{name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(page_text):
        raise SystemExit(f"missing {begin} ... {end}")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", page_text)


def main(argv: list[str]) -> int:
    stale = []
    for name, (page, body) in blocks().items():
        path = DOCS / page
        old = path.read_text(encoding="utf-8")
        new = render(old, name, body)
        if new != old:
            stale.append(page)
            if "--check" not in argv:
                path.write_text(new, encoding="utf-8")
    if stale and "--check" in argv:
        print("stale generated reference in: " + ", ".join(stale) + " (run: python docs/gen_reference.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(DOCS.parent))
    raise SystemExit(main(sys.argv[1:]))
