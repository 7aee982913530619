"""requirements/gpu-extras.txt (the offline GPU machine's .gpu/extras.tgz) covers what cvm-tune imports there.

The GPU machine has no network: what its image and the Unsloth bundle (site.tgz) lack must be in extras.tgz, or
`cvm-tune run`, `cvm-tune api serve` and `pytest -m gpu` stop there with a ModuleNotFoundError after minutes of
device time. This walks the installed dependency closure of cvm-tune's core, [train] and [test] requirements (the
distributions' own metadata) and checks that every distribution in it is pinned in gpu-extras.txt at the version
installed here, or is named below as coming from the image or the bundle, or as deliberately left out.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent

# The GPU image (Python 3.12, torch 2.11 + CUDA) and what its packages require.
IMAGE = {"torch", "transformers", "peft", "accelerate", "triton", "tokenizers", "safetensors", "huggingface-hub", "numpy",
         "pyarrow", "pandas", "python-dateutil", "tzdata", "six", "psutil", "xxhash", "requests", "urllib3", "idna",
         "charset-normalizer", "certifi", "rich", "pygments", "markdown-it-py", "mdurl", "pyyaml", "sentencepiece", "tqdm",
         "typer", "filelock", "httpx", "httpcore", "h11", "anyio", "click", "packaging", "regex", "jinja2", "markupsafe",
         "scipy", "mpmath", "sympy", "networkx"}
# The Unsloth bundle (site.tgz): Unsloth, TRL, datasets, pydantic, protobuf and their needs.
BUNDLE = {"unsloth", "unsloth-zoo", "trl", "datasets", "dill", "multiprocess", "fsspec", "bitsandbytes", "torchao",
          "cut-cross-entropy", "tyro", "docstring-parser", "typeguard", "typing-extensions", "diffusers",
          "importlib-metadata", "zipp", "lazy-importer", "pillow", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "hf-transfer", "msgspec", "json5", "nest-asyncio", "structlog", "protobuf", "einops", "wheel",
          "schedule"}
LEFT_OUT = {
    "opacus": "DP-SGD training is not part of the GPU checks",
    "flwr": "federated rounds are not part of the GPU checks",
    "pyqwest": "12 MiB; the tinker SDK imports it only for a transport the server's client/config turns off",
    "asyncio": "dstack-sdk names the PyPI backport of a standard-library module",
    "pytest-xdist": "the GPU checks run pytest in one process (one GPU)",
}
# Pinned although no distribution's metadata asks for them: the tinker SDK builds httpx clients with http2=True.
UNDECLARED = {"h2", "hpack", "hyperframe"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements" / "gpu-extras.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[_norm(m[1])] = m[2]
    return pins


def _closure() -> dict[str, str]:
    """Distribution -> the distribution that first required it; the walk stops at the image and the bundle."""
    wanted: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = []
    for spec in metadata.requires("cvm-tune") or []:
        req = Requirement(spec)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("train", "test")):
            todo.append((req, "cvm-tune"))
    while todo:
        req, by = todo.pop()
        name = _norm(req.name)
        if name in IMAGE or name in BUNDLE or name in LEFT_OUT or (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        wanted.setdefault(name, by)
        for spec in metadata.requires(name) or []:
            sub = Requirement(spec)
            extras = [""] + sorted(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append((sub, name))
    return wanted


def test_every_dependency_cvm_tune_imports_on_the_gpu_machine_travels_there() -> None:
    pins, wanted = _pins(), _closure()
    missing = {name: by for name, by in wanted.items() if name not in pins}
    assert not missing, f"add to requirements/gpu-extras.txt (bench/make-gpu-extras.sh), needed by: {missing}"


def test_gpu_extras_pins_nothing_unneeded_and_match_this_environment() -> None:
    pins, wanted = _pins(), _closure()
    assert set(pins) - set(wanted) <= UNDECLARED, f"pinned but nothing requires them: {set(pins) - set(wanted) - UNDECLARED}"
    differ = {name: (version, metadata.version(name)) for name, version in pins.items() if metadata.version(name) != version}
    assert not differ, f"gpu-extras.txt pin vs the locked version: {differ}"
    assert not (set(pins) & (IMAGE | BUNDLE)), "the image or site.tgz already has these; a second copy shadows it"


def test_the_gpu_checks_pytest_command_lines_parse_with_only_the_plugins_that_travel() -> None:
    """bench/gpu-checks.sh's ``pytest`` calls (options such as ``--timeout`` come from plugins) collect with plugin
    autoloading off and only the pytest plugins pinned in gpu-extras.txt loaded: the GPU machine's image has no pytest,
    so a plugin that does not travel turns a GPU session's test run into a usage error."""
    import os
    import shlex
    import subprocess
    import sys

    script = (REPO / "bench" / "gpu-checks.sh").read_text()
    common = shlex.split(re.search(r"python3 -m pytest (.*?) \\\n\s*(.*?) \"\$@\"", script, re.S).expand(r"\1 \2"))
    calls = [shlex.split(m) for m in re.findall(r"^\s*gpu_pytest \S+ \d+ (.*)$", script, re.M)]
    assert calls and "--timeout" in common, (common, calls)
    plugins = [ep.value.split(":")[0] for name in _pins() for ep in metadata.distribution(name).entry_points
               if ep.group == "pytest11"]
    assert "pytest_timeout" in plugins, plugins
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for args in calls:
        cmd = [sys.executable, "-m", "pytest", *(f"-p{p}" for p in plugins), *common, *args, "--collect-only", "-q"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert " selected" in proc.stdout or "tests collected" in proc.stdout, proc.stdout[-2000:]
