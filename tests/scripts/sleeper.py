"""Prints its pid and a grandchild's pid, then sleeps: the interrupt tests kill oomguard and look for orphans."""

import os
import subprocess
import sys
import time

grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(f"ready child={os.getpid()} grandchild={grandchild.pid}", flush=True)
time.sleep(600)
