"""`python -m dsv4_model generate ...` (dsv4_model/runtime/cli.py); `python -m dsv4_model serve ...` (dsv4_model/serve/cli.py)."""
import sys

if sys.argv[1:2] == ["serve"]:  # the server's flags live in its own package
    from dsv4_model.serve.cli import main as serve_main

    sys.exit(serve_main(sys.argv[2:]))

from dsv4_model.runtime.cli import main

sys.exit(main())
