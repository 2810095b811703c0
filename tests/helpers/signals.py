"""Signals for the tests' child processes."""
import signal


def default_sigint():
    """A child's SIGINT as a terminal's program has it (Popen's preexec_fn): a suite started in the background by a
    shell without job control runs with SIGINT ignored, which its children would inherit (and Python then keeps)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
