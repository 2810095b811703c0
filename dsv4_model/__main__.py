"""`python -m dsv4_model generate ...` (dsv4_model/runtime/cli.py); `python -m dsv4_model serve ...` (dsv4_model/serve/cli.py)."""
import sys


def _run() -> int:
    if sys.argv[1:2] == ["serve"]:  # the server's flags live in its own package
        from dsv4_model.serve.cli import main as serve_main

        return serve_main(sys.argv[2:])
    from dsv4_model.runtime.cli import main

    return main()


code = _run()
if "dsv4_model.runtime.distributed" in sys.modules:  # a torchrun rank: end it before interpreter teardown
    sys.modules["dsv4_model.runtime.distributed"].exit_rank(code)
sys.exit(code)
