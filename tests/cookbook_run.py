"""Run one tinker-cookbook recipe, unmodified, against a ``cvm-tune api serve`` (in the cookbook's own venv:
tests/cookbook_env.py), offline.

    python tests/cookbook_run.py TOKENIZER_DIR SERVED_NAME MODULE [KEY=VALUE ...]

Before the recipe's module runs as ``__main__`` (its own chz command line: ``KEY=VALUE ...``), only the cookbook's
extension points are used: ``register_tokenizer(SERVED_NAME)`` loads the served base model's tokenizer from
TOKENIZER_DIR (the cookbook would fetch it from the Hub), and ``register_renderer(RENDERER)`` names its role-colon
renderer for the recipes that take a ``renderer_name``. The Hub datasets the recipes load are local directories of
the same names in the working directory (tests/cookbook_data.py). Every connection but loopback is refused and
printed at exit (``NET-ATTEMPTS [...]``): the cookbook's pricing lookup is one, and only logs its failure.
"""

from __future__ import annotations

import atexit
import json
import runpy
import sys

RENDERER = "cvm-tune/role_colon"


def main(argv: list[str]) -> None:
    tokenizer_dir, served, module, *args = argv
    from tests.netguard import guard

    attempts = guard(allow_loopback=True).__enter__()
    atexit.register(lambda: print("NET-ATTEMPTS " + json.dumps(attempts), flush=True))

    from tinker_cookbook import renderers, tokenizer_utils
    from tinker_cookbook.renderers.role_colon import RoleColonRenderer
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(served, lambda: AutoTokenizer.from_pretrained(tokenizer_dir,
                                                                                     local_files_only=True))
    renderers.register_renderer(RENDERER, lambda tokenizer, _images=None: RoleColonRenderer(tokenizer))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
