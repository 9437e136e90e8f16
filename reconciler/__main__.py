"""`python -m reconciler` is the `reconcile` command."""

from reconciler.planclient import main

raise SystemExit(main())
