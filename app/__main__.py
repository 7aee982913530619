"""``python -m app`` is the same as the ``cvm-tune`` console script."""

from app.cli import main

raise SystemExit(main())
