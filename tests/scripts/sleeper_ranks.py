"""A rank that prints its pid and sleeps, for the tests that interrupt `oomguard run` over torchrun and look for
ranks left behind (torchrun starts every rank in a session of its own). ``--stubborn``: it ignores SIGINT and
SIGTERM, as a rank stuck in a collective does in effect."""

import os
import signal
import sys
import time

if "--stubborn" in sys.argv:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"rank={os.environ.get('RANK')} pid={os.getpid()} sid={os.getsid(0)}", flush=True)
time.sleep(600)
