"""Ends while torch's collective threads still hold Python tensors, with a finalizer that gives them the GIL.

    fullshard launch --num_processes 2 exit_mid_collective.py {in_flight|after_barrier}

``in_flight``: an all-reduce is started and never waited for; rank 1 joins it late, so on rank 0 it completes
(on gloo's worker thread) while the process ends. ``after_barrier``: the end of a typical script, a ``gather``
then a barrier. Under a plain ``python`` the interpreter's teardown runs ``SleepsWhenFinalized.__del__``,
which releases the GIL; a worker thread that takes it then is ended by CPython mid-destructor and the
process aborts (SIGABRT). Prints what must still happen at exit: the ``atexit`` handlers and
(``after_barrier``) the end of a non-daemon thread.
"""

import atexit
import sys
import threading
import time

import torch
import torch.distributed as dist


class SleepsWhenFinalized:
    """Held in ``sys.modules``, so only the interpreter's teardown finalizes it."""

    def __del__(self) -> None:
        time.sleep(0.2)


dist.init_process_group("gloo")
rank = dist.get_rank()
atexit.register(lambda: print(f"ATEXIT rank={rank}", flush=True))
sys.setswitchinterval(30.0)  # the main thread keeps the GIL until it blocks, as a busy script may
sys.modules["_finalized_at_teardown"] = SleepsWhenFinalized()  # type: ignore[assignment]
if sys.argv[1] == "in_flight":
    if rank == 1:
        time.sleep(0.1)  # rank 0's all-reduce completes after its script has returned
    dist.all_reduce(torch.ones(4), async_op=True)
else:
    # A non-daemon thread still running when the script returns (joining it releases the GIL, so only here).
    threading.Thread(target=lambda: (time.sleep(0.3), print(f"THREAD done rank={rank}", flush=True))).start()
    outputs = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(outputs, torch.ones(4))
    del outputs
    dist.barrier()
print(f"END rank={rank}", flush=True)
