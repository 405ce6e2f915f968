"""``python -m elastrun`` is the ``elastrun`` command."""

from elastrun.cli import main

raise SystemExit(main())
