"""Rank 0 waits on a collective that rank 1 never issues; for tests/test_distributed.py: ``RANK PORT OUT KIND``.

KIND: ``event`` (a chunk's collectives, waited for through ``HostEvent``), ``worker`` (the same
wait inside a CPU worker's job: on a CPU device the job runs inline, on the main thread), ``messages`` (a chunk's
reduction in a step, gloo's point-to-point messages, waited for through ``HostEvent``), ``issue``
(a chunk collective run at once, outside a step: state dicts, checkpoints), ``check`` (a blocking host
collective of ``Sharding``), ``barrier`` or ``broadcast`` (``protrain_core.barrier`` and
``broadcast_object``: the strategies' on gloo). Rank 0 writes OUT/waiting, then waits; the test sends
it SIGINT and expects it to end with KeyboardInterrupt. Rank 1 stays alive (sleeping) until
killed, so that the collective can never complete.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import protrain_core as pt
from protrain_core.runtime.device import DeviceContext, HostEvent
from protrain_core.runtime.sharding import Sharding


def main(rank: int, port: str, out: str, kind: str) -> None:
    # ctrl-C in a terminal reaches Python's own handler. A test run started in the background by a
    # shell without job control (``cmd &`` in a script, CI) passes SIGINT on ignored, and Python
    # then leaves it ignored: the signal would never arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(600)
        return
    sharding = Sharding.resolve()
    open(os.path.join(out, "waiting"), "w").close()
    try:
        if kind == "event":
            event = HostEvent()
            event.add(dist.all_reduce(torch.ones(4), async_op=True))
            event.wait()
        elif kind == "worker":
            event = HostEvent()
            event.add(dist.all_reduce(torch.ones(4), async_op=True))
            DeviceContext(torch.device("cpu")).worker(threaded=False).submit(event.wait)
            time.sleep(60)  # the step goes on: an interrupt kept in the job's future would be read only later
        elif kind == "messages":
            ctx = DeviceContext(torch.device("cpu"))
            ctx.collective(lambda: sharding.reduce_scatter_mean(torch.empty(2), torch.ones(4))).wait()
        elif kind == "issue":
            sharding.reduce_scatter_mean(torch.empty(2), torch.ones(4))  # a chunk collective outside a step
        elif kind == "barrier":
            pt.barrier()
        elif kind == "broadcast":
            pt.broadcast_object("a checkpoint path", src=1)
        else:
            sharding.max_on_host([1.0])
    except KeyboardInterrupt:
        open(os.path.join(out, "interrupted"), "w").close()
        os._exit(3)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
