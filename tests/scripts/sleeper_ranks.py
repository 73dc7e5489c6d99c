"""A rank that prints its pid and sleeps, for the tests that interrupt `oomguard run` over torchrun and look for
ranks left behind (torchrun starts every rank in a session of its own). ``--stubborn``: it ignores SIGINT and
SIGTERM, as a rank stuck in a collective does in effect, and says so (``rank=R ignored SIGINT``: the test that sends
a second SIGINT waits for that)."""

import os
import signal
import sys
import time


def ignore(signum, frame):
    try:
        print(f"rank={os.environ.get('RANK')} ignored {signal.Signals(signum).name}", flush=True)
    except OSError:  # nobody reads any more: still deaf
        pass


if "--stubborn" in sys.argv:
    signal.signal(signal.SIGINT, ignore)
    signal.signal(signal.SIGTERM, ignore)
print(f"rank={os.environ.get('RANK')} pid={os.getpid()} sid={os.getsid(0)}", flush=True)
time.sleep(600)
