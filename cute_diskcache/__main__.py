from .cli import console

raise SystemExit(console())
