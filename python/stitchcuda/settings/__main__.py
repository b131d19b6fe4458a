"""`python -m stitchcuda.settings`: this environment's values, the docs table (--markdown), or the docs page
rewritten (--write-docs)."""

from . import main

raise SystemExit(main())
