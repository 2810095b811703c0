"""`python -m dsv4_model generate --prompt TEXT ...` (see dsv4_model/runtime/cli.py)."""
import sys

from dsv4_model.runtime.cli import main

sys.exit(main())
