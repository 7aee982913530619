"""The shape of the code base: folders by concern whose imports point one way, no import cycle (not even through
an import inside a function), no library module over ~400 lines.

All of it is read from the source with ``ast`` (nothing is imported), so the test is fast and says which modules to
look at. The layers, lowest first (docs/development.md has the map):

    attestation            the verifier: imports nothing of app. Inside it, lowest first:
      attestation.errors, attestation.io          exceptions; bounded YAML/JSON, the HTTP edge, hashing
      attestation.tdx, attestation.compose        quote, collateral, event log, GPU evidence; app-compose
      attestation (policy, verdict, verify)       the policy and one quote's verification
      attestation.outputs                         confidential (age) weights, the op chain
      attestation.bundle                          the export bundle: manifest, audit chain, signatures, input checks
      attestation.privacy                         epsilon recomputed, the privacy step (reads the manifest)
      attestation.bundle.verify                   the bundle verifier, which runs all of the above
      attestation.bundle.lineage                  parent links and chains of bundles (verifies each)
      attestation.rounds                          federated round bundles (verify their client bundles)
    app (base)             app/*.py and app/config/, app/simulator/: errors, files, settings, guest agent, audit
    app.dataset
    app.training
    app.export             the export bundle: manifest, model directories, card, signature, report, Hub
    app.run                one run, top to bottom: pipeline and its stages
    app.federated, app.service, app.api   (app.api: the training API; inside it, rooms by concern, lowest first:
      app.api.errors, app.api.wire               refusals; the Tinker wire formats (shared by every room)
      app.api.engine                             the engine: worker, packed pass, sampling, losses, DP, op history
      app.api.proof                              records, sealed states, export bundles, checkpoints, replay
      app.api.completions, app.api.service       what the routes do
      app.api.http                               the HTTP edge: routes, TLS, `api attest`
      app.api                                    its __init__: open_service, serve)
    app.deploy
    app.cli                the commands

A module may import its own folder and any lower layer, never a higher one or a sibling folder of its own layer.
Inside app.api the same holds between its rooms (API_LAYERS).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "attestation")
MAX_LINES = 420
# Modules allowed to be longer, each with the reason.
LONG_OK: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


LAYERS: tuple[tuple[str, ...], ...] = (
    ("attestation.errors", "attestation.io"),
    ("attestation.tdx", "attestation.compose"),
    ("attestation",),  # its top modules: policy, verdict, verify (one quote); its __init__ re-exports the API
    ("attestation.outputs",),
    ("attestation.bundle",),
    ("attestation.privacy",),
    ("attestation.bundle.verify",),
    ("attestation.bundle.lineage",),
    ("attestation.rounds",),
    ("app", "app.config", "app.simulator"),  # the base: one layer, its modules may import each other
    ("app.dataset",),
    ("app.training",),
    ("app.export",),
    ("app.run",),
    ("app.federated", "app.service", "app.api"),
    ("app.deploy",),
    ("app.cli",),
    ("app.__main__",),  # `python -m app`: the commands
)


BASE = next(i for i, layer in enumerate(LAYERS) if "app" in layer)  # LAYERS index of the app's base

# Inside the training API (one folder of LAYERS), its rooms, lowest first (docs/development.md, "The training API's
# rooms"): a module of app.api imports its own room and lower ones only. Its top modules are listed one by one.
API_LAYERS: tuple[tuple[str, ...], ...] = (
    ("app.api.errors",),
    ("app.api.wire",),
    ("app.api.engine",),
    ("app.api.proof",),
    ("app.api.completions",),
    ("app.api.service",),
    ("app.api.http",),
    ("app.api",),  # its __init__: open_service, serve
)


def _folder(module: str) -> str:
    """The layer folder a module belongs to: the longest name in LAYERS that it is or lies under."""
    names = [f for layer in LAYERS for f in layer if module == f or module.startswith(f + ".")]
    return max(names, key=len)


def _layer(folder: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if folder in layer)


def _imports(name: str, path: Path, known: dict[str, Path], *, nested: bool = False) -> set[str]:
    """Modules of ``known`` that ``name`` imports at module level; with ``nested``, also inside functions and
    ``if TYPE_CHECKING`` blocks (every import, wherever it is written)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if nested else tree.body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names} & known.keys()
            # `from pkg import submodule` depends on the submodule; the package itself is already being imported
            found.update(subs if len(subs) == len(node.names) else subs | {module})
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_level_import_cycle() -> None:
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert _cycles(graph) == []


def test_no_import_cycle_even_through_imports_inside_functions() -> None:
    known = _modules()
    graph = {name: _imports(name, path, known, nested=True) for name, path in known.items()}
    # a package's __init__ importing its own submodules is how a package is built, not a cycle between concerns
    graph = {n: {d for d in deps if not (d.startswith(n + ".") and known[n].name == "__init__.py")} for n, deps in graph.items()}
    assert _cycles(graph) == []


def test_imports_point_one_way_between_folders() -> None:
    known = _modules()
    wrong = []
    for name, path in known.items():
        here = _folder(name)
        for dep in _imports(name, path, known, nested=True):
            if path.name == "__init__.py" and dep.startswith(name + "."):
                continue  # a package's __init__ re-exporting its own parts is its public API, not a dependency
            there = _folder(dep)
            if there != here and (_layer(there) > _layer(here) or (_layer(there) == _layer(here) != BASE)):
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def _api_room(module: str) -> int:
    """The API_LAYERS index of a module of app.api (every top module is listed, so a new one must be placed)."""
    rooms = [(len(f), i) for i, layer in enumerate(API_LAYERS) for f in layer
             if module == f or (f != "app.api" and module.startswith(f + "."))]
    assert rooms, f"{module} is in no room of API_LAYERS"
    return max(rooms)[1]


def test_the_training_api_rooms_point_one_way() -> None:
    known = _modules()
    api = {n: p for n, p in known.items() if n == "app.api" or n.startswith("app.api.")}
    wrong = []
    for name, path in api.items():
        for dep in _imports(name, path, known, nested=True):
            if dep in api and _api_room(dep) > _api_room(name):
                wrong.append(f"{name} -> {dep}")
    assert wrong == []


def test_the_layer_rule_can_fail() -> None:
    assert _folder("app.run.pipeline") == "app.run" and _folder("app.errors") == "app"
    assert _folder("app.config.base") == "app.config" and _folder("attestation.policy") == "attestation"
    assert _layer(_folder("app.cli.verify")) > _layer(_folder("app.run.pipeline")) > _layer(_folder("app.export.stage"))
    assert _folder("attestation.bundle.manifest") == "attestation.bundle"
    assert _layer(_folder("attestation.rounds.verify")) > _layer(_folder("attestation.bundle.verify")) > _layer(
        _folder("attestation.privacy.dp")) > _layer(_folder("attestation.bundle.manifest")) > _layer(
        _folder("attestation.tdx.quote"))
    assert _api_room("app.api.http.server") > _api_room("app.api.service") > _api_room("app.api.proof.vault") > _api_room(
        "app.api.engine.engine") > _api_room("app.api.wire") > _api_room("app.api.errors")
    assert _api_room("app.api") == len(API_LAYERS) - 1 and _api_room("app.api.engine") == _api_room("app.api.engine.dp")


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_about_400_lines() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in LONG_OK}
    assert long == {}


def test_the_verifier_shows_its_parts() -> None:
    """At most 12 entries at the top of the verifier package (modules and sub-packages, __init__ included)."""
    top = [p.name for p in (ROOT / "attestation").iterdir()
           if (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())]
    assert len(top) <= 12, sorted(top)
