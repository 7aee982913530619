"""Every command runs quietly unless ``--debug``: third-party warnings (this process and the processes it starts),
progress bars and other libraries' warning logs are off; caches go to a private directory removed at the end.
(tests/test_clean_machine.py runs the real commands.)"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path

import pytest

from app import cli


def _probe(seen: dict[str, object]) -> object:
    """A command that does what third-party libraries do, and notes what it found."""

    def command(args: argparse.Namespace) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("Setting `save_embedding_layers` to `True`", UserWarning, stacklevel=1)
            warnings.warn("`evaluation_strategy` is deprecated", FutureWarning, stacklevel=1)
        seen["warnings"] = [str(w.message) for w in caught]
        logging.getLogger("some_library.module").warning("a third-party warning")  # transformers, once imported, does not propagate
        logging.getLogger("cvm-tune.federated").warning("one of ours")
        seen["env"] = {name: os.environ.get(name) for name in ("PYTHONWARNINGS", "TQDM_DISABLE",
                                                               "HF_HUB_DISABLE_PROGRESS_BARS", "MPLCONFIGDIR", "NO_COLOR")}
        seen["private"] = Path(os.environ["MPLCONFIGDIR"]).parent
        return 0

    return command


@pytest.mark.parametrize("debug", [False, True])
def test_third_party_noise_is_off_unless_debug(debug: bool, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    for name in ("PYTHONWARNINGS", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "MPLCONFIGDIR", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    seen: dict[str, object] = {}
    monkeypatch.setitem(cli._COMMANDS, "schema", _probe(seen))
    caplog.set_level(logging.WARNING)
    assert cli.main(["--debug", "schema"] if debug else ["schema"]) == 0
    env = seen["env"]
    assert isinstance(env, dict)
    if debug:
        assert len(seen["warnings"]) == 2  # type: ignore[arg-type]
        assert env["PYTHONWARNINGS"] is None and env["TQDM_DISABLE"] is None
        assert {r.name for r in caplog.records} >= {"some_library.module", "cvm-tune.federated"}
    else:
        assert seen["warnings"] == []
        assert env["PYTHONWARNINGS"] == "ignore" and env["TQDM_DISABLE"] == "1" == env["HF_HUB_DISABLE_PROGRESS_BARS"]
        assert [r.getMessage() for r in caplog.records] == ["one of ours"]
    assert env["NO_COLOR"] == "1"  # pytest's streams are not terminals
    assert not Path(str(seen["private"])).exists()  # the private cache directory is gone
    assert "MPLCONFIGDIR" not in os.environ and "PYTHONWARNINGS" not in os.environ  # restored


def test_a_variable_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path))
    seen: dict[str, object] = {}
    monkeypatch.setitem(cli._COMMANDS, "schema", _probe(seen))
    assert cli.main(["schema"]) == 0
    assert seen["env"]["MPLCONFIGDIR"] == str(tmp_path) and tmp_path.is_dir()  # type: ignore[index]
