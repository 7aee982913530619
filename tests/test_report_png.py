"""report/loss.png: deterministic bytes, fixed size, matplotlib loaded only when a report is rendered."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from app.export.report import loss_png

REPO = Path(__file__).resolve().parent.parent


def test_png_is_deterministic_and_fixed_size() -> None:
    from PIL import Image

    losses = [[i, 3.0 / i] for i in range(1, 200)]
    png = loss_png(losses, title="r1")
    assert png == loss_png(losses, title="r1") and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert Image.open(io.BytesIO(png)).size == (600, 350)
    assert loss_png([], title="r1") != png  # no losses: an empty chart, still a PNG
    assert b"Software" not in png  # no version or timestamp metadata


def test_importing_the_report_module_loads_no_matplotlib() -> None:
    code = "import sys, app.export.report; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})


def test_drawing_leaves_nothing_in_home_or_tmpdir(tmp_path: Path) -> None:
    """Outside a cvm-tune command (which sets MPLCONFIGDIR): matplotlib's font cache goes to a directory removed after."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    code = "from app.export.report import loss_png; assert loss_png([[1, 2.0]], title='t').startswith(b'\\x89PNG')"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path,
                   env={"PYTHONPATH": str(REPO), "HOME": str(home), "TMPDIR": str(tmp)})
    assert list(home.iterdir()) == [] and list(tmp.iterdir()) == []
