"""`python -m reconciler` is the `reconcile` command."""

from reconciler.cli.entry import main

raise SystemExit(main())
