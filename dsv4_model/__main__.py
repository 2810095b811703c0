"""`python -m dsv4_model generate --prompt TEXT ...` (see dsv4_model/cli.py)."""
import sys

from dsv4_model.cli import main

sys.exit(main())
