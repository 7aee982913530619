"""The documentation cannot go stale: README.md and docs/*.md are checked here.

* Every fenced ```sh block: each ``cvm-tune SUBCOMMAND ... --flag`` in it must be a real subcommand and flag of the
  CLI's argparse parser.
* A ```sh block on the line right after ``<!-- runnable -->`` is executed with bash (``set -eo pipefail``) and must
  exit 0. The blocks of one page run in order in one scratch workspace: a temporary directory holding a copy of
  the repository's tracked files (so repository paths work as on a fresh clone, and nothing a user created in the
  checkout by following the docs is read or overwritten) and ``.venv`` pointing at the running interpreter's
  environment, with its ``bin`` on PATH and HF_HUB_OFFLINE=1. Keep the runnable set small.
* Every intra-repository link resolves (and its ``#anchor`` names a heading of the target page); targets that are
  still being written elsewhere may be listed in PENDING, which must be emptied once they exist.
* The generated reference tables (docs/gen_reference.py) match the pydantic models.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Link targets other pages are being written for; empty this set once they exist.
PENDING: set[str] = set()

RUNNABLE_MARK = "<!-- runnable -->"
_FENCE = re.compile(r"^(`{3,})(\S*)\s*$")
_COMMAND = re.compile(r"(?:^|(?<=[\s;&|(]))(?:\S*/)?cvm-tune(?=\s|$)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    runnable: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        runnable = start > 0 and lines[start - 1].strip() == RUNNABLE_MARK
        out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", runnable))
        i += 1
    return out


def sh_blocks() -> list[Block]:
    return [b for p in doc_pages() for b in blocks(p) if b.lang == "sh"]


# ---- every cvm-tune command line names a real subcommand and real flags ------------------------------------------

def _parser() -> argparse.ArgumentParser:
    from app.cli import _parser as build

    return build()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined; heredoc bodies skipped."""
    out, pending, heredoc = [], "", None
    for raw in text.split("\n"):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        out.append(line)
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if m:
            heredoc = m.group(1)
    return out


def _tokens(rest: str) -> list[str]:
    lex = shlex.shlex(rest, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        toks = list(lex)
    except ValueError:
        toks = rest.split()
    words = []
    for t in toks:
        if t and set(t) <= set("|&;<>()"):
            break  # end of this command
        words.append(t.strip("[]"))
    return [w for w in words if w]


def command_problems(text: str) -> list[str]:
    root = _parser()
    problems = []
    for line in _logical_lines(text):
        code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        for m in _COMMAND.finditer(code):
            parser, words = root, _tokens(code[m.end():])
            path = ["cvm-tune"]
            for w in words:
                subs = _subparsers(parser)
                if w.startswith("-"):
                    flag = w.split("=", 1)[0]
                    if flag not in parser._option_string_actions:
                        problems.append(f"{' '.join(path)}: no flag {flag!r} (line: {line.strip()})")
                elif subs and w not in ("...", "…"):
                    if w not in subs:
                        problems.append(f"{' '.join(path)}: no subcommand {w!r} (line: {line.strip()})")
                        break
                    parser = subs[w]
                    path.append(w)
    return problems


@pytest.mark.parametrize("block", sh_blocks(), ids=lambda b: b.id)
def test_sh_block_names_real_commands_and_flags(block: Block) -> None:
    assert command_problems(block.text) == []


def test_command_check_can_fail() -> None:
    assert command_problems("cvm-tune verify B --polcy p.yaml\n")
    assert command_problems(".venv/bin/cvm-tune verfy B\n")
    assert command_problems("x && cvm-tune dataset encrypt a -o b \\\n  --no-such-flag\n")
    assert not command_problems("cvm-tune dataset release r.json --policy p -o g.json  # cvm-tune-output\n")


# ---- runnable blocks ----------------------------------------------------------------------------------------------

def tracked_files(root: Path = ROOT) -> list[str]:
    """The repository's tracked files (``git ls-files``): what a fresh clone holds, never a user's own files."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name and (root / name).is_file()]


def copy_tracked(dest: Path, root: Path = ROOT) -> None:
    for name in tracked_files(root):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, dest / name)


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    made: dict[Path, Path] = {}

    def get(page: Path) -> Path:
        if page not in made:
            ws = tmp_path_factory.mktemp("doc-" + page.stem)
            copy_tracked(ws)
            (ws / ".venv").symlink_to(Path(sys.prefix))
            made[page] = ws
        return made[page]

    yield get
    for ws in made.values():
        shutil.rmtree(ws, ignore_errors=True)


RUNNABLE = [b for b in sh_blocks() if b.runnable]


def test_runnable_blocks_exist() -> None:
    assert any(b.page.name == "README.md" for b in RUNNABLE)


def test_workspace_holds_no_untracked_file_of_the_checkout(tmp_path: Path) -> None:
    """Files a user created by following the docs (verdict.json, deploy/, keys) stay out of the workspace."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("a\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "docs/a.md"], check=True)
    (repo / "verdict.json").write_text("the user's\n")
    (repo / "deploy").mkdir()
    (repo / "deploy" / "secrets.env").write_text("X=1\n")
    ws = tmp_path / "ws"
    ws.mkdir()
    copy_tracked(ws, repo)
    assert sorted(str(p.relative_to(ws)) for p in ws.rglob("*")) == ["docs", "docs/a.md"]
    assert not (ws / "docs" / "a.md").is_symlink()


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_runnable_block_exits_0(block: Block, workspaces) -> None:
    ws = workspaces(block.page)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSTACK_", "CVM_TUNE_"))}
    env.update(HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run(["bash", "-c", "set -eo pipefail\n" + block.text], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# ---- links -------------------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", prose, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    prose = re.sub(r"^(`{3,}).*?^\1", "", text, flags=re.S | re.M)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return _LINK.findall(prose)


def test_intra_repo_links_resolve() -> None:
    broken = []
    for page in doc_pages():
        for target in _links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert broken == []


def test_pending_targets_are_still_missing() -> None:
    """Once a pending page exists it must leave PENDING, so a later deletion is caught."""
    assert [p for p in sorted(PENDING) if (ROOT / p).exists()] == []


# ---- generated references ------------------------------------------------------------------------------------------

def test_generated_references_are_current() -> None:
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_reference
    finally:
        sys.path.remove(str(ROOT / "docs"))
    stale = []
    for name, (page, body) in gen_reference.blocks().items():
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        if gen_reference.render(text, name, body) != text:
            stale.append(page)
    assert stale == [], "run: python docs/gen_reference.py"


def test_readme_and_deploy_page_can_both_be_followed_in_one_checkout(tmp_path: Path) -> None:
    """A reader who runs README's deploy block and then the deploy page's step 3 in the same directory: both succeed,
    the token is kept, and the env file holding the webhook is private (0600)."""
    steps = [b for b in RUNNABLE if "bundles token" in b.text]
    assert {b.page.name for b in steps} == {"README.md", "deploy.md"}
    copy_tracked(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    tokens = []
    for block in steps:
        proc = subprocess.run(["bash", "-c", "set -eo pipefail\n" + block.text], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{block.id}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        tokens.append((tmp_path / "deploy-bundles.token").read_bytes())
        assert (tmp_path / "deploy" / "secrets.env").stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "deploy-bundles.token").stat().st_mode & 0o777 == 0o600
    assert tokens[0] == tokens[1]


def test_files_the_docs_create_are_ignored_by_git_and_docker() -> None:
    """Keys, tokens, env files and outputs that following the docs creates never get committed or sent to a docker
    build context; neither does the virtual environment."""
    gitignore = (ROOT / ".gitignore").read_text().split("\n")
    dockerignore = (ROOT / ".dockerignore").read_text().split("\n")
    created = ["/deploy/", "/deploy-bundles.token", "/verdict.json", "/signing-key.pem", "/staged-repo/", "/bundles/",
               "*.key", "*.cvmds", "/cvm-tune-output/", "/loop-demo/"]
    assert [p for p in created if p not in gitignore] == []
    assert [p for p in [".venv", ".git", *created] if p.strip("/") not in {d.strip("/") for d in dockerignore}] == []
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    sources = {src.split("/")[0].replace("${FLAVOR}", "cpu") for line in copied for src in line.split()}
    assert sources and not sources & {d.strip("/") for d in dockerignore}  # what the image needs stays in
