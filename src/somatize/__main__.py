"""``python -m somatize``: the same command as ``somatize``."""

from .cli import main

raise SystemExit(main())
