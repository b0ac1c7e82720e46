"""``python -m zeus_async`` runs the command-line interface."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
