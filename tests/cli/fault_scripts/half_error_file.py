"""Rank 1 of attempt 0 leaves half of an error file and is killed (SIGKILL), as a worker killed while writing it
would; rank 0 waits to be stopped. In the next attempt (if any) both ranks print ``BACK`` and exit 0."""

import os
import signal
import sys
import time

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
if attempt > 0:
    print(f"BACK attempt={attempt} rank={rank}", flush=True)
    sys.exit(0)
if rank == 1:
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
        fp.write('{"message": {"message": "ValueError: cut sh')  # where the kill stopped the write
    print(f"KILL at={time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
